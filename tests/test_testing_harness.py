"""meshcomm.testing.run_ranks: results by rank, real collectives, errors, timeouts, cleanup."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from meshcomm.core.errors import MeshcommError, RankFailure
from meshcomm.executors.distributed.launch import run_ranks


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


def _pid_or_sleep(rank: int, world_size: int, sleep_s: float) -> int:
    if rank == 1:
        time.sleep(sleep_s)
    return os.getpid()


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
    assert run_ranks(_identify, 3, "x", scale=10) == [("x", 0, 3), ("x", 10, 3), ("x", 20, 3)]
    _assert_no_children()


def test_all_reduce_over_four_ranks() -> None:
    assert run_ranks(_all_reduce_rank, 4) == [[10.0, 10.0, 10.0]] * 4
    _assert_no_children()


def test_exception_on_rank_two_reports_its_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_two, 4, timeout_s=30)
    text = str(info.value)
    assert "rank 2 of 4 raised" in text
    assert "Traceback" in text and "_fail_on_two" in text
    assert "ValueError: rank two is unhappy" in text
    assert isinstance(info.value, MeshcommError) and isinstance(info.value, RuntimeError)
    _assert_no_children()


def test_a_rank_past_the_timeout_is_killed_and_named() -> None:
    # Long enough for three spawns to import torch on a loaded 2-core machine.
    timeout_s = 25.0
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] of 3 did not finish within 25 s"):
        run_ranks(_pid_or_sleep, 3, 600.0, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + 5.0
    _assert_no_children()


def test_children_are_reaped_after_success() -> None:
    pids = run_ranks(_pid_or_sleep, 2, 0.0)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:
        _assert_gone(pid)
    _assert_no_children()


def test_a_crashed_rank_is_reported() -> None:
    with pytest.raises(RankFailure, match="rank 0 exited with code 3 without a result"):
        run_ranks(_crash_on_zero, 2, timeout_s=30)
    _assert_no_children()
