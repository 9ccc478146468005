"""The statistics of benchmarks/reshard_vs_dtensor.py: the paired ratio and its interval."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from reshard_vs_dtensor import median_interval, paired_ratio  # noqa: E402


def _coverage(n: int, lo: int, hi: int) -> float:
    """P(the lo-th <= the median <= the hi-th of n sorted values, 0-based): between lo + 1
    and hi of the n values fall below the median, a Binomial(n, 1/2) count."""
    return sum(math.comb(n, k) for k in range(lo + 1, hi + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 10, 30, 31, 50, 100, 200, 300])
def test_the_interval_is_the_narrowest_that_covers_95_percent(n: int) -> None:
    lo, hi = median_interval(n)
    assert hi == n - 1 - lo                        # symmetric
    assert _coverage(n, lo, hi) >= 0.95
    assert _coverage(n, lo + 1, hi - 1) < 0.95     # one value in on each side falls short


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_too_few_pairs_give_the_whole_sample(n: int) -> None:
    assert median_interval(n) == (0, n - 1)


def test_each_iteration_pairs_the_slowest_rank_of_both_sides() -> None:
    # two ranks, four iterations; meshcomm's rank 1 is slow in iteration 2 only
    ours = [[1.0, 2.0, 1.0, 1.0], [1.0, 8.0, 1.0, 1.0]]
    theirs = [[2.0, 2.0, 2.0, 2.0], [1.0, 4.0, 1.0, 1.0]]
    ratio, lo, hi = paired_ratio(ours, theirs)
    # per iteration: max(1, 1) / max(2, 1) = 0.5, 8 / 4 = 2, 0.5, 0.5
    assert ratio == 0.5 and (lo, hi) == (0.5, 2.0)
