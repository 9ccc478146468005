"""Plans between two meshes on gloo with 8 processes, and the examples that use them.

One spawn of 8 processes binds every mesh below and runs every case: a seeded sample of
layout pairs per mesh pair (disjoint, overlapping, nested, 4 -> 2, 2 -> 4, 3 -> 4, 8 -> 4,
both directions, partial sources and destinations, uneven shapes) plus named cases. Each
rank's output must equal `mc.sim` running the same plan bit for bit (None outside the
destination mesh), and the bytes counted at each call must equal the plan's figures for
that rank. Data is integer-valued, so every reduction order gives the same bits. Input
errors are checked in this process on BoundMeshes with no process groups: they must fire
before any communication.
"""

from __future__ import annotations

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
from meshcomm.sharded import infer_shape
from meshcomm.runtime.bind import BoundMesh
from meshcomm.executors.distributed.execute import execute_cross
from meshcomm.executors.distributed.handlers import ByteTrace
from meshcomm.core.errors import MeshMismatchError, PlanError, ShapeError
from meshcomm.planner.explain import balance, transfer_lines, transfer_rows
from meshcomm.testing import random_layout

from conftest import ints, ranks_fixture, scaled, sim_problems

ROOT = Path(__file__).resolve().parents[2]
MESHES = {                                            # bound in this order on every rank
    "A": mc.Mesh("dp=2 tp=2"),                        # ranks 0-3
    "B": mc.Mesh("tp=4", ranks=[4, 5, 6, 7]),         # disjoint from A
    "C": mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5]),      # overlaps A and B
    "D": mc.Mesh("q=2", ranks=[4, 5]),                # 2 ranks, disjoint from A
    "E": mc.Mesh("p=3"),                              # ranks 0-2
    "F": mc.Mesh("a=2 b=2 c=2"),                      # all 8
    "G": mc.Mesh("dp=4"),                             # ranks 0-3, for replicated sources
    "H": mc.Mesh("q=2", ranks=[1, 2]),                # nested in A
    "I": mc.Mesh("tp=4", ranks=[0, 2, 4, 6]),         # nested in F
}
PAIRS = [("A", "B"), ("A", "C"), ("A", "D"), ("E", "B"), ("E", "C"), ("F", "I"), ("A", "H"),
         ("G", "D")]
PER_PAIR = 10                                         # sampled cases per pair
NAMES = "ijk"
SIZES = (4, 6, 8, 5, 7, 3)
F32 = torch.float32
NAMED = [  # (tag, src mesh, dst mesh, shape, src, dst, dtype)
    ("disjoint", "A", "B", (8, 16), "(dp b) (tp s)", "b (tp s)", F32),
    ("disjoint", "B", "A", (8, 16), "b (tp s)", "(dp b) (tp s)", torch.float64),
    ("overlapping", "A", "C", (8, 6), "(dp b) s", "(x b) s", F32),
    ("overlapping", "C", "A", (8, 6), "(x b) (y s)", "(tp b) (dp s)", torch.int64),
    ("4->2", "A", "D", (8, 6), "(dp b) (tp s)", "b (q s)", F32),
    ("4->2", "A", "H", (8, 6), "(dp tp b) s", "(q b) s", torch.bfloat16),
    ("2->4", "D", "A", (6, 4), "(q b) s", "(dp b) (tp s)", F32),
    ("2->4", "D", "C", (5, 3), "(q b) s", "(y x b) s", F32),
    ("3->4", "E", "B", (7, 5), "(p b) s", "(tp b) s", F32),
    ("3->4", "E", "C", (7, 5), "(p b) s", "(x b) (y s)", F32),
    ("3->4", "E", "B", (3,), "(p b)", "(tp b)", F32),                   # an empty shard
    ("8->4", "F", "I", (8, 8), "(a b c w) x", "w (tp x)", torch.complex64),
    ("replicated", "G", "B", (16, 4), "b s", "(tp b) s", F32),
    ("replicated", "A", "B", (8, 6), "(dp b) s", "(tp b) s", F32),
    ("replicated", "G", "D", (8, 4), "b s", "(q b) s", F32),          # 2 blocks, 4 holders
    ("partial source", "A", "B", (8, 16), "b s | sum(tp)", "(tp b) s", F32),
    ("partial source", "A", "D", (7, 6), "(dp b) s | sum(tp)", "b (q s)", F32),
    ("partial source", "F", "B", (8, 4), "r s | sum(a, c)", "(tp r) s", F32),
    ("partial source", "E", "C", (6, 4), "b s | max(p)", "(x b) s", F32),
    ("partial source", "A", "B", (), "| sum(dp, tp)", "", F32),
    ("partial destination", "A", "C", (8, 6), "(dp b) s", "(x b) s | sum(y)", F32),
    ("partial destination", "B", "A", (8, 6), "(tp b) s", "b s | sum(dp)", F32),
    ("partial destination", "D", "G", (6, 4), "(q b) s", "b s | max(dp)", F32),
]


