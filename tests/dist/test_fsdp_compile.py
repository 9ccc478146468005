"""torch.compile of fully_shard'ed blocks (each block compiled, as torchtitan does), 2 gloo
ranks: the same losses as the eager model, and each block compiles once (plus one variant
for an input that requires grad): the FSDP hooks run eagerly, so no guard on the unit
recompiles a block per unit (this hit dynamo's recompile limit on a decoder layer)."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo.testing
from torch import nn

import meshcomm as mc

from conftest import ranks_fixture

BLOCKS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(BLOCKS)])


def losses(m: nn.Module, x: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = []
    for _ in range(3):
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {}
    for compiled in (False, True):
        m = model()
        for block in m:
            mc.nn.fully_shard(block, bound)
        mc.nn.fully_shard(m, bound)
        counter = torch._dynamo.testing.CompileCounter()
        if compiled:
            for i, block in enumerate(m):
                m[i] = torch.compile(block, backend=counter)
        result[compiled] = losses(m, x)
        result["frames"] = counter.frame_count
    return result


two = ranks_fixture(two_ranks, 2)


def test_compiled_blocks_train_as_eager_and_compile_once(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert max(abs(a - b) for a, b in zip(r[True], r[False])) < 1e-6, r
        assert r["frames"] <= 2, r        # one graph, one variant for a grad-requiring input
