"""meshcomm.dist.collectives on gloo, 4 and 8 ranks: equal to meshcomm.sim bit for bit.

Each spawn costs seconds, so one 4-rank run does every check (eager vs sim, bytes and call
counts, group forms, autograd, torch.compile) and one 8-rank run repeats the eager checks;
module-scoped fixtures hold their reports and the tests below read their own section.
Error messages are checked in this process, on a BoundMesh whose group names are fake:
the checks must fire before any communication.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import meshcomm as mc
from meshcomm.core.reduce_ops import REDUCE_OPS
from meshcomm.planner import Transfer
from meshcomm.runtime.bind import BoundMesh
from meshcomm.runtime.collectives import _group, post_shift
from meshcomm.core.errors import MeshAxisError, MeshMismatchError, ShapeError
from meshcomm.core.mesh import Mesh
from meshcomm.executors.distributed import wire
from meshcomm.executors.sim import collectives as sim

from conftest import ints, ranks_fixture

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute",
         "broadcast", "send_recv", "sendrecv")


@dataclass(frozen=True)
class Case:
    label: str
    kind: str
    inputs: Callable[[int], list[Tensor]]        # dtype -> one tensor per rank of the world
    run: Callable[[Tensor, int], Tensor]         # (x, pos) -> this rank's output
    ref: Callable[[list[Tensor]], Any]           # xs -> SimResult (or outputs, bytes)
    wire: bool = True                            # compare sent bytes with the sim's


def per_rank(mesh: Mesh, axes: tuple[str, ...], shape: Callable[[int], tuple[int, ...]],
             seed: int) -> Callable[..., list[Tensor]]:
    """Inputs whose shape depends on each rank's position in its group over `axes`."""
    def make(dtype: torch.dtype = torch.float32) -> list[Tensor]:
        return [ints(shape(mesh.group_index(r, *axes)[1]), seed * 100 + r, dtype)
                for r in range(mesh.size)]
    return make


def cases(bound: BoundMesh, axes_list: list[tuple[str, ...]]) -> list[Case]:
    return [case for axes in axes_list for case in cases_over(bound, axes)]


