"""Plans against DTensor's, case by case: partial sources with uneven dims, where a search
over 6,000 random transitions once found meshcomm receiving up to 1.42x DTensor's bytes.

Each expected figure is the busiest rank's received bytes of DTensor's own plan for the
case (its default planner, padded collectives counted as they travel), worked out from its
transforms in the comment. meshcomm must receive no more, and be exact in simulation.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshcomm as mc
from meshcomm.executors.sim import execute, gather, scatter

from conftest import scaled

CASES = [
    # mesh, shape, src, dst, DTensor bytes (its transforms)
    ("dp=2 tp=2", (10, 11), "u (tp v) | sum(dp)", "(tp u) (dp v)", 240),  # tp S1->S0, dp P->S1
    ("dp=2 tp=2", (4, 11, 12), "(tp u) v w | sum(dp)", "(dp u) (tp v) w", 1152),  # tp S0->S1, dp P->S0
    ("dp=2 tp=2", (9, 12), "(tp u) v | sum(dp)", "(dp u) (tp v)", 240),  # tp S0->S1, dp P->S0
    ("dp=2 tp=2", (16, 7), "(tp u) v | sum(dp)", "(dp u) (tp v)", 256),
    ("dp=2 tp=2", (8, 3), "u (tp v) | sum(dp)", "(tp u) (dp v)", 64),
    ("a=2 b=2 c=2", (6, 12), "(a c u) v | sum(b)", "(a b u) (c v)", 96),  # c S0->S1, b P->S0
    ("a=2 b=2 c=2", (12, 3), "u (c v) | sum(a)", "(c u) (a b v)", 96),  # c S1->S0, a P->S1, b R->S1
    ("a=2 b=2 c=2", (12, 10, 3), "(a u) v (c w) | sum(b)", "u (c v) w", 960),  # c S2->S1, b P->R, a S0->R
]


@pytest.mark.parametrize("mesh, shape, src, dst, dtensor_bytes", CASES)
def test_partial_sources_with_uneven_dims_move_no_more_than_dtensor(mesh, shape, src, dst,
                                                                    dtensor_bytes):
    m = mc.Mesh(mesh)
    # bytes alone: the default model's latency may take one step that receives more over
    # DTensor's two or three collectives (`"(a u) v (c w) | sum(b)"` here: one direct
    # delivery of 1,320 B against DTensor's 960 B in three transforms)
    p = mc.plan(m, shape, src, dst, cost_model=mc.CostModel(latency_s=0.0))
    assert max(p.recv_bytes) <= dtensor_bytes, str(p)
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    res = execute(p, scatter(x, m, src))
    assert res.recv_bytes == p.recv_bytes
    assert torch.equal(gather(list(res.outputs), m, dst, shape), x)


_PLANS = """
import hashlib, random
import meshcomm as mc
from meshcomm.testing import random_layout
rng = random.Random(5)
meshes = [mc.Mesh("a=2 b=2 c=2"), mc.Mesh("dp=2 tp=4"), mc.Mesh("a=2 b=1 c=3 d=2")]
out = []
while len(out) < 150:
    mesh = rng.choice(meshes); nd = rng.randint(1, 3)
    shape = tuple(rng.choice([1, 4, 6, 7, 8, 12]) for _ in range(nd))
    s, d = random_layout(rng, mesh, nd, ("sum", "max")), random_layout(rng, mesh, nd, ("sum", "max"))
    try:
        p = mc.plan(mesh, shape, s, d)
    except mc.errors.MeshcommError:
        continue
    out.append(" ; ".join(str(x) for x in p.steps))
print(hashlib.sha256("\\n".join(out).encode()).hexdigest())
"""


def test_every_process_plans_alike_whatever_its_string_hashes():
    """Ranks plan independently, so the search must not depend on PYTHONHASHSEED."""
    root = Path(__file__).resolve().parents[1]
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _PLANS], capture_output=True, text=True,
                             env=env, cwd=root, timeout=scaled(300), check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests
