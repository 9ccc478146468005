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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ...core.errors import (
    CollectiveError,
    CollectiveTimeout,
    MeshcommError,
    MeshMismatchError,
    ShapeError,
)
from ...core.mesh import Mesh
from ...core.reduce_ops import chunk_sizes, divide, op_reduce
from ...planner.values import Plan, Step
from ..local import (
    exchange,
    local_move,
    received,
    run_tree,
    send_buffer,
    tree_run,
)
from ..steps import Wire
from . import wire
from .groups import Groups, require_bound


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
    members = mesh.members(rank, *axes)
    return members, members.index(rank)


class Run(NamedTuple):
    """What every handler needs besides the step: the bound mesh, global shape, byte trace."""

    bound: Groups
    shape: tuple[int, ...]
    trace: ByteTrace | None
    wait: bool = True      # False: collectives return tensors waited on at first use

    def group(self, step: Step) -> wire.Group:
        """The step's group: its name, size and this rank's position."""
        members, pos = group_of(self.bound.mesh, self.bound.rank, step.axes)
        return wire.Group(self.bound.group_name(step.axes), len(members), pos)

    def members(self, step: Step) -> tuple[int, ...]:
        """Global ranks of the step's group, in group order."""
        return group_of(self.bound.mesh, self.bound.rank, step.axes)[0]

    def record(self, step: Step, call: Wire, itemsize: int) -> None:
        """Record one collective call, measured from the buffers it was handed."""
        if self.trace is not None:
            self.trace.add(step.kind, step.axes, call.sent * itemsize, call.received * itemsize)


def check_local(plan: Plan, local: Tensor, bound: Groups) -> None:
    """Raise before any communication if `local` or `bound` do not fit the plan on this rank."""
    require_bound(bound, "execute")
    if bound.mesh != plan.mesh:
        raise MeshMismatchError(f"plan was made for {plan.mesh!r} but is run on {bound.mesh!r}."
                                " fix: plan with the bound mesh, mc.plan(bound.mesh, ...)")
    if plan.dst_mesh is not None and plan.dst_mesh != plan.mesh:
        raise MeshMismatchError(
            f"plan goes from {plan.mesh!r} to dst_mesh={plan.dst_mesh!r}, so it runs on the ranks"
            " of both meshes; fix: mc.reshard(x, mesh, src, dst, dst_mesh=bound_dst), which"
            " runs it with meshcomm.executors.distributed.cross.execute_cross")
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


def execute(plan: Plan, local: Tensor, bound: Groups, *, trace: ByteTrace | None = None,
            wait: bool = True) -> Tensor:
    """This rank's output of `plan` for its input shard `local` (call it on every rank).

    `trace`, when given, records the bytes of every collective call as it is made.
    `wait=False` leaves every collective's result unwaited (PyTorch's AsyncCollectiveTensor):
    a step that needs the data waits for it, so the output of a plan whose last step is a
    collective comes back before that collective completes and is waited on at first use.
    A failure then surfaces at that use, as PyTorch's own error.

    >>> out = execute(mc.plan(bound.mesh, (8,), "(tp b)", "b"), x, bound)  # doctest: +SKIP
    """
    check_local(plan, local, bound)
    run = Run(bound, plan.shape, trace, wait)
    for k, step in enumerate(plan.steps):
        try:
            local = HANDLERS[step.kind](step, local, run)
        except RuntimeError as err:
            raise_step_failure(err, plan, k, bound)
            raise
    return local


def raise_step_failure(err: RuntimeError, plan: Plan, k: int, bound: Groups,
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
        " or never reached this step (look for its own error or exit first; MESHCOMM_CHECK=1"
        " or init_mesh(check=True) names ranks that call something else)"
        + ("; if the step is only slow, raise init_mesh(timeout_s=...)" if timeout else "")
    ) from err


# -- handlers: (step, this rank's tensor, run) -> this rank's next tensor ---------------
# Each follows `step.wire` (decided by the planner) and records the buffers it hands to
# the collective (`Wire`): the trace is measured, never recomputed from the plan.
def _local(step: Step, x: Tensor, run: Run) -> Tensor:
    mesh, rank = run.bound.mesh, run.bound.rank
    members, pos = group_of(mesh, rank, step.axes)
    return local_move(step, x, pos, len(members), step.after.local_shape(mesh, run.shape, rank),
                      rank, mesh, run.shape)


def _all_gather(step: Step, x: Tensor, run: Run) -> Tensor:
    if step.wire == "all_to_all":
        return _all_gather_v(step, x, run)
    y, call = wire.all_gather(x.unsqueeze(0).contiguous(), run.group(step), wait=run.wait)
    run.record(step, call, x.element_size())
    return step.post.apply(y) if step.post else y


