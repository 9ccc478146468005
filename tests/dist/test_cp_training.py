"""Context parallelism composed with fully_shard on 4 gloo ranks (`dp=2 cp=2`): a causal
attention block whose sequence is split over `cp` and batch over `dp`, its parameters
sharded over `dp` and replicated over `cp` (`fully_shard(axis="dp", replicate="cp")`: the
cp ranks' gradients are averaged too, as HSDP's replicas), trains like one process: the
loss and every gradient after a step equal one process's, in float64, for each strategy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import meshcomm as mc
from meshcomm.executors.sim import scatter

from conftest import ranks_fixture

B, S, E, H = 2, 10, 16, 4            # 10 tokens over cp=2: 5 each
D = E // H
LAYOUT = "(dp b) h (cp s) d"
STRATEGIES = ("allgather", "ulysses")


class Block(nn.Module):
    """x (b, s, e) -> causal self-attention -> (b, s, e); `attend` runs the attention of
    `b h s d` tensors (one process: whole sequences; CP: this rank's shards)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wq, self.wk, self.wv, self.wo = (
            nn.Parameter(torch.randn(E, E, generator=g, dtype=torch.float64) / E ** 0.5)
            for _ in range(4))

    def forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(w: torch.Tensor) -> torch.Tensor:
            return (x @ w).view(b, s, H, D).transpose(1, 2)
        y = attend(heads(self.wq), heads(self.wk), heads(self.wv))
        return y.transpose(1, 2).reshape(b, s, E) @ self.wo


def _batch(rows: int = B) -> torch.Tensor:
    return torch.randn(rows, S, E, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def one_process(rows: int = B) -> dict[str, Any]:
    """The block's loss and gradients on `rows` sequences, in one process."""
    model = Block()
    y = model(_batch(rows), lambda q, k, v: mc.nn.attention_reference(q, k, v, causal=True))
    loss = y.pow(2).mean()
    loss.backward()
    return {"loss": loss.item(), **{n: p.grad for n, p in model.named_parameters()}}


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 cp=2")
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        model = Block()
        mc.nn.fully_shard(model, bound, axis="dp", replicate="cp")
        x = scatter(_batch(), bound.mesh, "(dp b) (cp s) e")[rank]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return mc.nn.attention(q, k, v, bound, LAYOUT, causal=True, strategy=strategy)
        y = model(x, attend)
        loss = y.pow(2).mean()              # this rank's tokens: each rank holds as many
        loss.backward()
        global_loss = mc.reshard(loss.detach().reshape(1), bound, "a | avg(dp, cp)", "a")
        out[strategy] = {"loss": global_loss.item(),
                         **{n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    return out


four = ranks_fixture(four_ranks, 4)


def test_cp_and_fully_shard_train_as_one_process(four: list[dict[str, Any]]) -> None:
    want = one_process()
    for strategy in STRATEGIES:
        for r in four:
            got = r[strategy]
            assert abs(got["loss"] - want["loss"]) <= 1e-12 * abs(want["loss"]), strategy
            for name in ("wq", "wk", "wv", "wo"):
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                           msg=f"{strategy} {name}")
