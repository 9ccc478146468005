"""`mc.nn.attention` with the sequence split over mesh axes, on 4 and 8 gloo ranks, in
float64: every strategy's output and the gradients of q, k and v equal one process's
attention (relative error <= 1e-10), for causal, full, sliding-window and document masks,
contiguous "(cp s)", striped "(s cp)" and zigzag "zigzag(cp s)" splits, even and uneven
sequences, MHA and GQA; the sequence over one axis, and over two (the hybrid strategy:
all_to_all on one, the ring on the other).
One spawn per world size runs every case; it also measures the ring's bytes on the wire
against its `Cost`, and (4 ranks) the ring's overlap of a slow wire with slow blocks.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import ShapeError
from meshcomm.executors.distributed import wire
from meshcomm.executors.sim import scatter
from meshcomm.nn.attention import STRATEGIES, Mask, attention, attention_costs, reference
from meshcomm.nn.attention import ring as ring_module
from meshcomm.runtime.bind import BoundMesh
from meshcomm.runtime.collectives import post_shift

from conftest import ranks_fixture, slow_wire

MASKS = [(False, None, False), (True, None, False), (True, 5, False), (False, 4, False),
         (True, None, True), (False, 3, True)]          # (causal, window, documents)
SHAPES = {"(cp s)": [(16, 4, 4), (13, 4, 2), (16, 2, 1), (7, 8, 8)],   # (seq, heads, kv heads)
          "(s cp)": [(16, 4, 4), (16, 2, 1), (8, 8, 2)],
          "zigzag(cp s)": [(16, 4, 4), (13, 4, 2), (16, 2, 1), (7, 8, 8)]}


# the sequence over two axes ("cq" then "cr"): every strategy, the hybrid too (all_to_all
# over cq, the ring over cr)
TWO_AXES = {"(cp s)": [(16, 4, 2), (13, 8, 8)], "(s cp)": [(16, 4, 4)],
            "zigzag(cp s)": [(16, 4, 2), (11, 2, 1)]}


def two_axis_cases(world: int) -> list[tuple[Any, ...]]:
    out = []
    for strategy, seq in itertools.product(sorted(STRATEGIES), TWO_AXES):
        for (causal, window, docs), (s, h, hk) in itertools.product(MASKS[1::2], TWO_AXES[seq]):
            if seq == "(s cp)" and s % world:
                continue
            out.append((strategy, seq, causal, window, docs, s, h, hk))
    return out


def cases(world: int) -> list[tuple[Any, ...]]:
    out = []
    for strategy, seq in itertools.product(sorted(set(STRATEGIES) - {"hybrid"}), SHAPES):
        for (causal, window, docs), (s, h, hk) in itertools.product(MASKS, SHAPES[seq]):
            if seq == "(s cp)" and s % world:
                continue
            out.append((strategy, seq, causal, window, docs, s, h, hk))
    return out


def _inputs(s: int, h: int, hk: int, docs: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(s * 100 + h * 10 + hk)
    b, d = 2, 8
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, s, d, generator=g, dtype=torch.float64)
    doc = torch.randint(0, 3, (b, s), generator=g).sort(dim=1).values
    return q, k, v, doc


def run_case(bound: BoundMesh, strategy: str, seq: str, causal: bool, window: int | None,
             docs: bool, s: int, h: int, hk: int) -> float:
    """The largest relative error of output, dq, dk, dv on this rank."""
    axes = " ".join(a for a in bound.mesh.axis_names if a != "x")   # x: a spare size-1 axis
    layout = f"b h {seq.replace('cp', axes)} d"
    q, k, v, doc = _inputs(s, h, hk, docs)
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(rq, rk, rv, Mask(causal, window), doc=doc if docs else None)
    (ref * ref.detach().cos()).sum().backward()
    mesh, rank = bound.mesh, bound.rank
    lq, lk, lv = (scatter(t, mesh, layout)[rank].clone().requires_grad_() for t in (q, k, v))
    ldoc = scatter(doc, mesh, f"b {seq.replace('cp', axes)}")[rank] if docs else None
    out = attention(lq, lk, lv, bound, layout, causal=causal, window=window,
                    document_ids=ldoc, strategy=strategy, shape=q.shape, kv_shape=k.shape)
    want_out = scatter(ref.detach(), mesh, layout)[rank]
    (out * want_out.cos()).sum().backward()
    worst = 0.0
    for got, want in ((out, ref), (lq.grad, rq.grad), (lk.grad, rk.grad), (lv.grad, rv.grad)):
        w = scatter(want.detach(), mesh, layout)[rank]
        assert got is not None and got.shape == w.shape, (got, w.shape)
        if w.numel() == 0:         # a rank with no tokens (7 over 8 ranks)
            continue
        # relative to the whole tensor's scale: a rank's part may be exactly 0 (striped and
        # causal, rank 0's one query sees one key: dq = 0), where rounding is all there is
        scale = want.detach().abs().max().clamp_min(1e-30)
        worst = max(worst, ((got.detach() - w).abs().max() / scale).item())
    return worst


def on_the_wire(bound: BoundMesh, strategy: str = "ring",
                layout: str = "b h (cp s) d") -> dict[str, Any]:
    """A strategy's bytes and calls on this rank, forward and backward, measured by the
    wire, and its `Cost`: uneven (13 tokens), GQA, causal (the ring's skipped blocks still
    travel)."""
    q, k, v, _ = _inputs(13, 4, 2, False)
    lq, lk, lv = (scatter(t, bound.mesh, layout)[bound.rank].clone().requires_grad_()
                  for t in (q, k, v))
    with wire.recording() as heard:
        attention(lq, lk, lv, bound, layout, causal=True, strategy=strategy, shape=q.shape,
                  kv_shape=k.shape).sum().backward()
    cost = next(c for c in attention_costs(lq, lk, lv, bound, layout, shape=q.shape,
                                           kv_shape=k.shape) if c.strategy == strategy)
    return {"measured": (sum(w.sent * size for w, size in heard), len(heard),
                         sorted({w.kind for w, _ in heard})),
            "cost": (cost.sent_bytes, cost.calls)}


DELAY_S = 0.2       # the slow wire: a message lands this long after it is posted
COMPUTE_S = 0.2     # each block's attention, made this slow


def check_ring_overlap(bound: BoundMesh) -> dict[str, float]:
    """The ring's forward on 4 ranks (every block computed: no mask) with every message
    landing DELAY_S after it is posted and every block taking COMPUTE_S. Serial (a shift
    posted and waited, then the block) takes 3 (delay + compute) + compute = 1.4 s; the
    ring posts the next block before computing this one: about 3 max + compute = 0.8 s.
    `slow_wire` delays the functional collectives and the point-to-point batches."""
    layout = "b h (cp s) d"
    q, k, v, _ = _inputs(16, 4, 4, False)
    lq, lk, lv = (scatter(t, bound.mesh, layout)[bound.rank] for t in (q, k, v))
    mp = pytest.MonkeyPatch()
    block = ring_module.block

    def slow_block(*args: Any) -> Any:
        time.sleep(COMPUTE_S)
        return block(*args)
    try:
        slow_wire(mp, DELAY_S)
        mp.setattr(ring_module, "block", slow_block)
        kv = torch.stack([lk, lv])
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(3):
            kv = post_shift(kv, bound, "cp").wait()
            slow_block(lq, kv[0], kv[1], None, 1.0)
        slow_block(lq, kv[0], kv[1], None, 1.0)
        serial = time.perf_counter() - start
        torch.distributed.barrier()
        start = time.perf_counter()
        attention(lq, lk, lv, bound, layout, strategy="ring")
        ring = time.perf_counter() - start
    finally:
        mp.undo()
    return {"serial": serial, "ring": ring}


def all_cases(rank: int, world: int) -> list[Any]:
    bound = mc.init_mesh(f"cp={world}")
    unnamed = mc.init_mesh(mc.Mesh(f"d0={world}"))       # an unnamed-style axis name
    out: list[Any] = []
    for c in cases(world):
        out.append(run_case(bound, *c))
    two = mc.init_mesh(f"x=1 cq=2 cr={world // 2}")
    for c in two_axis_cases(world):
        out.append(run_case(two, *c))
    out.append(run_case(unnamed, "allgather", "(cp s)", True, None, False, 13, 4, 2))
    costs = attention_costs(*(torch.zeros(2, 4, 16 // world, 8) for _ in range(3)), bound,
                            "b h (cp s) d")
    out.append({"costs": {c.strategy: (c.sent_bytes, c.extra_bytes, c.calls) for c in costs},
                "ring": on_the_wire(bound),
                "hybrid": on_the_wire(two, "hybrid", "b h (cq cr s) d"),
                "overlap": check_ring_overlap(bound) if world == 4 else None})
    return out


four = ranks_fixture(all_cases, 4)
eight = ranks_fixture(all_cases, 8)


@pytest.mark.parametrize("world", [4, 8])
def test_every_strategy_equals_one_process(world: int, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue("four" if world == 4 else "eight")
    names = (cases(world) + [("on two axes", *c) for c in two_axis_cases(world)]
             + [("allgather on d0", "(cp s)", True, None, False, 13, 4, 2)])
    bad = [(c, max(r[i] for r in results)) for i, c in enumerate(names)
           if max(r[i] for r in results) > 1e-10]
    assert not bad, bad[:5]
    assert len(names) > 50


def test_costs_come_from_the_plans(four: list[Any]) -> None:
    """Even split over cp=4, (2, 4, 16, 8) float32: allgather sends its K and V block to 3
    peers forward and reduce-scatters dK, dV back; ulysses moves 3/4 of q, k, v, out each
    way; ring passes K and V on 3 times forward and 3 backward, and dK, dV 4 times, in
    3 + 5 p2p batches (backward: a block and the buffer of the step before in one message,
    and the last buffer's hop home), holding two K/V blocks and two dK/dV buffers."""
    costs = four[0][-1]["costs"]
    block = 2 * 4 * 4 * 8 * 4                      # one rank's K block, bytes
    assert costs["allgather"][0] == 2 * 2 * 3 * block
    assert costs["ulysses"][0] == 2 * 4 * 3 * block // 4 * 1
    assert costs["allgather"][1] == 2 * 4 * block        # the whole K and V
    assert costs["ring"] == (2 * (3 + 3 + 4) * block, 2 * 2 * 2 * block, 3 + 5)


@pytest.mark.parametrize("world", [4, 8])
def test_ring_sends_what_its_cost_says(world: int, request: pytest.FixtureRequest) -> None:
    """Measured by the wire on every rank (uneven blocks: rank 3 of 4 holds 1 token, rank 7
    of 8 none): bytes and batches equal the ring's Cost, all point to point."""
    results = request.getfixturevalue("four" if world == 4 else "eight")
    for r in results:
        got = r[-1]["ring"]
        assert got["measured"] == (*got["cost"], ["p2p"]), got


@pytest.mark.parametrize("world", [4, 8])
def test_the_hybrid_sends_what_its_cost_says(world: int, request: pytest.FixtureRequest
                                             ) -> None:
    """On cq=2 x cr=world/2: the all_to_alls over cq (q, k, v and the output, each way)
    and the ring's point-to-point batches over cr, as the hybrid's Cost counts them."""
    results = request.getfixturevalue("four" if world == 4 else "eight")
    for r in results:
        got = r[-1]["hybrid"]
        assert got["measured"][:2] == got["cost"], got
        assert set(got["measured"][2]) <= {"p2p", "all_to_all"}, got


def test_ring_overlaps_a_slow_wire_with_its_blocks(four: list[Any]) -> None:
    """Serial: 3 (delay + compute) + compute = 1.4 s; the ring: about 3 max + compute."""
    for r in four:
        timing = r[-1]["overlap"]
        assert timing["serial"] >= (3 * (DELAY_S + COMPUTE_S) + COMPUTE_S) * 0.95, timing
        assert timing["ring"] < 0.75 * timing["serial"], timing


def test_bad_arguments_raise_before_any_communication() -> None:
    bound = BoundMesh(mc.Mesh("cp=4"), "gloo", torch.device("cpu"), 1, {})
    q = torch.zeros(2, 4, 4, 8)
    with pytest.raises(ShapeError, match='no dim named "s"'):
        attention(q, q, q, bound, "b h (cp t) d")
    with pytest.raises(ShapeError, match="not a multiple of 3 key/value heads"):
        attention(q, torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, 8), bound, "b h (cp s) d")
    with pytest.raises(ShapeError, match="strategy='nope'"):
        attention(q, q, q, bound, "b h (cp s) d", strategy="nope")
    with pytest.raises(ShapeError, match="hybrid needs two or more axes"):
        attention(q, q, q, bound, "b h (cp s) d", strategy="hybrid")
    assert "hybrid" not in {c.strategy for c in attention_costs(q, q, q, bound, "b h (cp s) d")}
    with pytest.raises(ShapeError, match="must both be zigzag or neither"):
        attention(q, q, q, bound, "b h zigzag(cp s) d", kv_layout="b h (cp s) d")
    with pytest.raises(ValueError, match="window=0"):
        attention(q, q, q, bound, "b h (cp s) d", window=0)
