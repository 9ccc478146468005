"""meshcomm.nn blocks on 4 gloo ranks against the same math in one process, forward and
gradients, with the collectives each block runs counted and compared with its `explain()`.

One spawn runs every check (float64, so any factor or layout error shows far above rounding).
Loss convention of meshcomm.nn: each rank's loss is `(y_local * dy_local).sum()`; the
reference trains L = (y * dy).sum() / n, n the number of batch shards. Parameter gradients
(gathered with `.full()`) equal dL/dW; a rank's input gradient equals n * dL/dx on its shard.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshcomm as mc
from meshcomm.core.errors import MeshMismatchError, ShapeError
from meshcomm.executors.distributed import wire
from meshcomm.nn.fsdp.param import UNIT_ATTR

from conftest import ranks_fixture

KINDS = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
         "all_reduce_single": "all_reduce", "all_to_all_single": "all_to_all"}
CALLS: Counter[str] = Counter()
E, M, V, B, S = 16, 32, 24, 4, 6          # embed, mlp, vocab, batch, seq


def rand(*shape: int, seed: int, std: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * std


def count_collectives() -> None:
    """Wrap the functional collective calls of meshcomm's wire module (every collective
    meshcomm makes is one of them, on funcol or on the functional op itself) to count calls
    by kind."""
    for name, kind in KINDS.items():
        fn = getattr(wire, name)

        def counted(*args: Any, _fn: Callable[..., Any] = fn, _kind: str = kind,
                    **kwargs: Any) -> Any:
            CALLS[_kind] += 1
            return _fn(*args, **kwargs)
        setattr(wire, name, counted)


def mlp_weights(seed: int) -> dict[str, Tensor]:
    return {"w_up": rand(E, M, seed=seed, std=E ** -0.5), "b_up": rand(M, seed=seed + 1),
            "w_down": rand(M, E, seed=seed + 2, std=M ** -0.5), "b_down": rand(E, seed=seed + 3)}


MLP_NAMES = {"up.weight": "w_up", "up.bias": "b_up", "down.weight": "w_down",
             "down.bias": "b_down"}


def mlp_ref(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return F.gelu(x @ p["w_up"] + p["b_up"]) @ p["w_down"] + p["b_down"]


class MLP(nn.Module):
    def __init__(self, bound: mc.BoundMesh, recipe: str, p: dict[str, Tensor],
                 seq: str = "seq") -> None:
        super().__init__()
        io = f"batch {seq} embed"
        self.up = mc.nn.ColumnParallelLinear(bound, recipe, p["w_up"], p["b_up"], x_dims=io)
        self.down = mc.nn.RowParallelLinear(bound, recipe, p["w_down"], p["b_down"], out_dims=io)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Run:
    """One check: runs a block on local shards, compares with the reference, counts calls."""

    def __init__(self, bound: mc.BoundMesh, recipe: str) -> None:
        self.bound, self.recipe = bound, recipe
        self.problems: list[str] = []
        self.calls: dict[str, dict[str, int]] = {}
        self.n = 1
        for a in mc.nn.logical_axes("batch", recipe, bound.mesh):
            self.n *= bound.mesh.axis_size(a)

    def close(self, what: str, got: Tensor, want: Tensor) -> None:
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            self.problems.append(f"rank {self.bound.rank}: {what}: {err}"
                                 f" (got {tuple(got.shape)}, want {tuple(want.shape)})")

    def run(self, block: nn.Module, ref: Callable[[dict[str, Tensor], Tensor], Tensor],
            p: dict[str, Tensor], x: Tensor, io_dims: str, names: dict[str, str]) -> None:
        """Forward and backward of `block` on this rank's shards of x and dy; compare the
        output, the input gradient and each parameter's gradient (`names`: its key in `p`)."""
        in_layout = out_layout = mc.logical(io_dims, self.recipe, self.bound.mesh)
        want_p = {k: v.clone().requires_grad_() for k, v in p.items()}
        want_x = x.clone().requires_grad_()
        want_y = ref(want_p, want_x)
        dy = rand(*want_y.shape, seed=99)
        ((want_y * dy).sum() / self.n).backward()
        x_local = mc.distribute(x, self.bound, in_layout).local.requires_grad_()
        CALLS.clear()
        y = block(x_local)
        self.calls["forward"] = dict(CALLS)
        CALLS.clear()
        (y * mc.distribute(dy, self.bound, out_layout).local).sum().backward()
        self.calls["backward"] = dict(CALLS)
        self.close("output", y, mc.distribute(want_y.detach(), self.bound, out_layout).local)
        self.close("input grad", x_local.grad,
                   mc.distribute(want_x.grad * self.n, self.bound, in_layout).local)
        for path, module in block.named_modules():
            if isinstance(module, mc.nn.ShardedModule):
                for name, spec in module.specs.items():
                    where = f"{path}.{name}".lstrip(".")
                    grad = mc.Sharded(getattr(module, name).grad, self.bound, spec.stored,
                                      spec.shape).full()
                    self.close(f"{where} grad", grad, want_p[names[where]].grad)

    def report(self, **extra: Any) -> dict[str, Any]:
        return {"problems": self.problems, "calls": self.calls, **extra}


