"""The planner's cost (issue 39): a latency per round, direct delivery of partials to their
owners, ties of time broken toward the least-receiving busiest rank, and size-1 reductions
counted as nothing in the bound. Every plan here also runs exactly in simulation."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan import _check_exact

import meshcomm as mc
from meshcomm.planner import search
from meshcomm.planner.states import from_layout
from meshcomm.testing import partial_transition

# Bytes decide (no latency per round), as the default cost model did before it had a latency.
BYTES_ONLY = mc.CostModel(latency_s=0.0)
DEFAULTS = (mc.CostModel(), mc.CostModel(backend="gloo"))


def _ints(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("spec, shape, src, dst, rounds", [
    ("r=8", (12, 5), "a b | sum(r)", "(r a) b", 7),     # the 42-50 ms against 27 ms
    ("r=4", (6, 10), "a b | sum(r)", "a (r b)", 3),
])
def test_a_tree_whose_bytes_do_not_pay_for_its_rounds_loses_to_one_collective(
        spec: str, shape: tuple[int, ...], src: str, dst: str, rounds: int) -> None:
    """On bytes alone these reach the bound with a tree of several all_to_alls; each round
    costs a latency in the default models (NCCL's and gloo's figures), and the few bytes the
    tree saves do not pay for them: one reduce_scatter, as DTensor runs."""
    mesh = mc.Mesh(spec)
    tree = mc.plan(mesh, shape, src, dst, cost_model=BYTES_ONLY)
    [step] = tree.steps
    assert step.action == "tree" and step.rounds == rounds
    assert max(tree.recv_bytes) == max(tree.lower_bound_bytes)
    for cm in DEFAULTS:
        p = mc.plan(mesh, shape, src, dst, cost_model=cm)
        assert [s.kind for s in p.steps] == ["reduce_scatter"], str(p)
        saved = max(max(p.send_bytes), max(p.recv_bytes)) - max(
            max(tree.send_bytes), max(tree.recv_bytes))
        assert (rounds - 1) * cm.time(("r",), 0) > saved / cm.bandwidth_of("r")
        _check_exact(p, _ints(shape))


def test_a_latency_still_takes_a_tree_where_its_bytes_pay_for_its_rounds() -> None:
    """The same (12, 5) tensor, with a latency small enough that the 68 B the tree saves at
    the busiest rank pay for its 6 extra rounds: the tree at the bound."""
    mesh = mc.Mesh("r=8")
    cm = mc.CostModel(latency_s=1e-12, bandwidth=100e9)   # 6 rounds: 6 ps < 68 B: 680 ps
    p = mc.plan(mesh, (12, 5), "a b | sum(r)", "(r a) b", cost_model=cm)
    assert [s.action for s in p.steps] == ["tree"]
    assert max(p.recv_bytes) == max(p.lower_bound_bytes) == 212
    _check_exact(p, _ints((12, 5)))


def test_partials_go_straight_to_their_owners() -> None:
    """The issue's case: the planner reduced among the holders first (a reduce_scatter, then a
    send_recv: 320 B received at the busiest rank); each rank can take its block's three
    partials straight from their holders, 144 B, the bound, in one step. On bytes alone both
    take the same time (416 B sent at the busiest rank), and the tie goes to the one that
    receives less."""
    mesh, shape = mc.Mesh("pp=3 sp=3 dp=3"), (3, 54)
    src, dst = "(dp pp a) b | sum(sp)", "(a x1=3) (pp b dp sp)"
    for cm in (*DEFAULTS, BYTES_ONLY):
        p = mc.plan(mesh, shape, src, dst, dtype=torch.float64, cost_model=cm)
        [step] = p.steps
        assert step.action == "direct" and step.op == "sum", str(p)
        assert max(p.recv_bytes) == max(p.lower_bound_bytes) == 144
        assert max(p.send_bytes) == 416
        assert "partials to their owners, as all_to_all" in str(p)
        _check_exact(p, _ints(shape, torch.float64))


@pytest.mark.parametrize("spec, shape, src, dst", [
    ("a=2 b=2 c=2", (6, 10), "(b i) j | sum(c)", "(a i) (b j)"),   # [R, S0, P] -> [S0, S1, R]
    ("a=2 b=2 c=2", (8, 8), "(b i) j | sum(a)", "(c i) (a j)"),
    ("a=2 b=3 c=2", (4, 4), "(a i) j | avg(b, c)", "(c i) j"),
    ("dp=2 tp=4", (5, 3), "i (dp j) | max(tp)", "(tp i) j"),
])
def test_direct_delivery_is_exact(spec: str, shape: tuple[int, ...], src: str,
                                  dst: str) -> None:
    p = mc.plan(mc.Mesh(spec), shape, src, dst)
    assert [s.action for s in p.steps] == ["direct"], str(p)
    _check_exact(p, _ints(shape))


def test_size_one_reductions_count_as_nothing_in_the_bound() -> None:
    """A pending sum over an axis of size 1 is already its result: nothing to receive, so
    the bound is 0 B (it was 8 B between meshes, and the plan read 0.00x of it)."""
    src_mesh, dst_mesh = mc.Mesh("tp=2 sp=1"), mc.Mesh("tp=2")
    p = mc.plan(src_mesh, (4,), "a | sum(sp)", "(tp a)", dst_mesh=dst_mesh)
    assert max(p.recv_bytes) == 0 and max(p.lower_bound_bytes) == 0
    assert p.bound_ratio == 1.0 and "1.00x of the lower bound (0 B)" in str(p)
    # the same on one mesh, and a bound that counts where a size-1 reduction moves data
    assert max(mc.plan(src_mesh, (4,), "a | sum(sp)", "(tp a)").lower_bound_bytes) == 0
    moved = mc.plan(src_mesh, (4, 6), "a b | sum(sp)", "(tp a) b",
                    dst_mesh=mc.Mesh("tp=2", ranks=[2, 3]))
    assert max(moved.recv_bytes) == max(moved.lower_bound_bytes) == 48


def test_each_backend_has_its_figures() -> None:
    """`CostModel(backend=...)` takes that backend's latency and bandwidth where none is
    given; neither prints times; an unknown backend is refused."""
    nccl, gloo = DEFAULTS
    assert nccl == mc.CostModel(backend="nccl") and nccl.time(("r",), 0) == 10e-6
    assert gloo.time(("r",), 0) > nccl.time(("r",), 0)
    assert gloo.bandwidth_of("r") < nccl.bandwidth_of("r")
    assert not nccl.models_time and not gloo.models_time
    assert mc.CostModel(backend="gloo", latency_s=1e-3).bandwidth_of("r") == gloo.bandwidth_of("r")
    with pytest.raises(mc.errors.PlanError, match="backends are nccl, gloo"):
        mc.CostModel(backend="mpi")


def test_a_tie_of_time_goes_to_the_least_receiving_busiest_rank() -> None:
    """Two plans, equal in time on bytes alone (4 B at the busiest rank of each of two
    steps): a send_recv to ranks 1 and 5, then an all_reduce among ranks 0, 1, 4, 5, loads
    ranks 1 and 5 twice (8 B in all); the all_reduce among ranks 0 and 4 first, then the
    send_recv, 4 B. The sum of each step's busiest rank, the tie-break before, is 8 B for
    both and kept the first."""
    mesh = mc.Mesh("a=2 b=2 c=2")
    p = mc.plan(mesh, (1,), "(c b i) | sum(a)", "i | sum(b)", cost_model=BYTES_ONLY)
    assert p.cost == pytest.approx(8 / 100e9)
    assert max(p.recv_bytes) == 4, str(p)
    assert [s.kind for s in p.steps] == ["all_reduce", "send_recv", "local"]
    _check_exact(p, _ints((1,)))


# -- the tie-break, against the paths the search considers ----------------------------------
SMALL_MESHES = ("a=2 b=2", "dp=2 tp=3", "a=2 b=2 c=2", "x=4", "dp=2 tp=4")


def _considered(p: mc.Plan, cm: mc.CostModel) -> list[search.Key]:
    """The keys of every path of one or two moves the search considers from `p.src` to
    `p.dst` (each move priced exactly)."""
    mesh, shape = p.mesh, p.shape
    start, goal = from_layout(p.src, mesh, shape), from_layout(p.dst, mesh, shape)
    itemsize = p.dtype.itemsize
    keys = []
    for first in search.exact_moves(start, goal, mesh, cm):
        if first.after == goal:
            keys.append(search.path_key(start, (first,), mesh, itemsize, cm))
            continue
        for second in search.exact_moves(first.after, goal, mesh, cm):
            if second.after == goal:
                keys.append(search.path_key(start, (first, second), mesh, itemsize, cm))
    return keys


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([BYTES_ONLY, *DEFAULTS]))
def test_the_least_time_plan_has_the_least_busiest_rank_receive(seed: int, even: bool,
                                                                 cm: mc.CostModel) -> None:
    """Among the plans of one or two moves that the search considers, none takes less time
    than the plan it returns, and none of equal time has a busiest rank that receives less
    (the per-rank totals over the steps; `search.path_key` is the search's own key)."""
    mesh, shape, src, dst = partial_transition(random.Random(seed), even, SMALL_MESHES)
    if even:
        shape = tuple(max(1, n // 8) for n in shape)    # 8 to 24: the brute force stays small
    try:
        p = mc.plan(mesh, shape, src, dst, cost_model=cm)
    except mc.errors.ShapeError:
        return
    keys = _considered(p, cm)
    assert keys, f"no path of two moves from {src} to {dst}"
    least = min(k[0][0] for k in keys)
    assert p.cost <= least * (1 + 1e-9), str(p)
    ties = [k[0][1] for k in keys if math.isclose(k[0][0], p.cost, rel_tol=1e-9)]
    assert all(max(p.recv_bytes) <= got for got in ties), (str(p), ties)
    _check_exact(p, _ints(shape))
