"""mc.reshard and the torch.distributed executor on gloo, 4 and 8 ranks.

A broad seeded sample of transitions (even and uneven shapes, partial sources, every op)
runs on 2x2 (4 processes), 2x4 and 2x2x2 (8 processes): each rank's output must equal
`mc.sim.execute` bit for bit, and the bytes counted at each collective call must equal the
plan's figures for that step and rank. Data is integer-valued, so every reduction order
gives the same bits. Each spawn costs seconds, so one run per world size checks every
case and the tests read its report. Input errors are checked in this process on a
BoundMesh with no process groups: they must fire before any communication.
"""

from __future__ import annotations

import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm import cli
from meshcomm.sharded import infer_shape
from meshcomm.runtime.bind import BoundMesh
from meshcomm.executors.distributed.execute import execute
from meshcomm.executors.distributed.handlers import ByteTrace
from meshcomm.core.errors import MeshMismatchError, ShapeError
from meshcomm.executors.sim import execute as sim_execute
from meshcomm.testing import random_layout

from conftest import ints, ranks_fixture, scaled, sim_problems

ROOT = Path(__file__).resolve().parents[2]
NAMES = "ijk"
SIZES = (4, 6, 8, 12, 5, 7, 1)
OPS = ("sum", "max", "min", "avg")
SAMPLE_4 = 150           # transitions on 2x2
SAMPLE_8 = 40            # transitions on each 8-rank mesh
# Cases the sample may miss: uneven collectives, permutes, send_recv, dtypes.
NAMED = [
    ("dp=2 tp=2", (7, 4), "(dp tp b) h", "(dp b) h", torch.float32),        # all_gather_v
    ("dp=2 tp=2", (7, 4), "b h | sum(tp)", "(tp b) h", torch.float32),      # reduce_scatter_v
    ("dp=2 tp=2", (7, 4), "b h | max(tp)", "(tp b) h", torch.float32),
    ("dp=2 tp=2", (8, 4), "(dp tp b) h", "(tp dp b) h", torch.float32),     # permute
    ("dp=2 tp=2", (8, 4), "(dp b) (tp h)", "(tp b) (dp h)", torch.float64),
    ("dp=2 tp=2", (12,), "(tp b)", "(b tp)", torch.float32),
    ("dp=2 tp=2", (8, 6), "(dp b) (tp h)", "b (dp tp h)", torch.bfloat16),
    ("dp=2 tp=2", (8, 6), "b h | sum(dp, tp)", "(dp b) (tp h)", torch.int64),
    ("dp=2 tp=2", (8, 6), "b h | min(tp)", "b h", torch.int32),
    ("dp=2 tp=2", (8, 6), "(dp b) h | sum(tp)", "b (tp h)", torch.complex64),
    ("dp=2 tp=2", (8, 6), "(dp b) (tp h)", "(b dp) h | avg(tp)", torch.float64),
    ("dp=2 tp=2", (), "| sum(dp, tp)", "", torch.float32),
    ("dp=2 tp=4", (12,), "(tp b)", "(b tp)", torch.float32),                # send_recv
    ("dp=2 tp=4", (8, 16), "(dp tp b) s", "(tp dp b) s", torch.float32),
    ("dp=2 tp=4", (7, 10), "(dp b) (tp s)", "(tp b) (dp s)", torch.float32),
    ("a=2 b=2 c=2", (8, 8), "(a b c w) x", "(c b a w) x", torch.float32),
    ("dp=2 tp=4", (12,), "a | sum(tp)", "(tp dp a)", torch.float32),       # send_recv_reduce
    ("dp=2 tp=4", (12, 3), "a b | avg(tp)", "(tp dp a) b", torch.float64),
    ("a=2 b=2 c=2", (5, 3), "(a x) y | max(b, c)", "(c x) y", torch.float32),
    ("a=2 b=2 c=2", (5, 6, 7), "(a w) (b x) (c y)", "(c w) (a x) (b y)", torch.float32),
    ("dp=2 tp=2", (5,), "(tp i) | sum(dp)", "(dp i)", torch.float32),          # send_recv_tree
    ("dp=2 tp=2", (6, 2), "(dp i) j | min(tp)", "(tp i) (dp j)", torch.int32),
    ("dp=2 tp=4", (5,), "(tp i) | avg(dp)", "(dp i)", torch.float64),
    ("dp=2 tp=4", (3,), "i | max(tp)", "(tp dp i)", torch.bfloat16),
    ("dp=2 tp=4", (13, 2), "(dp i) j | sum(tp)", "(tp i) j", torch.int64),
    ("a=2 b=2 c=2", (4, 4), "(a i) j | sum(b, c)", "(c i) j", torch.float32),
    ("a=2 b=2 c=2", (3, 5), "(c i) j | avg(a, b)", "i (a j) | avg(b)", torch.float32),
    ("dp=2 tp=4", (5, 3), "i (dp j) | sum(tp)", "i j", torch.float32),      # tree, combiners
    ("a=2 b=2 c=2", (5, 5), "i (b c j) | avg(a)", "(b i) (c j)", torch.float64),
    ("a=2 b=2 c=2", (3, 3, 16), "i (c j) k | max(a)", "i j (c a k)", torch.float32),  # relay
    ("dp=2 tp=4", (8, 8), "(tp i) j", "(dp i) (tp j)", torch.float32),   # rotated send_recv
    ("a=2 b=2 c=2", (1, 8), "(a b i) j", "(c i) (b j)", torch.int64),
    ("dp=2 tp=2", (16, 3), "(tp s) d", "zigzag(tp s) d", torch.float32),     # zigzag
    ("dp=2 tp=2", (13, 3), "zigzag(dp tp s) d", "(dp tp s) d", torch.float64),
    ("dp=2 tp=2", (9, 4), "s (tp d)", "zigzag(dp s) (tp d)", torch.float32),
    ("dp=2 tp=2", (10, 4), "zigzag(tp s) d | sum(dp)", "s d", torch.int64),
    ("dp=2 tp=4", (19, 2), "zigzag(tp s) (dp d)", "(dp s) d", torch.float32),
    ("dp=2 tp=4", (32, 2), "(s tp) d", "zigzag(tp s) d", torch.float32),
    ("dp=2 tp=2", (13, 3), "zigzag(dp tp s) d", "s d", torch.float64),  # gather, select
    ("dp=2 tp=2", (16, 6), "zigzag(tp s) (dp d)", "s d", torch.float32),
    ("dp=2 tp=4", (19, 2), "zigzag(tp s) d", "s (dp d)", torch.float32),
]
# Partial sources straight to their owners: one step with the default cost model's latency.
DIRECT = [
    ("dp=2 tp=2", (8, 6), "(b dp) h | sum(tp)", "(dp tp b) h", torch.float32),
    ("a=2 b=2 c=2", (6, 10), "(b i) j | sum(c)", "(a i) (b j)", torch.float32),
]
KINDS = {"local", "all_gather", "all_gather_v", "reduce_scatter", "reduce_scatter_v",
         "all_reduce", "all_to_all", "collective_permute", "send_recv", "send_recv_reduce",
         "send_recv_tree", "send_recv_direct"}
