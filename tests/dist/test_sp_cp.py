"""Sequence parallelism composed with context parallelism on 4 gloo ranks (`dp=1 cp=2 tp=2`,
as `examples/train_llama.py --sequence-parallel` with a cp axis): a small causal
transformer whose sequence is split over cp, then each rank's part over tp between the
blocks (`embedding_sp`, `sp_params` norms, `sp_input` blocks, `colwise_gather_sp` output),
heads over tp and the attention over `"b (tp h) <split> d"` by `mc.nn.attention`, parameters
`fully_shard(axis="dp", replicate="cp")`. Trained 3 steps, its losses and parameters equal
one process's in float64 (1e-10), for a contiguous and a zigzag split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from conftest import ranks_fixture
from torch import nn

import meshcomm as mc
from meshcomm.executors.sim import scatter

B, S, E, H, VOCAB = 2, 16, 8, 4, 11     # 16 tokens: 8 a cp rank, 4 a tp rank between blocks
STEPS = 3
PLAN = {"emb": "embedding_sp", "norm1": "sp_params", "norm2": "sp_params",
        "norm": "sp_params", "attn": "sp_input", "attn.w[qkv]": "colwise_sp",
        "attn.wo": "rowwise_sp", "mlp": "sp_input", "mlp.up": "colwise_sp",
        "mlp.down": "rowwise_sp", "out": "colwise_gather_sp"}
# name -> (the sequence's split, the attention strategy)
CASES = {"contiguous allgather": ("(cp s)", "allgather"),
         "zigzag ring": ("zigzag(cp s)", "ring"),
         "contiguous ulysses": ("(cp s)", "ulysses")}


class Attention(nn.Module):
    """Causal self-attention; `attend` runs it on `b h s d` tensors (one process: the
    reference on whole sequences; CP: `mc.nn.attention` on this rank's shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.attend: Any = lambda q, k, v: mc.nn.attention_reference(q, k, v, causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(w: nn.Module) -> torch.Tensor:     # this rank's heads under tp
            return w(x).view(b, s, -1, E // H).transpose(1, 2)
        y = self.attend(heads(self.wq), heads(self.wk), heads(self.wv))
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(E, 16), nn.Linear(16, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Model(nn.Module):
    """Embedding, one pre-norm block (RMS norms), a final LayerNorm (weight and bias) and an
    output layer of 11 rows (uneven over tp=2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, E)
        self.norm1, self.norm2 = nn.RMSNorm(E, eps=1e-6), nn.RMSNorm(E, eps=1e-6)
        self.attn, self.mlp = Attention(), Mlp()
        self.norm = nn.LayerNorm(E)
        self.out = nn.Linear(E, VOCAB, bias=False)
        with torch.no_grad():            # norms away from their initial ones and zeros
            for p in (*self.norm1.parameters(), *self.norm2.parameters(),
                      *self.norm.parameters()):
                p.add_(0.1 * torch.randn(p.shape))
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.out(self.norm(h))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (B, S), generator=g),
            torch.randint(0, VOCAB, (B, S), generator=g))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0
          ) -> list[torch.Tensor]:
    """STEPS of SGD on the summed cross-entropy over B*S tokens times `scale`; the losses
    (this rank's share of the mean)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        share = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / (B * S)
        opt.zero_grad()
        (share * scale).backward()
        opt.step()
        losses.append(share.detach())
    return losses


def one_process() -> dict[str, Any]:
    model = Model()
    losses = train(model, *batch())
    return {"losses": [loss.item() for loss in losses],
            "params": {n: p.detach() for n, p in model.named_parameters()}}


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=1 cp=2 tp=2")
    out: dict[str, Any] = {}
    for name, (split, strategy) in CASES.items():
        model = mc.nn.parallelize(Model(), bound, PLAN, axis="tp")
        model.attn.attend = lambda q, k, v, split=split, strategy=strategy: mc.nn.attention(
            q, k, v, bound, f"b (tp h) {split} d", causal=True, strategy=strategy)
        mc.nn.fully_shard(model, bound, axis="dp", replicate="cp")
        x, y = (scatter(t, bound.mesh, f"b {split}")[rank] for t in batch())
        # each cp rank's share of the mean; the gradients are averaged over cp
        losses = train(model, x, y, scale=bound.mesh.axis_size("cp"))
        out[name] = {"losses": [mc.reshard(loss.reshape(1), bound, "a | sum(cp)", "a").item()
                                for loss in losses],
                     "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}
    return out


four = ranks_fixture(four_ranks, 4)


def test_sequence_and_context_parallel_train_as_one_process(four: list[dict[str, Any]]) -> None:
    want = one_process()
    for name in CASES:
        for r in four:
            got = r[name]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                       rtol=1e-10, atol=0, msg=name)
            assert set(got["params"]) == set(want["params"])
            for p, value in want["params"].items():   # norms: gradients summed over tp
                torch.testing.assert_close(got["params"][p], value, rtol=1e-10, atol=1e-12,
                                           msg=f"{name} {p}")
