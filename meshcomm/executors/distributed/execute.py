"""Run a Plan on this rank with PyTorch functional collectives: one short handler per step kind.

Executor layer. It mirrors `meshcomm.executors.sim.execute` handler for handler (same keys, same
local rearranges, same p2p packing), so every rank's output is bit-identical to the
simulated one for data movement; reductions are too whenever the floating-point result
does not depend on the order of the summands (e.g. integer-valued floats). The executor
decides nothing: every size comes from the plan's layouts, computed locally, and groups
are addressed by name only, so a traced program holds no process-group object. NCCL and
gloo share every line.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ...core.errors import (
    CollectiveError,
    CollectiveTimeout,
    MeshcommError,
    MeshMismatchError,
    ShapeError,
)
from ...core.mesh import Mesh
from ...core.reduce_ops import chunk_sizes, op_reduce
from ...planner.transfers import step_transfers
from ...planner.values import Plan, Step
from ..local import local_move, pack, recv_splits, unpack
from .bind import BoundMesh


class Call(NamedTuple):
    """One collective call on this rank: its kind, axes and the bytes it sent and received."""

    kind: str
    axes: tuple[str, ...]
    send_bytes: int
    recv_bytes: int


@dataclass
class ByteTrace:
    """Bytes this rank sends and receives, recorded at each collective call (eager only).

    >>> trace = ByteTrace()
    >>> trace.add("all_gather", ("tp",), 8, 8)
    >>> trace.send_bytes, trace.recv_bytes, len(trace.calls)
    (8, 8, 1)
    """

    calls: list[Call] = field(default_factory=list)

    def add(self, kind: str, axes: tuple[str, ...], send_bytes: int, recv_bytes: int) -> None:
        self.calls.append(Call(kind, axes, send_bytes, recv_bytes))

    @property
    def send_bytes(self) -> int:
        return sum(c.send_bytes for c in self.calls)

    @property
    def recv_bytes(self) -> int:
        return sum(c.recv_bytes for c in self.calls)


@functools.lru_cache(maxsize=4096)
def group_of(mesh: Mesh, rank: int, axes: tuple[str, ...]) -> tuple[tuple[int, ...], int]:
    """The ranks of `rank`'s group over `axes` (group order) and its position there."""
    group_index, pos = mesh.group_index(rank, *axes)
    return mesh.groups(*axes)[group_index], pos


class _Run(NamedTuple):
    """What every handler needs besides the step: the bound mesh, global shape, byte trace."""

    bound: BoundMesh
    shape: tuple[int, ...]
    trace: ByteTrace | None

    def group(self, step: Step) -> tuple[str, int, int]:
        """(group name, group size, this rank's position) of the step's group."""
        members, pos = group_of(self.bound.mesh, self.bound.rank, step.axes)
        return self.bound.group_name(step.axes), len(members), pos

    def members(self, step: Step) -> tuple[int, ...]:
        """Global ranks of the step's group, in group order."""
        return group_of(self.bound.mesh, self.bound.rank, step.axes)[0]

    def record(self, step: Step, send_elems: int, recv_elems: int, itemsize: int) -> None:
        if self.trace is not None:
            self.trace.add(step.kind, step.axes, send_elems * itemsize, recv_elems * itemsize)


