"""mc.nn.parallelize (tensor parallelism on unmodified modules) alone and under fully_shard,
on 4 gloo ranks (dp=2 tp=2) and 8 (dp=2 tp=4), against the same model trained in one process. The model has
a vocab-parallel embedding and an output layer of 11 rows (uneven over tp=2, then over dp=2
within each tp shard), a colwise /
rowwise MLP with biases, and a residual connection."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from conftest import outcome, ranks_fixture
from torch import nn

import meshcomm as mc

PLAN = {"emb": "embedding", "up": "colwise", "down": "rowwise", "out": "colwise_gather"}
STEPS = 4


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 16)
        self.down = nn.Linear(16, 6)
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.down(F.relu(self.up(h)))
        return self.out(h)


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2's projections), as it is written there: weight (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class TinyConv(Tiny):
    """Tiny with GPT-2's Conv1D projections in the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = Conv1D(16, 6), Conv1D(6, 16)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 16)
        self.down = nn.Linear(16, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(h)))


class TinySP(nn.Module):
    """Tiny with norms and the MLP in a submodule: the shape sequence parallelism needs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.norm1 = nn.LayerNorm(6)
        self.mlp = Mlp()
        self.norm2 = nn.LayerNorm(6)
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.mlp(h=self.norm1(h))    # by keyword, as Hugging Face calls its blocks
        return self.out(self.norm2(h))


SP_PLAN = {"emb": "embedding_sp", "norm1": "sp_params", "norm2": "sp_params",
           "mlp": "sp_input", "mlp.up": "colwise_sp", "mlp.down": "rowwise_sp",
           "out": "colwise_gather_sp"}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g)


def losses_of(m: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int) -> list[float]:
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    out = []
    for _ in range(STEPS):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if world > 1:
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            out.append(total.item() / world)
        else:
            out.append(loss.item())
    return out


def built(module: nn.Module, bound: mc.BoundMesh, plan: dict[str, str], fsdp: bool
          ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """`module` parallelized with `plan` (and fully_shard over dp), with this rank's data:
    the whole batch, or under FSDP its dp half."""
    m = mc.nn.parallelize(module, bound, plan)
    x, y = data()
    if fsdp:
        mc.nn.fully_shard(m, bound, axis="dp")
        dp = bound.mesh.coords(bound.rank)["dp"]
        x, y = x[dp * 4:(dp + 1) * 4], y[dp * 4:(dp + 1) * 4]
    return m, x, y


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 tp=2")
    out: dict[str, Any] = {}
    for fsdp in (False, True):
        m, x, y = built(Tiny(), bound, PLAN, fsdp)
        if fsdp:
            out["rows"] = {n: p.to_local().shape[0] for n, p in m.named_parameters()}
        out[fsdp] = (losses_of(m, x, y, world),
                     {n: str(tuple(p.placements)) for n, p in m.named_parameters()},
                     {n: p.full_tensor() for n, p in m.named_parameters()})
    out["styles"] = {n: mc.nn.tp_style(mod) for n, mod in m.named_modules() if n}
    for fsdp in (False, True):      # transformers' Conv1D: weight (in, out)
        m, x, y = built(TinyConv(), bound, PLAN, fsdp)
        out[("conv1d", fsdp)] = (losses_of(m, x, y, world),
                                 {n: p.full_tensor() for n, p in m.named_parameters()},
                                 {n: str(tuple(p.placements)) for n, p in m.named_parameters()})
    for fsdp in (False, True):      # sequence parallel: activations split over dim 1 (seq)
        m, x, y = built(TinySP(), bound, SP_PLAN, fsdp)
        out[("sp", fsdp)] = (losses_of(m, x, y, world),
                             {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                              for n, p in m.named_parameters()})
    out["errors"] = {key: outcome(lambda plan=plan: mc.nn.parallelize(Tiny(), bound, plan))
                     for key, plan in (("pattern", {"nope.*": "colwise"}),
                                       ("style", {"up": "diagonal"}),
                                       ("type", {"emb": "colwise"}))}
    return out


four = ranks_fixture(worker, 4)


def worker_8(rank: int, world: int) -> dict[str, Any]:
    """dp=2 x tp=4: each dp half of the batch is different, so the activations' layouts hold
    nothing over dp (a plan that used dp there, as the planner does for a replicated
    tensor on this mesh, would mix the halves)."""
    bound = mc.init_mesh("dp=2 tp=4")
    sub = bound.sub("tp")
    out: dict[str, Any] = {"sub": (sub.mesh, sub.group_name("tp") == bound.group_name("tp"),
                                   sub is bound.sub(("tp",)))}
    for fsdp in (False, True):
        m, x, y = built(Tiny(), bound, PLAN, fsdp)
        out[fsdp] = (losses_of(m, x, y, world),
                     {n: p.full_tensor() for n, p in m.named_parameters()})
    return out


eight = ranks_fixture(worker_8, 8)


def test_tensor_parallel_alone_and_under_fsdp_equals_one_process(
        four: list[dict[str, Any]]) -> None:
    ref = Tiny()
    x, y = data()
    want = losses_of(ref, x, y, 1)
    for fsdp in (False, True):
        losses, _, params = four[0][fsdp]
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, fsdp
        for name, p in ref.named_parameters():
            assert torch.allclose(params[name], p.detach(), rtol=1e-4, atol=1e-6), (fsdp, name)


def test_the_tp_slice_of_a_bound_mesh(eight: list[dict[str, Any]]) -> None:
    # rank r of dp=2 tp=4: its tp row, the same group, built once
    assert [r["sub"] for r in eight] == [
        (mc.Mesh("tp=4", ranks=list(range(4 * (r // 4), 4 * (r // 4) + 4))), True, True)
        for r in range(8)]


def test_tensor_parallel_on_dp2_tp4_equals_one_process(eight: list[dict[str, Any]]) -> None:
    ref = Tiny()
    x, y = data()
    want = losses_of(ref, x, y, 1)
    for fsdp in (False, True):
        losses, params = eight[0][fsdp]
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, (fsdp, losses, want)
        for name, p in ref.named_parameters():
            assert torch.allclose(params[name], p.detach(), rtol=1e-4, atol=1e-6), (fsdp, name)


def test_sequence_parallel_alone_and_under_fsdp_equals_one_process(
        four: list[dict[str, Any]]) -> None:
    ref = TinySP()
    x, y = data()
    want = losses_of(ref, x, y, 1)
    for fsdp in (False, True):
        losses, params = four[0][("sp", fsdp)]
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, (fsdp, losses, want)
        for name, p in ref.named_parameters():   # the norms' gradients were summed over tp
            assert torch.allclose(params[name], p.detach(), rtol=1e-4, atol=1e-6), (fsdp, name)


def test_weights_are_split_as_their_styles_say(four: list[dict[str, Any]]) -> None:
    tp, both = four[0][False][1], four[0][True][1]
    assert tp["up.weight"] == "(Replicate(), Shard(dim=0))"
    assert tp["down.weight"] == "(Replicate(), Shard(dim=1))"
    assert tp["down.bias"] == "(Replicate(), Replicate())"
    assert tp["emb.weight"] == "(Replicate(), Shard(dim=0))"
    # fully_shard over dp splits each tp shard further: tp major, dp minor on dim 0
    assert both["up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert both["down.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert four[0]["styles"] == {"emb": "embedding", "up": "colwise", "down": "rowwise",
                                 "out": "colwise_gather"}


def test_uneven_at_both_levels_is_split_tp_first_then_dp(four: list[dict[str, Any]]) -> None:
    # 11 vocabulary rows: tp=2 takes 6 and 5 (torch.chunk), dp=2 splits each: 3+3 and 3+2;
    # ranks are (dp, tp) = (0,0), (0,1), (1,0), (1,1). FSDP pads its gather buffer to 3 rows.
    assert [r["rows"]["emb.weight"] for r in four] == [3, 3, 3, 2]
    assert [r["rows"]["out.weight"] for r in four] == [3, 3, 3, 2]
    assert [r["rows"]["up.bias"] for r in four] == [4, 4, 4, 4]


def test_bad_plans_are_refused(four: list[dict[str, Any]]) -> None:
    errors = four[0]["errors"]
    assert errors["pattern"].startswith("StyleError: parallelize: 'nope.*' matches no module")
    assert errors["style"].startswith("StyleError: parallelize: style 'diagonal' for 'up'")
    assert errors["type"] == ("StyleError: parallelize: emb is an nn.Embedding; style 'colwise'"
                              " needs an nn.Linear")


def test_transformers_conv1d_is_split_as_its_transposed_weight_says(
        four: list[dict[str, Any]]) -> None:
    """GPT-2's Conv1D keeps (in, out) weights: colwise splits its dim 1, rowwise its dim 0,
    and training equals one process (parallelize_module refuses Conv1D)."""
    ref = TinyConv()
    x, y = data()
    want = losses_of(ref, x, y, 1)
    for fsdp in (False, True):
        losses, params, placements = four[0][("conv1d", fsdp)]
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, fsdp
        for name, p in ref.named_parameters():
            assert torch.allclose(params[name], p.detach(), rtol=1e-4, atol=1e-6), (fsdp, name)
    _, _, placements = four[0][("conv1d", False)]
    assert placements["up.weight"] == "(Replicate(), Shard(dim=1))"   # colwise: out columns
    assert placements["up.bias"] == "(Replicate(), Shard(dim=0))"
    assert placements["down.weight"] == "(Replicate(), Shard(dim=0))"  # rowwise: in rows
