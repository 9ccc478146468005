"""Run a schedule on paper: each rank's timeline, the step time, bubbles, peak activation
memory, and the two checks that keep a pipeline from hanging (pure; nothing communicates).

Time: rank r runs its row in order; an action starts when the rank is free and its inputs
are there. A forward of stage s > 0 waits on stage s - 1's forward of the same microbatch, plus
the hand-off's time when the two stages sit on different ranks (`StageCosts.send_forward`);
a backward (`B` or `I`) waits on its own forward and on stage s + 1's backward plus the
gradient's hand-off (`send_backward`); a `W` on its `I`. Sends are posted and never block the
sender (meshcomm issues them and goes on), so a hand-off costs its receiver only.

Memory: a stage holds `activation_bytes[s]` per microbatch from the start of its forward to
the end of its backward (`B`, or `W` when split).

Deadlock: if some rank's next action waits on an action that can never run, `simulate`
raises `ScheduleError` naming every stuck rank and what it waits on. (Messages between two
ranks match in the order they are posted, but that adds no constraint: a rank posts its
receives from a peer in the order that peer sends, early enough; see
`meshcomm.nn.pipeline`.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.errors import ScheduleError
from .actions import Action, Schedule


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Seconds per microbatch of each stage's `forward` and full `backward` (`weight`: the
    part of backward that is the weight gradient, `W`, in split schedules; the input
    gradient `I` is the rest), seconds of each hand-off from stage s to s + 1
    (`send_forward[s]`) and back (`send_backward[s]`), and `activation_bytes[s]` a stage
    holds per microbatch in flight. Missing tuples read as zeros."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...] = ()
    send_forward: tuple[float, ...] = ()
    send_backward: tuple[float, ...] = ()
    activation_bytes: tuple[int, ...] = ()

    @staticmethod
    def uniform(n_stages: int, forward: float = 1.0, backward: float = 2.0,
                weight: float = 0.0, send: float = 0.0,
                activation_bytes: int = 0) -> StageCosts:
        """The same costs for every stage and hand-off."""
        return StageCosts((forward,) * n_stages, (backward,) * n_stages, (weight,) * n_stages,
                          (send,) * (n_stages - 1), (send,) * (n_stages - 1),
                          (activation_bytes,) * n_stages)

    def seconds(self, a: Action) -> float:
        s = a.stage
        if a.kind == "F":
            return self.forward[s]
        w = self.weight[s] if s < len(self.weight) else 0.0
        return {"B": self.backward[s], "I": self.backward[s] - w, "W": w}[a.kind]


@dataclass(frozen=True, slots=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """What `simulate` found: every compute `Event`, and per rank its busy seconds, idle
    fraction (`bubbles[r]`) and peak activation bytes."""

    schedule: Schedule
    events: tuple[Event, ...]
    step_time: float
    busy: tuple[float, ...]
    peak_bytes: tuple[int, ...]
    bubbles: tuple[float, ...] = field(default=())

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks' time: 1 - sum(busy) / (ranks x step time)."""
        if self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)

    def chrome_trace(self) -> dict[str, object]:
        """The timeline as a Chrome / Perfetto trace (`json.dump` it; open it in
        ui.perfetto.dev or chrome://tracing): one track per pipeline rank, times in us."""
        names = {"F": "forward", "B": "backward", "I": "backward input", "W": "backward weight"}
        events: list[dict[str, object]] = [
            {"name": str(e.action), "cat": names[e.action.kind], "ph": "X", "pid": 0,
             "tid": e.rank, "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
             "args": {"stage": e.action.stage, "microbatch": e.action.microbatch}}
            for e in self.events]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                    "args": {"name": f"pipeline rank {r}"}} for r in range(len(self.busy))]
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.schedule.name,
                              "step_time_s": self.step_time,
                              "bubble_fraction": self.bubble_fraction}}


def simulate(schedule: Schedule, costs: StageCosts) -> Timeline:
    """The timeline of one step of `schedule` under `costs` (module docstring); raises
    `ScheduleError` if it deadlocks."""
    _check_costs(schedule, costs)
    rows = schedule.compute_only().rows
    split = schedule.split_pairs()
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(rows)
    pos = [0] * len(rows)
    events: list[Event] = []
    left = sum(len(row) for row in rows)
    while left:
        moved = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                ready = _ready(schedule, costs, a, end, split)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + costs.seconds(a)
                assert a.microbatch is not None
                end[(a.stage, a.kind, a.microbatch)] = free[r]
                events.append(Event(r, a, start, free[r]))
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise ScheduleError(_deadlock(schedule, rows, pos, end, split))
    return timeline(schedule, events, costs.activation_bytes)


