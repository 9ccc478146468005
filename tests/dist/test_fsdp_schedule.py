"""The schedule of fully_shard's units on 4 gloo ranks: a forward that raises inside a unit
leaves nothing behind (no saved-tensor hooks, no gathered parameters in the modules, no
prefetched buffer, a recording that starts over), so the next step equals a fresh model's;
and with a slow wire, prefetch overlaps each unit's all_gather with the unit before it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ranks_fixture, slow_wire
from torch import nn

import meshcomm as mc
from meshcomm.nn.fsdp.param import UNIT_ATTR

BATCH = 8
DELAY_S = 0.2      # the slow wire: an all_gather lands this long after it is issued
UNITS = 4


class Block(nn.Module):
    """Linear + ReLU; raises in forward while `fail` is set; sleeps `compute_s` (compute)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.fail = False
        self.compute_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        if self.compute_s:
            time.sleep(self.compute_s)
        return torch.relu(self.lin(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(6, 10), Block(10, 7), Block(7, 5), Block(5, 3))


def sharded(bound: mc.BoundMesh) -> nn.Sequential:
    m = model()
    for block in m:
        mc.nn.fully_shard(block, bound)
    mc.nn.fully_shard(m, bound)
    return m


def batch(bound: mc.BoundMesh) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    q, pos = BATCH // 4, bound.mesh.coords(bound.rank)["dp"]
    return x[pos * q:(pos + 1) * q], y[pos * q:(pos + 1) * q]


def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    m.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    return loss.item(), [p.grad.to_local().clone() for p in m.parameters()]


def leftovers(m: nn.Module) -> list[str]:
    """What a failed forward could leave behind."""
    found = []
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        found.append("saved-tensor hooks still active")
    for name, module in m.named_modules():
        unit = getattr(module, UNIT_ATTR, None)
        if unit is None:
            continue
        if unit.schedule.ahead:
            found.append(f"{name or 'root'}: a prefetched all_gather kept")
        if unit.hooks is not None or unit.kept is not None or unit.regather.gathered:
            found.append(f"{name or 'root'}: hooks or gathered parameters kept")
        for p in unit.params:
            if p.module._parameters[p.attr] is not p.param:
                found.append(f"{name or 'root'}.{p.name}: a gathered tensor in the module")
    return found


def check_raise(bound: mc.BoundMesh) -> dict[str, Any]:
    """Fail in block 2 (after blocks 0-1 ran and block 3's gather was prefetched), on the
    recording forward and on a later one; each time the next step equals a fresh model."""
    x, y = batch(bound)
    want = step(sharded(bound), x, y)
    out: dict[str, Any] = {"left": [], "same": []}
    for warm in (False, True):
        m = sharded(bound)
        if warm:
            step(m, x, y)          # the order is recorded: the failing forward prefetches
        m[2].fail = True
        with pytest.raises(RuntimeError, match="boom"):
            m(x)
        m[2].fail = False
        out["left"] += leftovers(m)
        got = step(m, x, y)        # no optimizer: the warm step changed no parameter
        out["same"].append(got[0] == want[0] and all(torch.equal(a, b)
                                                     for a, b in zip(got[1], want[1])))
        out["left"] += leftovers(m)
    return out


def check_overlap(bound: mc.BoundMesh) -> dict[str, float]:
    """Forward (no grad) of UNITS units, each DELAY_S of compute, on a wire whose all_gathers
    take DELAY_S: without prefetch UNITS (comm + compute); with it about (UNITS + 1) max."""
    x, _ = batch(bound)
    times = {}
    for prefetch in (False, True):
        m = model()
        for block in m:
            mc.nn.fully_shard(block, bound, prefetch=prefetch)
            block.compute_s = DELAY_S
        mc.nn.fully_shard(m, bound, prefetch=prefetch)
        with torch.no_grad():
            m(x)                   # records the order
        mp = pytest.MonkeyPatch()
        try:
            slow_wire(mp, DELAY_S)
            torch.distributed.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                m(x)
            times["prefetch" if prefetch else "serial"] = time.perf_counter() - start
        finally:
            mp.undo()
    return times


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=4")
    return {"raise": check_raise(bound), "overlap": check_overlap(bound)}


four = ranks_fixture(worker, 4)


def test_a_forward_that_raises_leaves_nothing_behind(four: list[dict[str, Any]]) -> None:
    assert [r["raise"]["left"] for r in four] == [[]] * 4


def test_after_a_forward_that_raised_a_step_equals_a_fresh_model(
        four: list[dict[str, Any]]) -> None:
    assert [r["raise"]["same"] for r in four] == [[True, True]] * 4


def test_prefetch_overlaps_a_slow_wire_with_compute(four: list[dict[str, Any]]) -> None:
    """The root unit gathers too (its own parameters: none here, so no all_gather)."""
    for r in four:
        serial, overlapped = r["overlap"]["serial"], r["overlap"]["prefetch"]
        assert serial >= 2 * UNITS * DELAY_S * 0.95, r["overlap"]
        assert overlapped < 0.75 * serial, r["overlap"]