# The NAMED cases name the step each one reaches on bytes alone (trees among them: the
# default model's latency takes one collective instead on these small tensors); the sample
# and DIRECT plan with the default.
BYTES_ONLY = mc.CostModel(latency_s=0.0)


# -- the sample -------------------------------------------------------------------------
def sample(mesh_spec: str, n: int, seed: int) -> list[tuple[str, tuple[int, ...], str, str,
                                                           torch.dtype]]:
    """`n` transitions that fit their shapes, the same on every rank."""
    mesh, rng, out = mc.Mesh(mesh_spec), random.Random(seed), []
    while len(out) < n:
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(SIZES) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, OPS, NAMES)
        op = mc.Layout(src).reduce_op
        dst = random_layout(rng, mesh, ndim, (op,) if op else OPS, NAMES)
        try:
            mc.Layout(src).placements(mesh, shape)
            mc.Layout(dst).placements(mesh, shape)
        except mc.errors.ShapeError:
            continue
        out.append((mesh_spec, shape, src, dst, torch.float32))
    return out


# -- what every rank runs ----------------------------------------------------------------
def step_kind(step: mc.Step) -> str:
    if step.action in ("tree", "direct"):
        return f"send_recv_{step.action}"
    if step.kind == "send_recv" and step.op is not None:
        return "send_recv_reduce"
    return step.kind + ("_v" if step.dim is not None and step.kind != "local" else "")