# -- the checks (each on every rank) ------------------------------------------------------------
def check_tp(bound: mc.BoundMesh) -> dict[str, Any]:
    """Megatron MLP under `tp` on dp=2 tp=2: f, column, gelu, row + all_reduce."""
    r = Run(bound, "tp")
    p = mlp_weights(1)
    block = MLP(bound, "tp", p)
    r.run(block, mlp_ref, p, rand(B, S, E, seed=2), "batch seq embed", MLP_NAMES)
    comms = block.up.comms((B, S, E)) + block.down.comms((B, S, M))
    return r.report(explained={ph: mc.nn.comms.count_collectives(comms, ph)
                               for ph in ("forward", "backward")})


def check_sequence_parallel(bound: mc.BoundMesh) -> dict[str, Any]:
    """The same MLP under `sequence_parallel`: all_gather in along seq, reduce_scatter out."""
    r = Run(bound, "sequence_parallel")
    p = mlp_weights(1)
    block = MLP(bound, "sequence_parallel", p, seq="norm_seq")
    r.run(block, mlp_ref, p, rand(B, S, E, seed=2), "batch norm_seq embed", MLP_NAMES)
    comms = block.up.comms((B, S, E)) + block.down.comms((B, S, M))
    return r.report(explained={ph: mc.nn.comms.count_collectives(comms, ph)
                               for ph in ("forward", "backward")},
                    down_bias_grad=str(block.down.specs["bias"].grad))


def check_embedding(bound: mc.BoundMesh) -> dict[str, Any]:
    """Vocab-parallel lookup under `tp` on dp=2 tp=2 (a partial sum over tp, all_reduced)."""
    r = Run(bound, "tp")
    table = rand(V, E, seed=5)
    tokens = torch.randint(V, (B, S), generator=torch.Generator().manual_seed(6))
    block = mc.nn.VocabParallelEmbedding(bound, "tp", table)
    want_table = table.clone().requires_grad_()
    want = want_table[tokens]
    dy = rand(B, S, E, seed=7)
    ((want * dy).sum() / r.n).backward()
    layout = mc.logical("batch seq", "tp", bound.mesh)
    out_layout = mc.logical("batch seq embed", "tp", bound.mesh)
    CALLS.clear()
    y = block(mc.distribute(tokens, bound, layout).local)
    r.calls["forward"] = dict(CALLS)
    CALLS.clear()
    (y * mc.distribute(dy, bound, out_layout).local).sum().backward()
    r.calls["backward"] = dict(CALLS)
    r.close("output", y, mc.distribute(want.detach(), bound, out_layout).local)
    spec = block.specs["weight"]
    r.close("table grad", mc.Sharded(block.weight.grad, bound, spec.stored, spec.shape).full(),
            want_table.grad)
    return r.report()


def check_fsdp(bound: mc.BoundMesh) -> dict[str, Any]:
    """FSDP x TP under `fsdp_tp` on fsdp=2 tp=2: a fully_shard unit over recipe modules
    (bucketed gathers, regather or keep), and the same MLP with each layer gathering its own
    parameters (no unit)."""
    out: dict[str, Any] = {"problems": []}
    p = mlp_weights(11)
    x = rand(B, S, E, seed=12)
    for name, wrap in (("reshard", True), ("keep", False), ("no unit", None)):
        r = Run(bound, "fsdp_tp")
        mlp = MLP(bound, "fsdp_tp", p)
        block = mlp if wrap is None else mc.nn.fully_shard(mlp, bound,
                                                           reshard_after_forward=wrap)
        assert block is mlp, "fully_shard works in place and returns its module"
        r.run(block, mlp_ref, p, x, "batch seq embed", MLP_NAMES)
        out["problems"] += [f"{name}: {msg}" for msg in r.problems]
        out[name] = r.calls
        if wrap is not None:
            unit = getattr(block, UNIT_ATTR)
            out[f"{name} schedule"] = mc.nn.fsdp_schedule(block)
            out[f"{name} received"] = unit.received_bytes     # measured by the engine
            out[f"{name} planned"] = (    # what its prepared plans say one step receives
                sum(c.recv_bytes for c in unit.gathers.calls()) * (2 if wrap else 1)
                + sum(c.recv_bytes for c in unit.reduces.calls()))
        out["stored"] = tuple(mlp.up.weight.shape)
    return out


