"""benchmarks/plan_scale.py --quick runs end to end and writes the JSON it promises.

It runs in a subprocess (its fake process group stays there) and no time is asserted:
a slow planner shows as "timeout" entries, which are valid results here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_scale.py"
BASE_TIMEOUT_S = 300.0
MESHCOMM_KEYS = {"cold_ms", "warm_inputs_built_ms", "cached_us", "peak_mb", "retained_mb",
                 "scale_ratio", "scaled_cold_ms", "scaled_shape", "steps"}
DTENSOR_KEYS = {"placements", "greedy_cold_ms", "min_cost_cold_ms", "min_cost_warm_ms",
                "cached_us"}
SUMMARY_KEYS = {"cases", "meshcomm_timeouts", "cold_p50_ms", "cold_max_ms",
                "one_collective_cold_p50_ms", "median_ratio_to_dtensor_min_cost",
                "median_ratio_warm_to_dtensor_min_cost_warm",
                "max_ratio_warm_to_dtensor_min_cost_warm", "max_element_scaling_ratio"}
SUMMARY_LINES = ("meshcomm cold plan over ", "meshcomm cold plan p50 over one-collective cases:",
                 "median ratio meshcomm cold / DTensor min-cost cold:",
                 "ratio meshcomm / DTensor min-cost, both warm (inputs built, no gc.collect()):",
                 "max element-scaling ratio (4096x elements, cold time big/small):")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "plan_scale.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled(BASE_TIMEOUT_S))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _is_measure(value: Any) -> bool:
    """A number, or a reason why there is none (a non-empty string)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(value))


def test_every_case_has_both_sides(quick_run: tuple[str, dict[str, Any]]) -> None:
    _, report = quick_run
    assert set(report) == {"meta", "cases", "summary", "random"}
    assert len(report["cases"]) == 5
    assert any(row["ranks"] == 1024 for row in report["cases"])
    for row in report["cases"]:
        assert {"id", "mesh", "shape", "src", "dst", "ranks", "one_collective",
                "meshcomm", "dtensor", "meshcomm_over_dtensor_min_cost"} <= set(row)
        assert MESHCOMM_KEYS <= set(row["meshcomm"]), row["id"]
        assert DTENSOR_KEYS <= set(row["dtensor"]), row["id"]
        for key in MESHCOMM_KEYS - {"scaled_shape", "steps"}:
            assert _is_measure(row["meshcomm"][key]), (row["id"], key, row["meshcomm"][key])
        for key in DTENSOR_KEYS - {"placements"}:
            assert _is_measure(row["dtensor"][key]), (row["id"], key, row["dtensor"][key])
        assert _is_measure(row["meshcomm_over_dtensor_min_cost"])
        assert _is_measure(row["warm_over_dtensor_min_cost_warm"])


def test_element_scaling_keeps_the_shape_rank(quick_run: tuple[str, dict[str, Any]]) -> None:
    _, report = quick_run
    for row in report["cases"]:
        big = row["meshcomm"]["scaled_shape"]
        assert len(big) == len(row["shape"])
        assert [b // s for b, s in zip(big, row["shape"]) if b != s] == [4096], row["id"]


def test_summary_is_written_and_printed(quick_run: tuple[str, dict[str, Any]]) -> None:
    stdout, report = quick_run
    summary = report["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert summary["cases"] == 5
    for key in SUMMARY_KEYS - {"cases", "meshcomm_timeouts"}:
        assert _is_measure(summary[key]), (key, summary[key])
    for line in SUMMARY_LINES:
        assert line in stdout, line


def test_the_random_section_draws_valid_transitions_and_reports_both_sides(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    """--quick: 10 random transitions at 256 and at 1,024 ranks (fixed seeds), each with a
    meshcomm cold time and DTensor's two planners beside it (or why not), per-size p50 /
    p90 / max, and whether the issue's targets hold (reported, never asserted)."""
    stdout, report = quick_run
    rows = report["random"]["rows"]
    assert [r["ranks"] for r in rows] == [256] * 10 + [1024] * 10
    import meshcomm as mc

    for r in rows:
        mesh = mc.Mesh(r["mesh"])
        assert mesh.size == r["ranks"] and r["src"] != r["dst"]
        mc.Layout(r["dst"]).placements(mesh, tuple(r["shape"]))   # a valid transition
        for key in ("meshcomm_cold_ms", "dtensor_greedy_cold_ms", "dtensor_min_cost_cold_ms"):
            assert _is_measure(r[key]), (key, r)
    summary = report["random"]["summary"]
    assert set(summary) == {"256", "1024"}
    assert summary["1024"]["targets_ms"] == {"p50": 5.0, "max": 100.0}
    for stats in summary.values():
        for key in ("meshcomm_p50_ms", "meshcomm_p90_ms", "meshcomm_max_ms"):
            assert _is_measure(stats[key]), (key, stats)
        assert isinstance(stats["targets_met"], bool)
    assert "random 1024 ranks (10 transitions" in stdout


def test_random_draws_are_the_same_every_run() -> None:
    import importlib
    import sys as _sys

    _sys.path.insert(0, str(SCRIPT.parent))
    try:
        bench = importlib.import_module("plan_scale")
        first, again = bench.random_cases(1024, 12, 1024), bench.random_cases(1024, 12, 1024)
    finally:
        _sys.path.remove(str(SCRIPT.parent))
    assert first == again and len(first) == 12
    assert any(swap for *_, swap in bench.random_cases(1024, 60, 1024))   # swaps included
