"""torch.compile(backend="inductor", fullgraph=True) of plans of every step kind on dp=2 tp=2
(4 gloo ranks): the compiled function's output equals eager, bit for bit. Inductor compiles
C++ for the local steps (a C compiler is on these machines); the first compile takes about a
minute, so one function holds every kind, forward only (tests/dist/test_autograd_compile.py
and test_compile_8.py compile forward and backward under aot_eager)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import meshcomm as mc

from conftest import ints, ranks_fixture

MESH = "dp=2 tp=2"
# on bytes alone: the default's per-round latency would plan the last step as one direct
# send_recv, and the chains are here to compile every step kind, the tree's rounds among them
BYTES = mc.CostModel(latency_s=0.0)


# (shape, src, dst) in order: two chains that together hold every step kind
X_CHAIN = [((8, 4), "(dp b) h", "b (dp h)"),              # all_to_all
           ((8, 4), "b (dp h)", "b h"),                   # all_gather
           ((8, 4), "b h", "b h | sum(tp)"),              # local mark_partial
           ((8, 4), "b h | sum(tp)", "(tp b) h"),         # reduce_scatter
           ((8, 4), "(tp b) h", "(tp dp b) h"),           # local slice
           ((8, 4), "(tp dp b) h", "(dp tp b) h")]        # collective_permute
U_CHAIN = [((7, 4), "(dp tp b) h", "(tp b) h"),           # send_recv (uneven)
           ((7, 4), "(tp b) h", "b h"),                   # all_gather (uneven)
           ((7, 4), "b h", "b h | sum(dp)"),
           ((7, 4), "b h | sum(dp)", "b h"),              # all_reduce
           ((7, 4), "b h", "b h | max(dp, tp)"),            # local reindex
           ((7, 4), "b h | max(dp, tp)", "(tp b) h")]     # send_recv tree


def chain(x: Tensor, u: Tensor, bound: mc.BoundMesh) -> tuple[Tensor, Tensor]:
    for shape, src, dst in X_CHAIN:
        x = mc.reshard(x * 2, bound, src, dst, shape=shape, cost_model=BYTES)
    for shape, src, dst in U_CHAIN:
        u = mc.reshard(u - 1, bound, src, dst, shape=shape, cost_model=BYTES)
    return x, u


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH)
    pos = bound.mesh.position(rank)
    x = mc.sim.scatter(ints((8, 4), 1), bound.mesh, "(dp b) h")[pos]
    u = mc.sim.scatter(ints((7, 4), 2), bound.mesh, "(dp tp b) h")[pos]
    compiled = torch.compile(lambda a, b: chain(a, b, bound), backend="inductor",
                             fullgraph=True)
    got = compiled(x, u)          # first: nothing of the plans is cached by an eager run
    want = chain(x, u, bound)
    kinds = sorted({s.action if s.kind == "local" or s.action == "tree" else s.kind
                    for shape, src, dst in X_CHAIN + U_CHAIN
                    for s in mc.plan(bound.mesh, shape, src, dst, cost_model=BYTES).steps})
    return {"same": [torch.equal(a, b) for a, b in zip(got, want)], "kinds": kinds}


four = ranks_fixture(four_ranks, 4, timeout_s=600)


def test_every_step_kind_compiles_with_inductor(four: list[dict[str, Any]]) -> None:
    assert four[0]["kinds"] == ["all_gather", "all_reduce", "all_to_all", "collective_permute",
                                "mark_partial", "reduce_scatter", "reindex", "send_recv", "slice",
                                "tree"]
    assert [r["same"] for r in four] == [[True, True]] * 4
