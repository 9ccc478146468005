"""One short handler per step kind, run on this rank with PyTorch functional collectives.

Executor layer. It mirrors `meshcomm.executors.sim.execute` handler for handler (same keys, same
local rearranges, same p2p packing), so every rank's output is bit-identical to the
simulated one for data movement; reductions are too whenever the floating-point result
does not depend on the order of the summands (e.g. integer-valued floats). The executor
decides nothing: every size comes from the plan's layouts, computed locally, and groups
are addressed by name only, so a traced program holds no process-group object. NCCL and
gloo share every line.

A handler starts its collective and returns at once: its output is a `Later`, the tensors
still on the wire and what to make of them once they land. The engine
(`meshcomm.executors.distributed.execute`) decides when to wait: before the next step
needs the data, or when the caller asks (`Handle.wait`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, Union

import torch
from torch import Tensor

from ...core.errors import (
    CollectiveError,
    CollectiveTimeout,
    MeshcommError,
    MeshMismatchError,
    ShapeError,
)
from ...core.layout import Layout
from ...core.mesh import Mesh
from ...core.reduce_ops import chunk_sizes, divide, op_reduce_rows
from ...core.untraced import tracing
from ...planner.values import Plan, Step, Transfer
from ..landing import combine, unpacked
from ..local import (
    Exchange,
    TreeRun,
    block,
    exchange,
    local_move,
    pack,
    rank_transfers,
    rearranged,
    received,
    recv_splits,
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


class Later(NamedTuple):
    """A step's output still on the wire: `then` of the `inflight` tensors once they land
    (collective results waited with `wire.waited`; point-to-point batches, `wire.Posted`,
    give their receive buffers)."""

    inflight: tuple[Tensor | wire.Posted, ...]
    then: Callable[..., Tensor]

    def result(self, wait: bool = True) -> Tensor:
        """`then` of the landed tensors; `wait=False` hands it the in-flight ones, which
        PyTorch waits for at their first use that is not a view."""
        one = self.inflight[0] if len(self.inflight) == 1 else None
        if isinstance(one, Tensor):   # one collective's result: the common case, kept short
            return self.then(wire.waited(one) if wait else one)
        got: list[Tensor] = []
        for t in self.inflight:
            if isinstance(t, wire.Posted):
                got.extend(t.landed() if wait else t.unwaited())
            else:
                got.append(wire.waited(t) if wait else t)
        return self.then(*got)


Out = Union[Tensor, Later]


def _same(y: Tensor) -> Tensor:
    return y


class Run(NamedTuple):
    """What every handler needs besides the step: the bound mesh, global shape, byte trace."""

    bound: Groups
    shape: tuple[int, ...]
    trace: ByteTrace | None

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


@functools.lru_cache(maxsize=4096)
def local_shape(layout: Layout, mesh: Mesh, shape: tuple[int, ...], rank: int
                ) -> tuple[int, ...]:
    """`layout.local_shape(mesh, shape, rank)`, worked out once: a call after the first is
    one dict lookup on hashes the layout and mesh keep (never on a plan, whose hash reads
    every step's per-rank figures)."""
    return layout.local_shape(mesh, shape, rank)


T = TypeVar("T")
_MEMO: dict[tuple[int, str, object], tuple[Step, object]] = {}


def per_step(step: Step, what: str, key: object, build: Callable[[], T]) -> T:
    """`build()` (`what` of `step` on this rank), worked out once per step and `key` (the
    rank, shapes, device: what it depends on besides the step) and kept by the step's
    identity: a prepared or memoized plan's steps live as long as the plan, so each call
    after the first is one dict lookup on (step id, `what`, `key`), whatever the group
    size, and a process that plays several ranks keeps one value per rank.
    (An lru_cache keyed on the step would hash it, and with it its per-rank byte tuples:
    O(ranks) per call.) Traced, nothing is kept: the values may hold the trace's tensors."""
    if tracing() or torch.compiler.is_compiling():
        return build()
    slot = (id(step), what, key)    # one entry per rank: a process playing several keeps all
    hit = _MEMO.get(slot)
    if hit is not None and hit[0] is step:
        return hit[1]  # type: ignore[return-value]
    value = build()
    if len(_MEMO) >= 4096:
        _MEMO.clear()
    _MEMO[slot] = (step, value)
    return value


def check_local(plan: Plan, local: Tensor, bound: Groups) -> None:
    """Raise before any communication if `local` or `bound` do not fit the plan on this rank."""
    # the common case in a few compares: a bound mesh of the plan's, this rank in it, a
    # tensor of the plan's dtype and this rank's local shape (`_check_local` says what differs)
    if (isinstance(bound, Groups) and bound.mesh == plan.mesh and plan.dst_mesh is None
            and isinstance(local, Tensor) and local.dtype == plan.dtype
            and bound.rank in plan.mesh
            and local.shape == local_shape(plan.src, plan.mesh, plan.shape, bound.rank)):
        return
    _check_local(plan, local, bound)


def _check_local(plan: Plan, local: Tensor, bound: Groups) -> None:
    require_bound(bound, "execute")
    if bound.mesh != plan.mesh:
        raise MeshMismatchError(f"plan was made for {plan.mesh!r} but is run on {bound.mesh!r}."
                                " fix: plan with the bound mesh, mc.plan(bound.mesh, ...)")
    if plan.dst_mesh is not None and plan.dst_mesh != plan.mesh:
        raise MeshMismatchError(
            f"plan goes from {plan.mesh!r} to dst_mesh={plan.dst_mesh!r}, so it runs on the ranks"
            " of both meshes; fix: mc.reshard(x, mesh, src, dst, dst_mesh=bound_dst), which"
            " runs it with meshcomm.executors.distributed.execute_cross")
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


# -- handlers: (step, this rank's tensor, run) -> this rank's next tensor, maybe Later ----
# Each follows `step.wire` (decided by the planner) and records the buffers it hands to
# the collective (`Wire`): the trace is measured, never recomputed from the plan.
def _local(step: Step, x: Tensor, run: Run) -> Tensor:
    mesh, rank = run.bound.mesh, run.bound.rank
    members, pos = group_of(mesh, rank, step.axes)
    return local_move(step, x, pos, len(members), step.after.local_shape(mesh, run.shape, rank),
                      rank, mesh, run.shape)


def _all_gather(step: Step, x: Tensor, run: Run) -> Out:
    if step.wire == "all_to_all":
        return _all_gather_v(step, x, run)
    y, call = wire.all_gather(x.unsqueeze(0).contiguous(), run.group(step), wait=False)
    run.record(step, call, x.element_size())
    return Later((y,), functools.partial(rearranged, step.post) if step.post else _same)


class _Splits(NamedTuple):
    """An uneven collective's all_to_all on this rank, in elements of a flat buffer: what
    it receives from and sends to each position (worked out once per step, `per_step`)."""

    recv: tuple[int, ...]
    send: tuple[int, ...]
    rows: tuple[int, ...]        # the rows along the step's dim (gathered, or chunked)
    total: int = 0               # the rows gathered


def _gather_splits(step: Step, run: Run, shape: tuple[int, ...]) -> _Splits:
    """An uneven all_gather's splits: every member's block (each member's local shape:
    O(group) work, once), this rank's sent to each; `shape` is the moved block's."""
    mesh, d = run.bound.mesh, step.dim
    assert d is not None, f"an uneven all_gather names its dim: {step}"
    _, g, pos = run.group(step)
    row = math.prod(shape[1:])
    rows = tuple(step.before.local_shape(mesh, run.shape, r)[d] for r in run.members(step))
    return _Splits(tuple(n * row for n in rows), (rows[pos] * row,) * g, rows, sum(rows))


def _all_gather_v(step: Step, x: Tensor, run: Run) -> Out:
    """Blocks differ in size along `step.dim`: one all_to_all sending the block to everyone."""
    g = run.group(step).size
    d = step.dim
    assert d is not None, f"an uneven all_gather names its dim: {step}"
    block = x.movedim(d, 0).contiguous()
    shape = tuple(block.shape)
    sp = per_step(step, "gather", (run.bound.rank, shape),
                  lambda: _gather_splits(step, run, shape))
    buf = block.reshape(1, -1).expand(g, -1).reshape(-1)    # the block, g times
    y = _a2a(step, run, buf, sp.recv, sp.send)
    return Later((y,), lambda y: y.view(sp.total, *shape[1:]).movedim(0, d))


def _reduce_scatter(step: Step, x: Tensor, run: Run) -> Out:
    if step.wire == "all_to_all":
        return _reduce_scatter_v(step, x, run)
    group = run.group(step)
    y = (rearranged(step.pre, x) if step.pre else x).contiguous()
    op = step.op or "sum"
    out, call = wire.reduce_scatter(y, _wire_op(op), group, wait=False)
    run.record(step, call, x.element_size())
    if op == "avg":
        return Later((out,), lambda out: divide(out.squeeze(0), group.size))
    return Later((out,), lambda out: out.squeeze(0))


def _scatter_splits(g: int, pos: int, shape: tuple[int, ...]) -> _Splits:
    """An uneven reduce_scatter's splits: torch.chunk chunks of the moved input's rows
    (`shape`), chunk p to position p; this position's chunk from each."""
    row = math.prod(shape[1:])
    rows = chunk_sizes(shape[0], g)
    return _Splits((rows[pos] * row,) * g, tuple(n * row for n in rows), rows)


def _reduce_scatter_v(step: Step, x: Tensor, run: Run) -> Out:
    """torch.chunk-sized chunks along `step.dim`: an all_to_all, then the reduction in group
    order (`op_reduce_rows`: `op_reduce`'s bits, as the simulator's) of the g chunks
    received, stacked in one buffer."""
    _, g, pos = run.group(step)
    d = step.dim
    assert d is not None, f"an uneven reduce_scatter names its dim: {step}"
    rows = x.movedim(d, 0).contiguous()
    shape = tuple(rows.shape)
    sp = per_step(step, "scatter", (run.bound.rank, shape),
                  lambda: _scatter_splits(g, pos, shape))
    y = _a2a(step, run, rows.reshape(-1), sp.recv, sp.send)
    chunk = (g, sp.rows[pos], *shape[1:])
    return Later((y,), lambda y: op_reduce_rows(y.view(chunk), step.op or "sum").movedim(0, d))


def _all_reduce(step: Step, x: Tensor, run: Run) -> Out:
    group = run.group(step)
    op = step.op or "sum"
    out, call = wire.all_reduce(x.contiguous(), _wire_op(op), group, wait=False)
    run.record(step, call, x.element_size())
    return Later((out,), (lambda out: divide(out, group.size)) if op == "avg" else _same)


def _all_to_all(step: Step, x: Tensor, run: Run) -> Out:
    y = (rearranged(step.pre, x) if step.pre else x).contiguous()
    out = _a2a(step, run, y)
    return Later((out,), functools.partial(rearranged, step.post) if step.post else _same)


def _permute(step: Step, x: Tensor, run: Run) -> Out:
    """Two point-to-point messages per rank at most: a position sends its whole tensor to
    each of its destinations and receives from its source; one that receives nothing gets
    zeros, as in the simulator. A pair from a position to itself is a local copy."""
    _, g, pos = run.group(step)
    dests, source, out_shape = per_step(step, "permute", (run.bound.rank, tuple(x.shape)),
                                        lambda: _permute_ends(step, run, pos, tuple(x.shape)))
    flat = x.contiguous().reshape(-1)
    out = flat.new_empty(math.prod(out_shape))
    sends = [(flat, d) for d in dests if d != pos]
    recvs = [(out, source)] if source is not None and source != pos else []
    posted, call = wire.p2p(sends, recvs, run.group(step).name, run.group(step), flat)
    run.record(step, call, x.element_size())
    if source is None:
        return Later((posted,), lambda *_: posted.tied(torch.zeros_like(x)))
    if source == pos:
        out.copy_(flat)
        return Later((posted,), lambda *_: posted.tied(out.view(out_shape)))
    # the received tensor itself (traced: the op's output, waited at first use)
    return Later((posted,), lambda got: got.view(out_shape))


def _permute_ends(step: Step, run: Run, pos: int, shape: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], int | None, tuple[int, ...]]:
    """A permute's destinations of this position, its source (None: none), and the shape
    it receives (its source's shard): O(pairs) work, once per step (`per_step`)."""
    dests = tuple(dst for src, dst in step.pairs if src == pos)
    source = next((src for src, dst in step.pairs if dst == pos), None)
    out_shape = shape if source is None else step.before.local_shape(
        run.bound.mesh, run.shape, run.members(step)[source])
    return dests, source, out_shape


