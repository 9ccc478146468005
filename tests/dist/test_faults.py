"""Faults on gloo: a rank that dies or never reaches a step makes its peers fail fast, with a
meshcomm error naming the step of the plan; world-size errors fire before any communication.

The plan has two steps on different groups of a dp=2 tp=2 mesh (4 processes):
step 1 all_reduce over tp (groups [0, 1], [2, 3]), step 2 all_gather over dp (groups
[0, 2], [1, 3]). Rank 3 is the faulty one, so rank 1, its dp peer, is the one left
waiting at step 2, while ranks 0 and 2 finish. Each worker catches the meshcomm error and
writes a report (a file, since `run_ranks` stops every process once it sees one die).

Timeouts: every group waits `scaled(HEALTHY_TIMEOUT_S)`, far beyond what a healthy step
needs on a loaded machine, except the one group that hangs, dp [1, 3], which gets the
short HANG_TIMEOUT_S (unscaled) in the test of a rank that never reaches step 2.
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
from meshcomm.runtime import launch

from conftest import outcome, run_scaled, scaled, set_group_timeout

MESH = "dp=2 tp=2"
SRC, DST = "(dp b) h | sum(tp)", "b h"
SHAPE = (8, 6)
# Collectives only: an all_reduce over tp, then an all_gather over dp, so ranks 0 and 2 never
# share a group with rank 3 at step 2 (the default plan, a reducing send_recv over tp, then
# an all_gather over dp and tp, would join them).
COST = mc.CostModel(native=("all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                            "collective_permute"))
HANG_TIMEOUT_S = 2.0          # the hanging group's collective timeout: short, never scaled
HEALTHY_TIMEOUT_S = 90.0      # init_mesh(timeout_s=scaled(...)): every other group's
RUN_TIMEOUT_S = 120.0         # run_ranks(timeout_s=scaled(...)): the whole test
SLACK_S = 5.0                 # scaled: how late past the timeout (or a death) an error may come
KILLED = 13                   # the exit code of the killed rank
STEP_2 = ('step 2 of 2, all_gather over dp (group ranks [1, 3]), "(dp b) h" -> "b h"')


def handlers() -> dict[str, Any]:
    """The executor's step handlers (`meshcomm.executors.distributed.handlers`)."""
    return importlib.import_module("meshcomm.executors.distributed.handlers").HANDLERS  # type: ignore[no-any-return]


def bind(rank: int, out_dir: str) -> mc.BoundMesh:
    """Record this process's pid (to check afterwards that it is gone), then bind the mesh."""
    Path(out_dir, f"pid{rank}").write_text(str(os.getpid()))
    return mc.init_mesh(MESH, timeout_s=scaled(HEALTHY_TIMEOUT_S))


def wait_for(*paths: Path) -> None:
    end = time.monotonic() + scaled(RUN_TIMEOUT_S)
    while not all(p.exists() for p in paths) and time.monotonic() < end:
        time.sleep(0.05)


def attempt(bound: mc.BoundMesh) -> dict[str, Any]:
    """Run the plan on this rank: {"ok"} against the simulator, or the error and its time."""
    mesh = bound.mesh
    data = torch.arange(48.0).reshape(SHAPE)
    locs = mc.sim.scatter(data, mesh, SRC)
    want = mc.sim.execute(mc.plan(mesh, SHAPE, SRC, DST, cost_model=COST),
                          locs).outputs[mesh.position(bound.rank)]
    torch.distributed.barrier()         # start together: no healthy step waits on a slow peer
    start = time.monotonic()
    try:
        got = mc.reshard(locs[mesh.position(bound.rank)], bound, SRC, DST, cost_model=COST)
    except mc.errors.MeshcommError as err:
        return {"error": type(err).__name__, "message": str(err),
                "seconds": time.monotonic() - start, "at": time.time()}
    return {"ok": bool(torch.equal(got, want)), "seconds": time.monotonic() - start}


