"""The engine: plans prepared once, issued now, waited on later. Every plan meshcomm runs over
torch.distributed goes through it: one plan, many bucketed plans, a plan between meshes.

Executor layer: it decides nothing. `prepare` checks what it can without the data, and
fixes the buckets (plans of one collective shape, each bucketed step one collective on a
flat buffer), once; `Prepared.issue(tensors)` runs every step on this rank, each collective
started without waiting (a later step that needs its data waits for it), and returns a
`Handle`; `Handle.wait()` waits for what is still on the wire and finishes it (copy-out,
the division of an avg, the unpacking of received blocks). Between the two the caller
computes: that is the overlap FSDP's prefetch, a ring's next block and a pipeline's next
send are made of. Every wait goes through `wire.waited`.

`execute`, `execute_many` and `execute_cross` are the engine issued and waited on at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from ...core.errors import ShapeError
from ...planner.values import Plan
from .groups import Groups
from .handlers import (
    BUCKETED,
    HANDLERS,
    RUN_MANY,
    ByteTrace,
    Call,
    Later,
    Out,
    Run,
    buckets,
    check_cross,
    check_local,
    raise_step_failure,
    transfer,
)
from .rows import Rows, misfit, rows_of
from .rows import issue as rows_issue

BUCKET_BYTES = 25 * 2**20


class Job(NamedTuple):
    """One plan to run on this rank: on `bound`'s mesh, and for a plan between meshes from
    `bound` (the source mesh) to `dst`."""

    plan: Plan
    bound: Groups
    dst: Groups | None = None


@dataclass(frozen=True)
class Prepared:
    """Plans ready to run on this rank: `issue(tensors)` starts them (one tensor per plan, None
    for a rank outside a plan's source mesh), `Handle.wait()` gives their outputs.

    >>> ready = prepare([p], bound)                        # doctest: +SKIP
    >>> handle = ready.issue([x])          # collectives in flight
    >>> y, = handle.wait()                 # waited on, finished
    """

    jobs: tuple[Job, ...]
    buckets: tuple[tuple[int, ...], ...]
    rows: tuple[Rows | None, ...] = ()     # per bucket: its padded rows (pad_rows), or None
    cast: bool = False                     # inputs cast to their plan's dtype (pad_rows)

    steps: int = field(init=False)          # the most steps of any plan: a Handle's count
    one_rows: Rows | None = field(init=False)   # the one bucket, of padded rows (FSDP's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", max((len(job.plan.steps) for job in self.jobs),
                                              default=0))
        object.__setattr__(self, "one_rows", self.rows[0] if len(self.rows) == 1 else None)

    def calls(self) -> list[Call]:
        """The collective calls one issue makes on this rank, in order (step by step, bucket
        by bucket), with their bytes: a padded-rows bucket's as its buffers give them (the
        padding travels), any other bucket's from its plans (a bucket's plans share a call).
        Computed, never measured: what a report prints before anything runs."""
        out: list[Call] = []
        for k in range(self.steps):
            for b, bucket in enumerate(self.buckets):
                rows = self.rows[b] if self.rows else None
                if rows is not None:
                    if k < len(rows.kinds):
                        w, size = rows.wires()[k], rows.dtype.itemsize
                        out.append(Call(w.kind, rows.axes[k], w.sent * size, w.received * size))
                    continue
                steps = [(job.plan.steps[k], job) for job in (self.jobs[i] for i in bucket)
                         if k < len(job.plan.steps) and job.plan.steps[k].kind != "local"]
                if steps:
                    step, job = steps[0]
                    at = job.plan.ranks.index(job.bound.rank)
                    out.append(Call(step.kind, step.axes, sum(s.send_bytes[at] for s, _ in steps),
                                    sum(s.recv_bytes[at] for s, _ in steps)))
        return out

    def issue(self, tensors: Sequence[Tensor | None], *, trace: ByteTrace | None = None,
              steps: int | None = None) -> Handle:
        """Start every plan on this rank's `tensors` (checked first, before any communication);
        `trace` records each collective's bytes as it is made. `steps`: issue only each
        plan's first `steps` steps now, the next ones at `Handle.advance()` (or `wait()`)."""
        if len(tensors) != len(self.jobs):
            raise ValueError(f"issue: {len(tensors)} tensors for {len(self.jobs)} prepared plans")
        xs: list[Out | None] = list(tensors)
        for b, bucket in enumerate(self.buckets):
            rows = self.rows[b] if self.rows else None
            if rows is not None:       # FSDP's hot path: one shape compare per tensor
                self._check_rows(rows, bucket, tensors)
                continue
            for i in bucket:
                job, x = self.jobs[i], tensors[i]
                if job.dst is not None:
                    check_cross(job.plan, x, job.bound, job.dst)
                    continue
                if self.cast and isinstance(x, Tensor) and x.dtype != job.plan.dtype:
                    xs[i] = x = x.to(job.plan.dtype)
                check_local(job.plan, x, job.bound)      # type: ignore[arg-type]
        handle = Handle(self, xs, trace)
        handle.advance(self.steps if steps is None else steps)
        return handle

    def _check_rows(self, rows: Rows, bucket: tuple[int, ...],
                    tensors: Sequence[Tensor | None]) -> None:
        """A padded-rows bucket's inputs: tensors of their plans' local shapes (any dtype:
        each is cast), one shape compare each; raise for the first that is not."""
        for item, i in zip(rows.items, bucket):
            x = tensors[i]
            if isinstance(x, Tensor) and x.shape == item.shape_in:
                continue
            plan = self.jobs[i].plan
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ShapeError(f'issue: tensor {i} ("{plan.src}" -> "{plan.dst}" of shape'
                             f" {plan.shape}) is {got}, but this rank holds {item.shape_in}"
                             " under the source layout; fix: pass this rank's local shard")