# -- the sample -------------------------------------------------------------------------
def sample(seed: int) -> list[tuple[str, str, str, tuple[int, ...], str, str, torch.dtype]]:
    """PER_PAIR cases per mesh pair, in a random direction, the same on every rank."""
    rng, out = random.Random(seed), []
    for a, b in PAIRS:
        done = 0
        while done < PER_PAIR:
            s, d = (a, b) if rng.random() < 0.5 else (b, a)
            ndim = rng.randint(1, 3)
            shape = tuple(rng.choice(SIZES) for _ in range(ndim))
            op = rng.choice(["sum", "sum", "max"])
            src = random_layout(rng, MESHES[s], ndim, (op,), NAMES, name_inside=0.3)
            dst = random_layout(rng, MESHES[d], ndim, (op,), NAMES, name_inside=0.3)
            try:
                mc.Layout(src).placements(MESHES[s], shape)
                mc.Layout(dst).placements(MESHES[d], shape)
            except mc.errors.ShapeError:
                continue
            out.append((f"{s}->{d}", s, d, shape, src, dst, F32))
            done += 1
    return out


# -- what every rank runs ----------------------------------------------------------------
def check_case(k: int, case: tuple[Any, ...], bounds: dict[str, BoundMesh]) -> dict[str, Any]:
    tag, s, d, shape, src, dst, dtype = case
    a, b = bounds[s], bounds[d]
    rank = a.rank
    p = mc.plan(a.mesh, shape, src, dst, dtype=dtype, dst_mesh=b.mesh)
    locs = mc.sim.scatter(ints(shape, k, dtype), a.mesh, src)
    want = mc.sim.execute(p, locs).outputs[p.ranks.index(rank)] if rank in p.ranks else None
    x = locs[a.mesh.position(rank)] if a.in_mesh else None
    trace = ByteTrace()
    if k % 2:   # the public API; source ranks infer the shape where it is even
        even = all(infer_shape(a.mesh, p.src, tuple(t.shape), r) == shape
                   for r, t in zip(a.mesh.ranks, locs) if all(t.shape))
        got = mc.reshard(x, a, src, dst, dst_mesh=b, trace=trace,
                         shape=None if even and a.in_mesh else shape,
                         dtype=None if a.in_mesh else dtype)
    else:
        got = execute_cross(p, x, a, b, trace=trace)
    where = f'case {k} {tag} {shape} {dtype} "{src}" -> "{dst}" on rank {rank}'
    problems = sim_problems(where, p, rank, got, want, trace)
    return {"problems": problems, "sent": trace.send_bytes,
            "kinds": [st.kind for st in p.collectives]}