class _Exchanged(NamedTuple):
    """A send_recv on this rank: its Exchange, its output shape, and its split lists as
    tuples (None where even), handed to every call as they are."""

    ex: Exchange
    out_shape: tuple[int, ...]
    recv: tuple[int, ...] | None
    send: tuple[int, ...] | None


def _exchanged(step: Step, run: Run, device: torch.device) -> _Exchanged:
    mesh, rank = run.bound.mesh, run.bound.rank
    in_shape = step.before.local_shape(mesh, run.shape, rank)   # static under torch.compile
    out_shape = step.after.local_shape(mesh, run.shape, rank)
    ex = exchange(step, rank, run.members(step), mesh, in_shape, out_shape, device)
    if ex.even:   # equal splits: none passed (torch checks a split list per member)
        return _Exchanged(ex, out_shape, None, None)
    return _Exchanged(ex, out_shape, tuple(ex.recv_splits), tuple(ex.send_splits))


def _send_recv(step: Step, x: Tensor, run: Run) -> Out:
    if step.action == "tree":
        return _tree(step, x, run)
    # the exchange, its splits and shapes: O(group) work once per step, rank and device
    got = per_step(step, "send_recv", (run.bound.rank, run.shape, x.device),
                   lambda: _exchanged(step, run, x.device))
    y = _a2a(step, run, send_buffer(got.ex, x), got.recv, got.send)
    return Later((y,), lambda y: received(got.ex, y, got.out_shape, step.op))


