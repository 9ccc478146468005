"""Trees rooted at helpers (`Schedule.roots` entries that do not need their item: a holder
combining in its input, or a rank holding none combining in scratch, which then delivers
the finished value to every needer) run through the torch.distributed executor on 8 gloo
ranks: every rank's output equals `mc.sim.execute` bit for bit, and the bytes each
collective call moves equal the plan's. Issue 39's two cases need 24 ranks; their plans are
checked exactly in simulation (tests/test_trees.py). One spawn runs every case; the tests
read its report."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ints, ranks_fixture, sim_problems

import meshcomm as mc
from meshcomm.executors.distributed.execute import execute
from meshcomm.executors.distributed.handlers import ByteTrace
from meshcomm.executors.sim import execute as sim_execute
from meshcomm.planner import trees
from meshcomm.planner.states import from_layout

BYTES_ONLY = mc.CostModel(latency_s=0.0)
CASES = [   # (mesh, shape, src, dst, dtype): each plan is one tree step with helper roots
    ("a=2 b=2 c=2", (8, 2, 3), "(c i) j (a k) | max(b)", "i (a j) k", torch.int64),
    ("a=4 b=2", (7, 7, 3), "i j (b k) | sum(a)", "i (b j) k", torch.int32),
    ("d0=4 d1=2", (7, 7, 3), "i j (d1 k) | sum(d0)", "i (d1 j) k", torch.float64),  # unnamed
]


def helper_roots(mesh: mc.Mesh, shape: tuple[int, ...], p: mc.Plan) -> int:
    """How many trees of `p`'s tree steps are rooted at a rank that does not need the item."""
    found = 0
    for s in p.steps:
        if s.action == "tree":
            sched = trees.schedule(from_layout(s.before, mesh, shape),
                                   from_layout(s.after, mesh, shape), mesh)
            found += sum(1 for *_, needs in sched.roots if not needs)
    return found


def run_cases(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank: what differs from sim, and each plan's steps."""
    problems, steps = [], []
    for i, (spec, shape, src, dst, dtype) in enumerate(CASES):
        bound = mc.init_mesh(spec)
        pos = bound.mesh.position(rank)
        p = mc.plan(bound.mesh, shape, src, dst, dtype=dtype, cost_model=BYTES_ONLY)
        steps.append([s.action for s in p.steps])
        data = ints(shape, i, dtype) if not dtype.is_floating_point else \
            torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=dtype)
        locs = mc.sim.scatter(data, bound.mesh, src)
        want = sim_execute(p, locs).outputs[pos]
        trace = ByteTrace()
        got = execute(p, locs[pos], bound, trace=trace)
        where = f"{spec} {shape} \"{src}\" -> \"{dst}\" on rank {rank}"
        problems += sim_problems(where, p, rank, got, want, trace)
    return {"problems": problems, "steps": steps}


reports = ranks_fixture(run_cases, 8, timeout_s=240.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]} {c[2]}")
def test_each_case_is_one_tree_with_helper_roots(case: tuple[Any, ...]) -> None:
    spec, shape, src, dst, dtype = case
    mesh = mc.Mesh(spec)
    p = mc.plan(mesh, shape, src, dst, dtype=dtype, cost_model=BYTES_ONLY)
    assert [s.action for s in p.steps] == ["tree"], p
    assert helper_roots(mesh, shape, p) > 0, p


def test_helper_rooted_trees_on_8_ranks_equal_sim_bit_for_bit(reports: list[dict[str, Any]]
                                                             ) -> None:
    problems = [p for rep in reports for p in rep["problems"]]
    assert not problems, "\n".join(problems[:5])
    assert all(rep["steps"] == [["tree"]] * len(CASES) for rep in reports), reports[0]["steps"]