def cases_over(bound: BoundMesh, axes: tuple[str, ...]) -> list[Case]:
    """The cases for one group (a function, so each set of closures binds its own values)."""
    mesh, out = bound.mesh, []
    groups, tag = mesh.groups(*axes), "/".join(axes)
    g, seed = len(groups[0]), sum(map(ord, tag))

    def add(label: str, kind: str, shape: Callable[[int], tuple[int, ...]],
            run: Callable[[Tensor, int], Tensor], ref: Callable[[list[Tensor]], Any],
            wire: bool = True) -> None:
        out.append(Case(f"{label} over {tag}", kind, per_rank(mesh, axes, shape, seed + len(out)),
                        run, ref, wire))

    a = axes if len(axes) > 1 else axes[0]
    uneven = [p % 3 for p in range(g)]                       # sizes per position
    for d in (0, 1, -1):
        add(f"all_gather dim={d}", "all_gather", lambda p: (2, 3),
            lambda x, p, d=d: mc.collectives.all_gather(x, bound, a, dim=d),
            lambda xs, d=d: sim.all_gather(xs, groups, d))
    add("all_gather uneven dim=1", "all_gather", lambda p: (2, uneven[p]),
        lambda x, p: mc.collectives.all_gather(x, bound, a, dim=1, sizes=uneven),
        lambda xs: sim.all_gather(xs, groups, 1))
    for op in REDUCE_OPS:
        add(f"reduce_scatter {op}", "reduce_scatter", lambda p: (2 * g, 3),
            lambda x, p, op=op: mc.collectives.reduce_scatter(x, bound, a, dim=0, op=op),
            lambda xs, op=op: sim.reduce_scatter(xs, groups, 0, op))
    add("reduce_scatter dim=1", "reduce_scatter", lambda p: (2, g),
        lambda x, p: mc.collectives.reduce_scatter(x, bound, a, dim=1),
        lambda xs: sim.reduce_scatter(xs, groups, 1))
    add("reduce_scatter torch.chunk sizes", "reduce_scatter", lambda p: (g + 1, 2),
        lambda x, p: mc.collectives.reduce_scatter(x, bound, a, dim=0, op="avg"),
        lambda xs: sim.reduce_scatter(xs, groups, 0, "avg"))
    add("reduce_scatter splits", "reduce_scatter", lambda p: (2, sum(uneven) + 1),
        lambda x, p: mc.collectives.reduce_scatter(x, bound, a, dim=1, op="max",
                                       splits=uneven[:-1] + [uneven[-1] + 1]),
        lambda xs: sim.reduce_scatter(xs, groups, 1, "max",
                                      splits=uneven[:-1] + [uneven[-1] + 1]))
    for op in REDUCE_OPS:
        add(f"all_reduce {op}", "all_reduce", lambda p: (3, 2),
            lambda x, p, op=op: mc.collectives.all_reduce(x, bound, a, op=op),
            lambda xs, op=op: sim.all_reduce(xs, groups, op), wire=False)
    for split, concat, shape in ((0, 0, (2 * g, 3)), (1, 0, (2, g)), (0, 1, (g, 3))):
        add(f"all_to_all split={split} concat={concat}", "all_to_all", lambda p, s=shape: s,
            lambda x, p, sp=split, c=concat: mc.collectives.all_to_all(x, bound, a, split_dim=sp,
                                                           concat_dim=c),
            lambda xs, sp=split, c=concat: sim.all_to_all(xs, groups, sp, c))
    ins = [[(p + 2 * j) % 3 * (p > 0) for j in range(g)] for p in range(g)]  # 0 sends nothing
    outs = [[ins[q][p] for q in range(g)] for p in range(g)]
    add("all_to_all uneven", "all_to_all", lambda p: (sum(ins[p]), 2),
        lambda x, p: mc.collectives.all_to_all(x, bound, a, input_splits=ins[p], output_splits=outs[p]),
        lambda xs: sim.all_to_all(xs, groups, input_splits=[
            ins[mesh.group_index(r, *axes)[1]] for r in range(mesh.size)]))
    cols = [j % 2 + 1 for j in range(g)]
    add("all_to_all uneven concat=1", "all_to_all", lambda p: (sum(cols), 2),
        lambda x, p: mc.collectives.all_to_all(x, bound, a, split_dim=0, concat_dim=1, input_splits=cols,
                                   output_splits=[cols[p]] * g),
        lambda xs: sim.all_to_all(xs, groups, 0, 1, input_splits=cols))
    for label, kw in (("shift=1", {"shift": 1}), ("shift=-1", {"shift": -1}),
                      ("one pair", {"pairs": [(0, g - 1)]}),
                      ("fan-out and self", {"pairs": [(0, 1), (0, 0)] + [(g - 1, g - 1)] * (g > 2)})):
        add(f"collective_permute {label}", "collective_permute", lambda p: (2, 3),
            lambda x, p, kw=kw: mc.collectives.collective_permute(x, bound, a, **kw),
            lambda xs, kw=kw: sim.collective_permute(xs, groups, **kw))
    for src in (0, g - 1):
        add(f"broadcast src={src}", "broadcast", lambda p: (3, 2),
            lambda x, p, src=src: mc.collectives.broadcast(x, bound, a, src=src),
            lambda xs, src=src: sim.broadcast(xs, groups, src), wire=False)
    add("send/recv", "send_recv", lambda p: (2, 2),
        lambda x, p: (mc.collectives.send(x, bound, a, dst=g - 1), x.clone())[1] if p == 0 else
        mc.collectives.recv(torch.empty_like(x), bound, a, src=0) if p == g - 1 else x.clone(),
        lambda xs: _send_recv(xs, [Transfer(grp[0], grp[-1], ((0, 1), (0, 1))) for grp in groups]))
    add("sendrecv ring", "sendrecv", lambda p: (2, 3),
        lambda x, p: mc.collectives.sendrecv(x, bound, a, dst=(p + 1) % g, src=(p - 1) % g),
        lambda xs: sim.collective_permute(xs, groups, shift=1))
    add("sendrecv chain", "sendrecv", lambda p: (2, 3),
        lambda x, p: mc.collectives.sendrecv(x, bound, a, dst=p + 1 if p + 1 < g else None,
                                 src=p - 1 if p else None),
        lambda xs: sim.collective_permute(xs, groups, [(p, p + 1) for p in range(g - 1)]))
    return out


