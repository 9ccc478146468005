"""Cut a model's layers into pipeline stages of balanced cost (pure).

`balance(weights, stages)` cuts a sequence of layer weights (FLOPs, seconds, parameter bytes:
any additive cost, the embedding and output layers included as layers of their own) into
`stages` contiguous runs, none empty, whose largest sum is the least possible, and returns
where each stage starts. It bisects on the largest sum (each probe one greedy pass), so a
model of thousands of layers splits in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.errors import ScheduleError


def balance(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """The first layer of each of `stages` stages (0 first) whose largest total weight is
    least.

    >>> balance([1, 1, 1, 1, 4], 2)          # the heavy output layer alone
    (0, 4)
    >>> balance([2, 1, 1, 1, 1, 2], 3)
    (0, 2, 5)
    """
    w = [float(x) for x in weights]
    n = len(w)
    if not (isinstance(stages, int) and 1 <= stages <= n):
        raise ScheduleError(f"balance(stages={stages!r}): expected 1..{n} (one layer or more a"
                            " stage)")
    if any(x < 0 for x in w):
        raise ScheduleError("balance(weights=...): weights are costs, expected >= 0")
    lo, hi = max(w), sum(w)
    for _ in range(100):                       # bisect the largest stage sum
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if _fits(w, stages, mid):
            hi = mid
        else:
            lo = mid
    return _cuts(w, stages, hi)


def _fits(w: Sequence[float], stages: int, limit: float) -> bool:
    count, run = 1, 0.0
    for x in w:
        if run + x > limit:
            count, run = count + 1, x
        else:
            run += x
    return count <= stages


def _cuts(w: Sequence[float], stages: int, limit: float) -> tuple[int, ...]:
    """Greedy runs of at most `limit`, then split the longest runs until there are `stages`
    (a stage is never empty)."""
    starts, run = [0], 0.0
    for i, x in enumerate(w):
        if run + x > limit * (1 + 1e-12) and i > starts[-1]:
            starts.append(i)
            run = x
        else:
            run += x
    while len(starts) < stages:                # more stages than the greedy needed
        ends = starts[1:] + [len(w)]
        k = max(range(len(starts)), key=lambda j: (ends[j] - starts[j], -j))
        starts.insert(k + 1, ends[k] - 1)
    return tuple(starts)


def stage_sums(weights: Sequence[float], starts: Sequence[int]) -> tuple[float, ...]:
    """Each stage's total weight, for starts from `balance`."""
    ends = list(starts[1:]) + [len(weights)]
    return tuple(float(sum(weights[a:b])) for a, b in zip(starts, ends))