def _tree(step: Step, x: Tensor, run: Run) -> Tensor:
    """A tree step: its rounds, each one all_to_all over the step's group, traced as one
    call with the rounds' bytes summed (the plan counts the step's bytes)."""
    mesh, rank = run.bound.mesh, run.bound.rank
    out_shape = step.after.local_shape(mesh, run.shape, rank)
    tree: TreeRun = per_step(step, "tree", (rank, x.device),
                             lambda: tree_run(step, rank, run.members(step), x.device))
    moved = [0, 0]

    def exchange(r: int, buffers: list[Tensor]) -> list[Tensor]:
        ex = tree.rounds[r]
        y, call = (wire.all_to_all(buffers[0], run.group(step)) if ex.even else
                   wire.all_to_all(buffers[0], run.group(step), ex.recv_splits, ex.send_splits))
        moved[0], moved[1] = moved[0] + call.sent, moved[1] + call.received
        return [y]

    [y] = run_tree(step, mesh, [tree], [x], [out_shape], exchange)
    if run.trace is not None:
        run.trace.add(step.kind, step.axes, moved[0] * x.element_size(),
                      moved[1] * x.element_size())
    return y


def _a2a(step: Step, run: Run, rows: Tensor, out_splits: Sequence[int] | None = None,
         in_splits: Sequence[int] | None = None) -> Tensor:
    """all_to_all_single of `rows` along dim 0 over the step's group, recorded as measured."""
    y, call = wire.all_to_all(rows, run.group(step), out_splits, in_splits, wait=False)
    run.record(step, call, rows.element_size())
    return y


