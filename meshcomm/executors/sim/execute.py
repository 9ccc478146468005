"""Run a Plan on simulated ranks: one short handler per step kind.

The executor decides nothing: every argument comes from the plan's steps. It is
the reference the torch.distributed executor must match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...core.errors import MeshMismatchError, ShapeError
from ...core.mesh import Mesh
from ...core.reduce_ops import chunk_sizes, op_reduce
from ...planner.values import Plan, Step
from ..landing import unpacked
from ..local import (
    exchange,
    local_move,
    pack,
    rank_transfers,
    received,
    run_tree,
    send_buffer,
    tree_run,
)
from . import collectives as coll
from .collectives import SimResult


def check_locals(plan: Plan, locals_: Sequence[Tensor]) -> None:
    """Raise before any step if `locals_` do not match the plan's source layout."""
    mesh = plan.mesh
    if len(locals_) != mesh.size:
        raise ShapeError(f"execute got {len(locals_)} local tensors for {mesh!r} of {mesh.size}"
                         " ranks; fix: pass one tensor per rank, in mesh order")
    for rank, x in zip(mesh.ranks, locals_):
        if not isinstance(x, Tensor):
            raise ShapeError(f"local tensor of rank {rank} is a {type(x).__name__}, not a Tensor")
        if x.dtype != plan.dtype:
            raise ShapeError(f"local tensor of rank {rank} has dtype {x.dtype} but the plan was"
                             f" made for {plan.dtype}; fix: mc.plan(..., dtype={x.dtype})")
        plan.src.check_local(mesh, plan.shape, rank, tuple(x.shape), "local tensor")


