"""`mc.nn.attention` with the sequence split over mesh axes, on 4 and 8 gloo ranks, in
float64: every strategy's output and the gradients of q, k and v equal one process's
attention (relative error <= 1e-10), for causal, full, sliding-window and document masks,
contiguous "(cp s)" and striped "(s cp)" splits, even and uneven sequences, MHA and GQA.
One spawn per world size runs every case.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import ShapeError
from meshcomm.executors.sim import scatter
from meshcomm.nn.attention import STRATEGIES, Mask, attention, attention_costs, reference
from meshcomm.runtime.bind import BoundMesh

from conftest import ranks_fixture

MASKS = [(False, None, False), (True, None, False), (True, 5, False), (False, 4, False),
         (True, None, True), (False, 3, True)]          # (causal, window, documents)
SHAPES = {"(cp s)": [(16, 4, 4), (13, 4, 2), (16, 2, 1), (7, 8, 8)],   # (seq, heads, kv heads)
          "(s cp)": [(16, 4, 4), (16, 2, 1), (8, 8, 2)]}


def cases(world: int) -> list[tuple[Any, ...]]:
    out = []
    for strategy, seq in itertools.product(sorted(STRATEGIES), SHAPES):
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
    axis = bound.mesh.axis_names[0]
    layout = f"b h {seq.replace('cp', axis)} d"
    q, k, v, doc = _inputs(s, h, hk, docs)
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(rq, rk, rv, Mask(causal, window), doc=doc if docs else None)
    (ref * ref.detach().cos()).sum().backward()
    mesh, rank = bound.mesh, bound.rank
    lq, lk, lv = (scatter(t, mesh, layout)[rank].clone().requires_grad_() for t in (q, k, v))
    ldoc = scatter(doc, mesh, f"b {seq.replace('cp', axis)}")[rank] if docs else None
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
        worst = max(worst, ((got - w).abs().max() / w.abs().max().clamp_min(1e-30)).item())
    return worst


def all_cases(rank: int, world: int) -> list[Any]:
    bound = mc.init_mesh(f"cp={world}")
    unnamed = mc.init_mesh(mc.Mesh(f"d0={world}"))       # an unnamed-style axis name
    out: list[Any] = []
    for c in cases(world):
        out.append(run_case(bound, *c))
    out.append(run_case(unnamed, "allgather", "(cp s)", True, None, False, 13, 4, 2))
    costs = attention_costs(*(torch.zeros(2, 4, 16 // world, 8) for _ in range(3)), bound,
                            "b h (cp s) d")
    out.append({c.strategy: (c.sent_bytes, c.extra_bytes, c.calls) for c in costs})
    return out


four = ranks_fixture(all_cases, 4)
eight = ranks_fixture(all_cases, 8)


@pytest.mark.parametrize("world", [4, 8])
def test_every_strategy_equals_one_process(world: int, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue("four" if world == 4 else "eight")
    names = cases(world) + [("allgather on d0", "(cp s)", True, None, False, 13, 4, 2)]
    bad = [(c, max(r[i] for r in results)) for i, c in enumerate(names)
           if max(r[i] for r in results) > 1e-10]
    assert not bad, bad[:5]
    assert len(names) > 50


def test_costs_come_from_the_plans(four: list[Any]) -> None:
    """Even split over cp=4, (2, 4, 16, 8) float32: allgather sends its K and V block to 3
    peers forward and reduce-scatters dK, dV back; ulysses moves 3/4 of q, k, v, out each
    way."""
    costs = four[0][-1]
    block = 2 * 4 * 4 * 8 * 4                      # one rank's K block, bytes
    assert costs["allgather"][0] == 2 * 2 * 3 * block
    assert costs["ulysses"][0] == 2 * 4 * 3 * block // 4 * 1
    assert costs["allgather"][1] == 2 * 4 * block        # the whole K and V


def test_bad_arguments_raise_before_any_communication() -> None:
    bound = BoundMesh(mc.Mesh("cp=4"), "gloo", torch.device("cpu"), 1, {})
    q = torch.zeros(2, 4, 4, 8)
    with pytest.raises(ShapeError, match='no dim named "s"'):
        attention(q, q, q, bound, "b h (cp t) d")
    with pytest.raises(ShapeError, match="not a multiple of 3 key/value heads"):
        attention(q, torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, 8), bound, "b h (cp s) d")
    with pytest.raises(ShapeError, match="strategy='nope'"):
        attention(q, q, q, bound, "b h (cp s) d", strategy="nope")
    with pytest.raises(ValueError, match="window=0"):
        attention(q, q, q, bound, "b h (cp s) d", window=0)
