"""mc.reshard(..., async_op=True) on 4 gloo ranks: it returns before its last collective
completes (an AsyncCollectiveTensor, waited on at first use), its values equal the
synchronous reshard for one- and several-step plans, its bytes are traced, and a tensor
that needs a gradient is refused."""

from __future__ import annotations

from typing import Any

import torch
from conftest import ranks_fixture

import meshcomm as mc

CASES = [("(dp tp b) h", "b h"), ("b h | sum(dp)", "(dp b) h"), ("(dp b) (tp h)", "(tp b) (dp h)"),
         ("(dp b) h", "b (dp h)"), ("(b dp tp) h", "(dp tp b) h")]


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 tp=2")
    out: dict[str, Any] = {"same": [], "types": []}
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for src, dst in CASES:
        x = mc.sim.scatter(full, bound.mesh, src)[bound.mesh.position(rank)]
        want = mc.reshard(x, bound, src, dst, shape=(8, 6))
        trace = mc.ByteTrace()
        got = mc.reshard(x, bound, src, dst, shape=(8, 6), async_op=True, trace=trace)
        out["types"].append(type(got).__name__)
        out["same"].append(bool(torch.equal(got, want)))
        p = mc.plan(bound.mesh, (8, 6), src, dst)
        out.setdefault("bytes", []).append(
            (trace.recv_bytes, p.recv_bytes[bound.mesh.position(rank)]))
    try:
        mc.reshard(torch.ones(4, 6, requires_grad=True), bound, "(dp b) h", "b h", async_op=True)
        out["grad"] = "no error"
    except mc.errors.ShapeError as err:
        out["grad"] = str(err)
    return out


four = ranks_fixture(worker, 4)


def test_async_reshard_equals_the_synchronous_one(four: list[dict[str, Any]]) -> None:
    assert all(r["same"] == [True] * len(CASES) for r in four)
    # a plan whose last step is a collective comes back unwaited
    assert four[0]["types"][0] == "AsyncCollectiveTensor"
    assert all(got == want for r in four for got, want in r["bytes"])


def test_async_reshard_refuses_a_tensor_that_needs_a_gradient(four: list[dict[str, Any]]) -> None:
    assert four[0]["grad"].startswith("reshard(async_op=True) returns before its collectives"
                                      " finish and records no gradient; fix: pass x.detach()")