def check_cases(bounds: dict[str, BoundMesh], cases: list[Any]) -> dict[str, Any]:
    """Run every case on this rank; report mismatches as text, and the step kinds seen."""
    problems, kinds = [], set()
    for i, (spec, shape, src, dst, dtype) in enumerate(cases):
        bound = bounds[spec]
        mesh, rank = bound.mesh, bound.rank
        pos = mesh.position(rank)
        cm = BYTES_ONLY if cases[i] in NAMED else None
        p = mc.plan(mesh, shape, src, dst, dtype=dtype, cost_model=cm)
        kinds |= {step_kind(s) for s in p.steps}
        locs = mc.sim.scatter(ints(shape, i, dtype), mesh, src)
        want = sim_execute(p, locs).outputs[pos]
        trace = ByteTrace()
        if i % 2:   # the public API, with the shape inferred when every rank can infer it
            even = all(infer_shape(mesh, p.src, tuple(x.shape), r) == shape
                       for r, x in zip(mesh.ranks, locs) if all(x.shape))
            got = mc.reshard(locs[pos], bound, src, dst, shape=None if even else shape,
                             trace=trace, cost_model=cm)
        else:
            got = execute(p, locs[pos], bound, trace=trace)
        where = f"case {i} {spec} {shape} {dtype} \"{src}\" -> \"{dst}\" on rank {rank}"
        problems += sim_problems(where, p, rank, got, want, trace)
    return {"problems": problems, "kinds": sorted(kinds), "cases": len(cases)}


def check_values(bound: BoundMesh) -> list[str]:
    """Sharded, distribute and full() on real ranks."""
    problems = []
    x = ints((8, 6), 7, torch.float32)
    for layout in ("(dp b) (tp h)", "(b dp) h | sum(tp)", "(dp tp b) h", "b h | max(dp)"):
        s = mc.distribute(x, bound, layout)
        for dst in ("b (dp tp h)", "(tp b) h | sum(dp)", "b h"):
            ops = {mc.Layout(layout).reduce_op, mc.Layout(dst).reduce_op} - {None}
            if len(ops) > 1:
                continue  # one axis cannot mix two reductions
            t = s.reshard(dst)
            if t.layout != mc.Layout(dst) or not torch.equal(t.full(), x):
                problems.append(f"distribute({layout}).reshard({dst}).full() != x")
        if not torch.equal(s.full(), x):
            problems.append(f"distribute({layout}).full() != x")
    uneven = mc.distribute(ints((7, 3), 8, torch.float32), bound, "(dp tp b) h")
    if not torch.equal(uneven.reshard("(tp b) h").full(), ints((7, 3), 8, torch.float32)):
        problems.append("uneven Sharded round trip differs")
    return problems


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 tp=2")
    cases = sample("dp=2 tp=2", SAMPLE_4, 4) + [c for c in NAMED + DIRECT
                                                if c[0] == "dp=2 tp=2"]
    report = check_cases({"dp=2 tp=2": bound}, cases)
    report["values"] = check_values(bound)
    return report


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    specs = ("dp=2 tp=4", "a=2 b=2 c=2")
    bounds = {spec: mc.init_mesh(spec) for spec in specs}
    cases = [c for k, spec in enumerate(specs) for c in sample(spec, SAMPLE_8, 8 + k)]
    return check_cases(bounds, cases + [c for c in NAMED + DIRECT if c[0] in specs])


