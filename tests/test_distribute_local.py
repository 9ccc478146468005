"""`mc.distribute` slices this rank's shard alone: the same local tensor as the simulator's
scatter gives that rank, made without building any other rank's (O(1) in the world size)."""

from __future__ import annotations

import pytest
import torch

import meshcomm as mc
from meshcomm.executors.sim import shards
from meshcomm.runtime.bind import BoundMesh


def unbound(spec: str, rank: int) -> BoundMesh:
    """A BoundMesh whose groups exist nowhere: distribute never communicates."""
    mesh = mc.Mesh(spec)
    return BoundMesh(mesh, "gloo", torch.device("cpu"), rank, {})


@pytest.mark.parametrize("layout", ["(dp b) (tp h)", "(b dp) h | sum(tp)",
                                    "b (tp h) | avg(dp)", "b h | max(dp, tp)", "(tp dp b) h"])
@pytest.mark.parametrize("rank", [0, 3, 5])
def test_distribute_is_the_simulator_s_shard_of_this_rank(layout: str, rank: int) -> None:
    x = torch.randint(-9, 10, (12, 6)).float()
    mesh = mc.Mesh("dp=2 tp=3")
    got = mc.distribute(x, unbound("dp=2 tp=3", rank), layout)
    assert torch.equal(got.local, mc.sim.scatter(x, mesh, layout)[mesh.position(rank)])
    assert got.layout == mc.Layout(layout) and got.shape == (12, 6)


def test_distribute_builds_no_other_rank_s_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 4,096-rank mesh, a partial layout: one call of the per-rank slicer, no scatter."""
    calls: list[int] = []
    real = shards.shard_of

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(shards, "scatter", None)          # would raise if called
    monkeypatch.setattr("meshcomm.sharded.value.shard_of", counted)
    got = mc.distribute(torch.ones(64, 8), unbound("dp=64 tp=64", 4032), "(dp b) h | sum(tp)")
    assert calls == [1]
    # row 63; tp position 0 of 64 holds element 0 of its 8 (round robin), the rest hold 0
    assert got.local.tolist() == [[1.0] + [0.0] * 7]
