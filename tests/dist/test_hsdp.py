"""HSDP (`fully_shard(..., replicate=)`) and gradient accumulation without reduction
(`set_requires_gradient_sync`), on 4 gloo ranks, against the same model in one process
(tests/dist/test_fsdp.py's model: uneven rows, three units and a root)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from conftest import outcome, ranks_fixture
from test_fsdp import BATCH, data, model, reference
from torch import nn

import meshcomm as mc
from meshcomm.nn.fsdp import UNIT_ATTR

STEPS = 3


def units(m: nn.Module) -> list[Any]:
    return [getattr(x, UNIT_ATTR) for x in m.modules() if hasattr(x, UNIT_ATTR)]


def sent(m: nn.Module) -> int:
    return sum(u.sent_bytes for u in units(m))


def quarter(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    q = BATCH // 4
    return x[position * q:(position + 1) * q], y[position * q:(position + 1) * q]


def mean_over_world(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


def train(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[int]]:
    """STEPS of AdamW on this rank's batch: the losses averaged over the world, and the
    bytes the model's units sent at each step."""
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    losses, per_step = [], []
    for _ in range(STEPS):
        before = sent(m)
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        per_step.append(sent(m) - before)
        losses.append(mean_over_world(loss))
    return losses, per_step


def hsdp(rank: int) -> dict[str, Any]:
    bound = mc.init_mesh("rep=2 dp=2")
    m = model()
    for i in (0, 2, 4):
        mc.nn.fully_shard(m[i], bound, axis="dp", replicate="rep")
    mc.nn.fully_shard(m, bound, axis="dp", replicate="rep")
    losses, per_step = train(m, *quarter(rank))     # the batch split over all 4 ranks
    return {"losses": losses, "sent": per_step,
            "params": {n: p.full_tensor() for n, p in m.named_parameters()},
            "local": {n: p.to_local().clone() for n, p in m.named_parameters()},
            "placements": str(tuple(m[2].weight.placements)),
            "schedule": mc.nn.fsdp_schedule(m)}


def accumulation(rank: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=4")
    m = model()
    for i in (0, 2, 4):
        mc.nn.fully_shard(m[i], bound)
    mc.nn.fully_shard(m, bound)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    x, y = quarter(rank)
    half = x.shape[0] // 2
    losses, quiet, synced = [], [], []
    for _ in range(STEPS):
        opt.zero_grad()
        mc.nn.set_requires_gradient_sync(m, False)
        before = sent(m)
        first = F.cross_entropy(m(x[:half]), y[:half]) / 2
        first.backward()
        quiet.append((sent(m) - before, all(p.grad is None for p in m.parameters())))
        mc.nn.set_requires_gradient_sync(m, True)
        before = sent(m)
        second = F.cross_entropy(m(x[half:]), y[half:]) / 2
        second.backward()
        synced.append(sent(m) - before)
        opt.step()
        losses.append(mean_over_world(first + second))
    return {"losses": losses, "quiet": quiet, "synced": synced,
            "params": {n: p.full_tensor() for n, p in m.named_parameters()}}


def errors() -> dict[str, str]:
    bound = mc.init_mesh("rep=2 dp=2")
    return {"same": outcome(lambda: mc.nn.fully_shard(model(), bound, axis="dp",
                                                      replicate="dp")),
            "unknown": outcome(lambda: mc.nn.fully_shard(model(), bound, axis="dp",
                                                         replicate="pp")),
            "no units": outcome(lambda: mc.nn.set_requires_gradient_sync(model(), False))}


def worker(rank: int, world: int) -> dict[str, Any]:
    return {"hsdp": hsdp(rank), "accumulation": accumulation(rank), "errors": errors()}


four = ranks_fixture(worker, 4)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(got[n], w, rtol=1e-4, atol=1e-6) for n, w in want.items())


def test_hsdp_trains_as_one_process(four: list[dict[str, Any]]) -> None:
    want_losses, want = reference(STEPS)
    for r in four:
        got = r["hsdp"]
        assert max(abs(a - b) / b for a, b in zip(got["losses"], want_losses)) < 1e-5
        assert close(got["params"], want)
    # sharded over dp, replicated over rep: ranks 0 and 2 (rep 0 and 1, dp 0) hold the same
    assert four[0]["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"
    for n, t in four[0]["hsdp"]["local"].items():
        assert torch.equal(t, four[2]["hsdp"]["local"][n]), n
        assert four[1]["hsdp"]["local"][n].shape[0] <= t.shape[0]


def test_hsdp_sends_the_shard_all_reduce_and_says_so(four: list[dict[str, Any]]) -> None:
    schedule = four[0]["hsdp"]["schedule"]
    assert schedule.count("all_reduce(rep)") == 3            # the root owns no parameters
    # per step, per rank: all_gather + reduce_scatter over dp=2 of the padded shards (n-1 = 1
    # shard each way, twice in forward+backward for resharded units) + all_reduce over rep=2
    # of the shard (2 * (r-1)/r = 1 shard): rows padded to 5, 4 and 2 of widths 6+1, 10+1, 7+1
    shard = (5 * 7 + 4 * 11 + 2 * 8) * 4
    assert four[0]["hsdp"]["sent"] == [shard * 4] * STEPS


def test_accumulation_sends_nothing_until_sync_and_trains_as_one_process(
        four: list[dict[str, Any]]) -> None:
    want_losses, want = reference(STEPS)
    for r in four:
        got = r["accumulation"]
        assert max(abs(a - b) / b for a, b in zip(got["losses"], want_losses)) < 1e-5
        assert close(got["params"], want)
        # the first micro-batch: the all_gathers only (forward + backward: 2 x G), no .grad;
        # the second adds one reduce_scatter per unit (G: the same padded shards, n-1 of them)
        for (quiet, grads_unset), synced in zip(got["quiet"], got["synced"]):
            assert grads_unset and quiet > 0
            assert synced == quiet * 3 // 2


def test_bad_hsdp_and_sync_calls(four: list[dict[str, Any]]) -> None:
    e = four[0]["errors"]
    assert e["same"].startswith("MeshAxisError: fully_shard(replicate='dp'): not an axis")
    assert e["unknown"].startswith("MeshAxisError: fully_shard(replicate='pp')")
    assert e["no units"].startswith("MeshMismatchError: set_requires_gradient_sync: Sequential"
                                    " has no fully_shard units")