def timeline(schedule: Schedule, events: Sequence[Event],
             activation_bytes: Sequence[int] = ()) -> Timeline:
    """The `Timeline` of compute `events` of `schedule`, simulated or recorded by a real step
    (`Pipeline(record=True)`, its `events`): the step runs from the earliest start to the
    latest end; a rank's busy time is the sum of its events' lengths; peak bytes as in
    `simulate` where `activation_bytes` (one per stage) is given."""
    events = tuple(events)
    t0 = min((e.start for e in events), default=0.0)
    if t0:
        events = tuple(Event(e.rank, e.action, e.start - t0, e.end - t0) for e in events)
    step = max((e.end for e in events), default=0.0)
    busy = [0.0] * schedule.n_ranks
    for e in events:
        busy[e.rank] += e.end - e.start
    bubbles = tuple(1.0 - b / step if step > 0 else 0.0 for b in busy)
    peaks = _peaks(schedule, tuple(activation_bytes), events)
    return Timeline(schedule, events, step, tuple(busy), peaks, bubbles)


def _ready(schedule: Schedule, costs: StageCosts, a: Action,
           end: dict[tuple[int, str, int], float], split: frozenset[tuple[int, int]]
           ) -> float | None:
    """When `a`'s inputs are there, or None while one of them has not run."""
    times = []
    for dep, hop in _deps(schedule, costs, a, split):
        if dep not in end:
            return None
        times.append(end[dep] + hop)
    return max(times, default=0.0)


def _deps(schedule: Schedule, costs: StageCosts, a: Action,
          split: frozenset[tuple[int, int]]) -> list[tuple[tuple[int, str, int], float]]:
    s, mb, ranks = a.stage, a.microbatch, schedule.stage_rank
    assert mb is not None
    if a.kind == "W":
        return [((s, "I", mb), 0.0)]
    if a.kind == "F":
        if s == 0:
            return []
        hop = _at(costs.send_forward, s - 1) if ranks[s - 1] != ranks[s] else 0.0
        return [((s - 1, "F", mb), hop)]
    out = [((s, "F", mb), 0.0)]
    if s < schedule.n_stages - 1:
        hop = _at(costs.send_backward, s) if ranks[s + 1] != ranks[s] else 0.0
        out.append(((s + 1, "I" if (s + 1, mb) in split else "B", mb), hop))
    return out


def _at(values: Sequence[float], i: int) -> float:
    return values[i] if i < len(values) else 0.0


def _deadlock(schedule: Schedule, rows: Sequence[Sequence[Action]], pos: Sequence[int],
              end: dict[tuple[int, str, int], float], split: frozenset[tuple[int, int]]
              ) -> str:
    stuck = []
    for r, row in enumerate(rows):
        if pos[r] < len(row):
            a = row[pos[r]]
            waits = [str(Action(*k)) for k, _ in _deps(schedule, StageCosts((), ()), a, split)
                     if k not in end]
            stuck.append(f"rank {r} at {a} waits on {', '.join(waits)}")
    return (f"schedule {schedule.name} deadlocks: {'; '.join(stuck)}. fix: reorder the rows so"
            " every action comes after the actions it waits on (or build the schedule with"
            " mc.nn.pipeline's named schedules)")


def _peaks(schedule: Schedule, activation_bytes: tuple[int, ...], events: Sequence[Event]
           ) -> tuple[int, ...]:
    if not activation_bytes:
        return (0,) * schedule.n_ranks
    deltas: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        size = activation_bytes[e.action.stage]
        if e.action.kind == "F":
            deltas[e.rank].append((e.start, size))
        elif e.action.kind in ("B", "W"):        # a microbatch's last backward: one of them
            deltas[e.rank].append((e.end, -size))
    peaks = []
    for r in range(schedule.n_ranks):
        now = peak = 0
        for _, d in sorted(deltas[r], key=lambda t: (t[0], t[1])):   # frees first at a tie
            now += d
            peak = max(peak, now)
        peaks.append(peak)
    return tuple(peaks)


def _check_costs(schedule: Schedule, costs: StageCosts) -> None:
    n = schedule.n_stages
    for name in ("forward", "backward"):
        got = getattr(costs, name)
        if len(got) != n:
            raise ScheduleError(f"StageCosts.{name}: {len(got)} values for a schedule of {n}"
                                " stages; expected one per stage")
    if costs.activation_bytes and len(costs.activation_bytes) != n:
        raise ScheduleError(f"StageCosts.activation_bytes: {len(costs.activation_bytes)}"
                            f" values for {n} stages; expected one per stage")