def check_local(plan: Plan, local: Tensor, bound: BoundMesh) -> None:
    """Raise before any communication if `local` or `bound` do not fit the plan on this rank."""
    if not isinstance(bound, BoundMesh):
        raise MeshMismatchError(
            f"execute needs a BoundMesh (from mc.init_mesh), got {type(bound).__name__};"
            f" fix: bound = mc.init_mesh({str(plan.mesh)!r})")
    if bound.mesh != plan.mesh:
        raise MeshMismatchError(f"plan was made for {plan.mesh!r} but is run on {bound.mesh!r}."
                                " fix: plan with the bound mesh, mc.plan(bound.mesh, ...)")
    if plan.dst_mesh is not None and plan.dst_mesh != plan.mesh:
        raise MeshMismatchError(
            f"plan goes from {plan.mesh!r} to dst_mesh={plan.dst_mesh!r}, so it runs on the ranks"
            " of both meshes; fix: mc.reshard(x, mesh, src, dst, dst_mesh=bound_dst), which"
            " runs it with meshcomm.dist.cross.execute_cross")
    if not bound.in_mesh:
        raise MeshMismatchError(f"rank {bound.rank} is not in {bound.mesh!r}; only its ranks"
                                f" {list(bound.mesh.ranks)} run its plans. fix: execute it on"
                                " those ranks only (if bound.in_mesh: ...)")
    rank = bound.rank
    if not isinstance(local, Tensor):
        raise ShapeError(f"local tensor of rank {rank} is a {type(local).__name__}, not a Tensor")
    if local.dtype != plan.dtype:
        raise ShapeError(f"local tensor of rank {rank} has dtype {local.dtype} but the plan was"
                         f" made for {plan.dtype}; fix: mc.plan(..., dtype={local.dtype})"
                         f" (reshard: dtype={local.dtype} or none), or pass x.to({plan.dtype})")
    plan.src.check_local(plan.mesh, plan.shape, rank, tuple(local.shape), "local tensor")


def execute(plan: Plan, local: Tensor, bound: BoundMesh, *, trace: ByteTrace | None = None
            ) -> Tensor:
    """This rank's output of `plan` for its input shard `local` (call it on every rank).

    `trace`, when given, records the bytes of every collective call as it is made.

    >>> out = execute(mc.plan(bound.mesh, (8,), "(tp b)", "b"), x, bound)  # doctest: +SKIP
    """
    check_local(plan, local, bound)
    run = _Run(bound, plan.shape, trace)
    for k, step in enumerate(plan.steps):
        try:
            local = _RUN[step.kind](step, local, run)
        except RuntimeError as err:
            raise_step_failure(err, plan, k, bound)
            raise
    return local


def raise_step_failure(err: RuntimeError, plan: Plan, k: int, bound: BoundMesh,
                       items: list[int] | None = None) -> None:
    """Raise the meshcomm error for step `k` of `plan` failing with `err` on this rank: which
    step (index, kind, axes, layouts), its group's ranks, and the backend's own message.
    Returns (the caller re-raises `err`) for meshcomm errors, local steps and tracing."""
    step = plan.steps[k]
    if (isinstance(err, MeshcommError) or step.kind == "local" or torch.compiler.is_compiling()
            or type(err).__module__.startswith("torch._dynamo")):
        return
    mesh = bound.mesh
    ranks = mesh.ranks if step.kind == "send_recv" else group_of(mesh, bound.rank, step.axes)[0]
    timeout = "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower()
    what = "reshard_many items " + str(items) if items is not None else "reshard"
    over = f" over {', '.join(step.axes)}" if step.axes else ""
    raise (CollectiveTimeout if timeout else CollectiveError)(
        f'{what} "{plan.src}" -> "{plan.dst}" of shape {plan.shape} {plan.dtype} on {mesh!r},'
        f" rank {bound.rank}: step {k + 1} of {len(plan.steps)}, {step.kind}{over} (group ranks"
        f' {list(ranks)}), "{step.before}" -> "{step.after}",'
        f" {'did not complete in time' if timeout else 'failed'}:"
        f" {type(err).__name__}: {str(err).strip()}\n  fix: a rank of the group died, hangs,"
        " or never reached this step (look for its own error or exit first)"
        + ("; if the step is only slow, raise init_mesh(timeout_s=...)" if timeout else "")
    ) from err


# -- handlers: (step, this rank's tensor, run) -> this rank's next tensor ---------------
def _local(step: Step, x: Tensor, run: _Run) -> Tensor:
    mesh, rank = run.bound.mesh, run.bound.rank
    members, pos = group_of(mesh, rank, step.axes)
    return local_move(step, x, pos, len(members), step.after.local_shape(mesh, run.shape, rank),
                      rank, mesh, run.shape)


def _all_gather(step: Step, x: Tensor, run: _Run) -> Tensor:
    if step.dim is not None:
        return _all_gather_v(step, x, run)
    name, g, _ = run.group(step)
    y = _wire(funcol.all_gather_single, _as_wire(x.unsqueeze(0).contiguous()), 0, name)
    run.record(step, (g - 1) * x.numel(), (g - 1) * x.numel(), x.element_size())
    return step.post.apply(y) if step.post else y