def _send_recv(xs: list[Tensor], transfers: list[Transfer]) -> sim.SimResult:
    r = sim.send_recv(xs, transfers)
    outs = [got[0] if got else x.clone() for x, got in zip(xs, r.received)]
    return sim.SimResult(outs, r.send_bytes, r.recv_bytes)


def same_bits(a: Tensor, b: Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


COLLECTIVE_OPS = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                  "all_to_all_single", "broadcast", "batch_p2p_ops", "isend", "irecv"}


class Wire(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each collective this rank calls and the bytes it puts on the wire: functional
    collectives as they are dispatched, eager point-to-point batches at
    `torch.distributed.batch_isend_irecv` (patched while the mode is on)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self._patch = pytest.MonkeyPatch()

    def __enter__(self) -> Wire:
        batch = torch.distributed.batch_isend_irecv

        def counted(ops: list[Any]) -> Any:
            self.calls.append(("batch_isend_irecv", sum(
                op.tensor.numel() * op.tensor.element_size() for op in ops
                if op.op is torch.distributed.isend)))
            return batch(ops)
        self._patch.setattr(torch.distributed, "batch_isend_irecv", counted)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patch.undo()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed import distributed_c10d as c10d

        name = func._opname
        if func.namespace == "c10d" and name == "alltoall_base_":
            # wire's eager all_to_all: the process group's own call (output, input, group,
            # split lists, empty for even splits), as the functional op makes it
            x, pg, ins = args[1], torch.distributed.ProcessGroup.unbox(args[2]), args[4]
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            own = ins[pg.rank()] if ins else x.shape[0] // pg.size()
            self.calls.append(("all_to_all_single", (x.shape[0] - own) * row))
        elif func.namespace == "_c10d_functional" and name in COLLECTIVE_OPS:
            x = args[0] if name != "batch_p2p_ops" else None
            if name == "all_to_all_single":
                me = c10d._resolve_process_group(args[3]).rank()
                row = x[0].numel() * x.element_size() if x.shape[0] else 0
                sent = (sum(args[2]) - args[2][me]) * row
            elif name == "all_gather_into_tensor":
                sent = (args[1] - 1) * x.numel() * x.element_size()
            elif name == "reduce_scatter_tensor":
                sent = x.numel() * x.element_size() * (args[2] - 1) // args[2]
            elif name == "batch_p2p_ops":
                sent = sum(t.numel() * t.element_size()
                           for op, t in zip(args[0], args[3]) if op == "isend")
            else:
                sent = -1
            self.calls.append((name, sent))
        return func(*args, **(kwargs or {}))


def check_against_sim(bound: BoundMesh, axes_list: list[tuple[str, ...]]) -> list[str]:
    """Every case on this rank: output bits, one collective call, bytes equal to the sim's,
    input untouched."""
    failures, rank = [], bound.rank
    for case in cases(bound, axes_list):
        for dtype in (torch.float32, torch.int64) if case.kind == "all_reduce" else (torch.float32,):
            if dtype == torch.int64 and "avg" in case.label:
                continue
            xs = case.inputs(dtype)
            ref = case.ref(xs)
            before = xs[rank].clone()
            with Wire() as wire:
                got = case.run(xs[rank], bound.mesh.group_index(rank, *_axes(case))[1])
                got = got.clone()  # waits
            what = f"rank {rank} {case.label} {dtype}"
            if not same_bits(xs[rank], before):
                failures.append(f"{what}: the input changed")
            if not same_bits(got, ref.outputs[rank]):
                failures.append(f"{what}: got {got.tolist()} want {ref.outputs[rank].tolist()}")
            kinds = [k for k, _ in wire.calls]
            # point-to-point: a rank that neither sends nor receives makes no call
            idle = (case.kind in ("send_recv", "collective_permute")
                    and ref.send_bytes[rank] == ref.recv_bytes[rank] == 0)
            if len(kinds) != (0 if idle else 1):
                failures.append(f"{what}: {len(kinds)} collective calls {kinds}")
            elif case.wire and kinds and wire.calls[0][1] != ref.send_bytes[rank]:
                failures.append(f"{what}: sent {wire.calls[0][1]} bytes, sim {ref.send_bytes[rank]}")
    return failures


def _axes(case: Case) -> tuple[str, ...]:
    return tuple(case.label.rsplit(" over ", 1)[1].split("/"))


# ---- group forms --------------------------------------------------------------------------

def check_group_forms(bound: BoundMesh) -> list[str]:
    """DeviceMesh, (DeviceMesh, dim), ProcessGroup and rank lists give the same results."""
    import torch._dynamo
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank, failures = bound.mesh, bound.rank, []
    dm = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.axis_names)
    xs = [ints((2, 3), 7 + r) for r in range(mesh.size)]
    tp = mesh.groups("tp")
    want = sim.all_gather(xs, tp, 1).outputs[rank]
    flipped = sim.all_gather(xs, [g[::-1] for g in tp], 1).outputs[rank]
    by_rank = next(g for g in tp if rank in g)
    forms = {"DeviceMesh + name": (dm, "tp", want), "(DeviceMesh, 1)": ((dm, 1), None, want),
             "DeviceMesh 1-d": (dm["tp"], None, want),
             "ProcessGroup": (c10d._resolve_process_group(bound.group_name("tp")), None, want),
             "ranks": (list(by_rank), None, want), "ranks reversed": (list(by_rank[::-1]), None,
                                                                      flipped)}
    traced = {"DeviceMesh + name", "ProcessGroup", "ranks reversed"}
    for label, (group, axes, ref) in forms.items():
        got = [mc.collectives.all_gather(xs[rank], group, axes, dim=1)]
        if label in traced:  # these also compile with fullgraph=True
            torch._dynamo.reset()
            got.append(torch.compile(lambda t, gr=group, ax=axes: mc.collectives.all_gather(t, gr, ax, dim=1),
                                     fullgraph=True, backend="aot_eager")(xs[rank]))
        for out in got:
            if not same_bits(out, ref):
                failures.append(f"rank {rank} {label}: got {out.tolist()} want {ref.tolist()}")
    return failures