HANDLERS: dict[str, Callable[[Step, Tensor, Run], Out]] = {
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
BUCKETED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
Item = tuple[Union[Tensor, None], Groups, Plan]   # (local or None, bound, plan)


def step_shape(plan: Plan) -> tuple[tuple[object, ...], ...]:
    """Per step its kind, axes, op, local action and wire: what plans of one bucket share
    besides mesh and dtype (not the tensor sizes)."""
    return tuple((s.kind, s.axes, s.op, s.action, s.wire) for s in plan.steps)


def signature(plan: Plan, bound: Groups) -> tuple[object, ...]:
    """What plans must share to run in one bucket: mesh, dtype and `step_shape`."""
    return (id(bound), plan.dtype, step_shape(plan))


def buckets(jobs: Sequence[Item], bucket_bytes: int) -> list[list[int]]:
    """Item indices per bucket; the same on every rank (plans and their peaks are)."""
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


class _Cut:
    """One bucket's landed buffer cut into its items' outputs once, for every item's Later."""

    def __init__(self, cut: Callable[[Tensor], list[Tensor]]) -> None:
        self.cut = cut
        self.parts: list[Tensor] | None = None

    def part(self, i: int, buf: Tensor) -> Tensor:
        if self.parts is None:
            self.parts = self.cut(buf)
        return self.parts[i]


def parts_of(buf: Tensor, cut: Callable[[Tensor], list[Tensor]], n: int) -> list[Out]:
    """`n` Laters of one in-flight bucket buffer, item i the i-th of `cut(buf)`."""
    shared = _Cut(cut)
    return [Later((buf,), functools.partial(shared.part, i)) for i in range(n)]


def _all_gather_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Out]:
    group = run.group(steps[0])
    flat = _rows(xs, 1)
    y, call = wire.all_gather(flat, group, wait=False)
    run.record(steps[0], call, flat.element_size())

    def cut(y: Tensor) -> list[Tensor]:
        parts = _unrows(y, [(group.size, *x.shape) for x in xs])
        return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]
    return parts_of(y, cut, len(xs))