def eight_ranks(rank: int, world: int, cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    bounds = {name: mc.init_mesh(mesh) for name, mesh in MESHES.items()}
    return [check_case(k, case, bounds) for k, case in enumerate(cases)]


CASES = NAMED + sample(7)


eight = ranks_fixture(eight_ranks, 8, CASES, timeout_s=300)


def test_every_case_equals_sim_and_counts_bytes(eight: list[list[dict[str, Any]]]) -> None:
    problems = [p for rep in eight for case in rep for p in case["problems"]]
    assert not problems, "\n".join(problems[:5])
    assert len(eight[0]) == len(NAMED) + PER_PAIR * len(PAIRS)


def test_the_cases_cover_every_kind_of_mesh_pair(eight: list[list[dict[str, Any]]]) -> None:
    tags = {case[0] for case in CASES}
    assert {"disjoint", "overlapping", "4->2", "2->4", "3->4", "replicated", "partial source",
            "partial destination"} <= tags
    kinds = {k for case in eight[0] for k in case["kinds"]}
    # small partial sources now take their partials straight to the owners (one step);
    # reduce_scatter before a transfer runs in test_crossmesh_direct_runtime.py (on bytes)
    assert {"send_recv", "all_reduce"} <= kinds


REPLICATED = [k for k, c in enumerate(NAMED) if c[0] == "replicated"]


@pytest.mark.parametrize(("k", "sent_max", "ideal"), [
    (REPLICATED[0], 64, 64),     # 4 blocks, 4 holders of each: one block per sender
    (REPLICATED[1], 48, 48),     # each block held twice: the two holders take turns
    (REPLICATED[2], 32, 32),     # 2 blocks over 4 holders: each block split over two senders
])
def test_replicated_sources_share_the_sending(eight: list[list[dict[str, Any]]], k: int,
                                              sent_max: int, ideal: int) -> None:
    _, s, d, shape, src, dst, dtype = NAMED[k]
    p = mc.plan(MESHES[s], shape, src, dst, dtype=dtype, dst_mesh=MESHES[d])
    (b,) = balance(p)
    sent = [eight[r][k]["sent"] for r in MESHES[s].ranks]    # counted at the calls
    assert sum(sent) == b["send_bytes_total"] and max(sent) == b["send_bytes_max"]
    assert (max(sent), b["ideal_bytes"]) == (sent_max, ideal)


def test_partial_sources_reduce_first_or_go_straight_to_their_owners(
        eight: list[list[dict[str, Any]]]) -> None:
    """A partial source reduces on the source mesh before the transfer, or the transfer
    delivers the partials to their owners, who add them (action "direct"; more cases in
    test_crossmesh_direct_runtime.py)."""
    for k, (tag, s, d, shape, src, dst, dtype) in enumerate(NAMED):
        if tag == "partial source":
            p = mc.plan(MESHES[s], shape, src, dst, dtype=dtype, dst_mesh=MESHES[d])
            assert p.collectives[-1].dst_mesh == MESHES[d]
            if p.collectives[-1].action == "direct":
                assert eight[0][k]["kinds"] == ["send_recv"]
                continue
            assert all(st.mesh == MESHES[s] for st in p.collectives[:-1])
            assert eight[0][k]["kinds"][:-1], f"{src}: no reduction before the transfer"


# -- the examples ---------------------------------------------------------------------------
def run_example(name: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], check=False,
                          capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=scaled(300))