def _all_gather_v(step: Step, x: Tensor, run: Run) -> Tensor:
    """Blocks differ in size along `step.dim`: one all_to_all sending the block to everyone."""
    name, g, pos = run.group(step)
    mesh, d = run.bound.mesh, step.dim
    assert d is not None, f"an uneven all_gather names its dim: {step}"
    sizes = [step.before.local_shape(mesh, run.shape, r)[d] for r in run.members(step)]
    block = x.movedim(d, 0).contiguous()
    buf = block.repeat((g,) + (1,) * (block.dim() - 1))
    return _a2a(step, run, buf, sizes, [sizes[pos]] * g).movedim(0, d)


def _reduce_scatter(step: Step, x: Tensor, run: Run) -> Tensor:
    if step.wire == "all_to_all":
        return _reduce_scatter_v(step, x, run)
    group = run.group(step)
    y = (step.pre.apply(x) if step.pre else x).contiguous()
    op = step.op or "sum"
    out, call = wire.reduce_scatter(y, _wire_op(op), group, wait=run.wait)
    run.record(step, call, x.element_size())
    out = out.squeeze(0)
    return divide(out, group.size) if op == "avg" else out


def _reduce_scatter_v(step: Step, x: Tensor, run: Run) -> Tensor:
    """torch.chunk-sized chunks along `step.dim`: an all_to_all, then the reduction in group
    order (`op_reduce`, as the simulator), so the result is bit-identical to it."""
    _, g, pos = run.group(step)
    d = step.dim
    assert d is not None, f"an uneven reduce_scatter names its dim: {step}"
    sizes = list(chunk_sizes(x.shape[d], g))
    y = _a2a(step, run, x.movedim(d, 0).contiguous(), [sizes[pos]] * g, sizes)
    c = sizes[pos]
    out = op_reduce([y.narrow(0, j * c, c) for j in range(g)], step.op or "sum")
    return out.movedim(0, d)


def _all_reduce(step: Step, x: Tensor, run: Run) -> Tensor:
    group = run.group(step)
    op = step.op or "sum"
    out, call = wire.all_reduce(x.contiguous(), _wire_op(op), group, wait=run.wait)
    run.record(step, call, x.element_size())
    return divide(out, group.size) if op == "avg" else out


def _all_to_all(step: Step, x: Tensor, run: Run) -> Tensor:
    y = (step.pre.apply(x) if step.pre else x).contiguous()
    out = _a2a(step, run, y)
    return step.post.apply(out) if step.post else out


def _permute(step: Step, x: Tensor, run: Run) -> Tensor:
    """Pairs as one all_to_all: a position sends its whole tensor to each of its destinations;
    one that receives nothing gets zeros, as in the simulator."""
    _, g, pos = run.group(step)
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
    y = _a2a(step, run, send.contiguous(), out_splits, in_splits)
    return torch.zeros_like(x) if source is None else y.reshape(out_shape)


def _send_recv(step: Step, x: Tensor, run: Run) -> Tensor:
    mesh, rank = run.bound.mesh, run.bound.rank
    if step.action == "tree":
        return _tree(step, x, run)
    in_shape = step.before.local_shape(mesh, run.shape, rank)   # static under torch.compile
    out_shape = step.after.local_shape(mesh, run.shape, rank)
    ex = exchange(step, rank, run.members(step), mesh, in_shape, out_shape, x.device)
    if ex.even:   # equal splits: none passed (torch checks a split list per member)
        y = _a2a(step, run, send_buffer(ex, x))
    else:
        y = _a2a(step, run, send_buffer(ex, x), ex.recv_splits, ex.send_splits)
    return received(ex, y, out_shape, step.op)


def _tree(step: Step, x: Tensor, run: Run) -> Tensor:
    """A tree step: its rounds, each one all_to_all over the step's group, traced as one
    call with the rounds' bytes summed (the plan counts the step's bytes)."""
    mesh, rank = run.bound.mesh, run.bound.rank
    out_shape = step.after.local_shape(mesh, run.shape, rank)
    tree = tree_run(step, rank, run.members(step), x.device)
    moved = [0, 0]

    def exchange(r: int, buffers: list[Tensor]) -> list[Tensor]:
        ex = tree.rounds[r]
        y, call = (wire.all_to_all(buffers[0], run.group(step), wait=run.wait) if ex.even else
                   wire.all_to_all(buffers[0], run.group(step), ex.recv_splits, ex.send_splits,
                                   wait=run.wait))
        moved[0], moved[1] = moved[0] + call.sent, moved[1] + call.received
        return [y]

    [y] = run_tree(step, mesh, [tree], [x], [out_shape], exchange)
    if run.trace is not None:
        run.trace.add(step.kind, step.axes, moved[0] * x.element_size(),
                      moved[1] * x.element_size())
    return y