def _reduce_scatter_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Out]:
    group = run.group(steps[0])
    g = group.size
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    assert all(y.shape[0] == g for y in ys), f"even reduce_scatter inputs lead with {g}"
    op = steps[0].op or "sum"
    buf = _rows(ys, g)
    out, call = wire.reduce_scatter(buf, _wire_op(op), group, wait=False)
    run.record(steps[0], call, buf.element_size())

    def cut(out: Tensor) -> list[Tensor]:
        rows = _unrows(out, [(1, *y.shape[1:]) for y in ys])
        parts = [p.reshape(y.shape[1:]) for p, y in zip(rows, ys)]
        return [divide(p, g) for p in parts] if op == "avg" else parts
    return parts_of(out, cut, len(xs))


def _all_reduce_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Out]:
    group = run.group(steps[0])
    g = group.size
    op = steps[0].op or "sum"
    flat = _rows(xs, 1)
    out, call = wire.all_reduce(flat, _wire_op(op), group, wait=False)
    run.record(steps[0], call, flat.element_size())

    def cut(out: Tensor) -> list[Tensor]:
        parts = [p.reshape(x.shape)
                 for p, x in zip(_unrows(out, [(1, *x.shape) for x in xs]), xs)]
        return [divide(p, g) for p in parts] if op == "avg" else parts
    return parts_of(out, cut, len(xs))


def _all_to_all_many(steps: list[Step], xs: list[Tensor], run: Run) -> list[Out]:
    ys = [s.pre.apply(x) if s.pre else x for s, x in zip(steps, xs)]
    out = _a2a(steps[0], run, _rows(ys, run.group(steps[0]).size))

    def cut(out: Tensor) -> list[Tensor]:
        parts = _unrows(out, [tuple(y.shape) for y in ys])
        return [s.post.apply(p) if s.post else p for s, p in zip(steps, parts)]
    return parts_of(out, cut, len(xs))


RUN_MANY: dict[str, Callable[[list[Step], list[Tensor], Run], list[Out]]] = {
    "all_gather": _all_gather_many,
    "reduce_scatter": _reduce_scatter_many,
    "all_reduce": _all_reduce_many,
    "all_to_all": _all_to_all_many,
}