# ---- autograd -----------------------------------------------------------------------------

def check_autograd(bound: BoundMesh) -> list[str]:
    """Gradients equal those of the sim reference differentiated in one process (float64)."""
    failures, rank, mesh = [], bound.rank, bound.mesh
    chosen = {"all_gather dim=1", "all_gather uneven dim=1", "reduce_scatter sum",
              "reduce_scatter avg", "reduce_scatter splits", "reduce_scatter torch.chunk sizes",
              "all_reduce sum", "all_reduce avg", "all_to_all split=1 concat=0",
              "all_to_all uneven", "all_to_all uneven concat=1",
              "collective_permute fan-out and self", "collective_permute one pair",
              "broadcast src=0", "sendrecv ring", "sendrecv chain"}
    checked = 0
    for case in cases(bound, [("tp",), ("tp", "dp")]):
        if case.label.split(" over ")[0] not in chosen:
            continue
        checked += 1
        xs = [x.requires_grad_() for x in case.inputs(torch.float64)]
        outs = case.ref(xs).outputs
        ws = [ints(tuple(o.shape), 1000 + r, torch.float64) for r, o in enumerate(outs)]
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
        want = [torch.zeros_like(x) if gr is None else gr
                for x, gr in zip(xs, torch.autograd.grad(loss, xs, allow_unused=True))]
        x = xs[rank].detach().clone().requires_grad_()
        y = case.run(x, mesh.group_index(rank, *_axes(case))[1])
        (y * ws[rank]).sum().backward()
        got = torch.zeros_like(x) if x.grad is None else x.grad
        if not same_bits(got, want[rank]):
            failures.append(f"rank {rank} grad of {case.label}: got {got.tolist()}"
                            f" want {want[rank].tolist()}")
    if checked != 2 * len(chosen):
        failures.append(f"rank {rank}: {checked} gradient cases, expected {2 * len(chosen)}")
    return failures