def _a2a(step: Step, run: Run, rows: Tensor, out_splits: list[int] | None = None,
         in_splits: list[int] | None = None) -> Tensor:
    """all_to_all_single of `rows` along dim 0 over the step's group, recorded as measured."""
    y, call = wire.all_to_all(rows, run.group(step), out_splits, in_splits, wait=run.wait)
    run.record(step, call, rows.element_size())
    return y


HANDLERS: dict[str, Callable[[Step, Tensor, Run], Tensor]] = {
    "local": _local,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "collective_permute": _permute,
    "send_recv": _send_recv,
}


def _wire_op(op: str) -> str:
    """The backend's op: avg runs as sum, then a division by the group size (as `op_reduce`)."""
    return "sum" if op == "avg" else op


# -- many plans at once: one collective per bucket of plans with the same shape ---------
_BUCKETED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
Job = tuple[Tensor, Groups, Plan]


def execute_many(jobs: Sequence[Job], *, bucket_bytes: int = 25 * 2**20,
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
        runs = [Run(bound, jobs[i][2].shape, trace) for i in bucket]
        for k, step in enumerate(first.steps):
            steps = [jobs[i][2].steps[k] for i in bucket]
            xs = [outs[i] for i in bucket]
            try:
                if len(bucket) > 1 and step.kind in _BUCKETED and step.wire == step.kind:
                    ys = _RUN_MANY[step.kind](steps, xs, runs[0])
                else:
                    ys = [HANDLERS[s.kind](s, x, run) for s, x, run in zip(steps, xs, runs)]
            except RuntimeError as err:
                raise_step_failure(err, first, k, bound, bucket)
                raise
            for i, y in zip(bucket, ys):
                outs[i] = y
    return outs


def step_shape(plan: Plan) -> tuple[tuple[object, ...], ...]:
    """Per step its kind, axes, op, local action and wire: what plans of one bucket share
    besides mesh and dtype (not the tensor sizes)."""
    return tuple((s.kind, s.axes, s.op, s.action, s.wire) for s in plan.steps)


def signature(plan: Plan, bound: Groups) -> tuple[object, ...]:
    """What plans must share to run in one bucket: mesh, dtype and `step_shape`."""
    return (id(bound), plan.dtype, step_shape(plan))


def _buckets(jobs: Sequence[Job], bucket_bytes: int) -> list[list[int]]:
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


def _all_gather_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Tensor]:
    group = run.group(steps[0])
    flat = _rows(xs, 1)
    y, call = wire.all_gather(flat, group)
    run.record(steps[0], call, flat.element_size())
    parts = _unrows(y, [(group.size, *x.shape) for x in xs])
    return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]


def _reduce_scatter_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Tensor]:
    group = run.group(steps[0])
    g = group.size
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    assert all(y.shape[0] == g for y in ys), f"even reduce_scatter inputs lead with {g}"
    op = steps[0].op or "sum"
    buf = _rows(ys, g)
    out, call = wire.reduce_scatter(buf, _wire_op(op), group)
    run.record(steps[0], call, buf.element_size())
    rows = _unrows(out, [(1, *y.shape[1:]) for y in ys])
    parts = [p.reshape(y.shape[1:]) for p, y in zip(rows, ys)]
    return [divide(p, g) for p in parts] if op == "avg" else parts


def _all_reduce_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Tensor]:
    group = run.group(steps[0])
    g = group.size
    op = steps[0].op or "sum"
    flat = _rows(xs, 1)
    out, call = wire.all_reduce(flat, _wire_op(op), group)
    run.record(steps[0], call, flat.element_size())
    parts = [p.reshape(x.shape) for p, x in zip(_unrows(out, [(1, *x.shape) for x in xs]), xs)]
    return [divide(p, g) for p in parts] if op == "avg" else parts


def _all_to_all_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Tensor]:
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    out = _a2a(steps[0], run, _rows(ys, run.group(steps[0]).size))
    parts = _unrows(out, [tuple(y.shape) for y in ys])
    return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]


_RUN_MANY: dict[str, Callable[[list[Step], list[Tensor], Run], list[Tensor]]] = {
    "all_gather": _all_gather_many,
    "reduce_scatter": _reduce_scatter_many,
    "all_reduce": _all_reduce_many,
    "all_to_all": _all_to_all_many,
}