class Handle:
    """Plans in flight on this rank: `wait()` gives each plan's output (None where this rank
    holds none: outside a plan's destination mesh). Waiting twice gives the same tensors."""

    __slots__ = ("_ready", "_outs", "_trace", "_at", "_done")

    def __init__(self, ready: Prepared, outs: list[Out | None],
                 trace: ByteTrace | None) -> None:
        self._ready, self._outs, self._trace = ready, outs, trace
        self._at = 0                     # the next step to issue
        self._done: list[Tensor | None] | None = None

    @property
    def steps_left(self) -> int:
        """Steps not issued yet (`advance` issues them)."""
        return self._ready.steps - self._at

    def advance(self, steps: int = 1) -> bool:
        """Issue the next `steps` steps of every plan (landing the ones in flight that they
        read); True while steps remain to issue."""
        ready, start = self._ready, self._at
        stop = min(start + steps, ready.steps)
        if stop <= start:
            return False
        outs, trace = self._outs, self._trace
        for b, bucket in enumerate(ready.buckets):
            first = ready.jobs[bucket[0]]
            rows = ready.rows[b] if ready.rows else None
            if rows is not None:
                _issue_rows(rows, bucket, outs, trace, start, stop)
            elif first.dst is not None:
                outs[bucket[0]] = _issue_cross(first, outs[bucket[0]], trace, start, stop)
            elif len(bucket) == 1:
                held = outs[bucket[0]]
                assert held is not None, "a plan on one mesh has an input on its ranks"
                outs[bucket[0]] = _issue_one(first.plan, first.bound, held, trace, start, stop)
            else:
                _issue_bucket([ready.jobs[i] for i in bucket], bucket, outs, trace, start, stop)
        self._at = stop
        return stop < ready.steps

    def wait(self) -> list[Tensor | None]:
        if self._done is None:
            if self._at < self._ready.steps:
                self.advance(self._ready.steps)
            self._done = self._finish(wait=True)
        return self._done

    def unwaited(self) -> list[Tensor | None]:
        """The outputs without waiting: tensors PyTorch waits for at their first use that is
        not a view (AsyncCollectiveTensor), so a failure surfaces there, as PyTorch's error."""
        if self._done is not None:
            return self._done
        self.advance(self._ready.steps)
        return self._finish(wait=False)

    def _finish(self, wait: bool) -> list[Tensor | None]:
        # a rank outside the destination mesh waits too: for its sends to complete
        ready, outs = self._ready, self._outs
        jobs = ready.jobs
        if ready.one_rows is not None:
            return _landed(outs[0], jobs[0].plan, jobs[0].bound,  # type: ignore[arg-type, return-value]
                           len(ready.one_rows.kinds) - 1, wait)
        if ready.rows:           # a padded-rows bucket lands once, for all its plans
            done: list[Tensor | None] = [None] * len(jobs)
            for b, bucket in enumerate(ready.buckets):
                rows = ready.rows[b]
                if rows is None:
                    for i in bucket:
                        out, job = outs[i], jobs[i]
                        done[i] = None if out is None else _landed(
                            out, job.plan, job.bound, len(job.plan.steps) - 1, wait)
                    continue
                first = jobs[bucket[0]]
                parts: list[Tensor] = _landed(outs[bucket[0]],  # type: ignore[arg-type, assignment]
                                              first.plan, first.bound, len(rows.kinds) - 1, wait)
                for i, t in zip(bucket, parts):
                    done[i] = t
            return done
        landed = [None if out is None
                  else _landed(out, job.plan, job.bound, len(job.plan.steps) - 1, wait)
                  for job, out in zip(jobs, outs)]
        return [None if job.dst is not None and not job.dst.in_mesh else out
                for job, out in zip(jobs, landed)]