# -- between two meshes (see `meshcomm.planner.crossmesh`) ----------------------------------
# A step on one mesh runs with the handlers above on that mesh's ranks (the others skip it).
# The transfer step runs on every rank of either mesh as one batch of point-to-point
# messages, one per (sender, receiver) pair, so all transfers overlap. A sender packs with
# `pack` (blocks in transfer order, grouped by receiver) and sends each receiver its slice; a
# receiver receives each sender's message into its slice of one flat buffer, which
# `landing.combine` reads. So the bytes and their order are the simulator's
# (`sim.execute_cross`). What a rank in both meshes keeps is a local copy and moves no
# bytes. Ranks in neither mesh do nothing.
def check_cross(plan: Plan, local: Tensor | None, src: Groups, dst: Groups) -> None:
    """Raise before any communication if `local`, `src` or `dst` do not fit the plan here."""
    if plan.dst_mesh is None:
        raise MeshMismatchError(
            f"execute_cross runs plans between two meshes, but this plan stays on"
            f" {plan.mesh!r}. fix: run it with"
            " mc.executors.distributed.execute(plan, local, bound)")
    for word, bound, mesh in (("source", src, plan.mesh), ("destination", dst, plan.dst_mesh)):
        require_bound(bound, "execute_cross", f"the {word} mesh")
        if bound.mesh != mesh:
            raise MeshMismatchError(
                f"plan's {word} mesh is {mesh!r} but the bound {word} mesh is {bound.mesh!r}."
                " fix: plan with the bound meshes, mc.plan(src.mesh, ..., dst_mesh=dst.mesh)")
    if src.rank != dst.rank:
        raise MeshMismatchError(f"the source and destination meshes were bound on different"
                                f" processes (ranks {src.rank} and {dst.rank})")
    rank = src.rank
    if rank not in plan.mesh and rank not in plan.dst_mesh:
        return                                  # in neither mesh: it does nothing
    if rank not in plan.mesh:
        if local is not None:
            raise ShapeError(
                f"rank {rank} is not in the source mesh {plan.mesh!r}, so it has no input,"
                f" but it got a {type(local).__name__}. fix: pass None on ranks"
                f" {[r for r in plan.ranks if r not in plan.mesh.ranks]}")
        return
    if not isinstance(local, Tensor):
        raise ShapeError(f"local tensor of rank {rank} is a {type(local).__name__}, not a"
                         f" Tensor; ranks {list(plan.mesh.ranks)} of the source mesh pass"
                         " their shard")
    if local.dtype != plan.dtype:
        raise ShapeError(f"local tensor of rank {rank} has dtype {local.dtype} but the plan was"
                         f" made for {plan.dtype}; fix: mc.plan(..., dtype={local.dtype})")
    plan.src.check_local(plan.mesh, plan.shape, rank, tuple(local.shape), "local tensor")


def transfer(step: Step, x: Tensor | None, plan: Plan, dst: Groups,
             trace: ByteTrace | None) -> Later:
    """The send_recv between meshes, posted: one batch of point-to-point messages, one per
    pair (on a rank outside the destination mesh, its result is an empty tensor)."""
    if torch.compiler.is_compiling():
        return _transfer_traced(step, x, plan, dst, trace)
    rank = dst.rank
    held = x if x is not None else torch.empty(0, dtype=plan.dtype, device=dst.device)
    route = _route(step, rank)      # this rank's peers and blocks, worked out once
    sends = [(_message(held, ts), peer) for peer, ts in route.sends]
    backs = [(held.new_empty(n), peer) for peer, n, _ in route.recvs]
    posted, call = wire.p2p(sends, backs, wire.WORLD)   # peers are global ranks
    if trace is not None:
        size = held.element_size()
        trace.add(step.kind, step.axes, call.sent * size, call.received * size)
    if not dst.in_mesh:
        return Later((posted,), lambda *_: held.new_empty(0))
    shape = step.after.local_shape(dst.mesh, plan.shape, rank)
    own = [(t, block(held, t.src_index).reshape(-1)) for t in route.own]

    def land(*_: Tensor) -> Tensor:
        parts = list(own)
        for (buf, _peer), (_from, _n, ts) in zip(backs, route.recvs):
            at = 0
            for t in ts:
                parts.append((t, buf[at:at + t.numel]))
                at += t.numel
        return combine(step, parts, shape, held, fresh=not own)   # received: ours alone
    return Later((posted,), land)