# one spawn per world size; the tests read its report
four = ranks_fixture(four_ranks, 4)
eight = ranks_fixture(eight_ranks, 8)


def test_reshard_equals_sim_and_counts_bytes_on_2x2(four: list[dict[str, Any]]) -> None:
    problems = [p for rep in four for p in rep["problems"]]
    assert not problems, "\n".join(problems[:5])
    assert four[0]["cases"] == SAMPLE_4 + sum(c[0] == "dp=2 tp=2" for c in NAMED + DIRECT)


def test_reshard_equals_sim_and_counts_bytes_on_2x4_and_2x2x2(
        eight: list[dict[str, Any]]) -> None:
    problems = [p for rep in eight for p in rep["problems"]]
    assert not problems, "\n".join(problems[:5])


def test_the_sample_covers_every_step_kind(four: list[dict[str, Any]],
                                           eight: list[dict[str, Any]]) -> None:
    assert set(four[0]["kinds"]) | set(eight[0]["kinds"]) == KINDS


def test_sharded_distribute_and_full_on_4_ranks(four: list[dict[str, Any]]) -> None:
    problems = [p for rep in four for p in rep["values"]]
    assert not problems, "\n".join(problems)


# -- structure and input errors, in this process (nothing communicates) -------------------
def fake_bound(spec: str = "dp=2 tp=2", rank: int = 1) -> BoundMesh:
    """A BoundMesh with no process groups: any collective would fail, checks must not."""
    return BoundMesh(mc.Mesh(spec), "gloo", torch.device("cpu"), rank, {})


def test_wrong_local_shape_fails_before_communication() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(dp b) (tp h)", "b h")
    msg = ('local tensor on rank 1 has shape (4, 6), but layout "(dp b) (tp h)" of global shape'
           " (8, 6) on Mesh(dp=2, tp=2) gives it shape (4, 3). fix: pass the shard this rank"
           " holds, or the right global shape/layout")
    with pytest.raises(ShapeError, match=re.escape(msg)):
        execute(p, torch.zeros(4, 6), fake_bound())
    with pytest.raises(ShapeError, match=re.escape(msg)):
        mc.reshard(torch.zeros(4, 6), fake_bound(), "(dp b) (tp h)", "b h", shape=(8, 6))


def test_wrong_dtype_and_mesh_fail_before_communication() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(dp b) (tp h)", "b h")
    with pytest.raises(ShapeError, match=re.escape(
            "local tensor of rank 1 has dtype torch.float64 but the plan was made for"
            " torch.float32; fix: mc.plan(..., dtype=torch.float64)")):
        execute(p, torch.zeros(4, 3, dtype=torch.float64), fake_bound())
    with pytest.raises(MeshMismatchError, match=re.escape(
            "plan was made for Mesh(dp=2, tp=2) but is run on Mesh(tp=2, dp=2). fix: plan"
            " with the bound mesh, mc.plan(bound.mesh, ...)")):
        execute(p, torch.zeros(4, 3), fake_bound("tp=2 dp=2"))
    with pytest.raises(MeshMismatchError, match=re.escape(
            "reshard needs a mesh bound to torch.distributed, got the Mesh Mesh(dp=2, tp=2);"
            " fix: bound = mc.init_mesh('dp=2 tp=2') on every rank, then pass bound")):
        mc.reshard(torch.zeros(4, 3), mc.Mesh("dp=2 tp=2"), "(dp b) (tp h)", "b h")


def test_global_shape_is_inferred_locally_for_even_layouts() -> None:
    mesh = mc.Mesh("dp=2 tp=2")
    assert infer_shape(mesh, mc.Layout("(dp b) s | sum(tp)"), (4, 6), 0) == (8, 6)
    assert infer_shape(mesh, mc.Layout("(b dp) (x=3 tp s)"), (4, 6), 3) == (8, 12)
    assert infer_shape(mesh, mc.Layout("b s"), (4, 6), 2) == (4, 6)
    msg = ('cannot infer the global shape of layout "(dp tp b) s" on Mesh(dp=2, tp=2): rank 3'
           " holds 0 elements of dim 0, so its shards are uneven. fix: pass shape=(...) (the"
           " global shape) on every rank")
    with pytest.raises(ShapeError, match=re.escape(msg)):
        mc.reshard(torch.zeros(0, 6), fake_bound(rank=3), "(dp tp b) s", "b s")