class Stack(nn.Module):
    """Two MLP blocks and a root-owned ColumnParallelLinear: nested fully_shard units."""

    def __init__(self, bound: mc.BoundMesh, p: list[dict[str, Tensor]], w_out: Tensor) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(bound, "fsdp_tp", q) for q in p)
        self.out = mc.nn.ColumnParallelLinear(bound, "fsdp_tp", w_out)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def check_fsdp_training(bound: mc.BoundMesh, steps: int = 3, lr: float = 0.01) -> dict[str, Any]:
    """Recipe modules under fully_shard (each block, then the root) on fsdp=2 tp=2, trained
    with SGD on the local shards: every step's output and the final parameters equal one
    process's training of the same model."""
    r = Run(bound, "fsdp_tp")
    blocks = [mlp_weights(31), mlp_weights(41)]
    w_out = rand(E, M, seed=51, std=E ** -0.5)
    model = Stack(bound, blocks, w_out)
    for block in model.blocks:
        mc.nn.fully_shard(block, bound)
    mc.nn.fully_shard(model, bound)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    want = {f"blocks.{i}.{where}": q[k].clone().requires_grad_()
            for i, q in enumerate(blocks) for where, k in MLP_NAMES.items()}
    want["out.weight"] = w_out.clone().requires_grad_()
    want_opt = torch.optim.SGD(want.values(), lr=lr)

    def ref(x: Tensor) -> Tensor:
        for i in range(len(blocks)):
            x = x + mlp_ref({k: want[f"blocks.{i}.{w}"] for w, k in MLP_NAMES.items()}, x)
        return x @ want["out.weight"]

    layout = mc.logical("batch seq embed", "fsdp_tp", bound.mesh)
    out_layout = mc.logical("batch seq mlp", "fsdp_tp", bound.mesh)
    for step in range(steps):
        x, dy = rand(B, S, E, seed=60 + step), rand(B, S, M, seed=70 + step)
        want_y = ref(x)
        want_opt.zero_grad()
        ((want_y * dy).sum() / r.n).backward()
        want_opt.step()
        y = model(mc.distribute(x, bound, layout).local)
        opt.zero_grad()
        (y * mc.distribute(dy, bound, out_layout).local).sum().backward()
        opt.step()
        r.close(f"step {step} output", y.detach(),
                mc.distribute(want_y.detach(), bound, out_layout).local)
    for path, module in model.named_modules():
        if isinstance(module, mc.nn.ShardedModule):
            for name in module.specs:
                r.close(f"{path}.{name} after {steps} steps", module.full_param(name),
                        want[f"{path}.{name}"].detach())
    return r.report()


def check_moe(bound: mc.BoundMesh) -> dict[str, Any]:
    """Top-1 MoE under `expert_parallel` on ep=4: uneven dispatch and combine."""
    r = Run(bound, "expert_parallel")
    n_exp, hidden = 8, 8
    router = rand(E, n_exp, seed=21, std=0.5)
    w_up = rand(n_exp, E, hidden, seed=22, std=E ** -0.5)
    w_down = rand(n_exp, hidden, E, seed=23, std=hidden ** -0.5)
    p = {"router": router, "w_up": w_up, "w_down": w_down}

    def ref(q: dict[str, Tensor], x: Tensor) -> Tensor:
        flat = x.reshape(-1, E)
        gate, expert = torch.softmax(flat @ q["router"], -1).max(-1)
        rows = [F.gelu(flat[i:i + 1] @ q["w_up"][e]) @ q["w_down"][e]
                for i, e in enumerate(expert.tolist())]
        return (torch.cat(rows) * gate.unsqueeze(-1)).reshape(x.shape)

    block = mc.nn.MoE(bound, "expert_parallel", router, w_up, w_down)
    x = rand(8, 3, E, seed=24)
    r.run(block, ref, p, x, "batch seq embed", {k: k for k in p})
    flat = mc.distribute(x, bound, block.layout("batch seq embed")).local.reshape(-1, E)
    _, routing = mc.nn.dispatch(flat, block.route(flat)[1], bound, block.experts_layout, n_exp)
    return r.report(sent=routing.send_splits, received=routing.recv_splits)


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    count_collectives()
    tp, fsdp, ep = (mc.init_mesh(m) for m in ("dp=2 tp=2", "fsdp=2 tp=2", "ep=4"))
    return {"tp": check_tp(tp), "sp": check_sequence_parallel(tp),
            "embedding": check_embedding(tp), "fsdp": check_fsdp(fsdp),
            "fsdp training": check_fsdp_training(fsdp), "moe": check_moe(ep)}


