"""`mc.nn.attention`'s automatic pick, from the strategies' figures alone (nothing runs):
the fewest bytes, and under a memory budget the fewest bytes among those that fit."""

from __future__ import annotations

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import ShapeError
from meshcomm.nn.attention import Mask, pick
from meshcomm.nn.attention.call import resolve
from meshcomm.runtime.bind import BoundMesh


def _call(seq: int = 64, heads: int = 8) -> object:
    bound = BoundMesh(mc.Mesh("cp=4"), "gloo", torch.device("cpu"), 1, {})
    q = torch.zeros(1, heads, seq // 4, 16)
    return resolve(q, q, q, bound, "b h (cp s) d", None, "b h s d", None, None, Mask(True),
                   None)


def test_auto_picks_the_fewest_bytes_then_what_fits_the_budget() -> None:
    call = _call()
    costs = {c.strategy: c for c in mc.nn.attention_costs(
        *(torch.zeros(1, 8, 16, 16) for _ in range(3)),
        BoundMesh(mc.Mesh("cp=4"), "gloo", torch.device("cpu"), 1, {}), "b h (cp s) d")}
    cheapest = min(costs.values(), key=lambda c: (c.sent_bytes, c.extra_bytes))
    assert pick(call, torch.float32) == cheapest.strategy
    smallest = min(costs.values(), key=lambda c: c.extra_bytes)
    budget = smallest.extra_bytes
    assert pick(call, torch.float32, budget) == min(
        (c for c in costs.values() if c.extra_bytes <= budget),
        key=lambda c: (c.sent_bytes, c.extra_bytes)).strategy
    with pytest.raises(ShapeError, match="no strategy fits"):
        pick(call, torch.float32, budget - 1)