def _all_gather_v(step: Step, x: Tensor, run: _Run) -> Tensor:
    """Blocks differ in size along `step.dim`: one all_to_all sending the block to everyone."""
    name, g, pos = run.group(step)
    mesh, d = run.bound.mesh, step.dim
    assert d is not None, f"an uneven all_gather names its dim: {step}"
    sizes = [step.before.local_shape(mesh, run.shape, r)[d] for r in run.members(step)]
    block = x.movedim(d, 0).contiguous()
    y = _a2a(block.repeat((g,) + (1,) * (block.dim() - 1)), name, out_splits=sizes,
             in_splits=[sizes[pos]] * g)
    row = math.prod(block.shape[1:])
    run.record(step, (g - 1) * x.numel(), (sum(sizes) - sizes[pos]) * row, x.element_size())
    return y.movedim(0, d)


def _reduce_scatter(step: Step, x: Tensor, run: _Run) -> Tensor:
    if step.dim is not None:
        return _reduce_scatter_v(step, x, run)
    name, g, _ = run.group(step)
    y = step.pre.apply(x) if step.pre else x
    op = step.op or "sum"
    out = _wire(funcol.reduce_scatter_single, _as_wire(y.contiguous()), _wire_op(op), 0, name)
    out = out.squeeze(0)
    run.record(step, y.numel() - out.numel(), (g - 1) * out.numel(), x.element_size())
    return out / g if op == "avg" else out


def _reduce_scatter_v(step: Step, x: Tensor, run: _Run) -> Tensor:
    """torch.chunk-sized chunks along `step.dim`: an all_to_all, then the reduction in group
    order (`op_reduce`, as the simulator), so the result is bit-identical to it."""
    name, g, pos = run.group(step)
    d = step.dim
    assert d is not None, f"an uneven reduce_scatter names its dim: {step}"
    sizes = list(chunk_sizes(x.shape[d], g))
    y = _a2a(x.movedim(d, 0).contiguous(), name, out_splits=[sizes[pos]] * g, in_splits=sizes)
    c = sizes[pos]
    out = op_reduce([y.narrow(0, j * c, c) for j in range(g)], step.op or "sum")
    out = out.movedim(0, d)
    run.record(step, x.numel() - out.numel(), (g - 1) * out.numel(), x.element_size())
    return out


def _all_reduce(step: Step, x: Tensor, run: _Run) -> Tensor:
    name, g, pos = run.group(step)
    op = step.op or "sum"
    out = _wire(funcol.all_reduce, _as_wire(x.contiguous()), _wire_op(op), name)
    own = chunk_sizes(x.numel(), g)[pos]
    moved = (x.numel() - own) + (g - 1) * own
    run.record(step, moved, moved, x.element_size())
    return out / g if op == "avg" else out


