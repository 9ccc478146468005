"""Every rank must plan the same steps, and each rank's Python hashes strings with its own
seed (unless PYTHONHASHSEED is set): a plan that picked between equal candidates by the
iteration order of a set of axis names would differ between ranks (a hang or a wrong
result). Here the same cases are planned, cold, in two processes seeded differently, under
the default cost model and on bytes alone, and the plans compared whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLANNER = r"""
import hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import meshcomm as mc
import plan_fuzz_time as fuzz
from plan_fuzz_same import digest

cases = fuzz.random_small(120, 5) + fuzz.random_cross(80, 5)
cases.append(("pp=1 ep=2", (24,), "i | avg(ep)", "(ep i)", "ep=2@1"))   # seed 1 vs 2 differed
out = []
for latency in (None, 0.0):
    for case in cases:
        fuzz.clear_caches()
        src, dst = fuzz.meshes(case)
        kw = {} if latency is None else {"cost_model": mc.CostModel(latency_s=latency)}
        if dst is not None:
            kw["dst_mesh"] = dst
        plan = mc.plan(src, case[1], case[2], case[3], **kw)
        out.append([repr(case), latency, digest(plan)["hash"]])
print(json.dumps(out))
"""


def _plans(seed: int) -> list[list[object]]:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PLANNER, str(ROOT)], env=env, check=True,
                          capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout)


def test_plans_do_not_depend_on_string_hashing():
    one, two = _plans(1), _plans(2)
    assert len(one) == len(two) > 400
    differ = [(a[0], a[1]) for a, b in zip(one, two) if a != b]
    assert not differ, f"plans differ between hash seeds 1 and 2: {differ[:5]}"


def test_every_rank_of_a_plan_between_meshes_lists_its_transfers():
    """A tree step on the source mesh, asked for a destination-only rank's transfers (a plan
    between meshes lists both meshes' ranks), answers none; it raised ValueError."""
    import meshcomm as mc

    plan = mc.plan(mc.Mesh("pp=4 ep=4"), (6,), "i | avg(ep)", "(tp i) | avg(dp)",
                   dst_mesh=mc.Mesh("cp=2 dp=3 tp=2", ranks=range(5, 17)),
                   cost_model=mc.CostModel(latency_s=0.0))
    trees = [s for s in plan.steps if s.action == "tree"]
    assert trees, [str(s) for s in plan.steps]
    assert 16 in plan.ranks and 16 not in plan.mesh
    for step in trees:
        assert step.rank_transfers(16) == ()
        assert any(step.rank_transfers(r) for r in plan.mesh.ranks)
