"""A pipeline timeline as plain rows for a terminal: one row per pipeline rank, time left to
right in columns, each compute action a block with its label. `display.render_timeline`
colours them with rich; `timeline_text` prints them with letters alone.

Every column shows the action running at the column's middle instant, or idle; an action
shorter than a column can fall between two middles and is then not drawn (`Grid.hidden`
counts them, and the footer says so). A block's label is the action in PyTorch's notation
without the stage (`F3`: forward of microbatch 3) when each rank runs one stage, and with
it (`4F3`) when a rank runs several; a block too narrow for its label shows a shorter one
(`F3`, then `F`). Labels, not colours, carry the meaning: the plain text reads the same as the
coloured picture.
"""

from __future__ import annotations

from dataclasses import dataclass

from .core.units import format_bytes
from .planner.pipeline import Action, Event, Timeline

__all__ = ["KIND_NAMES", "Block", "Grid", "TimelineRow", "fit", "format_seconds", "label",
           "timeline_grid", "timeline_text"]

KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)",
              "W": "backward (weights)"}
IDLE = "·"
RANK_HEAD = "rank"


@dataclass(frozen=True, slots=True)
class Block:
    """One drawn action: `action`, its first column, width in columns, `label` (what fits:
    module docstring) and shade (the stage's position among its rank's stages, 0 first)."""

    action: Action
    col: int
    width: int
    label: str
    shade: int

    @property
    def kind(self) -> str:
        return self.action.kind

    @property
    def text(self) -> str:
        """The block's characters: its label padded with spaces."""
        return self.label.ljust(self.width)


def label(action: Action, width: int, several: bool) -> str:
    """The longest label of `action` that fits `width` columns: `4F3` (when a rank runs
    several stages), `F3`, `F`, or nothing. Where a rank runs several stages a label keeps
    a space after it: the next block's label may start with a digit (`F3` then `2B1` would
    read `F32B1`)."""
    full = str(action)
    short = full[len(str(action.stage)):]             # PyTorch's notation less the stage
    room = width - 1 if several else width
    for text in ((full, short, action.kind) if several else (short, action.kind)):
        if len(text) <= room:
            return text
    return ""


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """One pipeline rank: its blocks left to right, idle fraction and peak activation bytes."""

    rank: int
    blocks: tuple[Block, ...]
    idle: float
    peak_bytes: int

    def text(self, width: int) -> str:
        """The row's `width` columns: blocks, and `IDLE` where nothing runs."""
        out = [IDLE] * width
        for b in self.blocks:
            out[b.col:b.col + b.width] = b.text
        return "".join(out)


@dataclass(frozen=True, slots=True)
class Grid:
    """A timeline drawn `width` columns wide: one row per pipeline rank; `hidden` actions
    were too short to cover a column's middle."""

    timeline: Timeline
    width: int
    rows: tuple[TimelineRow, ...]
    hidden: int

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds drawn, in `KIND_NAMES` order."""
        seen = {b.kind for row in self.rows for b in row.blocks}
        return tuple(k for k in KIND_NAMES if k in seen)

    def stats(self, row: TimelineRow) -> str:
        """The text right of a row: its idle share, and its peak when any rank holds one."""
        peak = (f"  peak {format_bytes(row.peak_bytes):>9}"
                if any(r.peak_bytes for r in self.rows) else "")
        return f"{row.idle:4.0%} idle{peak}"

    def footer(self) -> str:
        """The summary lines: the schedule; step time, bubble fraction, highest peak; and
        how many actions were too short to draw, if any."""
        t = self.timeline
        s = t.schedule
        peak = max(range(len(t.peak_bytes)), key=lambda r: t.peak_bytes[r], default=0)
        lines = [f"{s.name}: {s.n_ranks} ranks, {s.n_stages} stages, {s.n_microbatches}"
                 " microbatches",
                 f"step {format_seconds(t.step_time)}, bubble {t.bubble_fraction:.1%}"]
        if any(t.peak_bytes):
            lines[1] += f", peak activations {format_bytes(t.peak_bytes[peak])} (rank {peak})"
        if self.hidden:
            lines.append(f"{self.hidden} actions too short to draw at {self.width} columns"
                         " (a wider terminal or --width shows them)")
        return "\n".join(lines)

    def axis(self) -> str:
        """The time axis under the rows: 0 at the left, the step time at the right."""
        end = format_seconds(self.timeline.step_time)
        return "0".ljust(max(self.width - len(end), 1)) + end


def format_seconds(seconds: float) -> str:
    """Seconds with three significant digits in s, ms, us or ns.

    >>> format_seconds(11.0), format_seconds(0.0123), format_seconds(2.5e-5), format_seconds(0)
    ('11 s', '12.3 ms', '25 us', '0 s')
    >>> format_seconds(4.1e-12)
    '0.0041 ns'
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}" if seconds else "0 s"
    raise AssertionError(f"unreachable for {seconds!r}")


