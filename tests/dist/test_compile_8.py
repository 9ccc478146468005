"""torch.compile(fullgraph=True) of send_recv and collective_permute plans on dp=2 tp=4
(8 gloo ranks), forward and backward equal to eager. These failed to trace ("Could not
guard on data-dependent expression") while the executor worked out a rank's transfers under
the compiler's fake tensors; it now does that outside any dispatch mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import meshcomm as mc

from conftest import ints, ranks_fixture

MESH = "dp=2 tp=4"
CASES = [((16, 16), "(dp a) (tp b)", "(tp a) (dp b)"),      # send_recv (the case)
         ((16, 16), "(dp tp a) b", "(tp dp a) b"),          # collective_permute
         ((14, 16), "(dp tp a) b", "(tp dp a) b")]          # uneven: send_recv


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH)
    pos = bound.mesh.position(rank)
    out: dict[str, Any] = {"kinds": [], "same": []}
    for i, (shape, src, dst) in enumerate(CASES):
        out["kinds"].append([s.kind for s in mc.plan(bound.mesh, shape, src, dst).steps])
        x = mc.sim.scatter(ints(shape, i), bound.mesh, src)[pos]

        def f(t: Tensor, shape: tuple[int, ...] = shape, src: str = src, dst: str = dst
              ) -> Tensor:
            return mc.reshard(t * 2, bound, src, dst, shape=shape)

        got = []     # compiled first: nothing of the plan is cached from an eager run yet
        for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
            t = x.clone().requires_grad_()
            y = fn(t)
            (y * y).sum().backward()
            got.append((y.detach(), t.grad))
        out["same"].append(all(torch.equal(a, b) for a, b in zip(got[0], got[1])))
    return out


eight = ranks_fixture(eight_ranks, 8)


def test_send_recv_and_permute_compile_fullgraph_on_8_ranks(eight: list[dict[str, Any]]) -> None:
    assert eight[0]["kinds"] == [["send_recv"], ["collective_permute"], ["send_recv"]]
    assert [r["same"] for r in eight] == [[True] * len(CASES)] * 8