# ---- post_shift: a ring step posted now, waited later ----------------------------------------

def check_post_shift(bound: BoundMesh) -> list[str]:
    """Over ("tp", "dp") (caller order), sizes differing along the ring (position 0 sends
    nothing): position p gets p - 1's tensor, from one p2p batch that sends what x holds;
    shift=4 (the group size) copies x without a message."""
    axes = ("tp", "dp")
    ranks, p = bound.mesh.members(bound.rank, *axes), bound.mesh.group_index(bound.rank, *axes)[1]
    x = torch.full((p, 3), float(bound.rank))
    with wire.recording() as heard:
        posted = post_shift(x, bound, axes, recv_shape=((p - 1) % 4, 3))
        got = posted.wait()
        own = post_shift(x, bound, axes, shift=4).wait()
    want = torch.full(((p - 1) % 4, 3), float(ranks[(p - 1) % 4]))
    failures = []
    if not torch.equal(got, want) or not torch.equal(own, x):
        failures.append(f"rank {bound.rank}: got {got.tolist()} and {own.tolist()}")
    if [(w.kind, w.sent) for w, _ in heard] != [("p2p", x.numel())]:
        failures.append(f"rank {bound.rank}: wire {heard}")
    return failures


# ---- torch.compile ------------------------------------------------------------------------

def check_compile(bound: BoundMesh) -> dict[str, list[str]]:
    """Per kind: fullgraph aot_eager compiles (a graph break raises), output and gradient equal
    eager. The cases include empty blocks, where a traced backward must keep its collective."""
    import torch._dynamo

    rank, mesh, report = bound.rank, bound.mesh, {kind: [] for kind in KINDS}
    labels = {"all_gather dim=1", "all_gather uneven dim=1", "reduce_scatter sum",
              "reduce_scatter torch.chunk sizes", "all_reduce sum", "all_to_all split=0 concat=1",
              "all_to_all uneven", "collective_permute fan-out and self", "broadcast src=0",
              "send/recv", "sendrecv chain"}
    for case in cases(bound, [("tp", "dp")]):
        if case.label.split(" over ")[0] not in labels:
            continue
        torch._dynamo.reset()
        x0 = case.inputs(torch.float64)[rank]
        pos = mesh.group_index(rank, *_axes(case))[1]
        grad = case.kind != "send_recv"   # send and recv are not differentiable
        def eager(t: Tensor, run: Callable[[Tensor, int], Tensor] = case.run,
                  pos: int = pos) -> Tensor:
            return run(t, pos)

        compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
        try:
            runs = []
            for fn in (eager, compiled):
                x = x0.clone().requires_grad_(grad)
                y = fn(x)
                if grad:
                    (y * ints(tuple(y.shape), 5, torch.float64)).sum().backward()
                runs.append((y.detach(), x.grad))
            (y0, g0), (y1, g1) = runs
            if not same_bits(y0, y1) or grad and not same_bits(g0, g1):
                report[case.kind].append(f"rank {rank} {case.label}: compiled {y1.tolist()}"
                                         f" {g1} eager {y0.tolist()} {g0}")
        except Exception as e:  # noqa: BLE001 (a graph break under fullgraph=True raises)
            report[case.kind].append(f"rank {rank} {case.label}: {type(e).__name__}: {e}"[:2000])
        labels.discard(case.label.split(" over ")[0])
    if labels:
        report["all_gather"].append(f"rank {rank}: compile cases not found: {sorted(labels)}")
    return report


