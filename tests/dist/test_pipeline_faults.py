"""Pipeline faults on gloo: a stage that raises (its process then exits, as a real job's
does) or hangs makes every other rank's `Pipeline.step` raise within a bounded time.

Four processes, one single-rank stage each, 1F1B over 4 microbatches. The stage on rank 2
fails in its forward of microbatch 1: by then rank 1 has sent it microbatches 0 and 1 and
waits for the gradient of 0, rank 3 has run microbatch 0 and waits for microbatch 1, and
rank 0 waits for rank 1's gradient of microbatch 0.

Like a real job, a rank whose step raises writes what it saw (a report file, since
`run_ranks` stops every process once it sees one die) and then exits: its peers see the
lost connection. Every rank ignores run_ranks's SIGTERM, so those still waiting get its
grace period (then SIGKILL) to raise and report.

- dies: rank 2 exits at once; ranks 1 and 3 see the lost connection at once, rank 0 when
  rank 1 exits. The world group waits `scaled(HEALTHY_TIMEOUT_S)`, so no error is a timeout.
- hangs: rank 2 sleeps in its forward until the others have reported; the world group is
  made again with the collective timeout HANG_TIMEOUT_S (short, unscaled: `short_world`),
  and ranks 1 and 3 raise when it runs out; rank 0 when it runs out, or when rank 1 exits,
  whichever comes first.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_scaled, scaled
from torch import nn

import meshcomm as mc
from meshcomm.core.errors import RankFailure
from meshcomm.nn.pipeline import Pipeline, Stage
from meshcomm.runtime import launch

WORLD, M, B, H = 4, 4, 8, 6
FAULTY, MICROBATCH = 2, 1
HANG_TIMEOUT_S = 2.0          # the world group's collective timeout in the hang test: unscaled
HEALTHY_TIMEOUT_S = 90.0      # scaled: the world group's timeout in the other test
RUN_TIMEOUT_S = 120.0         # run_ranks(timeout_s=scaled(...)): the whole test
SLACK_S = 5.0                 # scaled: how late past a death (or the timeout) an error may come
KILLED, FAILED = 13, 14       # the exit codes of the faulty rank and of a rank whose step raised


# What each healthy rank waits for when rank 2 fails (the runner names the hand-off).
WAITS = {0: "pipeline step, rank 0: receiving the gradient of microbatch 0 from stage 1 to"
            " stage 0 (from Mesh(x=1, ranks=[1]))",
         1: "pipeline step, rank 1: receiving the gradient of microbatch 0 from stage 2 to"
            " stage 1 (from Mesh(x=1, ranks=[2]))",
         3: "pipeline step, rank 3: receiving the activation of microbatch 1 from stage 2 to"
            " stage 3 (from Mesh(x=1, ranks=[2]))"}


class Faulty(nn.Module):
    """tanh(x @ w); on the faulty rank, `fault()` in the forward of microbatch 1."""

    def __init__(self, fault: Any = None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(H))
        self.fault, self.forwards = fault, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault is not None and self.forwards == MICROBATCH:
            self.fault()
        self.forwards += 1
        return torch.tanh(x @ self.w)


def wait_for(*paths: Path) -> None:
    end = time.monotonic() + scaled(RUN_TIMEOUT_S)
    while not all(p.exists() for p in paths) and time.monotonic() < end:
        time.sleep(0.05)


def reports(out_dir: Path, ranks: Any) -> list[Path]:
    return [out_dir / f"rank{r}.json" for r in ranks]


def short_world(rank: int, world: int, out: Path) -> None:
    """The world group again, with the collective timeout HANG_TIMEOUT_S. Hand-offs are
    messages over the world group, and gloo's point-to-point waits keep the timeout the group
    was created with (`_set_pg_timeout`, conftest's `set_group_timeout`, does not reach them:
    a receive from a sleeping peer waited 8 s under a 2 s setting)."""
    dist.barrier()                       # arrive together: the new group connects in time
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(str(out / "store"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))


def worker(rank: int, world: int, out_dir: str, mode: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = Path(out_dir)
    (out / f"pid{rank}").write_text(str(os.getpid()))

    def die() -> None:
        raise RuntimeError(f"stage {FAULTY} failed in its forward of microbatch {MICROBATCH}")

    def hang() -> None:
        (out / "hangs_at").write_text(repr(time.time()))
        wait_for(*reports(out, (r for r in range(world) if r != FAULTY)))
        (out / f"rank{FAULTY}.json").write_text(json.dumps({"hung": True}))
        os._exit(KILLED)                 # the others have reported: this one is done too

    fault = {"dies": die, "hangs": hang}[mode] if rank == FAULTY else None
    if mode == "hangs":
        short_world(rank, world, out)
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in range(world)]
    stages = [Stage(meshes[s], "b h", "b h", Faulty(fault) if s == rank else None)
              for s in range(world)]
    pipe = Pipeline(stages, "1f1b", microbatches=M, shapes=(B // M, H), loss_fn=lambda y, t:
                    ((y - t) ** 2).mean())
    x = torch.ones(B, H)
    dist.barrier()                       # start together: no healthy wait on a slow peer
    start = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, x if rank == world - 1 else None)
        result: dict[str, Any] = {"ok": True}
    except Exception as err:             # noqa: BLE001  what a real job would die of
        result = {"error": type(err).__name__, "message": str(err),
                  "meshcomm": isinstance(err, mc.errors.MeshcommError),
                  "seconds": time.monotonic() - start, "at": time.time()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == FAULTY:
        (out / "died_at").write_text(repr(time.time()))
        os._exit(KILLED)
    os._exit(FAILED if "error" in result else 0)    # a real job's process ends here


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> dict[int, dict[str, Any]]:
    monkeypatch.setattr(launch, "_GRACE_S", scaled(SLACK_S) + HANG_TIMEOUT_S)
    timeout = HEALTHY_TIMEOUT_S if mode == "dies" else RUN_TIMEOUT_S
    with pytest.raises(RankFailure, match="exited with code"):
        run_scaled(worker, WORLD, str(tmp_path), mode, timeout_s=timeout)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(WORLD)]
    assert len(set(pids)) == WORLD and os.getpid() not in pids
    for pid in pids:                     # no process is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    got = {}
    for rank in range(WORLD):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} never raised (killed at run_ranks's grace)"
        got[rank] = json.loads(path.read_text())
    return got


def test_a_stage_that_raises_makes_every_rank_raise_at_once(tmp_path, monkeypatch):
    got = run(tmp_path, monkeypatch, "dies")
    assert got[FAULTY]["error"] == "RuntimeError"
    assert got[FAULTY]["message"] == "stage 2 failed in its forward of microbatch 1"
    died_at = float((tmp_path / "died_at").read_text())
    for rank in (0, 1, 3):
        r = got[rank]
        # the lost connection, seen at once: not a timeout (the world waits 90 s and more)
        assert r.get("error") == "CollectiveError" and r["meshcomm"], (rank, r)
        assert "Timed out" not in r["message"], (rank, r)
        assert 0 < r["at"] - died_at < scaled(SLACK_S), (rank, r, died_at)
        assert r["message"].startswith(WAITS[rank] + " failed: reshard"), r


def test_a_stage_that_hangs_makes_every_rank_raise_at_the_timeout(tmp_path, monkeypatch):
    got = run(tmp_path, monkeypatch, "hangs")
    assert got[FAULTY] == {"hung": True}
    for rank in (0, 1, 3):
        r = got[rank]
        # rank 0 waits on rank 1: its own timeout, or rank 1's exit, whichever comes first
        assert r.get("error") in ("CollectiveTimeout", "CollectiveError"), (rank, r)
        assert r["seconds"] < HANG_TIMEOUT_S + scaled(SLACK_S), (rank, r)
    for rank in (1, 3):                  # they wait on the hanging rank itself: its timeout
        r = got[rank]
        assert r["error"] == "CollectiveTimeout" and "Timed out" in r["message"], (rank, r)
        assert r["message"].startswith(WAITS[rank] + " failed: reshard"), r
        assert r["seconds"] > HANG_TIMEOUT_S - 0.5, (rank, r)