def _landed(out: Out, plan: Plan, bound: Groups, k: int, wait: bool = True) -> Tensor:
    """`out`, the output of step `k` of `plan` on `bound`, landed; a failure there raises
    the meshcomm error that names the step (`raise_step_failure`)."""
    if not isinstance(out, Later):
        return out
    try:
        return out.result(wait)
    except RuntimeError as err:
        raise_step_failure(err, plan, k, bound)
        raise


def prepare(plans: Sequence[Plan], bound: Groups | Sequence[Groups], *,
            dst: Groups | None = None, bucket_bytes: int = BUCKET_BYTES,
            pad_rows: bool = False) -> Prepared:
    """`plans` ready to be issued on this rank: on `bound` (one bound mesh for all, or one per
    plan), or from `bound` to `dst` for plans between two meshes (each runs alone).

    Plans with the same collective shape (`handlers.signature`) share buckets: consecutive
    plans of one signature, in order, up to `bucket_bytes` of their peak bytes (max over
    ranks); a plan larger than that runs alone. Buckets are the same on every rank.

    `pad_rows` (FSDP's mode): plans that gather or scatter dim-0 rows over one group, then
    maybe all_reduce (`rows.misfit`), share one bucket of padded rows per step shape, FSDP2's
    flat buffer (`rows.py`) whatever its size; any other plan is bucketed as usual. Inputs
    may be of any dtype: each is cast to its plan's (mixed precision), in the copy-in.
    """
    # a single bound mesh is checked with the tensors (`check_local` names what is wrong)
    bounds: list[Groups] = (list(bound) if isinstance(bound, (list, tuple))
                            else [bound] * len(plans))  # type: ignore[list-item]
    if len(bounds) != len(plans):
        raise ValueError(f"prepare: {len(bounds)} bound meshes for {len(plans)} plans")
    jobs = tuple(Job(p, b, dst if p.dst_mesh is not None and p.dst_mesh != p.mesh else None)
                 for p, b in zip(plans, bounds))
    if pad_rows:
        return _prepare_rows(jobs, bucket_bytes)
    if len(jobs) == 1:       # nothing to share a bucket with: no plan's peaks are read
        return Prepared(jobs, ((0,),))
    alone = [(i,) for i, job in enumerate(jobs) if job.dst is not None]
    local = [i for i, job in enumerate(jobs) if job.dst is None]
    shared = buckets([(None, jobs[i].bound, jobs[i].plan) for i in local], bucket_bytes)
    together = [tuple(local[k] for k in bucket) for bucket in shared]
    return Prepared(jobs, tuple(sorted(alone + together, key=lambda b: b[0])))


def _prepare_rows(jobs: tuple[Job, ...], bucket_bytes: int) -> Prepared:
    """`prepare(..., pad_rows=True)`: one padded-rows bucket per step shape of the plans that
    fit, the others in buckets as usual."""
    if any(job.dst is not None or job.bound is not jobs[0].bound for job in jobs):
        raise ValueError("prepare(pad_rows=True): the plans must stay on one bound mesh")
    fit: dict[tuple[object, ...], list[int]] = {}
    rest = []
    for i, job in enumerate(jobs):
        if misfit(job.plan) is None:
            key = (job.plan.dtype, tuple((s.kind, s.axes, s.op) for s in job.plan.steps))
            fit.setdefault(key, []).append(i)
        else:
            rest.append(i)
    groups = [tuple(b) for b in fit.values()]
    rows: list[Rows | None] = [rows_of([jobs[i].plan for i in b], jobs[0].bound) for b in groups]
    for b in buckets([(None, jobs[i].bound, jobs[i].plan) for i in rest], bucket_bytes):
        groups.append(tuple(rest[k] for k in b))
        rows.append(None)
    return Prepared(jobs, tuple(groups), tuple(rows), cast=True)


def _issue_rows(rows: Rows, bucket: tuple[int, ...], outs: list[Out | None],
                trace: ByteTrace | None, start: int, stop: int) -> None:
    """Steps start..stop-1 of a padded-rows bucket (`rows.issue`): the bucket's one output
    in flight is held in its first plan's place (the last step's gives every plan's)."""
    for k in range(start, min(stop, len(rows.kinds))):
        outs[bucket[0]] = rows_issue(rows, [outs[i] for i in bucket] if k == 0  # type: ignore[misc]
                                     else (), k, outs[bucket[0]], trace)


def _issue_one(plan: Plan, bound: Groups, x: Out, trace: ByteTrace | None,
               start: int = 0, stop: int | None = None) -> Out:
    """Steps start..stop-1 of one plan on one mesh (a bucket of one) from `x` (the input, or
    step start-1's output); the last issued stays in flight."""
    run = Run(bound, plan.shape, trace)
    out: Out = x
    steps = plan.steps
    for k in range(start, len(steps) if stop is None else min(stop, len(steps))):
        step = steps[k]
        x = _landed(out, plan, bound, k - 1)
        try:
            out = HANDLERS[step.kind](step, x, run)
        except RuntimeError as err:
            raise_step_failure(err, plan, k, bound)
            raise
    return out


