"""mc.reshard_many on 4 gloo ranks: bucketed results equal one-by-one reshards, bit for bit,
with one collective per bucketed step instead of one per tensor.

Data is integer-valued, so a reduction over a bucket's flat buffer gives the same bits as
one per tensor. Buckets are computed from the plans only, so every rank makes the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import meshcomm as mc
from meshcomm.runtime.bind import BoundMesh
from meshcomm.executors.distributed.handlers import ByteTrace, buckets, signature

from conftest import ints, ranks_fixture, scaled

ROOT = Path(__file__).resolve().parents[2]
MESH = "dp=2 tp=2"
BUCKETED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# (src, dst, rows): several tensors of each; one signature per row of this table.
MIXED = [
    ("(dp tp b) h", "b h", 8),                  # all_gather
    ("b h | sum(dp, tp)", "(dp tp b) h", 8),    # reduce_scatter
    ("b h | avg(tp)", "b h", 8),                # all_reduce (avg)
    ("(dp b) h", "b (dp h)", 8),                # all_to_all
    ("(dp tp b) h", "(tp dp b) h", 8),          # permute: one by one
    ("(dp tp b) h", "(dp b) h", 7),             # uneven all_gather: one by one
    ("(dp b) h | sum(tp)", "b (tp h)", 8),      # reduce_scatter then all_gather (on bytes)
]
# The mixed items plan on bytes alone: the default's per-round latency would send the last
# signature's partials straight to their owners in one send_recv (more bytes, one round),
# and this test is about how signatures of several collectives bucket.
BYTES = mc.CostModel(latency_s=0.0)


def mixed_items(bound: BoundMesh) -> list[Any]:
    """Sharded items and (x, mesh, src, dst, shape) items, interleaved across signatures."""
    items: list[Any] = []
    for k in range(3):
        for j, (src, dst, rows) in enumerate(MIXED):
            x = ints((rows, 4 + 2 * k), 10 * j + k)
            s = mc.distribute(x, bound, src)
            items.append((s, dst) if k % 2 == 0 else (s.local, bound, src, dst, s.shape))
    return items


def one_by_one(items: list[Any]) -> tuple[list[Tensor], int]:
    outs, calls = [], 0
    for item in items:
        trace = ByteTrace()
        if len(item) == 2:
            s, dst = item
            outs.append(mc.reshard(s.local, s.mesh, s.layout, dst, shape=s.shape, trace=trace,
                                   cost_model=BYTES))
        else:
            x, bound, src, dst, shape = item
            outs.append(mc.reshard(x, bound, src, dst, shape=shape, trace=trace,
                                   cost_model=BYTES))
        calls += len(trace.calls)
    return outs, calls


def plan_of(item: Any) -> tuple[Tensor, BoundMesh, mc.Plan]:
    if len(item) == 2:
        s, dst = item
        return s.local, s.mesh, mc.plan(s.mesh.mesh, s.shape, s.layout, dst, cost_model=BYTES)
    x, bound, src, dst, shape = item
    return x, bound, mc.plan(bound.mesh, shape, src, dst, cost_model=BYTES)


def expected_calls(items: list[Any], bucket_bytes: int) -> int:
    """One call per bucketed step per bucket of 2 or more, else one per tensor."""
    jobs = [plan_of(item) for item in items]
    total = 0
    for bucket in buckets(jobs, bucket_bytes):
        for step in jobs[bucket[0]][2].collectives:
            together = len(bucket) > 1 and step.kind in BUCKETED and step.dim is None
            total += 1 if together else len(bucket)
    return total


def unwrap(out: Any) -> Tensor:
    return out.local if isinstance(out, mc.Sharded) else out


def check(bound: BoundMesh) -> dict[str, Any]:
    report: dict[str, Any] = {"problems": []}
    problems = report["problems"]
    # FSDP-style: 50 parameters of different sizes, all gathered by one collective.
    params = [mc.distribute(ints((4 * (1 + i % 5), 3 + i % 4), i), bound, "(dp tp b) h")
              for i in range(50)]
    trace = ByteTrace()
    full = mc.reshard_many([(p, "b h") for p in params], trace=trace)
    report["fsdp_calls"] = len(trace.calls)
    report["fsdp_bytes"] = (trace.send_bytes, trace.recv_bytes)
    pos = bound.mesh.position(bound.rank)
    plans = [mc.plan(bound.mesh, p.shape, p.layout, "b h") for p in params]
    report["fsdp_planned"] = (sum(p.send_bytes[pos] for p in plans),
                              sum(p.recv_bytes[pos] for p in plans))
    for p, out in zip(params, full):
        if not (isinstance(out, mc.Sharded) and out.layout == mc.Layout("b h")
                and torch.equal(out.local, p.full())):
            problems.append(f"fsdp item {p} differs")
    # Mixed signatures, several bucket sizes (1 byte: every item alone).
    items = mixed_items(bound)
    want, report["one_by_one_calls"] = one_by_one(items)
    report["mixed_calls"] = {}
    for bucket_bytes in (25 * 2**20, 500, 1):
        trace = ByteTrace()
        got = mc.reshard_many(items, bucket_bytes=bucket_bytes, trace=trace, cost_model=BYTES)
        report["mixed_calls"][bucket_bytes] = (len(trace.calls),
                                               expected_calls(items, bucket_bytes))
        for k, (g, w) in enumerate(zip(got, want)):
            if not torch.equal(unwrap(g), w):
                problems.append(f"bucket_bytes={bucket_bytes}: item {k} {items[k][-1]} differs")
    # A gradient is needed: items run one by one through reshard, and stay differentiable.
    x = ints((8, 4), 5).requires_grad_()
    (y,) = mc.reshard_many([(x, bound, "b h", "(dp tp b) h", (8, 4))])
    y.sum().backward()
    report["grad"] = x.grad is not None and torch.equal(x.grad, torch.ones(8, 4))
    return report


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    return check(mc.init_mesh(MESH))


four = ranks_fixture(four_ranks, 4)


def test_bucketed_results_equal_one_by_one(four: list[dict[str, Any]]) -> None:
    problems = [p for rep in four for p in rep["problems"]]
    assert not problems, "\n".join(problems[:5])


def test_fifty_gathers_are_one_collective(four: list[dict[str, Any]]) -> None:
    for rep in four:
        assert rep["fsdp_calls"] == 1
        assert rep["fsdp_bytes"] == rep["fsdp_planned"]  # gathers add up exactly


def test_mixed_items_bucket_by_signature(four: list[dict[str, Any]]) -> None:
    rep = four[0]
    calls = rep["mixed_calls"]
    assert all(got == want for got, want in calls.values()), calls
    # 7 signatures of 3 items; one signature has 2 collectives, so 8 calls per round.
    assert calls[1][0] == rep["one_by_one_calls"] == 3 * 8
    # 4 bucketed signatures, permute and uneven gather one by one, 2 bucketed steps.
    assert calls[25 * 2**20][0] == 4 + 3 * 2 + 2
    # 500 bytes of peak: pairs of the smaller items share (plans' peaks 64 to 512 bytes).
    assert calls[500][0] == 2 + 2 + 3 + 2 + 3 + 3 + 2 * 2


def test_items_that_need_a_gradient_run_one_by_one(four: list[dict[str, Any]]) -> None:
    assert all(rep["grad"] for rep in four)


def test_signatures_ignore_sizes_but_not_kinds() -> None:
    mesh = mc.Mesh(MESH)
    bound = BoundMesh(mesh, "gloo", torch.device("cpu"), 0, {})
    a = mc.plan(mesh, (8, 4), "(dp tp b) h", "b h")
    b = mc.plan(mesh, (16, 6), "(dp tp b) h", "b h")
    c = mc.plan(mesh, (8, 4), "(dp b) h", "b h")
    d = mc.plan(mesh, (8, 4), "(dp tp b) h", "b h", dtype=torch.float64)
    assert signature(a, bound) == signature(b, bound)
    assert signature(a, bound) != signature(c, bound) != signature(d, bound)


def test_benchmark_quick_mode_runs(tmp_path: Path) -> None:
    out = tmp_path / "reshard_vs_dtensor.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # --quick spawns one group of 4 ranks; the benchmark's own default timeout is 480 s
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reshard_vs_dtensor.py"),
                           "--quick", "--json", str(out), "--timeout", str(scaled(240))],
                          capture_output=True, text=True, env=env, timeout=scaled(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"meta", "cases", "summary", "overhead", "many"} <= set(report)
    assert report["cases"] and all(row["ok"] for row in report["cases"])
    assert report["summary"]["cases"] == len(report["cases"])
    # reshard_many gave the same tensors as the loop of reshards it was timed against
    assert {"all_gather", "reduce_scatter"} <= set(report["many"])
    assert report["many"]["all_gather"]["ok"] and report["many"]["reduce_scatter"]["ok"]
    assert "geometric mean" in done.stdout