class Route(NamedTuple):
    """One rank's part of a transfer between meshes: to each peer, the blocks it sends (in
    the order they travel); from each peer, the elements and blocks it receives; the blocks
    it keeps (source and destination both itself)."""

    sends: tuple[tuple[int, tuple[Transfer, ...]], ...]
    recvs: tuple[tuple[int, int, tuple[Transfer, ...]], ...]
    own: tuple[Transfer, ...]


def _route(step: Step, rank: int) -> Route:
    """`rank`'s Route of `step`, kept by the step's identity (`per_step`): each call after
    the first costs one dict lookup, whatever the number of ranks."""
    return per_step(step, "route", rank, lambda: _routed(step, rank))


def _routed(step: Step, rank: int) -> Route:
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    own = []
    for t in rank_transfers(step, rank):
        if t.src == rank and t.dst == rank:
            own.append(t)
        elif t.src == rank:
            sends.setdefault(t.dst, []).append(t)
        elif t.dst == rank:
            recvs.setdefault(t.src, []).append(t)
    return Route(tuple((p, tuple(ts)) for p, ts in sorted(sends.items())),
                 tuple((p, sum(t.numel for t in ts), tuple(ts))
                       for p, ts in sorted(recvs.items())), tuple(own))


def _message(x: Tensor, blocks: Sequence[Transfer]) -> Tensor:
    """The flat message of `blocks` of `x`, in order (no copy for one whole block)."""
    parts = [block(x, t.src_index).reshape(-1) for t in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _transfer_traced(step: Step, x: Tensor | None, plan: Plan, dst: Groups,
                     trace: ByteTrace | None) -> Later:
    """`transfer` under torch.compile: one all_to_all over the group of exactly the plan's
    ranks (every one of them posts here; peers are group positions), as a permute's: a
    traced batch_p2p_ops raced under inductor (wrong values on some ranks in some runs)."""
    ranks, rank = plan.ranks, dst.rank
    me = ranks.index(rank)
    held = x if x is not None else torch.empty(0, dtype=plan.dtype, device=dst.device)
    mine = rank_transfers(step, rank)
    flat, send_splits = pack(mine, ranks, rank, held)
    wanted = recv_splits(mine, ranks, rank)
    sends = torch.split(flat, send_splits)
    union = _union_group(ranks)
    to = [(sends[j], j) for j in range(len(ranks)) if j != me and send_splits[j]]
    back = [(flat.new_empty(wanted[j]), j) for j in range(len(ranks)) if j != me and wanted[j]]
    posted, call = wire.p2p(to, back, union.name, union, flat)
    if trace is not None:
        trace.add(step.kind, step.axes, call.sent * flat.element_size(),
                  call.received * flat.element_size())

    def landed(*got: Tensor) -> Tensor:
        """The pieces in rank order, this rank's own among them (the all_to_all's output)."""
        arrived = iter(got)
        return posted.tied(torch.cat([sends[me] if j == me else next(arrived)
                                      for j in range(len(ranks)) if j == me or wanted[j]]))
    if not dst.in_mesh:
        return Later((posted,), landed)
    shape = step.after.local_shape(dst.mesh, plan.shape, rank)
    return Later((posted,), lambda *got: unpacked(step, mine, ranks, rank, landed(*got),
                                                  shape))


def _union_group(ranks: tuple[int, ...]) -> wire.Group:
    """The process group of exactly `ranks` (both meshes' ranks, ascending), which a traced
    transfer runs over: the world where the meshes cover it."""
    group = wire.ranks_group(ranks)
    if group is None:
        raise MeshMismatchError(
            f"reshard(..., dst_mesh=...) under torch.compile runs its transfer as one"
            f" all_to_all over the ranks of both meshes, {list(ranks)}, and no process group"
            " of exactly those ranks exists. fix: torch.distributed.new_group("
            f"{list(ranks)}) on every rank before compiling, or meshes that cover the world")
    return group
