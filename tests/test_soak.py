"""benchmarks/soak.py in quick mode: 200 random reshards on 4 gloo processes, each equal to
the simulator, with the plan caches bounded (16, below the pool of 50) and memory flat."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from conftest import scaled

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def report(pytestconfig: pytest.Config) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))   # spawned ranks import `soak` by name too
        soak = importlib.import_module("soak")
        return soak.run(count=200, pool=50, plan_cache=16, seed=0, cost_reps=20,  # type: ignore[no-any-return]
                        timeout_s=scaled(240))


def test_every_reshard_equals_the_simulator(report: dict[str, Any]) -> None:
    summary = report["summary"]
    assert summary["mismatches"] == 0, report["problems"]
    assert summary["reshards_per_rank"] == 200
    assert {"all_gather", "all_to_all", "reduce_scatter", "all_reduce"} <= set(
        summary["step_kinds"])


def test_plan_caches_stay_within_their_bound(report: dict[str, Any]) -> None:
    assert report["summary"]["plan_cache_max_fill"] == 16
    for checkpoints in report["checkpoints"].values():
        assert len(checkpoints) == 20
        assert all(cp["plans"] <= 16 and cp["calls"] <= 16 for cp in checkpoints)
        assert checkpoints[-1]["misses"] > 50        # evicted plans were made again


def test_memory_is_flat_once_caches_are_warm(report: dict[str, Any]) -> None:
    assert max(report["summary"]["rss_growth_second_half_mb"]) < 4.0, report["summary"]


def test_check_mode_adds_one_32_byte_all_reduce_to_each_call(report: dict[str, Any]) -> None:
    """What check mode costs in communication, as the wire module recorded every call: the
    call's own collectives, plus one all_reduce of the 32-byte probe when the ranks agree."""
    assert set(report["check_cost"]) == {"0", "1", "2", "3"}
    for cost in report["check_cost"].values():
        assert set(cost) == {"reshard_all_gather", "reshard_no_step", "all_reduce_1_elem"}
        assert cost["reshard_all_gather"]["calls_off"] == [["all_gather", 128]]   # (4, 8) f32
        assert cost["reshard_no_step"]["calls_off"] == []
        assert cost["all_reduce_1_elem"]["calls_off"] == [["all_reduce", 4]]
        for c in cost.values():
            assert c["added_calls"] == [["all_reduce", 32]], c
            assert c["on_us"] > 0 and c["off_us"] > 0, c
