"""`mc.nn.attention`'s automatic pick, from the strategies' figures alone (nothing runs): the
least modelled time (links from a `CostModel`, blocks from a FLOP rate), under a memory
budget the least among those that fit; `attention_explain` marks that pick."""

from __future__ import annotations

import re

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import ShapeError
from meshcomm.nn.attention import Cost, Mask, pick
from meshcomm.nn.attention.call import Call, resolve
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
    """Causal over a contiguous split: the ring's and allgather's slowest rank (the last)
    computes cp - 1 whole blocks and its own causal triangle; Ulysses one causal triangle
    over the whole sequence for a quarter of the heads: (cp - 1/2) / cp^2 against 1/(2 cp)
    of the sequence's pairs per head, 0.219 against 0.125 on cp = 4 (up to the triangles'
    diagonals)."""
    costs = _costs(seq=1024, cost_model=FAST_LINK, flops=1e9)
    assert costs["ring"].compute_s == pytest.approx(costs["allgather"].compute_s)
    n, cp = 1024, 4
    block = n // cp
    last = (cp - 1) * block * block + block * (block + 1) // 2
    whole = n * (n + 1) // 2 // cp
    assert costs["ulysses"].compute_s / costs["ring"].compute_s == pytest.approx(whole / last)
    assert pick(_call(seq=1024), torch.float32, None, FAST_LINK, 1e9) == "ulysses"


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
    point-to-point batches one each (2 cp = 8 of them, its comm before overlap)."""
    latency = mc.CostModel(latency_s=1e-3, bandwidth=1e30)
    costs = _costs(cost_model=latency, flops=1e30)
    assert costs["allgather"].comm_s == pytest.approx(4 * 3 * 1e-3)
    assert costs["ring"].calls == 8
