"""The planner's cheap paths change no plan: a step priced at a floor first (an uneven
all_gather the search may never pop) keys no higher than its exact price, prices to what
the general formula gives, and plans come out the same as with every such step priced
up front."""

from __future__ import annotations

import random
import sys

import pytest

import meshcomm as mc
from meshcomm.planner import moves
from meshcomm.planner.search import exact_moves, path_key
from meshcomm.planner.states import from_layout, local_numels_tensor
from meshcomm.planner.traffic import gather_traffic
from meshcomm.testing import random_layout

MESHES = ("dp=4", "dp=3 tp=5", "dp=2 cp=3 tp=4", "dp=16 tp=16", "pp=4 dp=8 tp=8",
          "dp=32 tp=32")
SIZES = (1, 3, 7, 13, 64, 97, 1000, 50257)
COST = mc.CostModel()


def _clear_caches() -> None:
    for name, module in list(sys.modules.items()):
        if not name.startswith("meshcomm") or module is None:
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and not isinstance(value, type):
                value.cache_clear()
    sys.modules["meshcomm.planner.plan"].clear_memos()


def _uneven(seed: int, count: int) -> list[tuple[mc.Mesh, tuple[int, ...], str, str]]:
    """`count` transitions from a layout with an uneven dim, on `MESHES`."""
    rng = random.Random(seed)
    out: list[tuple[mc.Mesh, tuple[int, ...], str, str]] = []
    while len(out) < count:
        mesh = mc.Mesh(rng.choice(MESHES))
        shape = tuple(rng.choice(SIZES) for _ in range(rng.randint(1, 3)))
        src = random_layout(rng, mesh, len(shape), ("sum",), name_inside=0.3)
        dst = random_layout(rng, mesh, len(shape), ("sum",), name_inside=0.3)
        try:
            state = from_layout(mc.Layout(src), mesh, shape)
            from_layout(mc.Layout(dst), mesh, shape)
        except mc.errors.MeshcommError:
            continue
        if any(d.chunks for d in state.dims) and src != dst:
            out.append((mesh, shape, src, dst))
    return out


def test_an_uneven_gather_is_a_floor_of_its_exact_price() -> None:
    floors = 0
    for mesh, shape, src, dst in _uneven(0, 120):
        state = from_layout(mc.Layout(src), mesh, shape)
        goal = from_layout(mc.Layout(dst), mesh, shape)
        for move in moves.gathers(state, goal, mesh):
            if move.dim is None:
                continue
            exact = moves.chunk_gather(state, move.dim, mesh)
            axis = state.dims[move.dim].chunks[-1]
            assert (exact.send, exact.recv) == gather_traffic(
                mesh, (axis,), None, local_numels_tensor(state, mesh))
            assert exact.after == move.after and not exact.estimate
            if not move.estimate:
                assert move == exact
                continue
            floors += 1
            assert 0 < move.least <= max(max(exact.send), max(exact.recv))
            for itemsize in (1, 4):
                low = path_key(state, (move,), mesh, itemsize, COST)
                assert low <= path_key(state, (exact,), mesh, itemsize, COST), (src, dst)
            assert exact in exact_moves(state, goal, mesh, COST)
    assert floors >= 20, f"only {floors} gathers were priced at a floor"


def test_v1024_never_prices_the_gather_it_does_not_take(monkeypatch) -> None:
    # benchmarks/plan_scale.py's v1024: one send_recv; the uneven all_gather stays a floor
    priced = []
    exact = moves.chunk_gather
    monkeypatch.setattr(sys.modules["meshcomm.planner.search"], "chunk_gather",
                        lambda *a, **k: priced.append(a) or exact(*a, **k))
    _clear_caches()
    p = mc.plan(mc.Mesh("dp=32 tp=32"), (50257, 4096), "(tp v) h", "v (tp h)")
    assert [s.kind for s in p.steps] == ["send_recv"] and priced == []
    _clear_caches()   # g1024: both gathers taken, the first priced when popped
    p = mc.plan(mc.Mesh("dp=32 tp=32"), (50257, 4096), "(dp tp v) h", "v h")
    assert [(s.kind, s.axes) for s in p.steps] == [("all_gather", ("tp",)),
                                                    ("all_gather", ("dp",))]
    assert len(priced) == 1


