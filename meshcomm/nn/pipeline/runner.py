"""Run a pipeline schedule over stages on their own meshes: one training step's forwards and
backwards, hand-offs as planned reshards between the stages' meshes.

Hand-offs. Stage s gives its output in its layout on its mesh; stage s + 1 takes it in its
own layout on its mesh. The hand-off is one plan between the two meshes (`mc.plan(...,
dst_mesh=...)`), prepared once when the pipeline is built, and the gradient comes back by the
reverse plan. Nothing is exchanged to learn shapes: every activation's global shape per
microbatch is declared (`shapes=`).

Order. A sender issues a hand-off right after the compute that makes it and goes on (the
message travels while it computes the next action); the sends are waited on at the end of the
step. Messages between two ranks match in the order they are posted, so a rank posts its
receives from each peer in the order that peer sends (both read the one schedule), one
action ahead of the action that needs them: a receive is in flight while the action before
it computes. A schedule that cannot finish is refused by `simulate` before the first send.

Gradients. `loss_fn(output, target)` gives the last stage's loss of one microbatch on this
rank. With `loss_reduction="mean"` the step's objective is the mean over microbatches (and
over the last stage's averaged ranks, as data parallelism means it); with `"sum"`, their sum.
`fully_shard` averages a stage's gradients over its averaged axes (`Stage.averaged`), which is
right when the averaged axes that split the stage's activations (the stage's *scale*) see
that many times the true gradient. So the gradient of an activation crossing from stage
s + 1 to stage s is multiplied by scale(s) / scale(s + 1) on arrival, and the loss is seeded
with 1 / microbatches (mean) or scale(last) (sum): every stage's gradients equal those of
one process over the whole batch, whatever the stages' meshes. Gradients accumulate over the
microbatches; a stage's `fully_shard` units reduce once per step, in the stage's last
backward. With `Stage(gather="step")` they also gather once per step: held from their first
use to the end of the step (`Unit.hold`, `Unit.release`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.errors import CollectiveError, ScheduleError, ShapeError
from ...core.layout import Layout
from ...executors.distributed import Handle, Prepared, prepare
from ...planner.pipeline import Action, Event, Schedule, StageCosts, build, simulate
from ...planner.plan import plan as make_plan
from ...planner.values import Plan
from ...runtime.checks import agree_world, checking
from ..fsdp.param import UNIT_ATTR
from .grads import Tie, TiedGrads, clip_grad_norm_
from .stage import Stage, averaged_axes, grad_scale

Key = tuple[str, int, int]      # ("F" | "B", boundary s (stage s <-> s + 1), microbatch)


@dataclass(frozen=True)
class HandOff:
    """One direction of one boundary, prepared on this rank: `plan`, its engine job, and how
    many of its steps to issue to post the receive (through the transfer between meshes)."""

    plan: Plan
    ready: Prepared
    post_steps: int
    local: bool          # both stages on this rank: issued and waited on at once


class Pipeline:
    """A model split into `stages`, run by `schedule` over `microbatches` per `step`.

    >>> pipe = Pipeline([Stage(s0, "(dp b) h", "(dp b) h", m0), Stage(s1, "b h", "b h", m1)],
    ...                 "1f1b", microbatches=4, shapes=(8, 16), loss_fn=mse)  # doctest: +SKIP
    >>> loss = pipe.step(x, target)         # doctest: +SKIP

    Build it on every rank of the world with the same arguments; each rank runs the stages
    whose mesh it is in. `schedule`: a name of `meshcomm.nn.pipeline.SCHEDULES` ("gpipe",
    "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v"), a `Schedule`, or CSV text in
    PyTorch's notation. `shapes`: the global shape of the activation between stage s and s + 1
    per microbatch, one tuple for all boundaries or one per boundary. `dtype`: the
    activations'. `ties`: weights two stages share (`Tie`): after each step both copies'
    gradients are their sum. `check` (default: the first stage mesh's check mode): every rank of the
    world compares the pipeline it built (schedule, stages, shapes) before the first send,
    and all raise `CollectiveMismatchError` naming the ranks that differ (one small
    all_reduce over the world, here, at build time). `record`: each step keeps this rank's
    compute as it ran, `events` (one `Event` per action: from its input's arrival to the
    issue of its output, host seconds since the step began at `started`, a
    `time.perf_counter()` reading; nothing is synchronised, so on a GPU these are launch
    times); `meshcomm.nn.pipeline.timeline(schedule, events)` of every rank's events is the
    measured `Timeline`, to set beside `simulate`'s. See the module docstring for hand-offs
    and gradients.
    """

    def __init__(self, stages: Sequence[Stage], schedule: str | Schedule, *, microbatches: int,
                 shapes: Sequence[int] | Sequence[Sequence[int]],
                 loss_fn: Callable[[Tensor, Any], Tensor],
                 dtype: torch.dtype = torch.float32, loss_reduction: str = "mean",
                 ties: Sequence[Tie] = (), check: bool | None = None,
                 record: bool = False) -> None:
        self.stages = tuple(stages)
        self.record = record
        self.events: tuple[Event, ...] = ()
        self.started = 0.0
        n = len(self.stages)
        if n < 1 or not all(isinstance(s, Stage) for s in self.stages):
            raise ScheduleError("Pipeline(stages=...): expected a sequence of mc.nn.Stage, one"
                                " per stage, the same on every rank")
        if loss_reduction not in ("mean", "sum"):
            raise ScheduleError(f"Pipeline(loss_reduction={loss_reduction!r}): expected 'mean'"
                                " or 'sum'")
        self.microbatches, self.loss_fn, self.dtype = microbatches, loss_fn, dtype
        self.reduction = loss_reduction
        self.schedule = _schedule(schedule, self.stages, microbatches)
        self.shapes = _shapes(shapes, n)
        self.rank = self.stages[0].mesh.rank
        self.me = _my_pipeline_rank(self.stages, self.schedule, self.rank)
        self.row = self.schedule.compute_only().rows[self.me]
        self.mine = self.schedule.stages_of(self.me)
        layouts = [s.layouts() for s in self.stages]
        for s in self.mine:
            if self.stages[s].module is None:
                raise ScheduleError(f"Pipeline: rank {self.rank} runs stage {s} but its Stage"
                                    " has module=None; fix: pass the stage's module on its"
                                    " mesh's ranks")
        # the parameters a split backward's W differentiates, read now: inside a step,
        # fully_shard's modules hold their gathered tensors where the parameters were
        self.params = {s: [q for q in self.stages[s].module.parameters()    # type: ignore
                           if q.requires_grad] for s in self.mine}
        axes = [averaged_axes(st, s) for s, st in enumerate(self.stages)]
        self.scale_in = [grad_scale(st, layouts[s][0], axes[s]) for s, st in enumerate(self.stages)]
        self.scale_out = [grad_scale(st, layouts[s][1], axes[s])
                          for s, st in enumerate(self.stages)]
        self.forward_plans: list[Plan] = []
        self.backward_plans: list[Plan] = []
        for b in range(n - 1):
            src, dst = self.stages[b], self.stages[b + 1]
            shape = self.shapes[b]
            self.forward_plans.append(_plan(src, dst, shape, layouts[b][1], layouts[b + 1][0],
                                            dtype))
            self.backward_plans.append(_plan(dst, src, shape, layouts[b + 1][0], layouts[b][1],
                                             dtype))
        self.handoffs: dict[tuple[str, int], HandOff] = {}
        for b in range(n - 1):
            if b in self.mine or b + 1 in self.mine:
                self.handoffs[("F", b)] = _handoff(self.forward_plans[b], self.stages[b],
                                                   self.stages[b + 1])
                self.handoffs[("B", b)] = _handoff(self.backward_plans[b], self.stages[b + 1],
                                                   self.stages[b])
        self.queues = _receive_queues(self.schedule, self.me)
        # one rank per stage: the peer that sends a message is the one that took ours
        single = all(len(st.mesh.mesh.ranks) == 1 for st in self.stages)
        self.releases = _releases(self.schedule, self.me) if single else {}
        self.last = {s: _last_backward(self.row, s) for s in self.mine}
        # what each stage of this rank must give: its output layout's local shape here
        self.out_shapes = {s: tuple(self.forward_plans[s].src.local_shape(
            self.forward_plans[s].mesh, self.forward_plans[s].shape, self.rank))
            for s in self.mine if s < n - 1}
        simulate(self.schedule, StageCosts.uniform(n))      # refuses a deadlock, here
        self.ties = TiedGrads(self, ties) if ties else None
        if checking(self.stages[0].mesh, check):
            self._agree(layouts)

    def _agree(self, layouts: Sequence[tuple[Layout, Layout]]) -> None:
        sched = self.schedule
        fields = (("call", "Pipeline"), ("schedule", sched.name),
                  ("stages", str(len(self.stages))), ("microbatches", str(self.microbatches)),
                  ("dtype", str(self.dtype).replace("torch.", "")),
                  ("loss_reduction", self.reduction),
                  ("gather", ",".join(s.gather for s in self.stages)))
        detail = sched.to_csv() + "".join(
            f"{s.mesh.mesh!r} {a} -> {b};" for s, (a, b) in zip(self.stages, layouts)) + str(
            self.shapes)
        agree_world(fields, detail, self.stages[0].mesh.device,
                    f"Pipeline of {len(self.stages)} stages")

    # -- one step ---------------------------------------------------------------------------
    def step(self, inputs: Tensor | Sequence[Tensor] | None = None,
             targets: Any = None) -> Tensor | None:
        """Run one step: forwards and backwards of every microbatch in schedule order, the
        gradients left in the stages' parameters (`.grad`), summed over microbatches and
        reduced by their `fully_shard` units. `inputs` (on stage 0's ranks): this rank's
        shard of the batch (dim 0 is the batch), or a list of one shard per microbatch.
        `targets` (on the last stage's ranks): likewise, handed to `loss_fn` with that
        microbatch's output. Returns the loss (mean or sum over microbatches of `loss_fn`)
        on the last stage's ranks, None elsewhere.

        Microbatch i is rows i, i + m, i + 2m, ... of the batch (m = `microbatches`), taken
        from each rank's shard as `x[i::m]`: the same rows whatever the layout, as long as
        every rank holds a block of the batch ("(dp b)", or all of it) whose length m
        divides. So inputs on stage 0 split over `dp=2` and targets whole on a last stage
        split over `tp` pair up row for row."""
        m, n = self.microbatches, len(self.stages)
        xs = _split(inputs, m, "inputs") if 0 in self.mine else None
        ys = _split(targets, m, "targets") if n - 1 in self.mine else None
        run = _Step(self, xs, ys)
        self.events = ()
        for s in self.mine:
            _set_sync(self.stages[s], False)
            _set_hold(self.stages[s], True)
        try:
            run.go()
            self.events = tuple(run.events)
            self.started = run.t0
        finally:
            for s in self.mine:
                _set_sync(self.stages[s], True)
                _set_hold(self.stages[s], False)
        if self.ties is not None:
            self.ties.sum()
        return run.loss()

    def clip_grad_norm_(self, max_norm: float,
                        param_layouts: dict[tuple[int, str], tuple[str, Sequence[int]]]
                        | None = None) -> Tensor:
        """Clip every stage's gradients to a total 2-norm of `max_norm`; the norm before
        clipping, the same on every rank (`meshcomm.nn.pipeline.grads.clip_grad_norm_`)."""
        return clip_grad_norm_(self, max_norm, param_layouts)

    def explain(self) -> str:
        """The hand-off plans, one block per boundary, forward and backward."""
        out = []
        for b, (f, g) in enumerate(zip(self.forward_plans, self.backward_plans)):
            out.append(f"stage {b} -> {b + 1}:\n{f}\nstage {b + 1} -> {b} (gradient):\n{g}")
        return "\n\n".join(out)


class _Step:
    """The state of one `Pipeline.step` on this rank."""

    def __init__(self, pipe: Pipeline, xs: list[Tensor] | None, ys: list[Any] | None) -> None:
        self.p, self.xs, self.ys = pipe, xs, ys
        self.posted: dict[Key, Handle] = {}
        self.local: dict[Key, Tensor] = {}            # hand-offs between stages of this rank
        self.at = {peer: 0 for peer in pipe.queues}
        self.stash: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]] = {}
        self.sends: dict[Key, Handle] = {}
        self.losses: list[Tensor] = []
        self.events: list[Event] = []
        self.t0 = time.perf_counter()

    def go(self) -> None:
        row = self.p.row
        for j, a in enumerate(row):
            if j + 1 < len(row):
                self.post(row[j + 1])            # the next action's message, in flight now
            self.run(a)
        for key, h in self.sends.items():
            self.wait(key, h, sent=True)

    def loss(self) -> Tensor | None:
        if not self.losses:
            return None
        total = torch.stack(self.losses).sum()
        return total / len(self.losses) if self.p.reduction == "mean" else total

    # messages
    def need(self, a: Action) -> Key | None:
        n, mb = len(self.p.stages), a.microbatch
        assert mb is not None
        if a.kind == "F" and a.stage > 0:
            return ("F", a.stage - 1, mb)
        if a.kind in ("B", "I") and a.stage < n - 1:
            return ("B", a.stage, mb)
        return None

    def post(self, a: Action) -> None:
        key = self.need(a)
        if key is None or key in self.posted or key in self.local:
            return
        sender = self._sender(key)
        if sender == self.p.me:
            return                                # made on this rank: in `local`
        queue, at = self.p.queues[sender], self.at
        while key not in self.posted:
            k = queue[at[sender]]
            h = self.p.handoffs[(k[0], k[1])]
            self.posted[k] = h.ready.issue([None], steps=h.post_steps)
            at[sender] += 1

    def _sender(self, key: Key) -> int:
        kind, b, _ = key
        return self.p.schedule.stage_rank[b if kind == "F" else b + 1]

    def take(self, key: Key) -> Tensor:
        if key in self.local:
            return self.local.pop(key)
        if key not in self.posted:
            self.post_key(key)
        out = self.wait(key, self.posted.pop(key), sent=False)[0]
        assert out is not None, f"rank {self.p.rank} received nothing for {key}"
        for done in self.p.releases.get(key, ()):     # landed already: frees its buffers
            self.wait(done, self.sends.pop(done), sent=True)
        return out

    def wait(self, key: Key, h: Handle, *, sent: bool) -> list[Tensor | None]:
        """`h.wait()`; a failed hand-off names its stages, microbatch and peer."""
        try:
            return h.wait()
        except CollectiveError as err:        # CollectiveTimeout: the same type again
            kind, b, mb = key
            src, dst = (b, b + 1) if kind == "F" else (b + 1, b)
            what = "activation" if kind == "F" else "gradient"
            peer = self.p.stages[dst if sent else src].mesh.mesh
            raise type(err)(
                f"pipeline step, rank {self.p.rank}: {'sending' if sent else 'receiving'} the"
                f" {what} of microbatch {mb} from stage {src} to stage {dst}"
                f" ({'to' if sent else 'from'} {peer!r}) failed: {err}") from err

    def post_key(self, key: Key) -> None:
        kind, b, mb = key
        self.post(Action(b + 1 if kind == "F" else b, "F" if kind == "F" else "B", mb))

    def give(self, key: Key, x: Tensor) -> None:
        h = self.p.handoffs[(key[0], key[1])]
        if h.local:
            out = h.ready.issue([x]).wait()[0]
            assert out is not None
            self.local[key] = out
        else:
            self.sends[key] = h.ready.issue([x])

    # compute
    def run(self, a: Action) -> None:
        began = self._compute(a)
        if self.p.record:           # host time: from its input's arrival to its sends' issue
            self.events.append(Event(self.p.me, a, began - self.t0,
                                     time.perf_counter() - self.t0))

    def _compute(self, a: Action) -> float:
        """Run `a`; the time its compute began (its input taken)."""
        s, mb = a.stage, a.microbatch
        assert mb is not None
        p = self.p
        stage, last = p.stages[s], s == len(p.stages) - 1
        module = stage.module
        assert module is not None
        if a.kind == "F":
            if s == 0:
                assert self.xs is not None
                x = self.xs[mb]
            else:
                x = _on(self.take(("F", s - 1, mb)), module).detach().requires_grad_()
            began = time.perf_counter()
            y = module(x)
            if last:
                assert self.ys is not None
                loss = p.loss_fn(y, self.ys[mb])
                self.losses.append(loss.detach())
                seed = 1.0 / p.microbatches if p.reduction == "mean" else float(p.scale_in[s])
                self.stash[(s, mb)] = (x, loss * seed, None)
            else:
                self._check_out(s, y)
                self.stash[(s, mb)] = (x, y, None)
                self.give(("F", s, mb), y.detach())
            return began
        x, y, g = self.stash[(s, mb)]
        if a.kind in ("B", "I") and not last:
            g = self.take(("B", s, mb)).to(y.device)
            factor = p.scale_out[s] / p.scale_in[s + 1]
            if factor != 1:
                g = g * factor
        began = time.perf_counter()
        if a.kind == "B":
            _sync_if_last(p, s, a)
            torch.autograd.backward(y, g)
            del self.stash[(s, mb)]
            if s > 0:
                self.give(("B", s - 1, mb), _grad(x))
        elif a.kind == "I":
            if s > 0:
                torch.autograd.backward(y, g, inputs=[x], retain_graph=True)
                self.give(("B", s - 1, mb), _grad(x))
            self.stash[(s, mb)] = (x, y, g)
        else:   # W
            _sync_if_last(p, s, a)
            params = p.params[s]
            if params:
                torch.autograd.backward(y, g, inputs=params)
            del self.stash[(s, mb)]
        return began

    def _check_out(self, s: int, y: Tensor) -> None:
        p = self.p
        plan, want = p.forward_plans[s], p.out_shapes[s]
        if tuple(y.shape) != want or y.dtype != p.dtype:
            raise ShapeError(
                f"pipeline stage {s} on rank {p.rank} gave an output of shape {tuple(y.shape)}"
                f" and dtype {y.dtype}, but its layout \"{plan.src}\" of the declared shape"
                f" {plan.shape} puts {tuple(want)} ({p.dtype}) here; fix: Pipeline(shapes=...,"
                " dtype=...) or the Stage's output layout")


def _on(x: Tensor, module: torch.nn.Module) -> Tensor:
    """`x` on the device of `module`'s parameters: a receive lands on its mesh's device, and a
    dry run's modules and activations are on the meta device (`mc.dryrun`)."""
    first = next(module.parameters(), None)
    return x if first is None or first.device == x.device else x.to(first.device)


def _grad(x: Tensor) -> Tensor:
    g = x.grad
    if g is None:
        raise ScheduleError("pipeline: a stage's input got no gradient (its output does not"
                            " depend on it); every stage after the first must use its input")
    x.grad = None
    return g


# -- built once --------------------------------------------------------------------------------
def _schedule(schedule: str | Schedule, stages: Sequence[Stage], m: int) -> Schedule:
    if isinstance(schedule, Schedule):
        out = schedule
    elif isinstance(schedule, str) and ("," in schedule or "\n" in schedule):
        out = Schedule.from_csv(str(schedule))
    elif isinstance(schedule, str):
        groups = {tuple(sorted(s.mesh.mesh.ranks)) for s in stages}
        p = len(groups)
        kw = {"v": len(stages) // p} if schedule == "interleaved_1f1b" else {}
        if schedule == "zero_bubble_v":
            p = len(stages) // 2
        out = build(schedule, p, m, **kw)
    else:
        raise ScheduleError(f"Pipeline(schedule={schedule!r}): expected a schedule name, a"
                            " Schedule or CSV text")
    if out.n_stages != len(stages) or out.n_microbatches != m:
        raise ScheduleError(
            f"Pipeline: schedule {out.name} has {out.n_stages} stages and {out.n_microbatches}"
            f" microbatches, but {len(stages)} stages and microbatches={m} were given")
    return out


def _shapes(shapes: Sequence[int] | Sequence[Sequence[int]], n: int) -> list[tuple[int, ...]]:
    if len(shapes) and all(isinstance(d, int) for d in shapes):
        return [tuple(int(d) for d in shapes)] * (n - 1)   # type: ignore[arg-type]
    out = [tuple(s) for s in shapes if not isinstance(s, int)]
    if len(out) != n - 1:
        raise ShapeError(f"Pipeline(shapes=...): {len(out)} shapes for {n - 1} boundaries;"
                         " expected one global shape per microbatch for all, or one per"
                         " boundary (stage s -> s + 1)")
    return out


def _my_pipeline_rank(stages: Sequence[Stage], schedule: Schedule, rank: int) -> int:
    ranks_of: dict[int, tuple[int, ...]] = {}
    for s, stage in enumerate(stages):
        group = tuple(sorted(stage.mesh.mesh.ranks))
        r = schedule.stage_rank[s]
        if ranks_of.setdefault(r, group) != group:
            raise ScheduleError(
                f"Pipeline: stages {schedule.stages_of(r)} run on pipeline rank {r} of schedule"
                f" {schedule.name}, so their meshes must cover the same ranks; stage {s}'s mesh"
                f" has ranks {list(group)}, another's {list(ranks_of[r])}")
    owners = [r for r, g in ranks_of.items() if rank in g]
    seen = [rk for g in ranks_of.values() for rk in g]
    if len(seen) != len(set(seen)):
        raise ScheduleError("Pipeline: two pipeline ranks' stage meshes share ranks; each rank"
                            " of the world runs the stages of one pipeline rank")
    if not owners:
        raise ScheduleError(f"Pipeline: rank {rank} is in no stage's mesh; every rank of the"
                            " world must run a stage")
    return owners[0]


def _plan(src: Stage, dst: Stage, shape: tuple[int, ...], a: Layout, b: Layout,
          dtype: torch.dtype) -> Plan:
    if src.mesh.mesh == dst.mesh.mesh:
        return make_plan(src.mesh.mesh, shape, a, b, dtype=dtype)
    return make_plan(src.mesh.mesh, shape, a, b, dtype=dtype, dst_mesh=dst.mesh.mesh)


def _handoff(plan: Plan, src: Stage, dst: Stage) -> HandOff:
    local = set(src.mesh.mesh.ranks) == set(dst.mesh.mesh.ranks)
    if plan.dst_mesh is None or plan.dst_mesh == plan.mesh:
        return HandOff(plan, prepare([plan], src.mesh), len(plan.steps), True)
    ready = prepare([plan], src.mesh, dst=dst.mesh)
    through = next(k for k, st in enumerate(plan.steps) if st.dst_mesh is not None) + 1
    return HandOff(plan, ready, through, local)


def _receive_queues(schedule: Schedule, me: int) -> dict[int, list[Key]]:
    """Per peer pipeline rank, the messages it sends `me`, in the order it sends them."""
    out: dict[int, list[Key]] = {}
    ranks = schedule.stage_rank
    for peer, row in enumerate(schedule.compute_only().rows):
        if peer == me:
            continue
        for a in row:
            for send in schedule.sends(a):
                assert send.microbatch is not None
                if send.kind == "SEND_F" and ranks[send.stage + 1] == me:
                    out.setdefault(peer, []).append(("F", send.stage, send.microbatch))
                elif send.kind == "SEND_B" and ranks[send.stage - 1] == me:
                    out.setdefault(peer, []).append(("B", send.stage - 1, send.microbatch))
    return out


def _releases(schedule: Schedule, me: int) -> dict[Key, list[Key]]:
    """Per message `me` receives, the messages `me` sent that peer which have surely landed
    once it arrives: the peer sent it after the action that used them. Waiting on those then
    returns at once and frees their send buffers long before the end of the step (a send
    completes only once its receiver posts the receive)."""
    out: dict[Key, list[Key]] = {}
    rows = schedule.compute_only().rows
    for peer, incoming in _receive_queues(schedule, me).items():
        at = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(rows[peer])}
        sent = [_position(at, k[1] if k[0] == "F" else k[1] + 1, k[0], k[2]) for k in incoming]
        for mine in _receive_queues(schedule, peer).get(me, []):
            kind, b, mb = mine
            used = _position(at, b + 1 if kind == "F" else b, kind, mb)
            i = bisect.bisect_right(sent, used)     # `incoming` is in the peer's order
            if i < len(incoming):
                out.setdefault(incoming[i], []).append(mine)
    return out


def _position(at: dict[tuple[int, str, int | None], int], stage: int, kind: str,
              mb: int) -> int:
    """Where a row runs stage's forward ("F") or input-gradient backward ("B", or "I")."""
    if kind == "F":
        return at[(stage, "F", mb)]
    return at[(stage, "B", mb)] if (stage, "B", mb) in at else at[(stage, "I", mb)]


def _last_backward(row: Sequence[Action], s: int) -> Action:
    kinds = ("B", "W")
    return [a for a in row if a.stage == s and a.kind in kinds][-1]


def _sync_if_last(p: Pipeline, s: int, a: Action) -> None:
    if p.last[s] == a:
        _set_sync(p.stages[s], True)


def _set_sync(stage: Stage, requires: bool) -> None:
    if stage.module is None:
        return
    for m in stage.module.modules():
        unit = getattr(m, UNIT_ATTR, None)
        if unit is not None:
            unit.sync = requires


def _set_hold(stage: Stage, on: bool) -> None:
    """gather="step": the stage's units keep their gathered parameters from their first use
    in the step until it ends (`Unit.hold`), then free them (`Unit.release`)."""
    if stage.module is None or stage.gather != "step":
        return
    for m in stage.module.modules():
        unit = getattr(m, UNIT_ATTR, None)
        if unit is not None and on:
            unit.hold()
        elif unit is not None:
            unit.release()


def _split(value: Any, m: int, what: str) -> list[Any]:
    if value is None:
        raise ScheduleError(f"Pipeline.step: this rank runs a stage that needs {what}=; pass"
                            " this rank's shard (or a list of one per microbatch)")
    if isinstance(value, Tensor):
        if value.shape[0] % m:
            raise ShapeError(f"Pipeline.step({what}=...): dim 0 of this rank's shard is"
                             f" {value.shape[0]}, not a multiple of microbatches={m}; fix: pass"
                             " a list of one shard per microbatch")
        return [value[i::m] for i in range(m)]
    out = list(value)
    if len(out) != m:
        raise ShapeError(f"Pipeline.step({what}=...): {len(out)} microbatches, expected {m}")
    return out