def _issue_bucket(jobs: list[Job], bucket: tuple[int, ...], outs: list[Out | None],
                  trace: ByteTrace | None, start: int, stop: int) -> None:
    """Steps start..stop-1 of a bucket of plans on one mesh; the last issued stays in flight."""
    first = jobs[0]
    runs = [Run(job.bound, job.plan.shape, trace) for job in jobs]
    for k in range(start, min(stop, len(first.plan.steps))):
        step = first.plan.steps[k]
        steps = [job.plan.steps[k] for job in jobs]
        xs = [_landed(outs[i], job.plan, job.bound, k - 1)  # type: ignore[arg-type]
              for i, job in zip(bucket, jobs)]
        try:
            if len(bucket) > 1 and step.kind in BUCKETED and step.wire == step.kind:
                ys = RUN_MANY[step.kind](steps, xs, runs[0])
            else:
                ys = [HANDLERS[s.kind](s, x, run) for s, x, run in zip(steps, xs, runs)]
        except RuntimeError as err:
            raise_step_failure(err, first.plan, k, first.bound,
                               list(bucket) if len(bucket) > 1 else None)
            raise
        for i, y in zip(bucket, ys):
            outs[i] = y


def _issue_cross(job: Job, x: Out | None, trace: ByteTrace | None, start: int,
                 stop: int) -> Out | None:
    """Steps start..stop-1 of a plan between meshes: steps on one mesh run on its ranks, the
    transfer on both."""
    plan, src, dst = job.plan, job.bound, job.dst
    assert dst is not None, "a plan between meshes has a destination"
    if src.rank not in plan.mesh and src.rank not in dst.mesh:
        return None
    bounds = {plan.mesh: src, dst.mesh: dst}
    out: Out | None = x
    for k in range(start, min(stop, len(plan.steps))):
        step = plan.steps[k]
        held = None if out is None else _landed(out, plan, src, k - 1)
        if step.dst_mesh is not None:
            out = transfer(step, held, plan, dst, trace)
            continue
        bound = bounds[step.mesh or plan.mesh]
        if bound.in_mesh:
            assert held is not None, f"rank {src.rank} runs {step} without a tensor"
            out = HANDLERS[step.kind](step, held, Run(bound, plan.shape, trace))
    return out


# -- issued and waited on at once ------------------------------------------------------------
def execute(plan: Plan, local: Tensor, bound: Groups, *,
            trace: ByteTrace | None = None) -> Tensor:
    """This rank's output of `plan` for its input shard `local` (call it on every rank).

    `trace`, when given, records the bytes of every collective call as it is made.

    >>> out = execute(mc.plan(bound.mesh, (8,), "(tp b)", "b"), x, bound)  # doctest: +SKIP
    """
    check_local(plan, local, bound)     # a bucket of one, issued and waited on at once
    return _landed(_issue_one(plan, bound, local, trace), plan, bound, len(plan.steps) - 1)


def execute_many(jobs: Sequence[tuple[Tensor, Groups, Plan]], *,
                 bucket_bytes: int = BUCKET_BYTES,
                 trace: ByteTrace | None = None) -> list[Tensor]:
    """Each job's output, running plans with the same collective shape in buckets: each even
    all_gather, reduce_scatter, all_reduce or all_to_all step is one collective on a flat
    buffer of the bucket's tensors; other steps run one by one (see `prepare`)."""
    ready = prepare([p for _, _, p in jobs], [b for _, b, _ in jobs], bucket_bytes=bucket_bytes)
    outs = ready.issue([x for x, _, _ in jobs], trace=trace).wait()
    return [out for out in outs if out is not None]


def execute_cross(plan: Plan, local: Tensor | None, src: Groups, dst: Groups, *,
                  trace: ByteTrace | None = None) -> Tensor | None:
    """This rank's output of a plan between meshes: its shard on the destination mesh, or
    None on a rank outside it (call it on every rank of the world).

    `local` is this rank's shard on the source mesh, None on a rank outside it. `trace`
    records one call per step this rank takes part in, the transfer's bytes counted from
    the messages it posts.

    >>> p = mc.plan(a.mesh, (8, 16), "(dp b) s", "(tp b) s", dst_mesh=b.mesh)  # doctest: +SKIP
    >>> y = execute_cross(p, x if a.in_mesh else None, a, b)                    # doctest: +SKIP
    """
    if plan.dst_mesh is None or plan.dst_mesh == plan.mesh:
        check_cross(plan, local, src, dst)       # raises: the plan stays on one mesh
    return prepare([plan], src, dst=dst).issue([local], trace=trace).wait()[0]