@pytest.mark.parametrize("seed", range(3))
def test_plans_as_with_every_gather_priced_up_front(seed: int, monkeypatch) -> None:
    cases = _uneven(100 + seed, 40)
    floored = []
    for mesh, shape, src, dst in cases:
        _clear_caches()
        floored.append(mc.plan(mesh, shape, src, dst))
    exact = moves.chunk_gather
    monkeypatch.setattr(moves, "chunk_gather",
                        lambda state, d, mesh, **_: exact(state, d, mesh))
    for (mesh, shape, src, dst), want in zip(cases, floored):
        _clear_caches()
        got = mc.plan(mesh, shape, src, dst)
        assert str(got) == str(want) and got.steps == want.steps, (mesh, shape, src, dst)
        assert (got.send_bytes, got.recv_bytes, got.peak_bytes) == (
            want.send_bytes, want.recv_bytes, want.peak_bytes)


def test_off_diagonal_by_repetition_as_by_tensors() -> None:
    from meshcomm.planner import traffic
    rng = random.Random(7)
    for spec in ("dp=4 tp=4", "pp=2 dp=3 cp=5 tp=3", "a=2 b=3 c=2 d=3", "dp=32 tp=32", "x=4"):
        mesh = mc.Mesh(spec)
        for a in mesh.axis_names:
            # one axis with itself: every rank's two coordinates agree, it keeps all
            assert traffic.off_diagonal(mesh, (3,) * mesh.size, a, a) == (0,) * mesh.size
            for b in mesh.axis_names:
                if a == b:
                    continue
                n = rng.randint(1, 9)
                uneven = tuple(n + (r % 3) for r in range(mesh.size))
                with_tensors = traffic.off_diagonal(mesh, uneven, a, b)   # ranks differ
                laid = traffic.off_diagonal(mesh, (n,) * mesh.size, a, b)
                assert laid == tuple(0 if k == 0 else n for k in with_tensors), (spec, a, b)
                assert 0 < laid.count(0) < mesh.size


def test_peaks_laid_out_per_block_as_by_tensors() -> None:
    from meshcomm.planner import search
    laid = 0
    for mesh, shape, src, dst in _uneven(3, 80):
        state = from_layout(mc.Layout(src), mesh, shape)
        goal = from_layout(mc.Layout(dst), mesh, shape)
        for move in exact_moves(state, goal, mesh, COST):
            for itemsize, held in ((4, 0), (2, 12)):
                got = search._laid_live(move, state, mesh, itemsize, held)
                if got is None:
                    continue
                laid += 1
                want = search._per_rank(search._live(move, state, mesh) * itemsize + held, mesh)
                assert got == want, (src, dst, move.kind, move.action)
    assert laid >= 30, f"only {laid} steps took the laid-out path"


def test_a_replicated_destination_counts_without_tensors() -> None:
    """Toward a destination every rank holds whole (no sharded dim), what a rank lacks
    (`bounds.missing`) and what it sends in a send_recv (`transfers.pair_sent`) come from its
    own block's size alone: the same as the block-table counts, on even and uneven
    sources, pending sums, and meshes with size-1 axes."""
    from meshcomm.planner import blocks, bounds, transfers
    checked = 0
    for mesh, shape, src, _ in _uneven(5, 60) + _even(6, 40):
        state = from_layout(mc.Layout(src), mesh, shape)
        names = " ".join(f"d{i}" for i in range(len(shape)))
        goal = from_layout(mc.Layout(names), mesh, shape)
        own, need = blocks.own_and_need(state, goal, mesh)
        assert bounds.missing(state, goal, mesh) == tuple((need - own).tolist())
        tables = blocks.summed_overlap(state, goal, mesh, bounds.sharding_axes(state),
                                       in_need=True) - own
        assert transfers.pair_sent(state, goal, mesh) == tuple(tables.tolist()), (mesh, src)
        checked += 1
    assert checked == 100


def _even(seed: int, count: int) -> list[tuple[mc.Mesh, tuple[int, ...], str, str]]:
    """`count` layouts with no uneven dim, on `MESHES` (the dst is unused)."""
    rng = random.Random(seed)
    out: list[tuple[mc.Mesh, tuple[int, ...], str, str]] = []
    while len(out) < count:
        mesh = mc.Mesh(rng.choice(MESHES))
        shape = tuple(rng.choice((8, 16, 24, 48)) for _ in range(rng.randint(1, 3)))
        src = random_layout(rng, mesh, len(shape), ("sum",), name_inside=0.3)
        try:
            state = from_layout(mc.Layout(src), mesh, shape)
        except mc.errors.MeshcommError:
            continue
        if not any(d.chunks for d in state.dims):
            out.append((mesh, shape, src, src))
    return out