def timeline_grid(timeline: Timeline, width: int) -> Grid:
    """The rows of `timeline` drawn `width` (>= 1) columns wide (module docstring)."""
    assert width >= 1, f"timeline width {width} must be at least 1 column"
    s = timeline.schedule
    several = any(len(s.stages_of(r)) > 1 for r in range(s.n_ranks))
    by_rank: list[list[Event]] = [[] for _ in range(s.n_ranks)]
    for e in timeline.events:
        by_rank[e.rank].append(e)
    rows, hidden = [], 0
    for r, events in enumerate(by_rank):
        events.sort(key=lambda e: e.start)
        shade = {st: k for k, st in enumerate(s.stages_of(r))}
        blocks = _blocks(events, timeline.step_time, width, several, shade)
        hidden += len(events) - len({id(e) for e, _ in blocks})
        idle = timeline.bubbles[r] if r < len(timeline.bubbles) else 0.0
        peak = timeline.peak_bytes[r] if r < len(timeline.peak_bytes) else 0
        rows.append(TimelineRow(r, tuple(b for _, b in blocks), idle, peak))
    return Grid(timeline, width, tuple(rows), hidden)


def _blocks(events: list[Event], step: float, width: int, several: bool,
            shade: dict[int, int]) -> list[tuple[Event, Block]]:
    """Columns to events by their middle instants, runs of one event as one block."""
    owner: list[Event | None] = [None] * width
    k = 0
    for c in range(width):
        t = (c + 0.5) * step / width
        while k < len(events) and events[k].end <= t:
            k += 1
        if k < len(events) and events[k].start <= t < events[k].end:
            owner[c] = events[k]
    out: list[tuple[Event, Block]] = []
    c = 0
    while c < width:
        e = owner[c]
        if e is None:
            c += 1
            continue
        stop = c
        while stop < width and owner[stop] is e:
            stop += 1
        a = e.action
        out.append((e, Block(a, c, stop - c, label(a, stop - c, several),
                             shade.get(a.stage, 0))))
        c = stop
    return out


def timeline_text(timeline: Timeline, width: int = 100) -> str:
    """The picture in letters alone, `width` columns in all (what `display.show_timeline`
    prints with NO_COLOR).

    >>> from meshcomm.planner.pipeline import StageCosts, one_f_one_b, simulate
    >>> print(timeline_text(simulate(one_f_one_b(2, 2), StageCosts.uniform(2)), width=52))
    rank 0 │F0  F1 ········B0     ····B1     │  33% idle
    rank 1 │····F0 B0      F1 B1      ·······│  33% idle
            0                             9 s
    1f1b: 2 ranks, 2 stages, 2 microbatches
    step 9 s, bubble 33.3%
    """
    grid, head = fit(timeline, width)
    lines = [f"{head(row.rank)}│{row.text(grid.width)}│ {grid.stats(row)}" for row in grid.rows]
    lines.append(" " * (len(head(0)) + 1) + grid.axis())
    lines.append(grid.footer())
    return "\n".join(line.rstrip() for line in lines)


def fit(timeline: Timeline, width: int) -> tuple[Grid, _Head]:
    """The grid that fits `width` columns beside the rank labels and row stats, and the
    rank label maker (shared by the plain and the coloured printouts)."""
    n = timeline.schedule.n_ranks
    digits = len(str(max(n - 1, 0)))
    head = _Head(digits)
    probe = timeline_grid(timeline, 1)
    stats = max((len(probe.stats(row)) for row in probe.rows), default=0)
    room = max(width - len(head(0)) - 3 - stats, 8)
    return timeline_grid(timeline, room), head


@dataclass(frozen=True, slots=True)
class _Head:
    digits: int

    def __call__(self, rank: int) -> str:
        return f"{RANK_HEAD} {rank:>{self.digits}} "
