"""`mc.nn.attention`'s automatic pick, from the strategies' figures alone (nothing runs): the
least modelled time (links from a `CostModel`, blocks from a FLOP rate), under a memory
budget the least among those that fit; `attention_explain` marks that pick."""

from __future__ import annotations

import re

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import PlanError, ShapeError
from meshcomm.nn.attention import Cost, Mask, pick
from meshcomm.nn.attention.call import Call, resolve
from meshcomm.nn.attention.timing import CPU_KEY_TILE, causal_pairs, key_tile
from meshcomm.runtime.bind import BoundMesh

BOUND = BoundMesh(mc.Mesh("cp=4"), "gloo", torch.device("cpu"), 1, {})
SLOW_LINK = mc.CostModel(latency_s=1e-3, bandwidth=1e6)      # 1 MB/s: bytes decide
FAST_LINK = mc.CostModel(latency_s=1e-6, bandwidth=100e9)


def _call(seq: int = 64, heads: int = 8, kv_heads: int | None = None,
          causal: bool = True) -> Call:
    q = torch.zeros(1, heads, seq // 4, 16)
    k = torch.zeros(1, kv_heads or heads, seq // 4, 16)
    return resolve(q, k, k, BOUND, "b h (cp s) d", None, "b h s d", None, None,
                   Mask(causal), None)


def _costs(seq: int = 64, heads: int = 8, kv_heads: int | None = None, causal: bool = True,
           **kw: object) -> dict[str, Cost]:
    q = torch.zeros(1, heads, seq // 4, 16)
    k = torch.zeros(1, kv_heads or heads, seq // 4, 16)
    return {c.strategy: c for c in mc.nn.attention_costs(q, k, k, BOUND, "b h (cp s) d",
                                                         causal=causal, **kw)}


def _least(costs: list[Cost]) -> str:
    return min(costs, key=lambda c: (c.time_s, c.sent_bytes, c.extra_bytes)).strategy


def test_auto_picks_the_least_modelled_time_then_what_fits_the_budget() -> None:
    call, costs = _call(), _costs()
    assert pick(call, torch.float32) == _least(list(costs.values()))
    budget = min(c.extra_bytes for c in costs.values())
    assert pick(call, torch.float32, budget) == _least(
        [c for c in costs.values() if c.extra_bytes <= budget])
    with pytest.raises(ShapeError, match="no strategy fits"):
        pick(call, torch.float32, budget - 1)


def test_a_slow_link_picks_the_fewest_bytes() -> None:
    """At 1 MB/s the messages dwarf the math: MHA sends least by ulysses, GQA (2 key heads
    of 8) least by allgather (ulysses would repeat the key heads first)."""
    for kv_heads, fewest in ((None, "ulysses"), (2, "allgather")):
        costs = _costs(kv_heads=kv_heads, cost_model=SLOW_LINK, flops=1e15)
        assert min(costs.values(), key=lambda c: c.sent_bytes).strategy == fewest
        assert pick(_call(kv_heads=kv_heads), torch.float32, None, SLOW_LINK, 1e15) == fewest


def test_slow_math_lets_the_ring_hide_its_messages() -> None:
    """At 1 GFLOP/s and no mask every strategy computes the same pairs; the ring overlaps
    its messages with them, the others wait for theirs, so the ring is fastest though it
    sends the most bytes."""
    costs = _costs(seq=1024, causal=False, cost_model=FAST_LINK, flops=1e9)
    ring = costs["ring"]
    assert ring.sent_bytes == max(c.sent_bytes for c in costs.values())
    for name in ("allgather", "ulysses"):
        assert ring.compute_s == pytest.approx(costs[name].compute_s)
    assert ring.comm_s < ring.compute_s and ring.time_s < ring.compute_s + ring.comm_s
    full = _call(seq=1024, causal=False)
    assert pick(full, torch.float32, None, FAST_LINK, 1e9) == "ring"
    # the same shapes on a slow link: the bytes decide again
    assert pick(full, torch.float32, None, SLOW_LINK, 1e9) == "ulysses"


def test_causal_work_is_counted_as_the_kernel_runs_it() -> None:
    """Causal over a contiguous split on CPU: the ring's and allgather's slowest rank (the
    last) computes cp - 1 whole blocks and its own causal triangle of 256, which the fused
    CPU kernel runs as the whole square (its key tiles are 512 wide); Ulysses one causal
    triangle over the whole sequence for a quarter of the heads, three quarters of its
    square (query tiles below 512 run one key tile, the others two): 0.1875 against 0.25
    of the sequence's pairs per head."""
    costs = _costs(seq=1024, cost_model=FAST_LINK, flops=1e9)
    assert costs["ring"].compute_s == pytest.approx(costs["allgather"].compute_s)
    n, cp = 1024, 4
    block = n // cp
    last = (cp - 1) * block * block + block * block
    whole = 3 * n * n // 4 // cp
    assert costs["ulysses"].compute_s / costs["ring"].compute_s == pytest.approx(whole / last)
    assert pick(_call(seq=1024), torch.float32, None, FAST_LINK, 1e9) == "ulysses"


@pytest.mark.parametrize(("n", "tile", "want"), [
    (4, 1, 10), (1024, 1, 1024 * 1025 // 2),          # a kernel skipping by element: half
    (100, CPU_KEY_TILE, 100 * 100), (512, CPU_KEY_TILE, 512 * 512),   # one key tile: square
    (1024, CPU_KEY_TILE, 3 * 1024 * 1024 // 4),        # 256-query tiles: 512, 512, 1024, 1024
    (2048, CPU_KEY_TILE, 5 * 2048 * 2048 // 8),        # keys 512 .. 2048 by tile: 5/8
    (600, CPU_KEY_TILE, 512 * 512 + 88 * 600),         # 64-query tiles: 8 of 512, then 600
])
def test_a_causal_triangle_counts_the_key_tiles_its_kernel_runs(n: int, tile: int,
                                                                want: int) -> None:
    assert causal_pairs(n, tile) == want


def test_the_cpu_kernel_has_key_tiles_an_accelerator_does_not() -> None:
    assert key_tile(torch.device("cpu")) == CPU_KEY_TILE
    assert key_tile(torch.device("meta")) == 1


def test_each_wire_takes_its_own_figures() -> None:
    """Axes at 1 ms a hop; all_to_all at 1 µs and the ring's point-to-point shifts free:
    allgather's four collectives pay 3 ms each, Ulysses' eight all_to_alls (q, k, v and
    the output, each way) 3 µs each, the ring nothing; so the wires' figures decide."""
    slow = mc.CostModel(latency_s=1e-3, bandwidth=1e30)
    cm = mc.CostModel(latency_s=1e-3, bandwidth=1e30,
                      wires={"all_to_all": (1e-6, 1e30), "p2p": (0.0, 1e30)})
    costs, before = _costs(cost_model=cm, flops=1e30), _costs(cost_model=slow, flops=1e30)
    assert costs["allgather"].comm_s == pytest.approx(4 * 3 * 1e-3)
    assert costs["ulysses"].comm_s == pytest.approx(8 * 3 * 1e-6)
    assert before["ulysses"].comm_s == pytest.approx(8 * 3 * 1e-3)
    assert costs["ring"].comm_s == pytest.approx(0.0, abs=1e-12)
    assert before["ring"].comm_s == pytest.approx(8 * 1e-3)      # one latency a message
    assert pick(_call(), torch.float32, None, slow, 1e30) == "ring"
    gathers = mc.CostModel(latency_s=1e-3, bandwidth=1e30, wires={
        "all_gather": (1e-7, 1e30), "reduce_scatter": (1e-7, 1e30)})
    assert pick(_call(), torch.float32, None, gathers, 1e30) == "allgather"


def test_a_cost_model_s_wires_are_canonical_and_checked() -> None:
    a = mc.CostModel(latency_s=1e-3, wires={"p2p": (1e-4, 2e9), "all_to_all": (1e-5, 1e9)})
    b = mc.CostModel(latency_s=1e-3, wires=(("all_to_all", 1e-5, 1e9), ("p2p", 1e-4, 2e9)))
    assert a == b and hash(a) == hash(b) and a != mc.CostModel(latency_s=1e-3)
    assert a.wires == (("all_to_all", 1e-5, 1e9), ("p2p", 1e-4, 2e9))
    assert a.time(("cp",), 2000, "p2p") == pytest.approx(1e-4 + 1e-6)
    assert a.time(("cp",), 0, "all_gather") == a.time(("cp",), 0) == pytest.approx(1e-3)
    assert mc.CostModel(wires={"p2p": (1e-4, 2e9)}).models_time
    with pytest.raises(PlanError, match=re.escape("CostModel(wires=...) names unknown wires"
                                                  " ['shift']; wires are all_gather,")):
        mc.CostModel(wires={"shift": (1e-4, 1e9)})
    with pytest.raises(PlanError, match=re.escape("needs bandwidth > 0 and latency >= 0")):
        mc.CostModel(wires={"p2p": (1e-4, 0.0)})


def test_the_ring_time_is_its_steps_overlapped() -> None:
    """No mask, 4 ranks of 16 tokens, 8 heads of 16: each step's block is 16 x 16 pairs
    x 8 x 16 = 32,768; at 1e6 FLOP/s a forward step takes 4 x that = 0.131 s and a
    backward one 0.328 s, longer than any hop at 100 GB/s; so the time is the math (4
    forward and 4 backward steps) plus the last dK/dV hop and two exposed latencies."""
    q = torch.zeros(1, 8, 16, 16)
    costs = {c.strategy: c for c in mc.nn.attention_costs(
        q, q, q, BOUND, "b h (cp s) d", cost_model=FAST_LINK, flops=1e6)}
    ring = costs["ring"]
    work = 16 * 16 * 8 * 16
    assert ring.compute_s == pytest.approx(4 * 14 * work / 1e6)
    hop = FAST_LINK.time(("cp",), 2 * 16 * 8 * 16 * 4)
    assert ring.time_s == pytest.approx(ring.compute_s + hop + 2 * 1e-6)
    # allgather and ulysses: messages and math add up
    for name in ("allgather", "ulysses"):
        assert costs[name].time_s == pytest.approx(costs[name].comm_s + costs[name].compute_s)


def test_a_memory_budget_still_binds() -> None:
    """A fast link and fast math pick by time; a budget of the ring's memory rules out the
    strategies that need more, whatever their time."""
    costs = _costs(kv_heads=2, cost_model=SLOW_LINK, flops=1e15)
    assert pick(_call(kv_heads=2), torch.float32, None, SLOW_LINK, 1e15) == "allgather"
    budget = costs["ring"].extra_bytes
    over = {n for n, c in costs.items() if c.extra_bytes > budget}
    chosen = pick(_call(kv_heads=2), torch.float32, budget, SLOW_LINK, 1e15)
    assert chosen not in over and costs[chosen].extra_bytes <= budget


def test_explain_marks_exactly_the_pick() -> None:
    q = torch.zeros(1, 8, 256, 16)
    for cm, flops, budget in ((SLOW_LINK, 1e15, None), (FAST_LINK, 1e9, None),
                              (FAST_LINK, 1e15, 2**20)):
        explained = mc.nn.attention_explain(q, q, q, BOUND, "b h (cp s) d", causal=True,
                                            cost_model=cm, flops=flops, memory_budget=budget)
        chosen = pick(_call(seq=1024), torch.float32, budget, cm, flops)
        assert explained.pick == chosen
        assert [r["strategy"] for r in explained.rows() if r["picked"]] == [chosen]
        text = str(explained)
        marked = [line.split()[1] for line in text.splitlines() if line.startswith("*")]
        assert marked == [chosen], text
        assert re.search(r"strategy +sent/rank +extra memory +calls +time \(µs\)", text)
        assert {line.split()[0] for line in text.splitlines()[2:] if not line.startswith("*")
                } == {"allgather", "ulysses", "ring"} - {chosen}


def test_explain_without_a_fitting_strategy_marks_none() -> None:
    q = torch.zeros(1, 8, 16, 16)
    explained = mc.nn.attention_explain(q, q, q, BOUND, "b h (cp s) d", memory_budget=1)
    assert explained.pick is None and not any(r["picked"] for r in explained.rows())
    text = str(explained)
    assert not any(line.startswith("*") for line in text.splitlines())
    assert text.endswith("no strategy fits the memory budget")
    with pytest.raises(ShapeError, match=re.escape("attention(memory_budget=1): no strategy"
                                                   " fits; their extra memory on rank 1:")):
        mc.nn.attention(q, q, q, BOUND, "b h (cp s) d", memory_budget=1)


def test_pick_is_cached_per_call_signature() -> None:
    call = _call(seq=128)
    pick(call, torch.float32, None, FAST_LINK, 1e12)
    hits = pick.cache_info().hits
    for _ in range(3):
        pick(call, torch.float32, None, FAST_LINK, 1e12)
    assert pick.cache_info().hits == hits + 3


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match=re.escape("attention(flops=0.0): expected a positive")):
        _costs(flops=0.0)


def test_a_collective_pays_a_latency_per_step_of_its_ring() -> None:
    """At 1 ms a message and no bandwidth cost, allgather's four collectives over cp=4 (K
    and V gathered, dK and dV reduce-scattered) each take 3 steps: 12 ms; the ring's
    point-to-point batches one each (2 cp = 8 of them, its comm before overlap: a backward
    step's K/V block and dK/dV buffer are one message)."""
    latency = mc.CostModel(latency_s=1e-3, bandwidth=1e30)
    costs = _costs(cost_model=latency, flops=1e30)
    assert costs["allgather"].comm_s == pytest.approx(4 * 3 * 1e-3)
    assert costs["ring"].calls == 8
    assert costs["ring"].comm_s == pytest.approx(8 * 1e-3)