# ---- in this process: group resolution and every input check -------------------------------

def fake_bound(mesh: Mesh, rank: int) -> BoundMesh:
    """A BoundMesh whose group names exist nowhere: any communication would fail."""
    names = {s: "fake-" + "-".join(s) for k in range(1, len(mesh.axis_names) + 1)
             for s in itertools.combinations(mesh.axis_names, k)}
    return BoundMesh(mesh, "gloo", torch.device("cpu"), rank, names)


@pytest.mark.parametrize("axes", [axes for k in (1, 2, 3)
                                  for axes in itertools.permutations(("pp", "dp", "tp"), k)])
def test_groups_in_any_axis_order_map_onto_mesh_order_groups(axes: tuple[str, ...]) -> None:
    mesh = Mesh("pp=2 dp=2 tp=2", ranks=[7, 6, 5, 4, 3, 2, 1, 0])
    mesh_order = tuple(a for a in mesh.axis_names if a in axes)
    for rank in mesh.ranks:
        g = _group("test", fake_bound(mesh, rank), axes)
        ranks = next(grp for grp in mesh.groups(*axes) if rank in grp)
        pg_ranks = next(grp for grp in mesh.groups(*mesh_order) if rank in grp)
        assert g.name == "fake-" + "-".join(mesh_order)
        assert (g.ranks, g.pos, g.size) == (ranks, mesh.group_index(rank, *axes)[1], len(ranks))
        assert [pg_ranks[q] for q in g.order] == list(ranks)
        assert [g.order[p] for p in g.inv] == list(range(len(ranks)))