def report(out_dir: str, rank: int, result: dict[str, Any]) -> dict[str, Any]:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return result


def assert_all_gone(out_dir: Path, world: int) -> None:
    """No rank's process is left: each recorded pid is reaped and gone."""
    pids = [int((out_dir / f"pid{rank}").read_text()) for rank in range(world)]
    assert len(set(pids)) == world and os.getpid() not in pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def kill_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    # run_ranks stops the others as soon as it sees rank 3 die; ignoring its SIGTERM gives
    # them its grace period (then SIGKILL) to write their reports.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bound = bind(rank, out_dir)
    if rank == 3:
        def die(step: Any, x: torch.Tensor, run: Any) -> torch.Tensor:
            """Die at step 2, once ranks 0 and 2 (which never wait on rank 3) have reported."""
            wait_for(Path(out_dir, "rank0.json"), Path(out_dir, "rank2.json"))
            Path(out_dir, "died_at").write_text(repr(time.time()))
            os._exit(KILLED)
        handlers()["all_gather"] = die
    return report(out_dir, rank, attempt(bound))


def skip_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    bound = bind(rank, out_dir)
    if bound.group_ranks("dp") == (1, 3):
        set_group_timeout(bound, "dp", HANG_TIMEOUT_S)
    if rank == 3:
        def stall(step: Any, x: torch.Tensor, run: Any) -> torch.Tensor:
            """Never reach step 2's collective: wait until rank 1 has given up on it."""
            wait_for(Path(out_dir, "rank1.json"))
            return x
        handlers()["all_gather"] = stall
    return {**report(out_dir, rank, attempt(bound)), "pid": os.getpid()}


def test_a_rank_killed_between_steps_makes_its_peer_fail_naming_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 reports after rank 3's death, within run_ranks's SIGTERM grace: give it time.
    monkeypatch.setattr(launch, "_GRACE_S", scaled(SLACK_S))
    with pytest.raises(RankFailure, match=f"rank 3 exited with code {KILLED} without a result"):
        run_scaled(kill_worker, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S)
    assert_all_gone(tmp_path, 4)
    for rank in (0, 2):         # they never wait on rank 3 at step 2: they finished
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["ok"] is True
    peer = json.loads((tmp_path / "rank1.json").read_text())
    # The lost connection, seen at once: not a timeout (its group waits 90 s and more).
    assert peer["error"] == "CollectiveError", peer
    died_at = float((tmp_path / "died_at").read_text())
    assert 0 < peer["at"] - died_at < scaled(SLACK_S), (peer, died_at)
    message = peer["message"]
    assert message.startswith(f'reshard "{SRC}" -> "{DST}" of shape {SHAPE} torch.float32 on'
                              f" Mesh(dp=2, tp=2), rank 1: {STEP_2}, failed: "), message
    assert "fix: a rank of the group died, hangs, or never reached this step" in message


def test_a_rank_that_never_reaches_a_step_times_out_its_peer_naming_the_step(tmp_path: Path):
    results = run_scaled(skip_worker, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S)
    assert_all_gone(tmp_path, 4)
    assert [r["pid"] for r in results] == [int((tmp_path / f"pid{r}").read_text())
                                           for r in range(4)]
    assert results[0]["ok"] is True and results[2]["ok"] is True
    peer = results[1]
    assert peer["error"] == "CollectiveTimeout", peer
    # The hanging group's short timeout fired: not before it, and long before the healthy one.
    assert HANG_TIMEOUT_S - 0.5 < peer["seconds"] < HANG_TIMEOUT_S + scaled(SLACK_S), peer
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
    out["reshard"] = outcome(lambda: mc.reshard(x, bound, "(tp b) h", "b h"))
    out["all_gather"] = outcome(lambda: mc.collectives.all_gather(x, bound, "tp"))
    return out


def test_mesh_and_world_disagree_and_rank_outside_the_mesh():
    results = run_scaled(world_worker, 3, timeout_s=RUN_TIMEOUT_S)
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