four = ranks_fixture(four_ranks, 4)


def problems(four: list[dict[str, Any]], key: str) -> list[str]:
    return [msg for rep in four for msg in rep[key]["problems"]]


# -- values and gradients ---------------------------------------------------------------------
@pytest.mark.parametrize("key", ["tp", "sp", "embedding", "fsdp", "fsdp training", "moe"])
def test_block_matches_single_process(four: list[dict[str, Any]], key: str) -> None:
    found = problems(four, key)
    assert not found, "\n".join(found[:8])


# -- collectives: counted on the wire, and as explain() says ---------------------------------
def test_tensor_parallel_mlp_collectives(four: list[dict[str, Any]]) -> None:
    rep = four[0]["tp"]
    # forward: the row-parallel output's all_reduce over tp only (the entry `f` is free).
    assert rep["calls"]["forward"] == {"all_reduce": 1}
    # backward: f's all_reduce over tp, one all_reduce avg(dp) per parameter (4).
    assert rep["calls"]["backward"] == {"all_reduce": 5}
    assert rep["explained"] == {"forward": 1, "backward": 5}


def test_sequence_parallel_gathers_in_and_reduce_scatters_out(four: list[dict[str, Any]]) -> None:
    rep = four[0]["sp"]
    assert rep["calls"]["forward"] == {"all_gather": 1, "reduce_scatter": 1}
    # backward: all_gather (row's output), reduce_scatter (entry), 4 parameter all_reduces.
    assert rep["calls"]["backward"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 4}
    assert rep["explained"] == {"forward": 2, "backward": 6}
    # the row bias meets sequence-split activations: summed over dp and tp, then / dp.
    assert rep["down_bias_grad"] == "embed | sum(dp, tp)"


