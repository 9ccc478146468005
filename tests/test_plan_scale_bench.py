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
MESHCOMM_KEYS = {"cold_ms", "cached_us", "peak_mb", "retained_mb", "scale_ratio",
                 "scaled_cold_ms", "scaled_shape", "steps"}
DTENSOR_KEYS = {"placements", "greedy_cold_ms", "min_cost_cold_ms", "cached_us"}
SUMMARY_KEYS = {"cases", "meshcomm_timeouts", "cold_p50_ms", "cold_max_ms",
                "one_collective_cold_p50_ms", "median_ratio_to_dtensor_min_cost",
                "max_element_scaling_ratio"}
SUMMARY_LINES = ("meshcomm cold plan over ", "meshcomm cold plan p50 over one-collective cases:",
                 "median ratio meshcomm cold / DTensor min-cost cold:",
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
    assert set(report) == {"meta", "cases", "summary"}
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