MESH = Mesh("dp=2 tp=4")
B = fake_bound(MESH, 1)
X = torch.zeros(5, 2)
ON_TP = 'over "tp" of Mesh(dp=2, tp=4)'
ERRORS = [
    (lambda: mc.collectives.all_gather(X, B, "tq"), MeshAxisError,
     ('all_gather: "tq" is not an axis of Mesh(dp=2, tp=4); axes are dp, tp\n'
     '  fix: did you mean "tp"?')),
    (lambda: mc.collectives.all_gather(X, B, ("tp", "tp")), MeshAxisError,
     "all_gather: axes ['tp', 'tp'] name an axis twice; fix: name each once"),
    (lambda: mc.collectives.all_reduce(X, B), MeshAxisError,
     ("all_reduce: axes=None does not name mesh axes of Mesh(dp=2, tp=4); fix: pass an axis or"
     " a tuple of axes, e.g. \"tp\" or ('dp', 'tp')")),
    (lambda: mc.collectives.all_gather(X, fake_bound(MESH, 9), "tp"), MeshMismatchError,
     ("all_gather: rank 9 is not in Mesh(dp=2, tp=4); only its ranks [0, 1, 2, 3, 4, 5, 6, 7]"
     " run its collectives")),
    (lambda: mc.collectives.all_gather(X, [0, 1], "tp"), MeshAxisError,
     ("all_gather: axes='tp' goes with a BoundMesh or a DeviceMesh, but the group is a list,"
     " which names its ranks already; fix: drop axes")),
    (lambda: mc.collectives.all_gather(X, "tp"), MeshAxisError,
     ("all_gather: 'tp' is not a group; pass a BoundMesh and axes (mc.init_mesh(...), \"tp\"), a"
     " DeviceMesh, (DeviceMesh, dim), a ProcessGroup, or a list of global ranks")),
    (lambda: mc.collectives.all_gather([1.0], B, "tp"), ShapeError,
     "all_gather: x must be a torch.Tensor, got list"),
    (lambda: mc.collectives.all_gather(X, B, "tp", dim=2), ShapeError,
     f"all_gather {ON_TP}: dim=2 is not a dim of x with shape (5, 2) (valid: -2..1)"),
    (lambda: mc.collectives.all_gather(X, B, "tp", sizes=[5, 5, 5]), ShapeError,
     f"all_gather {ON_TP}: sizes=[5, 5, 5] is not 4 sizes >= 0, one per group position"),
    (lambda: mc.collectives.all_gather(X, B, "tp", sizes=[5, 4, 5, 5]), ShapeError,
     (f"all_gather {ON_TP}: sizes=[5, 4, 5, 5] says position 1 (this rank) has 4 along dim 0,"
     " but x has 5")),
    (lambda: mc.collectives.reduce_scatter(X, B, "tp", splits=[1, 1, 1, 1]), ShapeError,
     (f"reduce_scatter {ON_TP}: splits=[1, 1, 1, 1] sums to 4, but dim 0 of x is 5; fix: sizes"
     " that sum to 5")),
    (lambda: mc.collectives.reduce_scatter(X, B, "tp", op="summ"), ShapeError,
     (f"reduce_scatter {ON_TP}: unknown reduce op 'summ'; ops are sum, avg, max, min\n"
     '  fix: did you mean "sum"?')),
    (lambda: mc.collectives.all_reduce(X.long(), B, "tp", op="avg"), ShapeError,
     (f"all_reduce {ON_TP}: op 'avg' needs a floating dtype, got torch.int64; fix: reduce with"
     " op='sum' and divide, or cast to a float dtype")),
    (lambda: mc.collectives.all_to_all(X, B, "tp"), ShapeError,
     (f"all_to_all {ON_TP}: x has size 5 along split_dim=0, not divisible by the group size 4;"
     " fix: pad dim 0 to a multiple of 4, or pass input_splits and output_splits")),
    (lambda: mc.collectives.all_to_all(X, B, "tp", input_splits=[1, 1, 1, 2]), ShapeError,
     (f"all_to_all {ON_TP}: give input_splits and output_splits together (the sizes this rank"
     " receives cannot be derived locally); fix: exchange the counts first, output_splits ="
     " mc.collectives.all_to_all(torch.tensor(input_splits), ...).tolist(), or give neither for equal"
     " blocks")),
    (lambda: mc.collectives.all_to_all(X, B, "tp", input_splits=[1, 1, 1, 1], output_splits=[1] * 4),
     ShapeError, (f"all_to_all {ON_TP}: input_splits=[1, 1, 1, 1] sums to 4, but split_dim=0 of"
     " x is 5; fix: sizes that sum to 5")),
    (lambda: mc.collectives.all_to_all(X, B, "tp", input_splits=[1, 2, 1, 1], output_splits=[1] * 4),
     ShapeError, (f"all_to_all {ON_TP}: position 1 (this rank) sends itself input_splits[1]=2"
     " rows but output_splits[1]=1; the two must agree")),
    (lambda: mc.collectives.all_to_all(X, B, "tp", concat_dim=1, input_splits=[1, 2, 1, 1],
                           output_splits=[1, 2, 1, 1]), ShapeError,
     (f"all_to_all {ON_TP}: output_splits=[1, 2, 1, 1] differ, so the received blocks differ"
     " along split_dim=0 and cannot be joined along concat_dim=1; fix: concat_dim=0")),
    (lambda: mc.collectives.collective_permute(X, B, "tp", pairs=[(0, 4)]), MeshAxisError,
     (f"collective_permute {ON_TP}: pair (0, 4) is not (src, dst) with positions in 0..3; pairs"
     " name positions within the group (ranks [0, 1, 2, 3]), not global ranks")),
    (lambda: mc.collectives.collective_permute(X, B, "tp", pairs=[(0, 1), (2, 1)]), ShapeError,
     (f"collective_permute {ON_TP}: position 1 is the destination of more than one pair in"
     " [(0, 1), (2, 1)]; each position may receive once")),
    (lambda: mc.collectives.collective_permute(X, B, "tp", pairs=[(0, 1)], shift=1), ShapeError,
     (f"collective_permute {ON_TP}: give exactly one of pairs=[(src, dst), ...] or shift=k (an"
     " int), got pairs=[(0, 1)], shift=1")),
    (lambda: mc.collectives.broadcast(X, B, "tp", src=4), MeshAxisError,
     (f"broadcast {ON_TP}: src=4 is not a position of the group (0..3, ranks [0, 1, 2, 3]); it"
     " is a position within the group, not a global rank")),
    (lambda: mc.collectives.sendrecv(X, B, "tp", dst=1, src=0), MeshAxisError,
     (f"sendrecv {ON_TP}: dst=1 is this rank's own position; a rank does not send to itself."
     " fix: use x.clone() locally")),
    (lambda: mc.collectives.sendrecv(X, B, "tp", dst=None, src=None), MeshAxisError,
     (f"sendrecv {ON_TP}: give dst, src or both; fix: dst=position to send to, src=position to"
     " receive from")),
    (lambda: post_shift(X, B, "tp", recv_shape=(5, -2)), ShapeError,
     f"post_shift {ON_TP}: recv_shape=(5, -2) is not a shape (a sequence of ints >= 0)"),
    (lambda: post_shift(X, B, "tp", shift=4, recv_shape=(4, 2)), ShapeError,
     (f"post_shift {ON_TP}: shift=4 is a multiple of the group size 4, so this rank receives"
      " its own x of shape (5, 2), not recv_shape=[4, 2]")),
    (lambda: mc.collectives.recv(X, B, ("tp", "dp"), src=8), MeshAxisError,
     ("recv over ('tp', 'dp') of Mesh(dp=2, tp=4): src=8 is not a position of the group (0..7,"
     " ranks [0, 4, 1, 5, 2, 6, 3, 7]); it is a position within the group, not a global rank")),
]


