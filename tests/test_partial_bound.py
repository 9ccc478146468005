"""Partial sources against the counting bound (issue 22): an oracle that counts messages
element by element (`meshcomm.testing.counting_bound`), our bound checked against it, and
plans checked against both.

The oracle: resolving a pending reduction over g ranks, an item (an element, with a
coordinate on the pending axes the destination keeps) needs g - 1 messages to combine
its g partial values, plus one delivery to each rank needing it, less one when a rank
needing it holds a partial (it can combine there): S = sum over items of g - 1 + n - h.
The busiest rank receives at least S / P of them, and every rank at least one per element
it needs. It is a lower bound for every plan, whatever its steps.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_plan_scale import _check_exact, _data

import meshcomm as mc
from meshcomm.executors.sim import execute, scatter
from meshcomm.testing import counting_bound, partial_transition


def _sample(n: int, seed: int, even: bool) -> list[tuple[mc.Mesh, tuple[int, ...], str, str]]:
    rng = random.Random(seed)
    return [partial_transition(rng, even) for _ in range(n)]


@pytest.mark.parametrize("even", [False, True], ids=["small", "divisible"])
def test_our_bound_is_the_counting_bound(even: bool) -> None:
    """The planner's bound (per-rank counts from block tables, never listing elements)
    equals the oracle's element-by-element count on every case: it never claims a plan is
    worse than it is, nor understates the gap."""
    for mesh, shape, src, dst in _sample(60, 1, even):
        p = mc.plan(mesh, shape, src, dst)
        want = counting_bound(mesh, shape, src, dst)
        assert max(p.lower_bound_bytes) == want * 4, (mesh, shape, src, dst)
        assert max(p.recv_bytes) >= max(p.lower_bound_bytes), str(p)


def test_partial_sources_on_divisible_shapes_reach_the_bound() -> None:
    """150 partial-source transitions on meshes of up to 64 ranks, every dim divisible by
    the mesh: each plan exact in simulation; at least 90% at the counting bound (the
    measured share is 92.7%; 95-98% on other seeds, see docs/plans.md), none above 1.5x."""
    ratios = []
    for mesh, shape, src, dst in _sample(150, 2, even=True):
        p = mc.plan(mesh, shape, src, dst)
        _check_exact(p, _data(p.shape))
        ratios.append((max(p.recv_bytes) / (counting_bound(mesh, shape, src, dst) * 4), str(p)))
    at = sum(r <= 1.0 for r, _ in ratios) / len(ratios)
    worst = max(ratios)
    assert at >= 0.90, f"{at:.0%} at the bound"
    assert worst[0] <= 1.5, worst[1]


def test_partial_sources_on_small_shapes_are_exact() -> None:
    """Small shapes (torch.chunk leaves ranks empty): every plan exact and at or above the
    bound; at least 95% at it (the measured share is 98.8%; tree steps reach most of them,
    see docs/plans.md), none above 1.5x."""
    ratios = []
    for mesh, shape, src, dst in _sample(80, 3, even=False):
        p = mc.plan(mesh, shape, src, dst)
        _check_exact(p, _data(p.shape))
        assert max(p.recv_bytes) >= max(p.lower_bound_bytes), str(p)
        ratios.append((p.bound_ratio, str(p)))
    assert sum(r <= 1.0 for r, _ in ratios) >= 0.95 * len(ratios)
    assert max(ratios)[0] <= 1.5, max(ratios)[1]


# The worst cases of the issue's fuzz, and the ratio each plan had then -> has now.
LISTED = [
    ("dp=4 pp=2 ep=4", (10, 4, 9, 10), "(pp a) b c d | sum(dp)", "(dp ep a) b c d",
     torch.float32, 6.8, 1.003),
    ("ep=2 dp=4 tp=2 sp=2", (1, 11), "(sp dp a) (ep b) | sum(tp)", "e (tp ep sp dp f)",
     torch.float64, 7.0, 1.0),
    ("pp=2 sp=4 dp=4", (13, 2), "(sp a) b | sum(dp)", "(dp pp sp a) b", torch.int16, 4.7, 1.0),
    ("sp=4 dp=4 pp=2", (12,), "a | sum(dp)", "(dp sp pp a)", torch.float64, 4.5, 1.0),
    ("pp=4 cp=4", (5,), "a | min(cp)", "(cp pp a)", torch.float32, 6.0, 1.0),
    ("a=2 b=3 c=2", (4, 4), "(a i) j | sum(b, c)", "(c i) j", torch.float32, 1.57, 1.0),
]


@pytest.mark.parametrize("spec, shape, src, dst, dtype, was, now", LISTED)
def test_the_issue_s_worst_cases(spec: str, shape: tuple[int, ...], src: str, dst: str,
                                 dtype: torch.dtype, was: float, now: float) -> None:
    mesh = mc.Mesh(spec)
    p = mc.plan(mesh, shape, src, dst, dtype=dtype)
    assert max(p.lower_bound_bytes) == counting_bound(mesh, shape, src, dst) * dtype.itemsize
    assert p.bound_ratio <= now + 0.005 < was, str(p)
    x = torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    res = execute(p, scatter(x, mesh, src))
    for got, want in zip(res.outputs, scatter(x, mesh, dst)):
        assert torch.equal(got, want), str(p)


def test_idle_ranks_raise_the_bound() -> None:
    """docs/plans.md: 9 ranks need one element each and 40 hold nothing; ceil(S / P) is one
    element, but the 24 holders make only 24 of the 63 unions with one message each, and an
    idle rank wastes its first message of an element: the bound is 2 elements, the oracle's
    too, and the plan receives at least that."""
    mesh = mc.Mesh("dp=8 tp=8")
    args = (mesh, (1, 3, 3), "i j (tp k) | min(dp)", "i (dp j) (tp k)")
    assert counting_bound(*args) == 2
    p = mc.plan(*args)
    assert max(p.lower_bound_bytes) == 8 <= max(p.recv_bytes)
    # with no idle rank the refinement changes nothing: a plain reduce_scatter's bound
    assert counting_bound(mc.Mesh("tp=4"), (8,), "i | sum(tp)", "(tp i)") == 6
