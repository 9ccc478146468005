"""meshcomm.runtime.launch.run_ranks: results by rank, real collectives, errors,
timeouts, cleanup; and the tests' one timeout factor (conftest.scaled)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TIMEOUT_FACTOR_ENV, run_scaled, scaled

from meshcomm.core.errors import MeshcommError, RankFailure
from meshcomm.runtime import launch
from meshcomm.runtime.launch import run_ranks

# Long enough for every healthy rank to spawn, import torch and join the group on a busy
# machine (run_ranks counts spawning in); MESHCOMM_TEST_TIMEOUT_FACTOR scales it further.
HEALTHY_S = 60.0
# The hang test waits all of this: healthy ranks must finish well within it.
HANG_RUN_S = 30.0


def _identify(rank: int, world_size: int, tag: str, *, scale: int = 1) -> tuple[str, int, int]:
    return tag, rank * scale, world_size


def _all_reduce_rank(rank: int, world_size: int) -> list[float]:
    import torch
    import torch.distributed as dist

    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    return x.tolist()


def _fail_on_two(rank: int, world_size: int) -> int:
    if rank == 2:
        raise ValueError("rank two is unhappy")
    return rank


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _hang(rank: int, world_size: int, pid_dir: str) -> int:
    """Rank 0 finishes. Rank 1 hangs in Python and ignores SIGTERM (only SIGKILL stops it).
    Rank 2 hangs inside a gloo collective: a barrier of the group [1, 2] that rank 1 never
    reaches (its own timeout is 30 minutes, torch's default for a new group)."""
    import torch.distributed as dist

    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    pair = dist.new_group([1, 2])          # every rank creates every group
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Event().wait()
    if rank == 2:
        dist.barrier(group=pair)
    return rank


def _crash_on_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def _assert_no_children() -> None:
    assert multiprocessing.active_children() == [], multiprocessing.active_children()


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_results_come_back_in_rank_order_with_args_and_kwargs() -> None:
    assert run_scaled(_identify, 3, "x", scale=10, timeout_s=HEALTHY_S) == [
        ("x", 0, 3), ("x", 10, 3), ("x", 20, 3)]
    _assert_no_children()


def test_all_reduce_over_four_ranks() -> None:
    assert run_scaled(_all_reduce_rank, 4, timeout_s=HEALTHY_S) == [[10.0, 10.0, 10.0]] * 4
    _assert_no_children()


def test_exception_on_rank_two_reports_its_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_scaled(_fail_on_two, 4, timeout_s=HEALTHY_S)
    text = str(info.value)
    assert "rank 2 of 4 raised" in text
    assert "Traceback" in text and "_fail_on_two" in text
    assert "ValueError: rank two is unhappy" in text
    assert isinstance(info.value, MeshcommError) and isinstance(info.value, RuntimeError)
    _assert_no_children()


def test_the_rank_whose_fn_raised_is_named_even_when_a_consequence_reports_first() -> None:
    """CI once saw rank 0's gloo connect fail ("connection closed by peer") before rank 2's
    own ValueError reached the queue; the report named rank 0. A consequence (an init or
    teardown error) now waits for the root cause, even seconds later."""
    results_q: queue.Queue = queue.Queue()
    consequence = (0, "Traceback ...\nRuntimeError: Connection closed by peer", False)
    cause = (2, False, "Traceback ...\nValueError: rank two is unhappy", True)
    threading.Timer(1.5, results_q.put, args=(cause,)).start()
    results_q.put((1, True, b"", False))
    running = [SimpleNamespace(exitcode=None) for _ in range(4)]
    later = launch._later_failures(results_q, consequence, set(), running,
                                   time.monotonic() + 60)
    with pytest.raises(RankFailure) as info:
        launch._raise_failures([consequence] + later, 4)
    text = str(info.value)
    assert text.startswith("run_ranks: rank 2 of 4 raised:\nTraceback"), text
    assert "other ranks that failed too:\n  rank 0: RuntimeError: Connection closed" in text


def test_a_consequence_waits_no_longer_once_the_silent_ranks_have_exited() -> None:
    """A rank that crashed (os._exit, a signal) never reports: the wait for a root cause
    ends once every rank that has not reported has exited, not after _ROOT_CAUSE_S."""
    results_q: queue.Queue = queue.Queue()
    consequence = (0, "Traceback ...\nRuntimeError: Connection closed by peer", False)
    procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9)]
    start = time.monotonic()
    assert launch._later_failures(results_q, consequence, set(), procs,
                                  start + 60) == []
    assert time.monotonic() - start < launch._ROOT_CAUSE_S / 2


def test_hanging_ranks_are_named_at_the_timeout_and_killed(tmp_path: Path) -> None:
    timeout_s = scaled(HANG_RUN_S)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=(
            rf"^run_ranks: rank\(s\) \[1, 2\] of 3 did not finish within {timeout_s:g} s;"
            " all ranks were stopped")):
        run_ranks(_hang, 3, str(tmp_path), timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    # It waited the whole timeout, then at most the SIGTERM grace before SIGKILL (and slack).
    assert timeout_s <= elapsed < timeout_s + launch._GRACE_S + scaled(10), elapsed
    pids = {int(p.read_text()) for p in tmp_path.glob("rank*.pid")}
    assert len(pids) == 3 and os.getpid() not in pids
    for pid in pids:            # the SIGTERM-proof rank and the one inside gloo included
        _assert_gone(pid)
    _assert_no_children()


def test_children_are_reaped_after_success() -> None:
    pids = run_scaled(_pid, 2, timeout_s=HEALTHY_S)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:
        _assert_gone(pid)
    _assert_no_children()


def test_a_crashed_rank_is_reported() -> None:
    with pytest.raises(RankFailure, match="rank 0 exited with code 3 without a result"):
        run_scaled(_crash_on_zero, 2, timeout_s=HEALTHY_S)
    _assert_no_children()


# -- the timeout factor ----------------------------------------------------------------------
@pytest.mark.parametrize("value, factor", [("1", 1.0), ("3", 3.0), (" 0.5 ", 0.5)])
def test_scaled_multiplies_by_the_environment_factor(monkeypatch: pytest.MonkeyPatch,
                                                     value: str, factor: float) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 50.0, 50.0))   # a set factor wins
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, value)
    assert scaled(20) == 20 * factor


@pytest.mark.parametrize("value", [None, ""])
@pytest.mark.parametrize("load, factor", [(0.3, 1.0), (2.0, 1.0), (30.0, 15.0)])
def test_unset_the_factor_follows_the_load_per_core(monkeypatch: pytest.MonkeyPatch,
                                                    value: str | None, load: float,
                                                    factor: float) -> None:
    if value is None:
        monkeypatch.delenv(TIMEOUT_FACTOR_ENV, raising=False)
    else:
        monkeypatch.setenv(TIMEOUT_FACTOR_ENV, value)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert scaled(20) == 20 * factor


@pytest.mark.parametrize("value", ["0", "-2", "fast", "nan", "inf"])
def test_a_bad_factor_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_FACTOR_ENV}='{value}': give a number > 0"):
        scaled(20)