@pytest.mark.parametrize("layout", ["(dp b) (tp h)", "(b tp) h | sum(dp)", "(dp tp b) h",
                                    "b h | max(dp, tp)", "(tp b) h | avg(dp)", "b h"])
def test_distribute_slices_like_sim_scatter(layout: str) -> None:
    x = ints((6, 4), 3, torch.float32)
    for rank in range(4):
        s = mc.distribute(x, fake_bound(rank=rank), layout)
        assert torch.equal(s.local, mc.sim.scatter(x, mc.Mesh("dp=2 tp=2"), layout)[rank])
        assert s.shape == (6, 4) and s.layout == mc.Layout(layout)


def test_sharded_checks_its_shard_and_shows_its_layout(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    s = mc.Sharded(torch.zeros(4, 3), fake_bound(), "(dp b) (tp h)", (8, 6))
    assert repr(s) == ("Sharded(layout='(dp b) (tp h)', shape=(8, 6), mesh=Mesh(dp=2, tp=2),"
                       " rank=1, local=(4, 3) torch.float32)")
    s.show(width=80)
    assert 'layout "(dp b) (tp h)" of shape (8, 6) on Mesh(dp=2, tp=2)' in capsys.readouterr().out
    with pytest.raises(ShapeError, match=re.escape("Sharded.local on rank 1 has shape (4, 6)")):
        mc.Sharded(torch.zeros(4, 6), fake_bound(), "(dp b) (tp h)", (8, 6))


# -- the command line: `meshcomm demo` and `meshcomm launch` -------------------------------
def _cli(*argv: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m meshcomm *argv`, killed after `scaled(timeout)` seconds."""
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "meshcomm", *argv], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=scaled(timeout))


def test_demo_runs_on_4_processes_and_exits_0() -> None:
    done = _cli("demo", "--width", "100", timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "on 4 local processes (torch.distributed, gloo)" in done.stdout
    assert done.stdout.count("OK: ") == 3 and "FAIL" not in done.stdout


TINY = """
import sys, torch
import torch.distributed.tensor._random
import meshcomm as mc
bound = mc.init_mesh("tp=2")
y = mc.reshard(torch.arange(3.0) + 3 * bound.rank, bound, "(tp b)", "b")
print(f"rank {bound.rank} {bound.backend} {y.tolist()} {sys.argv[1:]}")
# torch's log lines carry "[rank0]:" once a group exists; the launcher's tee must not add one
torch.distributed.tensor._random.logger.warning("a torch log line")
"""


def test_launch_runs_a_script_on_2_processes(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    done = _cli("launch", "-n", "2", str(script), "hello", timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} gloo [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] ['hello']" in done.stdout
        logged = [line for line in done.stderr.splitlines() if "a torch log line" in line]
        assert any(line.startswith(f"[rank{rank}]:W") for line in logged), done.stderr
    assert "]:[rank" not in done.stdout + done.stderr, done.stderr[-2000:]


def test_one_prefix_collapses_a_doubled_rank_prefix_only() -> None:
    out = io.StringIO()
    stream = cli.OnePrefix(out)
    stream.write("[rank3]:[rank3]:W a log line\n[rank3]:a print\n")
    stream.write("[rank1]:[rank2]: two ranks stay\n")
    assert out.getvalue() == ("[rank3]:W a log line\n[rank3]:a print\n"
                              "[rank1]:[rank2]: two ranks stay\n")


def test_launch_reports_a_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit(3)\n")
    done = _cli("launch", "-n", "2", str(script), timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert "meshcomm launch:" in done.stderr