@pytest.mark.parametrize("call, error, message", ERRORS, ids=[m[:40] for *_, m in ERRORS])
def test_input_errors_come_before_any_communication(call: Callable[[], Any], error: type,
                                                     message: str) -> None:
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call()


# ---- the spawned bodies ---------------------------------------------------------------------

AXES_4 = [("tp",), ("dp",), ("dp", "tp"), ("tp", "dp")]
AXES_8 = [("tp",), ("pp", "tp"), ("tp", "dp", "pp"), ("tp", "pp", "dp")]  # the last: a 3-cycle


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    bound = mc.init_mesh("dp=2 tp=2")
    report: dict[str, Any] = {"sim": check_against_sim(bound, AXES_4),
                              "forms": check_group_forms(bound),
                              "autograd": check_autograd(bound),
                              "shift": check_post_shift(bound)}
    report["compile"] = check_compile(bound)
    return report


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("pp=2 dp=2 tp=2")
    return {"sim": check_against_sim(bound, AXES_8)}


# one spawn per world size; the tests read its report
four = ranks_fixture(four_ranks, 4)
eight = ranks_fixture(eight_ranks, 8)


def section(reports: list[dict[str, Any]], key: str) -> str:
    return "\n".join(line for rep in reports for line in rep[key])


def test_every_collective_equals_sim_on_4_ranks(four: list[dict[str, Any]]) -> None:
    assert section(four, "sim") == ""


def test_every_collective_equals_sim_on_8_ranks(eight: list[dict[str, Any]]) -> None:
    assert section(eight, "sim") == ""


def test_group_forms_device_mesh_process_group_and_rank_lists(four: list[dict[str, Any]]) -> None:
    assert section(four, "forms") == ""


def test_gradients_equal_the_single_process_reference(four: list[dict[str, Any]]) -> None:
    assert section(four, "autograd") == ""


def test_post_shift_passes_uneven_blocks_round_a_ring(four: list[dict[str, Any]]) -> None:
    assert section(four, "shift") == ""


@pytest.mark.parametrize("kind", KINDS)
def test_compiles_fullgraph_and_equals_eager(four: list[dict[str, Any]], kind: str) -> None:
    assert "\n".join(line for rep in four for line in rep["compile"][kind]) == ""