def _all_to_all(step: Step, x: Tensor, run: _Run) -> Tensor:
    name, g, _ = run.group(step)
    y = step.pre.apply(x) if step.pre else x
    out = _a2a(y.contiguous(), name)
    run.record(step, y.numel() - y.numel() // g, y.numel() - y.numel() // g, x.element_size())
    return step.post.apply(out) if step.post else out


def _permute(step: Step, x: Tensor, run: _Run) -> Tensor:
    """Pairs as one all_to_all: a position sends its whole tensor to each of its destinations;
    one that receives nothing gets zeros, as in the simulator."""
    name, g, pos = run.group(step)
    members = run.members(step)
    dests = [dst for src, dst in step.pairs if src == pos]
    source = next((src for src, dst in step.pairs if dst == pos), None)
    out_shape = x.shape if source is None else step.before.local_shape(
        run.bound.mesh, run.shape, members[source])
    flat = x.reshape(-1)
    send = flat.repeat(len(dests)) if len(dests) != 1 else flat
    in_splits = [x.numel() if j in dests else 0 for j in range(g)]
    got = math.prod(out_shape)
    out_splits = [got if j == source else 0 for j in range(g)]
    y = _a2a(send.contiguous(), name, out_splits=out_splits, in_splits=in_splits)
    run.record(step, sum(x.numel() for j in dests if j != pos),
              got if source not in (None, pos) else 0, x.element_size())
    return torch.zeros_like(x) if source is None else y.reshape(out_shape)


def _send_recv(step: Step, x: Tensor, run: _Run) -> Tensor:
    mesh, rank = run.bound.mesh, run.bound.rank
    transfers = step_transfers(step, mesh, run.shape, rank)
    name, _, me = run.group(step)
    members = run.members(step)
    flat, splits = pack(transfers, members, rank, x)
    wanted = recv_splits(transfers, members, rank)
    y = _a2a(flat.contiguous(), name, out_splits=wanted, in_splits=splits)
    run.record(step, sum(splits) - splits[me], sum(wanted) - wanted[me], x.element_size())
    return unpack(transfers, members, rank, y, step.after.local_shape(mesh, run.shape, rank))


_RUN: dict[str, Callable[[Step, Tensor, _Run], Tensor]] = {
    "local": _local,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "collective_permute": _permute,
    "send_recv": _send_recv,
}


# -- the wire: funcol calls, complex tensors as real pairs ------------------------------
def _wire_op(op: str) -> str:
    """The backend's op: avg runs as sum, then a division by the group size (as `op_reduce`)."""
    return "sum" if op == "avg" else op


def _as_wire(x: Tensor) -> tuple[Tensor, bool]:
    return (torch.view_as_real(x), True) if x.is_complex() else (x, False)


def _wire(fn: Callable[..., Tensor], xc: tuple[Tensor, bool], *args: object) -> Tensor:
    """`fn(x, *args)`, waited on: the local rearranges that follow need the data anyway,
    and plain tensors skip the async wrapper's per-op dispatch (as DTensor's default)."""
    x, was_complex = xc
    y = fn(x, *args)
    # Eager calls return an AsyncCollectiveTensor; traced ones are already waited on.
    y = y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y
    return torch.view_as_complex(y) if was_complex else y


def _a2a(x: Tensor, name: str, *, out_splits: list[int] | None = None,
         in_splits: list[int] | None = None) -> Tensor:
    """all_to_all_single along dim 0 (complex tensors travel as real pairs)."""
    return _wire(funcol.all_to_all_single, _as_wire(x), out_splits, in_splits, name)


# -- many plans at once: one collective per bucket of plans with the same shape ---------
_BUCKETED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
Job = tuple[Tensor, BoundMesh, Plan]


def execute_many(jobs: list[Job], *, bucket_bytes: int = 25 * 2**20,
                 trace: ByteTrace | None = None) -> list[Tensor]:
    """Each job's output, running plans with the same collective shape (`signature`) in
    buckets: each even all_gather, reduce_scatter, all_reduce or all_to_all step is one
    collective on a flat buffer of the bucket's tensors; other steps run one by one.

    A bucket holds consecutive jobs of one signature (in job order) up to `bucket_bytes`
    of their plans' peak bytes (max over ranks); a job larger than that runs alone.
    """
    for x, bound, p in jobs:
        check_local(p, x, bound)
    outs = [x for x, _, _ in jobs]
    for bucket in _buckets(jobs, bucket_bytes):
        bound, first = jobs[bucket[0]][1], jobs[bucket[0]][2]
        runs = [_Run(bound, jobs[i][2].shape, trace) for i in bucket]
        for k, step in enumerate(first.steps):
            steps = [jobs[i][2].steps[k] for i in bucket]
            xs = [outs[i] for i in bucket]
            try:
                if len(bucket) > 1 and step.kind in _BUCKETED and step.dim is None:
                    ys = _RUN_MANY[step.kind](steps, xs, runs[0])
                else:
                    ys = [_RUN[s.kind](s, x, run) for s, x, run in zip(steps, xs, runs)]
            except RuntimeError as err:
                raise_step_failure(err, first, k, bound, bucket)
                raise
            for i, y in zip(bucket, ys):
                outs[i] = y
    return outs


def signature(plan: Plan, bound: BoundMesh) -> tuple[object, ...]:
    """What plans must share to run in one bucket: mesh, dtype, and per step its kind,
    axes, op and evenness (not the tensor sizes)."""
    return (id(bound), plan.dtype,
            tuple((s.kind, s.axes, s.op, s.action, s.dim is None) for s in plan.steps))


def _buckets(jobs: list[Job], bucket_bytes: int) -> list[list[int]]:
    """Job indices per bucket; the same on every rank (plans and their peaks are)."""
    open_: dict[tuple[object, ...], tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, (_, bound, p) in enumerate(jobs):
        key, size = signature(p, bound), max(p.peak_bytes, default=0)
        members, total = open_.get(key, ([], 0))
        if members and total + size > bucket_bytes:
            done.append(members)
            members, total = [], 0
        open_[key] = (members + [i], total + size)
    buckets = done + [members for members, _ in open_.values()]
    return sorted(buckets, key=lambda b: b[0])


def _rows(ys: list[Tensor], g: int) -> Tensor:
    """The tensors side by side as one (g, total) buffer: row j holds every block j."""
    return torch.cat([y.reshape(g, -1) for y in ys], dim=1).contiguous()


def _unrows(buf: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """Undo `_rows`: column slices of `buf`, reshaped to `shapes`."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape) // buf.shape[0]
        out.append(buf[:, at:at + n].reshape(shape))
        at += n
    return out


def _all_gather_many(steps: list[Step], xs: list[Tensor], run: _Run) -> list[Tensor]:
    name, g, _ = run.group(steps[0])
    flat = _rows(xs, 1)
    y = _wire(funcol.all_gather_single, _as_wire(flat), 0, name)
    run.record(steps[0], (g - 1) * flat.numel(), (g - 1) * flat.numel(), flat.element_size())
    parts = _unrows(y, [(g, *x.shape) for x in xs])
    return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]


def _reduce_scatter_many(steps: list[Step], xs: list[Tensor], run: _Run) -> list[Tensor]:
    name, g, _ = run.group(steps[0])
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    assert all(y.shape[0] == g for y in ys), f"even reduce_scatter inputs lead with {g}"
    op = steps[0].op or "sum"
    buf = _rows(ys, g)
    out = _wire(funcol.reduce_scatter_single, _as_wire(buf), _wire_op(op), 0, name)
    run.record(steps[0], buf.numel() - out.numel(), (g - 1) * out.numel(), buf.element_size())
    rows = _unrows(out, [(1, *y.shape[1:]) for y in ys])
    parts = [p.reshape(y.shape[1:]) for p, y in zip(rows, ys)]
    return [p / g for p in parts] if op == "avg" else parts


def _all_reduce_many(steps: list[Step], xs: list[Tensor], run: _Run) -> list[Tensor]:
    name, g, pos = run.group(steps[0])
    op = steps[0].op or "sum"
    flat = _rows(xs, 1)
    out = _wire(funcol.all_reduce, _as_wire(flat), _wire_op(op), name)
    own = chunk_sizes(flat.numel(), g)[pos]
    moved = (flat.numel() - own) + (g - 1) * own
    run.record(steps[0], moved, moved, flat.element_size())
    parts = [p.reshape(x.shape) for p, x in zip(_unrows(out, [(1, *x.shape) for x in xs]), xs)]
    return [p / g for p in parts] if op == "avg" else parts


def _all_to_all_many(steps: list[Step], xs: list[Tensor], run: _Run) -> list[Tensor]:
    name, g, _ = run.group(steps[0])
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    buf = _rows(ys, g)
    out = _a2a(buf, name)
    run.record(steps[0], buf.numel() - buf.numel() // g, buf.numel() - buf.numel() // g,
              buf.element_size())
    parts = _unrows(out, [tuple(y.shape) for y in ys])
    return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]


_RUN_MANY: dict[str, Callable[[list[Step], list[Tensor], _Run], list[Tensor]]] = {
    "all_gather": _all_gather_many,
    "reduce_scatter": _reduce_scatter_many,
    "all_reduce": _all_reduce_many,
    "all_to_all": _all_to_all_many,
}
