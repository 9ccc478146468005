"""The standard pipeline schedules, built as `Schedule` values (pure; nothing runs here).

- `gpipe(p, m)`: every forward, then every backward (peak: m microbatches held per rank).
- `one_f_one_b(p, m)`: rank r runs p - 1 - r forwards, then alternates one forward and one
  backward, then the remaining backwards (PipeDream-Flush; peak p - r microbatches).
- `interleaved_1f1b(p, m, v)`: v stages per rank, stage s on rank s % p (Megatron's
  virtual stages): the bubble shrinks v-fold for v-fold hand-offs.
- `zero_bubble(p, m)`: 1F1B's memory with backward split into `I` (gradient of the input,
  which the previous stage waits on) and `W` (gradient of the weights, which nobody waits
  on): `W`s fill the bubbles (ZB-H1's step, m (F + I + W) + (p - 1)(F + I - W), holding up
  to 2p - 1 microbatches where 1F1B holds p). `zero_bubble_v(p, m)` puts two stages per rank in a
  V (stage s and 2p - 1 - s on rank min(s, 2p - 1 - s)), so the last stage is on rank 0.

The zero-bubble orders come from one list scheduler (`greedy`): unit-time slots in which
each rank runs, by priority, the oldest `I` whose gradient has arrived, else the next
forward if fewer than its cap of forwards wait for their `I`, else the oldest `W`. A
microbatch's activations stay until its `W` (the weight gradient needs them), so a split
schedule holds more at its peak than 1F1B: `simulate` reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...core.errors import ScheduleError
from .actions import Action, Schedule


def _check(p: int, m: int, what: str) -> None:
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ScheduleError(f"{what}(ranks={p!r}, microbatches={m!r}): expected positive"
                            " integers")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe on `p` ranks (one stage each) over `m` microbatches."""
    _check(p, m, "gpipe")
    return Schedule.of([[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i)
                                                                 for i in range(m)]
                        for r in range(p)], name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B on `p` ranks (one stage each) over `m` microbatches."""
    _check(p, m, "one_f_one_b")
    rows = []
    for r in range(p):
        warm = min(m, p - 1 - r)
        row = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            row += [Action(r, "F", warm + i), Action(r, "B", i)]
        row += [Action(r, "B", i) for i in range(m - warm, m)]
        rows.append(row)
    return Schedule.of(rows, name="1f1b")


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B on `p` ranks with `v` stages each (stage s on rank s % p) over `m`
    microbatches, taken in rounds of p: forwards go chunk by chunk through a round, backwards
    the same with chunks reversed. Needs m a multiple of p (else a round would wait on a
    microbatch its neighbour has not started)."""
    _check(p, m, "interleaved_1f1b")
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"interleaved_1f1b(stages_per_rank={v!r}): expected a positive int")
    if m % p:
        raise ScheduleError(
            f"interleaved_1f1b(ranks={p}, microbatches={m}): the microbatches must be a"
            f" multiple of the ranks; fix: microbatches={-(-m // p) * p}, or one_f_one_b")
    order = [(c, mb) for first in range(0, m, p) for c in range(v)
             for mb in range(first, first + p)]
    rows = []
    for r in range(p):
        fwd = [Action(c * p + r, "F", mb) for c, mb in order]
        bwd = [Action((v - 1 - c) * p + r, "B", mb) for c, mb in order]
        warm = min(len(fwd), (p - 1 - r) * 2 + (v - 1) * p)
        row = fwd[:warm]
        for i in range(len(fwd) - warm):
            row += [fwd[warm + i], bwd[i]]
        row += bwd[len(fwd) - warm:]
        rows.append(row)
    return Schedule.of(rows, name=f"interleaved_1f1b(v={v})")


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 on `p` ranks (one stage each) over `m` microbatches: 1F1B's peak memory, with the
    weight gradients moved into the bubbles."""
    _check(p, m, "zero_bubble")
    return greedy(p, m, lambda s: s, cap=lambda r: p - r, defer=lambda r: p,
                  name="zero_bubble")


def zero_bubble_v(p: int, m: int) -> Schedule:
    """A zero-bubble V schedule: 2p stages on p ranks, stage s on rank min(s, 2p - 1 - s)."""
    _check(p, m, "zero_bubble_v")
    return greedy(2 * p, m, lambda s: min(s, 2 * p - 1 - s), cap=lambda r: 2 * p,
                  defer=lambda r: p, name="zero_bubble_v")


def greedy(n_stages: int, m: int, rank_of: Callable[[int], int], cap: Callable[[int], int],
           defer: Callable[[int], int], name: str) -> Schedule:
    """The order a unit-time list scheduler gives (module docstring): stage s on rank
    `rank_of(s)`, rank r running at most `cap(r)` forwards ahead of their input gradients
    (`I`) and putting off at most `defer(r)` `W`s (past that, a `W` comes first); the other
    `W`s wait for idle slots."""
    p = 1 + max(rank_of(s) for s in range(n_stages))
    stages = [[s for s in range(n_stages) if rank_of(s) == r] for r in range(p)]
    done: dict[tuple[int, str, int], int] = {}     # action -> slot it finished in
    rows: list[list[Action]] = [[] for _ in range(p)]
    nxt_f = [[0] * n_stages for _ in range(p)]      # next forward microbatch, per stage
    held = [0] * p                                  # forwards waiting for their I
    pending = [0] * p                               # Is waiting for their W
    total = n_stages * m * 3
    slot = 0
    while len(done) < total:
        if slot > 4 * total + 8:
            raise ScheduleError(f"{name}: the list scheduler made no progress (a bug)")
        picks = [_pick(r, stages[r], m, n_stages, done, nxt_f[r], held[r] < cap(r),
                       0 < pending[r] >= defer(r), slot) for r in range(p)]
        for r, a in enumerate(picks):
            if a is None:
                continue
            assert a.microbatch is not None
            rows[r].append(a)
            done[(a.stage, a.kind, a.microbatch)] = slot
            if a.kind == "F":
                nxt_f[r][a.stage] += 1
                held[r] += 1
            elif a.kind == "I":
                held[r] -= 1
                pending[r] += 1
            else:
                pending[r] -= 1
        slot += 1
    return Schedule.of(rows, name=name)


def _pick(r: int, stages: Sequence[int], m: int, n: int, done: dict[tuple[int, str, int], int],
          nxt_f: list[int], room: bool, flush: bool, slot: int) -> Action | None:
    def ready(key: tuple[int, str, int]) -> bool:
        return done.get(key, slot) < slot

    def weight() -> Action | None:
        for s in stages:
            for mb in range(m):
                if (s, "W", mb) not in done and ready((s, "I", mb)):
                    return Action(s, "W", mb)
        return None

    if flush and (w := weight()) is not None:
        return w

    # I: the latest stage first (it unblocks the rank below soonest), oldest microbatch
    for s in sorted(stages, reverse=True):
        for mb in range(m):
            if (s, "I", mb) in done or not ready((s, "F", mb)):
                continue
            if s == n - 1 or ready((s + 1, "I", mb)):
                return Action(s, "I", mb)
            break
    if room:   # F: the latest stage first (it drains work towards the loss)
        for s in sorted(stages, reverse=True):
            mb = nxt_f[s]
            if mb < m and (s == 0 or ready((s - 1, "F", mb))):
                return Action(s, "F", mb)
    return weight()


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble, "zero_bubble_v": zero_bubble_v,
}


def build(name: str, p: int, m: int, **kw: int) -> Schedule:
    """The schedule called `name` (a key of `SCHEDULES`) on `p` ranks over `m` microbatches."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}, a"
                            " Schedule, or CSV text (Schedule.from_csv)")
    return SCHEDULES[name](p, m, **kw)
