"""Pipeline schedules as values, in PyTorch's action notation.

An action is `<stage><kind><microbatch>`: `0F3` is stage 0's forward of microbatch 3, `2B1`
its full backward, `1I0` / `1W0` the two halves of a split backward (gradient of the input,
then of the weights), `0SEND_F1` / `1RECV_F1` / `1SEND_B1` / `0RECV_B1` the hand-offs, and
`0UNSHARD`, `0RESHARD`, `0REDUCE_GRAD` (no microbatch) a stage's parameter gathers and its
gradient reduction. A schedule is one row of actions per pipeline rank, in the order that
rank runs them; its CSV form is one line per rank, one action per cell (an empty cell is an
idle slot), which is what `torch.distributed.pipelining` reads and writes
(`_load_csv` / `_dump_csv`).

`Schedule.of` checks a schedule once, before anything runs: every action parses, each stage
sits on one rank, every microbatch of every stage is computed forward once and backward once
(`B`, or `I` then `W`), each on its stage's rank after its own forward, and every hand-off
action has its partner. Whether the order can finish at all (no rank waits on a message that
is posted after it) is `simulate.simulate`'s check.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...core.errors import ScheduleError

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STAGE_WIDE = ("UNSHARD", "RESHARD", "REDUCE_GRAD")     # no microbatch
KINDS = COMPUTE + COMMS + STAGE_WIDE
_ACTION = re.compile(r"(\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One action of a pipeline rank: `stage`, `kind` (one of `KINDS`) and `microbatch`
    (None for `UNSHARD`, `RESHARD` and `REDUCE_GRAD`). `str()` is PyTorch's notation."""

    stage: int
    kind: str
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.stage < 0 or (self.microbatch is not None and self.microbatch < 0):
            raise ScheduleError(f"action {self.stage}{self.kind}{self.microbatch}: stage and"
                                " microbatch are counted from 0")
        if (self.microbatch is None) != (self.kind in STAGE_WIDE):
            want = "no microbatch" if self.kind in STAGE_WIDE else "a microbatch"
            raise ScheduleError(f"action {self}: {self.kind} takes {want}, e.g."
                                f" {'0' + self.kind if self.kind in STAGE_WIDE else '0F1'}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind}{mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @staticmethod
    def parse(text: str) -> Action | None:
        """The action `text` spells (`"2F0"`, `"1SEND_B3"`, `"0UNSHARD"`); None for an empty
        cell (an idle slot)."""
        cell = text.strip()
        if not cell:
            return None
        m = _ACTION.fullmatch(cell)
        if m is None:
            raise ScheduleError(
                f"schedule action {text!r}: expected <stage><kind><microbatch> with kind one"
                f" of {', '.join(KINDS)}, e.g. '0F1', '2B0', '1SEND_F3', '0UNSHARD'")
        stage, kind, mb = m.groups()
        return Action(int(stage), kind, int(mb) if mb else None)

    @staticmethod
    def parse_cell(text: str) -> tuple[Action, ...]:
        """The actions one CSV cell holds: none (an idle slot), one, or the two of PyTorch's
        overlapped pair `(0F7;7B3)OVERLAP_F_B` (DualPipeV's forward of one stage beside the
        backward of another), which meshcomm runs one after the other, in that order."""
        m = _OVERLAP.fullmatch(text.strip())
        if m is None:
            one = Action.parse(text)
            return () if one is None else (one,)
        parts = tuple(Action.parse(part) for part in m.group(1).split(";"))
        if len(parts) != 2 or any(a is None or not a.is_compute for a in parts):
            raise ScheduleError(f"schedule cell {text!r}: an OVERLAP_F_B pair holds two compute"
                                " actions, e.g. '(0F7;7B3)OVERLAP_F_B'")
        return tuple(a for a in parts if a is not None)


@dataclass(frozen=True, slots=True)
class Schedule:
    """One row of actions per pipeline rank, in order, checked (`Schedule.of`).

    `stage_rank[s]` is the pipeline rank that runs stage s; `n_stages` and `n_microbatches`
    are read off the actions. `name` is for printouts only."""

    rows: tuple[tuple[Action, ...], ...]
    n_stages: int
    n_microbatches: int
    stage_rank: tuple[int, ...]
    name: str = "custom"

    @staticmethod
    def of(rows: Sequence[Iterable[Action | str | None]], name: str = "custom") -> Schedule:
        """The schedule of `rows` (actions or their strings; None or "" is an idle slot,
        dropped), after every check of the module docstring."""
        parsed = tuple(tuple(a for c in row for a in (
            (c,) if isinstance(c, Action) else () if c is None else Action.parse_cell(c)))
            for row in rows)
        if not parsed:
            raise ScheduleError("schedule: no rows; expected one row of actions per pipeline"
                                " rank")
        stage_rank = _stage_ranks(parsed)
        n_mb = 1 + max((a.microbatch for row in parsed for a in row
                        if a.microbatch is not None), default=-1)
        out = Schedule(parsed, len(stage_rank), n_mb, stage_rank, name)
        out.check()
        return out

    @property
    def n_ranks(self) -> int:
        return len(self.rows)

    @property
    def split_backward(self) -> bool:
        """True when some backward runs as `I` then `W` (a zero-bubble schedule; DualPipeV
        splits some microbatches' backwards and not others)."""
        return any(a.kind == "I" for row in self.rows for a in row)

    def split_pairs(self) -> frozenset[tuple[int, int]]:
        """The (stage, microbatch) pairs whose backward runs as `I` then `W`."""
        return frozenset((a.stage, a.microbatch) for row in self.rows for a in row
                         if a.kind == "I" and a.microbatch is not None)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `rank` runs, in order."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    def compute_only(self) -> Schedule:
        """This schedule without its hand-off and stage-wide actions."""
        return Schedule(tuple(tuple(a for a in row if a.is_compute) for row in self.rows),
                        self.n_stages, self.n_microbatches, self.stage_rank, self.name)

    def with_comms(self) -> Schedule:
        """This schedule with its hand-offs written out, as PyTorch's `compute_comms` form:
        `sSEND_Fm` right after the forward that makes it and `(s+1)RECV_Fm` right before the
        forward that needs it (likewise `SEND_B` / `RECV_B` for gradients), where the two
        stages sit on different ranks. meshcomm posts its hand-offs in this order."""
        rows = []
        for row in self.compute_only().rows:
            out: list[Action] = []
            for a in row:
                out.extend(self.receives(a))
                out.append(a)
                out.extend(self.sends(a))
            rows.append(tuple(out))
        return Schedule(tuple(rows), self.n_stages, self.n_microbatches, self.stage_rank,
                        self.name)

    def receives(self, a: Action) -> tuple[Action, ...]:
        """The receive compute action `a` waits on from another rank (none or one)."""
        s, mb, ranks = a.stage, a.microbatch, self.stage_rank
        if a.kind == "F" and s > 0 and ranks[s - 1] != ranks[s]:
            return (Action(s, "RECV_F", mb),)
        if a.kind in ("B", "I") and s < self.n_stages - 1 and ranks[s + 1] != ranks[s]:
            return (Action(s, "RECV_B", mb),)
        return ()

    def sends(self, a: Action) -> tuple[Action, ...]:
        """The send compute action `a` makes for another rank (none or one)."""
        s, mb, ranks = a.stage, a.microbatch, self.stage_rank
        if a.kind == "F" and s < self.n_stages - 1 and ranks[s + 1] != ranks[s]:
            return (Action(s, "SEND_F", mb),)
        if a.kind in ("B", "I") and s > 0 and ranks[s - 1] != ranks[s]:
            return (Action(s, "SEND_B", mb),)
        return ()

    def to_csv(self, comms: bool = False) -> str:
        """The CSV text: one line per pipeline rank (`comms=True`: with hand-offs)."""
        rows = (self.with_comms() if comms else self.compute_only()).rows
        return "".join(",".join(str(a) for a in row) + "\n" for row in rows)

    @staticmethod
    def from_csv(text: str, name: str = "csv") -> Schedule:
        """The schedule of CSV `text` (either form; PyTorch's `_dump_csv` output reads as is).
        Hand-off actions, when present, must be the ones `with_comms` would write."""
        lines = [line for line in text.splitlines() if line.strip()]
        read = Schedule.of([line.split(",") for line in lines], name)
        if any(not a.is_compute for row in read.rows for a in row):
            read.check_comms()
        return read

    def check(self) -> None:
        """Raise `ScheduleError` unless every microbatch of every stage runs forward once and
        backward once (`B`, or `I` then `W`), on its stage's rank, backward after forward."""
        where = {s: r for s, r in enumerate(self.stage_rank)}
        seen: Counter[tuple[int, str, int]] = Counter()
        for r, row in enumerate(self.rows):
            done: set[tuple[int, str, int]] = set()
            for a in row:
                if where.get(a.stage) != r:
                    raise ScheduleError(f"schedule {self.name}: action {a} is on rank {r}, but"
                                        f" stage {a.stage} runs on rank {where.get(a.stage)}")
                if not a.is_compute:
                    continue
                assert a.microbatch is not None
                key = (a.stage, a.kind, a.microbatch)
                need = {"F": None, "B": "F", "I": "F", "W": "I"}[a.kind]
                if need is not None and (a.stage, need, a.microbatch) not in done:
                    raise ScheduleError(f"schedule {self.name}: rank {r} runs {a} before"
                                        f" {a.stage}{need}{a.microbatch}")
                seen[key] += 1
                done.add(key)
        for s in range(self.n_stages):
            for mb in range(self.n_microbatches):
                f, b, i, w = (seen[(s, k, mb)] for k in COMPUTE)
                if f != 1 or not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                    raise ScheduleError(
                        f"schedule {self.name}: stage {s} microbatch {mb} runs F {f}x, B {b}x,"
                        f" I {i}x, W {w}x; expected F once and either B once or I and W once")

    def check_comms(self) -> None:
        """Raise `ScheduleError` unless the hand-off actions are the ones the compute order
        implies (`with_comms`'s, per rank), each `SEND` after the compute that makes it and
        each `RECV` before the compute that needs it. Where in between they sit is free
        (PyTorch's DualPipeV posts its receives early); meshcomm posts its own, in
        `with_comms`'s order."""
        want = self.with_comms()
        for r, (got, exp) in enumerate(zip(self.rows, want.rows)):
            mine = [a for a in got if a.kind not in STAGE_WIDE]
            comms = Counter(a for a in mine if not a.is_compute)
            expected = Counter(a for a in exp if not a.is_compute)
            if comms != expected:
                extra = sorted(map(str, comms - expected))
                missing = sorted(map(str, expected - comms))
                raise ScheduleError(
                    f"schedule {self.name}: rank {r}'s hand-offs are not the ones its compute"
                    f" order implies: {'extra ' + ' '.join(extra) if extra else ''}"
                    f"{'; ' if extra and missing else ''}"
                    f"{'missing ' + ' '.join(missing) if missing else ''}; fix: leave the"
                    " SEND/RECV actions out (meshcomm places them) or place them as"
                    " Schedule.with_comms does")
            at = {a: i for i, a in enumerate(mine)}
            for a in mine:
                if not a.is_compute:
                    continue
                for recv in self.receives(a):
                    if at[recv] > at[a]:
                        raise ScheduleError(f"schedule {self.name}: rank {r} runs {a} before"
                                            f" {recv}; a receive comes before the compute that"
                                            " needs it")
                for send in self.sends(a):
                    if at[send] < at[a]:
                        raise ScheduleError(f"schedule {self.name}: rank {r} has {send} before"
                                            f" {a}, which makes it; a send comes after it")


def _stage_ranks(rows: tuple[tuple[Action, ...], ...]) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for r, row in enumerate(rows):
        for a in row:
            if owner.setdefault(a.stage, r) != r:
                raise ScheduleError(f"schedule: stage {a.stage} has actions on ranks"
                                    f" {owner[a.stage]} and {r}; a stage runs on one rank")
    n = 1 + max(owner, default=-1)
    missing = [s for s in range(n) if s not in owner]
    if missing:
        raise ScheduleError(f"schedule: stages {missing} have no action; stages are numbered"
                            f" 0..{n - 1} with no gap")
    return tuple(owner[s] for s in range(n))