def test_embedding_collectives(four: list[dict[str, Any]]) -> None:
    rep = four[0]["embedding"]
    assert rep["calls"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_fully_shard_buckets_gathers_and_reduces(four: list[dict[str, Any]]) -> None:
    rep = four[0]["fsdp"]
    assert rep["stored"] == (8, 16)     # (fsdp embed) (tp mlp) of (16, 32)
    # One all_gather for every shard: w_up "(fsdp embed) (tp mlp)" and b_down "(fsdp embed)"
    # split dim 0, w_down "(tp mlp) (fsdp embed)" dim 1 (its rows padded in runs, one per
    # row of dim 0): one bucket of padded rows; b_up "(tp mlp)" needs none. The all_reduce
    # is the row layer's over tp.
    assert rep["reshard"]["forward"] == {"all_gather": 1, "all_reduce": 1}
    # backward: the all_gather again, one reduce_scatter, one all_reduce avg(fsdp) for
    # b_up, one for f over tp.
    assert rep["reshard"]["backward"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    assert rep["keep"]["forward"] == rep["reshard"]["forward"]
    assert rep["keep"]["backward"] == {"reduce_scatter": 1, "all_reduce": 2}
    # fsdp_schedule prints the unit's calls, in order
    rows = [tuple(line.split()[:3]) for line in rep["reshard schedule"].splitlines()]
    assert rows == [("forward", "all_gather", "(root)"), ("backward", "all_gather", "(root)"),
                    ("backward", "reduce_scatter", "(root)"),
                    ("backward", "all_reduce", "(root)")]
    # bytes received (float64): w_up + b_down shards 1,088 B and w_down's 1,024 B per
    # gather and per reduce_scatter, b_up's all_reduce 128 B; the engine measured what the
    # prepared plans say.
    assert rep["reshard received"] == rep["reshard planned"] == 2 * 2112 + 2112 + 128
    assert rep["keep received"] == rep["keep planned"] == 2112 + 2112 + 128
    # without a unit each layer gathers its own: 3 all_gathers, 3 reduce_scatters.
    assert rep["no unit"]["forward"] == {"all_gather": 3, "all_reduce": 1}
    assert rep["no unit"]["backward"] == {"reduce_scatter": 3, "all_reduce": 2}


def test_fully_shard_class_is_gone() -> None:
    """mc.nn.FullyShard was removed in 0.3; reading it names the replacement."""
    with pytest.raises(AttributeError, match=re.escape(
            "mc.nn.FullyShard was removed in meshcomm 0.3 (docs/changelog.md); use"
            " mc.nn.fully_shard(module, bound)")):
        mc.nn.FullyShard  # noqa: B018
    assert not hasattr(mc.nn, "FullyShard") and "FullyShard" not in mc.nn.__all__


def test_moe_routes_unevenly(four: list[dict[str, Any]]) -> None:
    sent = [rep["moe"]["sent"] for rep in four]
    received = [rep["moe"]["received"] for rep in four]
    assert [list(col) for col in zip(*sent)] == [list(r) for r in received]  # a transpose
    assert len({s for row in sent for s in row}) > 2 and 0 in {s for row in sent for s in row}
    # counts, dispatch, combine: three all_to_alls; the router's gradient one all_reduce.
    # (The two inverse all_to_alls of backward run inside funcol's autograd, not through
    # meshcomm's wire module, so they are not counted here; the values test checks them.)
    assert four[0]["moe"]["calls"] == {"forward": {"all_to_all": 3},
                                       "backward": {"all_reduce": 1}}


# -- one process: specs, explain text, errors -----------------------------------------------------
@pytest.mark.parametrize("mesh, recipe, dims, stored, use, grad, scale", [
    ("fsdp=2 tp=2", "fsdp_tp", "embed mlp", "(fsdp embed) (tp mlp)", "embed (tp mlp)",
     "embed (tp mlp) | avg(fsdp)", 1.0),
    ("dp=2 tp=2", "fsdp_tp", "mlp embed", "(tp mlp) embed", "(tp mlp) embed",
     "(tp mlp) embed | avg(dp)", 1.0),
    ("dp=2 fsdp=2 tp=2", "fsdp_tp", "embed", "(fsdp embed)", "embed", "embed | avg(dp, fsdp)",
     1.0),
    ("dp=2 ep=2", "expert_parallel", "experts embed expert_mlp",
     "(ep experts) embed expert_mlp", "(ep experts) embed expert_mlp",
     "(ep experts) embed expert_mlp | sum(dp)", 0.25),
])
def test_param_spec_layouts(mesh: str, recipe: str, dims: str, stored: str, use: str, grad: str,
                            scale: float) -> None:
    gather = "" if "experts" in dims else "batch"
    s = mc.nn.param_spec(mc.Mesh(mesh), recipe, dims, (8,) * len(dims.split()), gather=gather)
    assert (str(s.stored), str(s.use), str(s.grad), s.grad_scale) == (stored, use, grad, scale)


def test_column_explain_text() -> None:
    bound = mc.nn.planning_mesh("fsdp=2 tp=2")
    up = mc.nn.ColumnParallelLinear(bound, "fsdp_tp", torch.zeros(16, 32))
    assert up.explain((4, 8, 16)).splitlines() == [
        "ColumnParallelLinear on Mesh(fsdp=2, tp=2), recipe fsdp_tp",
        ('  forward   weight gather (16, 32): "(fsdp embed) (tp mlp)" -> "embed (tp mlp)":'
         " all_gather(fsdp) 512 B"),
        ('  forward   input (4, 8, 16): "(fsdp batch) seq embed" -> "(fsdp batch) seq embed":'
         " no communication"),
        ('  backward  weight grad (16, 32): "embed (tp mlp) | avg(fsdp)" ->'
         ' "(fsdp embed) (tp mlp)": reduce_scatter avg(fsdp) 512 B'),
        ('  backward  input grad (4, 8, 16): "(fsdp batch) seq embed | sum(tp)" ->'
         ' "(fsdp batch) seq embed": all_reduce sum(tp) 1.0 KiB'),
    ]
    assert "(activations: pass" in up.explain()
    assert "all_gather  fsdp (2)" in up.explain((4, 8, 16), full=True)


def test_blocks_need_a_bound_mesh() -> None:
    msg = ("ColumnParallelLinear needs a mesh bound to torch.distributed, got the Mesh"
           " Mesh(tp=2); fix: bound = mc.init_mesh('tp=2') on every rank, then pass bound")
    with pytest.raises(MeshMismatchError, match=re.escape(msg)):
        mc.nn.ColumnParallelLinear(mc.Mesh("tp=2"), "tp", torch.zeros(4, 4))  # type: ignore[arg-type]


def test_dispatch_needs_experts_that_split_evenly() -> None:
    bound = mc.nn.planning_mesh("ep=4")
    msg = "dispatch: 6 experts do not split evenly over ep (4 ranks); fix: use a multiple of 4"
    with pytest.raises(ShapeError, match=re.escape(msg)):
        mc.nn.dispatch(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), bound,
                       mc.Layout("(ep experts)"), 6)
