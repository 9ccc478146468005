"""Faults on gloo: a rank that dies or never reaches a step makes its peers fail fast, with a
meshcomm error naming the step of the plan; world-size errors fire before any communication.

The plan has two steps on different groups of a dp=2 tp=2 mesh (4 processes):
step 1 all_reduce over tp (groups [0, 1], [2, 3]), step 2 all_gather over dp (groups
[0, 2], [1, 3]). Rank 3 is the faulty one, so rank 1, its dp peer, is the one left
waiting at step 2, while ranks 0 and 2 finish. Each worker catches the meshcomm error and
writes a report (a file, since `run_ranks` stops every process once it sees one die).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import RankFailure
from meshcomm.executors.distributed.launch import run_ranks

MESH = "dp=2 tp=2"
SRC, DST = "(dp b) h | sum(tp)", "b h"
SHAPE = (8, 6)
TIMEOUT_S = 2.0          # init_mesh(timeout_s=...): the dp and tp groups' timeout
RUN_TIMEOUT_S = 60.0     # run_ranks: the whole test, spawning included
KILLED = 13              # the exit code of the killed rank
STEP_2 = ('step 2 of 2, all_gather over dp (group ranks [1, 3]), "(dp b) h" -> "b h"')


def handlers() -> dict[str, Any]:
    """The executor's step handlers (`meshcomm.executors.distributed.execute` is shadowed by its function)."""
    return importlib.import_module("meshcomm.executors.distributed.execute")._RUN  # type: ignore[no-any-return]


def attempt(bound: mc.BoundMesh) -> dict[str, Any]:
    """Run the plan on this rank: {"ok"} against the simulator, or the error and its time."""
    mesh = bound.mesh
    data = torch.arange(48.0).reshape(SHAPE)
    locs = mc.sim.scatter(data, mesh, SRC)
    want = mc.sim.execute(mc.plan(mesh, SHAPE, SRC, DST), locs).outputs[mesh.position(bound.rank)]
    start = time.monotonic()
    try:
        got = mc.reshard(locs[mesh.position(bound.rank)], bound, SRC, DST)
    except mc.errors.MeshcommError as err:
        return {"error": type(err).__name__, "message": str(err),
                "seconds": time.monotonic() - start}
    return {"ok": bool(torch.equal(got, want)), "seconds": time.monotonic() - start}


def report(out_dir: str, rank: int, result: dict[str, Any]) -> dict[str, Any]:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return result


def kill_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    # run_ranks stops the others as soon as it sees rank 3 die; ignoring its SIGTERM gives
    # them its grace period (then SIGKILL) to write their reports.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bound = mc.init_mesh(MESH, timeout_s=TIMEOUT_S)
    if rank == 3:
        handlers()["all_gather"] = lambda step, x, run: os._exit(KILLED)  # dies at step 2
    return report(out_dir, rank, attempt(bound))


def skip_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    bound = mc.init_mesh(MESH, timeout_s=TIMEOUT_S)
    if rank == 3:
        def stall(step: Any, x: torch.Tensor, run: Any) -> torch.Tensor:
            """Never reach step 2's collective: wait until rank 1 has given up on it."""
            end = time.monotonic() + RUN_TIMEOUT_S
            while not Path(out_dir, "rank1.json").exists() and time.monotonic() < end:
                time.sleep(0.05)
            return x
        handlers()["all_gather"] = stall
    return report(out_dir, rank, attempt(bound))


def test_a_rank_killed_between_steps_makes_its_peer_fail_naming_the_step(tmp_path: Path):
    with pytest.raises(RankFailure, match=f"rank 3 exited with code {KILLED} without a result"):
        run_ranks(kill_worker, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S)
    peer = json.loads((tmp_path / "rank1.json").read_text())
    assert peer["error"] in ("CollectiveError", "CollectiveTimeout"), peer
    assert peer["seconds"] < TIMEOUT_S + 3, peer
    message = peer["message"]
    assert message.startswith(f'reshard "{SRC}" -> "{DST}" of shape {SHAPE} torch.float32 on'
                              f" Mesh(dp=2, tp=2), rank 1: {STEP_2}"), message
    assert "fix: a rank of the group died, hangs, or never reached this step" in message
    # Ranks 0 and 2 never wait on rank 3 at step 2: they finish (when they reported in time).
    for rank in (0, 2):
        path = tmp_path / f"rank{rank}.json"
        if path.exists():
            assert json.loads(path.read_text()).get("ok") is True


def test_a_rank_that_never_reaches_a_step_times_out_its_peer_naming_the_step(tmp_path: Path):
    results = run_ranks(skip_worker, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S)
    assert results[0] == {"ok": True, "seconds": results[0]["seconds"]}
    assert results[2]["ok"] is True
    peer = results[1]
    assert peer["error"] == "CollectiveTimeout", peer
    assert TIMEOUT_S - 0.5 < peer["seconds"] < TIMEOUT_S + 3, peer
    message = peer["message"]
    assert message.startswith(f'reshard "{SRC}" -> "{DST}" of shape {SHAPE} torch.float32 on'
                              f" Mesh(dp=2, tp=2), rank 1: {STEP_2}, did not complete in time:"
                              " RuntimeError: "), message
    assert "Timed out" in message
    assert message.endswith("if the step is only slow, raise init_mesh(timeout_s=...)")
    assert isinstance(mc.errors.CollectiveTimeout("x"), TimeoutError)


# -- the world: checked before any communication ---------------------------------------------
def world_worker(rank: int, world: int) -> dict[str, str]:
    out = {}
    try:
        mc.init_mesh(MESH)                      # 4 ranks wanted, the world has 3
    except mc.errors.MeshcommError as err:
        out["too_big"] = f"{type(err).__name__}: {err}"
    bound = mc.init_mesh("tp=2")               # rank 2 is outside the mesh
    x = torch.zeros(2, 4)
    for name, call in (("reshard", lambda: mc.reshard(x, bound, "(tp b) h", "b h")),
                       ("all_gather", lambda: mc.collectives.all_gather(x, bound, "tp"))):
        try:
            call()
            out[name] = "ran"
        except mc.errors.MeshcommError as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_mesh_and_world_disagree_and_rank_outside_the_mesh():
    results = run_ranks(world_worker, 3, timeout_s=RUN_TIMEOUT_S)
    assert results[0]["too_big"] == (
        "MeshMismatchError: Mesh(dp=2, tp=2) needs ranks up to 3 but the world has 3 ranks;"
        " fix: launch 4 processes or use a smaller mesh")
    assert results[0]["reshard"] == results[1]["reshard"] == "ran"
    assert results[2]["reshard"] == (
        "MeshMismatchError: reshard: rank 2 is not in Mesh(tp=2) (its ranks are [0, 1]), so it"
        " holds no shard of a tensor on it. fix: call reshard on the mesh's ranks only"
        " (if mesh.in_mesh: ...)")
    assert results[2]["all_gather"] == (
        "MeshMismatchError: all_gather: rank 2 is not in Mesh(tp=2); only its ranks [0, 1]"
        " run its collectives")
