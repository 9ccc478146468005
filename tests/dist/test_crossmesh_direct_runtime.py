"""Partials delivered straight to their owners on another mesh, on 8 gloo processes.

One spawn of 8 processes binds the meshes below and runs every case: a partial source whose
plan (the default cost model) is one send_recv between meshes, action "direct", in which
each destination rank takes its block from one holder of each partial and adds them in
group order; and the same cases planned on bytes alone, where some reduce on the source
mesh first. Each rank's output must equal `mc.sim` bit for bit and, for a direct delivery,
the reduction of the partials computed here (random floats under the default model: the
order of adding is part of the result; integer values on bytes alone, where a gloo
reduce_scatter adds in its own order), and the bytes counted at each call the plan's. One
case also runs compiled (inductor), where the transfer is one all_to_all over both meshes' ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.core.reduce_ops import op_reduce
from meshcomm.executors.distributed.execute import execute_cross
from meshcomm.executors.distributed.handlers import ByteTrace
from meshcomm.executors.sim.shards import shard_of

from conftest import ranks_fixture, sim_problems
from test_crossmesh_direct import _partials

MESHES = {                                            # bound in this order on every rank
    "A": mc.Mesh("dp=2 tp=2"),                        # ranks 0-3
    "B": mc.Mesh("tp=4", ranks=[4, 5, 6, 7]),         # disjoint from A
    "C": mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5]),      # overlaps A and B
    "S": mc.Mesh("sp=4"),                             # ranks 0-3: the source
    "T": mc.Mesh("cp=2 ep=2 dp=2"),                   # all 8: the destination, small
    "U": mc.Mesh("d0=2 d1=2"),                        # unnamed (a DeviceMesh's d0, d1)
    "V": mc.Mesh("d0=4", ranks=[4, 5, 6, 7]),
    "O": mc.Mesh("one=1 tp=4", ranks=[4, 5, 6, 7]),   # a size-1 axis
    "E": mc.Mesh("p=3"),                              # ranks 0-2
}
I64, F32, F64 = torch.int64, torch.float32, torch.float64
CASES = [  # (tag, src mesh, dst mesh, shape, src, dst, dtype)
    ("issue, small", "S", "T", (4, 8, 12), "a b c | sum(sp)", "a (cp b) (c dp ep)", I64),
    ("issue, small", "S", "T", (4, 8, 12), "a b c | sum(sp)", "a (cp b) (c dp ep)", F32),
    ("disjoint", "A", "B", (8, 16), "b s | sum(tp)", "(tp b) s", F64),
    ("disjoint", "A", "B", (7, 5), "(dp b) s | max(tp)", "(tp b) s", F32),    # uneven
    ("disjoint", "B", "A", (6, 10), "a b | min(tp)", "(dp a) (tp b)", I64),
    ("overlapping", "A", "C", (6, 4), "a b | sum(dp, tp)", "(x a) (y b)", F32),
    ("overlapping", "C", "A", (5, 6), "(x a) b | avg(y)", "a (tp b)", F64),
    ("dst pending", "A", "C", (6, 4), "a b | sum(tp)", "(x a) b | sum(y)", F32),
    ("dst pending", "A", "C", (6, 4), "a b | sum(tp)", "(x a) b | max(y)", I64),
    ("unnamed", "U", "V", (6, 4), "dim0 dim1 | sum(d1)", "(d0 dim0) dim1", F32),
    ("unnamed", "V", "U", (8, 3), "dim0 dim1 | sum(d0)", "(d1 dim0) (d0 dim1)", F64),
    ("size-1 axis", "O", "A", (10, 3), "a b | sum(tp)", "(tp a) (dp b)", F32),
    ("3 -> 4", "E", "B", (7, 5), "a b | sum(p)", "(tp a) b", F32),
    ("empty block", "A", "B", (3, 2), "a b | sum(tp)", "(tp a) b", F32),
]
BYTES = mc.CostModel(latency_s=0.0)
MODELS = [("default", None), ("bytes", BYTES)]


def check_case(k: int, m: int, bounds: dict[str, mc.BoundMesh]) -> dict[str, Any]:
    tag, s, d, shape, src, dst, dtype = CASES[k]
    model, cost = MODELS[m]
    a, b = bounds[s], bounds[d]
    rank = a.rank
    p = mc.plan(a.mesh, shape, src, dst, dtype=dtype, dst_mesh=b.mesh, cost_model=cost)
    # random floats where the plan adds partials itself (in group order, as the simulator);
    # integers where a gloo reduce_scatter may add in its own order
    parts, locs = _partials(a.mesh, shape, src, dtype, seed=k, whole=cost is not None)
    want = mc.sim.execute(p, locs).outputs[p.ranks.index(rank)] if rank in p.ranks else None
    x = locs[a.mesh.position(rank)] if a.in_mesh else None
    trace = ByteTrace()
    if k % 2:   # the public API
        got = mc.reshard(x, a, src, dst, dst_mesh=b, trace=trace, shape=shape, dtype=dtype,
                         cost_model=cost)
    else:
        got = execute_cross(p, x, a, b, trace=trace)
    where = f'case {k} ({model}) {tag} {shape} {dtype} "{src}" -> "{dst}" on rank {rank}'
    problems = sim_problems(where, p, rank, got, want, trace)
    direct = any(st.action == "direct" for st in p.steps)
    if got is not None and direct and mc.Layout(dst).reduce_op is None:
        whole = op_reduce(parts, mc.Layout(src).reduce_op or "sum")
        if not torch.equal(got, shard_of(whole, b.mesh, dst, rank)):
            problems.append(f"{where}: not the reduction of the partials in group order")
    return {"problems": problems, "direct": direct,
            "kinds": [st.kind for st in p.collectives]}


def compiled(bounds: dict[str, mc.BoundMesh]) -> list[bool] | str:
    """The first case compiled (inductor, fullgraph) twice, each called twice: whether each
    call equals the simulator on this rank, or the error."""
    import torch._dynamo

    _, s, d, shape, src, dst, dtype = CASES[1]
    a, b = bounds[s], bounds[d]
    p = mc.plan(a.mesh, shape, src, dst, dtype=dtype, dst_mesh=b.mesh)
    _, locs = _partials(a.mesh, shape, src, dtype, seed=1, whole=False)
    want = mc.sim.execute(p, locs).outputs[p.ranks.index(a.rank)]
    x = locs[a.mesh.position(a.rank)] if a.in_mesh else None

    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return mc.reshard(x, a, src, dst, dst_mesh=b, shape=shape, dtype=dtype)
    got = []
    try:
        for _ in range(2):
            torch._dynamo.reset()
            fn = torch.compile(move, backend="inductor", fullgraph=True)
            for _ in range(2):
                y = fn(x)
                got.append(want is None if y is None else torch.equal(y, want))
    except Exception as exc:      # noqa: BLE001 - the test reports it
        return f"{type(exc).__name__}: {exc}"
    return got


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    bounds = {name: mc.init_mesh(mesh) for name, mesh in MESHES.items()}
    cases = [check_case(k, m, bounds) for k in range(len(CASES)) for m in range(len(MODELS))]
    return {"cases": cases, "compiled": compiled(bounds)}


eight = ranks_fixture(eight_ranks, 8, timeout_s=400)


def test_every_case_equals_sim_and_the_partials_reduced(eight: list[dict[str, Any]]) -> None:
    problems = [p for rep in eight for case in rep["cases"] for p in case["problems"]]
    assert not problems, "\n".join(problems[:5])
    assert len(eight[0]["cases"]) == len(CASES) * len(MODELS)


def test_the_default_model_delivers_every_case_directly(eight: list[dict[str, Any]]) -> None:
    default = eight[0]["cases"][0::len(MODELS)]
    assert all(case["direct"] and case["kinds"] == ["send_recv"] for case in default), \
        [c for c, case in zip(CASES, default) if not case["direct"]]


def test_on_bytes_alone_some_cases_reduce_on_the_source_mesh_first(
        eight: list[dict[str, Any]]) -> None:
    on_bytes = eight[0]["cases"][1::len(MODELS)]
    first = [case["kinds"] for case in on_bytes if not case["direct"]]
    assert first and all(len(kinds) >= 2 for kinds in first), first
    assert any(case["direct"] for case in on_bytes)


@pytest.mark.parametrize("rank", range(8))
def test_a_compiled_direct_delivery_equals_the_simulator(eight: list[dict[str, Any]],
                                                         rank: int) -> None:
    assert eight[rank]["compiled"] == [True] * 4, eight[rank]["compiled"]