def test_pipeline_handoff_example() -> None:
    done = run_example("pipeline_handoff.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("OK: ") == 4 and "FAIL" not in done.stdout
    assert done.stdout.count('plan "(dp b) (tp h)" -> "b (tp h)"') == 1   # printed once


def test_reshard_checkpoint_example() -> None:
    done = run_example("reshard_checkpoint.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("OK: ") == 2 and "FAIL" not in done.stdout
    # "(tp v) e" is replicated over dp: only dp coordinate 0 (ranks 0, 1) wrote it
    assert 'embedding: "(tp v) e" -> "v (tp e)": process 0 files [0, 1], process 1 files' \
           " [0, 1]" in done.stdout
    assert 'norm: "e" -> "(tp e)": process 0 files [0], process 1 files [0]' in done.stdout


# -- explain --------------------------------------------------------------------------------
def test_explain_shows_each_pair_its_block_and_the_balance() -> None:
    p = mc.plan(MESHES["A"], (8, 16), "(dp b) (tp s)", "b (tp s)", dst_mesh=MESHES["B"])
    lines = transfer_lines(p)
    assert lines[:3] == ("step 1, sender -> receiver: block (global index ranges), bytes",
                         "  r0 -> r4  [0:4, 0:4]    64 B",
                         "  r0 -> r5  [0:4, 4:8]    64 B")
    assert lines[-1] == ("  balance: busiest sender sends 128 B, ideal 128 B (512 B over 4"
                         " source ranks): 1.00x")
    text = p.explain()
    assert "-> Mesh(tp=4, ranks=[4, 5, 6, 7])" in text.splitlines()[1]
    assert "\n".join(lines) in text
    assert transfer_rows(p)[0] == {"step": 1, "src": 0, "dst": 4, "blocks": ["[0:4, 0:4]"],
                                   "bytes": 64}


def test_explain_of_a_partial_source_names_the_transfer_step() -> None:
    p = mc.plan(MESHES["A"], (8, 16), "b s | sum(tp)", "(tp b) s", dst_mesh=MESHES["B"])
    (b,) = balance(p)
    assert b["step"] == len(p.steps) and transfer_lines(p)[0].startswith(f"step {b['step']},")
    assert transfer_lines(mc.plan(MESHES["A"], (8, 16), "(dp b) s", "b s")) == ()


def test_show_plan_draws_the_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    p = mc.plan(MESHES["G"], (16, 4), "b s", "(tp b) s", dst_mesh=MESHES["B"])
    mc.show_plan(p, width=100, pictures=False)
    out = capsys.readouterr().out
    assert "r3 -> r7  [12:16, 0:4]  64 B" in out and "balance: busiest sender sends 64 B" in out


# -- input errors, in this process (nothing communicates) -----------------------------------
def fake(name: str, rank: int) -> BoundMesh:
    """A BoundMesh with no process groups: any communication would fail, checks must not."""
    return BoundMesh(MESHES[name], "gloo", torch.device("cpu"), rank, {})


PLAN = mc.plan(MESHES["A"], (8, 6), "(dp b) s", "(tp b) s", dst_mesh=MESHES["B"])


def test_a_wrong_shard_fails_before_communication() -> None:
    msg = ('local tensor on rank 1 has shape (2, 6), but layout "(dp b) s" of global shape'
           " (8, 6) on Mesh(dp=2, tp=2) gives it shape (4, 6)")
    with pytest.raises(ShapeError, match=re.escape(msg)):
        execute_cross(PLAN, torch.zeros(2, 6), fake("A", 1), fake("B", 1))
    with pytest.raises(ShapeError, match=re.escape("has dtype torch.float64 but the plan")):
        execute_cross(PLAN, torch.zeros(4, 6, dtype=torch.float64), fake("A", 1), fake("B", 1))
    with pytest.raises(ShapeError, match=re.escape(
            "rank 5 is not in the source mesh Mesh(dp=2, tp=2), so it has no input, but it got"
            " a Tensor. fix: pass None on ranks [4, 5, 6, 7]")):
        execute_cross(PLAN, torch.zeros(4, 6), fake("A", 5), fake("B", 5))


def test_wrong_meshes_fail_before_communication() -> None:
    with pytest.raises(MeshMismatchError, match=re.escape(
            "plan's destination mesh is Mesh(tp=4, ranks=[4, 5, 6, 7]) but the bound"
            " destination mesh is Mesh(x=2, y=2, ranks=[2, 3, 4, 5])")):
        execute_cross(PLAN, None, fake("A", 5), fake("C", 5))
    with pytest.raises(MeshMismatchError, match="this plan stays on Mesh"):
        execute_cross(mc.plan(MESHES["A"], (8, 6), "(dp b) s", "b s"), None, fake("A", 5),
                      fake("B", 5))
    with pytest.raises(MeshMismatchError, match=re.escape(
            "reshard(..., dst_mesh=...) needs dst_mesh bound to torch.distributed, got the"
            " Mesh Mesh(tp=4, ranks=[4, 5, 6, 7])")):
        mc.reshard(torch.zeros(4, 6), fake("A", 1), "(dp b) s", "(tp b) s",
                   dst_mesh=MESHES["B"])   # type: ignore[call-overload]


def test_reshard_on_a_destination_rank_needs_shape_and_dtype() -> None:
    msg = ("rank 5 is only in the destination mesh Mesh(tp=4, ranks=[4, 5, 6, 7]): it has no"
           " shard to read the global shape and dtype from. fix: pass shape=(...) and"
           " dtype=... (those of the source) on every rank")
    with pytest.raises(ShapeError, match=re.escape(msg)):
        mc.reshard(None, fake("A", 5), "(dp b) s", "(tp b) s", dst_mesh=fake("B", 5),
                   shape=(8, 6))


def test_ranks_in_neither_mesh_do_nothing() -> None:
    assert mc.reshard(None, fake("A", 6), "(dp b) s", "b s", dst_mesh=fake("D", 6)) is None
    p = mc.plan(MESHES["A"], (8, 6), "(dp b) s", "b s", dst_mesh=MESHES["D"])
    trace = ByteTrace()
    assert execute_cross(p, None, fake("A", 6), fake("D", 6), trace=trace) is None
    assert execute_cross(p, torch.zeros(1), fake("A", 6), fake("D", 6), trace=trace) is None
    assert trace.calls == []


def test_requires_grad_is_for_ranks_only_in_the_destination_mesh() -> None:
    """Between meshes a rank only in the destination has no input to read requires_grad
    from, so it says it (`requires_grad=True`); said where an input does not require grad, or
    without dst_mesh, it is an error before any communication. (Gradients through a
    hand-off: tests/dist/test_engine.py.)"""
    with pytest.raises(PlanError, match=re.escape(
            "reshard(..., dst_mesh=..., requires_grad=True) on rank 1, whose input does not"
            " require grad: requires_grad= is for ranks only in the destination mesh")):
        mc.reshard(torch.zeros(4, 6), fake("A", 1), "(dp b) s", "(tp b) s",
                   dst_mesh=fake("B", 1), requires_grad=True)
    with pytest.raises(ShapeError, match=re.escape(
            "reshard(requires_grad=True) goes with dst_mesh=")):
        mc.reshard(torch.zeros(4, 6), fake("A", 1), "(dp b) s", "(tp b) s",
                   requires_grad=True)  # type: ignore[call-overload]