def execute(plan: Plan, locals_: Sequence[Tensor], mesh: Mesh | None = None) -> SimResult:
    """Each rank's output of `plan` and the bytes every step moved (mesh order).

    For a plan between two meshes, see `execute_cross` below.

    >>> import meshcomm as mc
    >>> m = mc.Mesh("tp=2")
    >>> p = mc.plan(m, (4,), "(tp b)", "b")
    >>> execute(p, mc.sim.scatter(torch.arange(4.0), m, "(tp b)")).outputs[1].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    if mesh is not None and mesh != plan.mesh:
        raise MeshMismatchError(f"plan was made for {plan.mesh!r} but is run on {mesh!r}."
                                " fix: plan with the mesh you run on")
    if plan.dst_mesh is not None:
        return execute_cross(plan, locals_)
    check_locals(plan, locals_)
    result = SimResult.noop(list(locals_))
    for step in plan.steps:
        result = result.then(run_step(step, plan.mesh, list(result.outputs), plan.shape))
    return result


def run_step(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    """One step on every rank of `mesh` (tensors in mesh order)."""
    return HANDLERS[step.kind](step, mesh, xs, shape)


def _groups(mesh: Mesh, step: Step) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(mesh.position(r) for r in g) for g in mesh.groups(*step.axes))


def _size(mesh: Mesh, step: Step) -> int:
    return mesh.group_size(step.axes)


def _positions(mesh: Mesh, step: Step) -> list[int]:
    """Each rank's position in its group over the step's axes (mesh order)."""
    return [mesh.group_index(r, *step.axes)[1] for r in mesh.ranks]


def _map(step: Step, xs: list[Tensor], fn: Callable[[Tensor], Tensor] | None) -> list[Tensor]:
    return xs if fn is None else [fn(x) for x in xs]


# -- handlers: (step, mesh, every rank's tensor, global shape) -> SimResult -------------
# Each follows `step.wire` and hands the simulated collective the same buffers the
# torch.distributed executor hands the real one; the bytes are the collective's own.
def _local(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    g = _size(mesh, step)
    outs = [local_move(step, x, pos, g, step.after.local_shape(mesh, shape, rank), rank, mesh,
                       shape) for rank, pos, x in zip(mesh.ranks, _positions(mesh, step), xs)]
    return SimResult.noop(outs)


def _all_gather(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    if step.wire == "all_to_all":    # uneven blocks: each sent to every member
        d, g = step.dim, _size(mesh, step)
        assert d is not None, f"an uneven all_gather names its dim: {step}"
        bufs = [x.movedim(d, 0).contiguous() for x in xs]
        bufs = [b.repeat((g,) + (1,) * (b.dim() - 1)) for b in bufs]
        res = coll.all_to_all(bufs, _groups(mesh, step),
                              input_splits=[[x.shape[d]] * g for x in xs])
        return _with(res, [y.movedim(0, d) for y in res.outputs])
    res = coll.all_gather([x.unsqueeze(0) for x in xs], _groups(mesh, step), dim=0)
    return _with(res, _map(step, list(res.outputs), step.post.apply if step.post else None))


def _reduce_scatter(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]
                    ) -> SimResult:
    op = step.op or "sum"
    if step.wire == "all_to_all":    # torch.chunk chunks, reduced in group order
        d, g = step.dim, _size(mesh, step)
        assert d is not None, f"an uneven reduce_scatter names its dim: {step}"
        splits = [list(chunk_sizes(x.shape[d], g)) for x in xs]
        res = coll.all_to_all([x.movedim(d, 0).contiguous() for x in xs], _groups(mesh, step),
                              input_splits=splits)
        outs = []
        for y, pos, own in zip(res.outputs, _positions(mesh, step), splits):
            c = own[pos]
            outs.append(op_reduce([y.narrow(0, j * c, c) for j in range(g)], op).movedim(0, d))
        return _with(res, outs)
    ys = _map(step, xs, step.pre.apply if step.pre else None)
    res = coll.reduce_scatter(ys, _groups(mesh, step), dim=0, op=op)
    return _with(res, [y.squeeze(0) for y in res.outputs])


def _all_reduce(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    return coll.all_reduce(xs, _groups(mesh, step), op=step.op or "sum")


def _all_to_all(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    ys = _map(step, xs, step.pre.apply if step.pre else None)
    res = coll.all_to_all(ys, _groups(mesh, step), split_dim=0, concat_dim=0)
    return _with(res, _map(step, list(res.outputs), step.post.apply if step.post else None))


def _permute(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    """Pairs as one all_to_all: a position sends its whole tensor to each destination; one
    that receives nothing gets zeros."""
    g, groups = _size(mesh, step), _groups(mesh, step)
    sends, splits, sources = [], [], []
    for x, pos in zip(xs, _positions(mesh, step)):
        dests = [dst for src, dst in step.pairs if src == pos]
        sends.append(x.reshape(-1).repeat(len(dests)))
        splits.append([x.numel() if j in dests else 0 for j in range(g)])
        sources.append(next((src for src, dst in step.pairs if dst == pos), None))
    res = coll.all_to_all(sends, groups, input_splits=splits)
    member = {i: group for group in groups for i in group}
    outs = [torch.zeros_like(x) if src is None else y.reshape(xs[member[i][src]].shape)
            for i, (x, y, src) in enumerate(zip(xs, res.outputs, sources))]
    return _with(res, outs)


def _send_recv(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    if step.action == "tree":
        return _tree(step, mesh, xs, shape)
    outs = [step.after.local_shape(mesh, shape, r) for r in mesh.ranks]
    exs = [exchange(step, r, mesh, mesh, tuple(x.shape), out, x.device)
           for r, x, out in zip(mesh.ranks, xs, outs)]
    group = (tuple(range(mesh.size)),)
    res = coll.all_to_all([send_buffer(ex, x) for ex, x in zip(exs, xs)], group,
                          input_splits=[ex.send_splits for ex in exs])
    return _with(res, [received(ex, flat, out, step.op)
                       for ex, flat, out in zip(exs, res.outputs, outs)])


def _tree(step: Step, mesh: Mesh, xs: list[Tensor], shape: tuple[int, ...]) -> SimResult:
    """A tree step: its rounds, each one all_to_all over the mesh (`executors.local`)."""
    outs = [step.after.local_shape(mesh, shape, r) for r in mesh.ranks]
    runs = [tree_run(step, r, mesh, x.device) for r, x in zip(mesh.ranks, xs)]
    trace = SimResult.noop(xs)
    group = (tuple(range(mesh.size)),)

    def exchange(r: int, buffers: list[Tensor]) -> tuple[Tensor, ...]:
        nonlocal trace
        res = coll.all_to_all(buffers, group,
                              input_splits=[run.rounds[r].send_splits for run in runs])
        trace = trace.then(res)
        return res.outputs

    outputs = run_tree(step, mesh, runs, xs, outs, exchange)
    return _with(trace, outputs)


def _with(res: SimResult, outputs: list[Tensor]) -> SimResult:
    return SimResult(tuple(outputs), res.send_bytes, res.recv_bytes)


HANDLERS: dict[str, Callable[[Step, Mesh, list[Tensor], tuple[int, ...]], SimResult]] = {
    "local": _local,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "collective_permute": _permute,
    "send_recv": _send_recv,
}


# -- a plan between two meshes -------------------------------------------------------
def execute_cross(plan: Plan, locals_: Sequence[Tensor]) -> SimResult:
    """Each rank's output of a cross-mesh `plan` and the bytes every step moved."""
    check_locals(plan, locals_)
    ranks = plan.ranks
    held: dict[int, Tensor] = dict(zip(plan.mesh.ranks, locals_))
    send, recv = [0] * len(ranks), [0] * len(ranks)
    for step in plan.steps:
        if step.dst_mesh is not None:
            held, res = _transfer(step, plan, held)
            sent, got = res.send_bytes, res.recv_bytes
        else:
            mesh = step.mesh or plan.mesh
            res = run_step(step, mesh, [held[r] for r in mesh.ranks], plan.shape)
            held = dict(zip(mesh.ranks, res.outputs))
            sent, got = _spread(mesh, ranks, res.send_bytes), _spread(mesh, ranks, res.recv_bytes)
        send = [a + b for a, b in zip(send, sent)]
        recv = [a + b for a, b in zip(recv, got)]
    outputs = tuple(held.get(r) if plan.dst_mesh and r in plan.dst_mesh.ranks else None
                    for r in ranks)
    return SimResult(outputs, tuple(send), tuple(recv))  # type: ignore[arg-type]


def _spread(mesh: Mesh, ranks: tuple[int, ...], values: tuple[int, ...]) -> tuple[int, ...]:
    where = dict(zip(mesh.ranks, values))
    return tuple(where.get(r, 0) for r in ranks)


def _transfer(step: Step, plan: Plan,
              held: dict[int, Tensor]) -> tuple[dict[int, Tensor], SimResult]:
    """The send_recv between meshes, simulated as one uneven all_to_all over both meshes;
    a direct delivery's receivers reduce the partials in group order (`landing`)."""
    ranks = plan.ranks
    empty = torch.empty(0, dtype=plan.dtype)
    mine = {r: rank_transfers(step, r) for r in ranks}
    packed = [pack(mine[r], ranks, r, held.get(r, empty)) for r in ranks]
    res = coll.all_to_all([p[0] for p in packed], (tuple(range(len(ranks))),),
                          input_splits=[p[1] for p in packed])
    dst_mesh = step.dst_mesh
    assert dst_mesh is not None, f"a transfer step needs dst_mesh: {step}"
    out = {r: unpacked(step, mine[r], ranks, r, res.outputs[ranks.index(r)],
                       step.after.local_shape(dst_mesh, plan.shape, r))
           for r in dst_mesh.ranks}
    return out, res
