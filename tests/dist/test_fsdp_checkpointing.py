"""Activation checkpointing inside fully_shard'ed blocks, as Hugging Face does it: the block
checkpoints its own `forward` body (`torch.utils.checkpoint` of a bound method), so the
recompute in backward runs without the module's hooks. It must compute with the gathered
parameters (not the DTensor shards) and train as one process does (4 gloo ranks, dp=4).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from conftest import ranks_fixture
from torch import nn
from torch.utils.checkpoint import checkpoint

import meshcomm as mc

BATCH, STEPS = 8, 3


class Block(nn.Module):
    """A residual MLP block that checkpoints its body when `checkpointing` is on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width + 1), nn.Linear(2 * width + 1, width)
        self.checkpointing = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self.body, x, use_reentrant=False)
            return out
        return self.body(x)


def model(checkpointing: bool) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), Block(6), Block(6), nn.Linear(6, 3))
    for b in (m[1], m[2]):
        b.checkpointing = checkpointing
    return m


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 5, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def train(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=4")
    x, y = data()
    q = BATCH // 4
    mine = slice(rank * q, (rank + 1) * q)
    out: dict[str, Any] = {}
    for raf in (True, False):
        m = model(checkpointing=True)
        for b in (m[1], m[2]):
            mc.nn.fully_shard(b, bound, reshard_after_forward=raf)
        mc.nn.fully_shard(m, bound)
        losses = train(m, x[mine], y[mine])
        total = torch.tensor(losses)
        torch.distributed.all_reduce(total)
        out[raf] = {"losses": (total / 4).tolist(),
                    "params": {n: p.full_tensor() for n, p in m.named_parameters()},
                    "dtensors": all(hasattr(p, "full_tensor") for p in m.parameters())}
    return out


four = ranks_fixture(worker, 4)


def test_a_block_checkpointing_its_own_forward_trains_as_one_process(
        four: list[dict[str, Any]]) -> None:
    ref = model(checkpointing=True)
    x, y = data()
    want = train(ref, x, y)
    plain = train(model(checkpointing=False), x, y)
    torch.testing.assert_close(torch.tensor(want), torch.tensor(plain))  # same maths
    for raf in (True, False):
        got = four[0][raf]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), msg=name)
        assert got["dtensors"]      # the DTensor parameters are back after backward
