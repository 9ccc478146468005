"""benchmarks/plan_vs_dtensor.py --quick runs end to end and writes the JSON it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_vs_dtensor.py"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "plan_vs_dtensor.json"
    # --quick spawns a group per world size (4 and 8 ranks), each under --timeout
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out),
                           "--timeout", str(scaled(120))],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_json_has_the_expected_keys(quick_run: tuple[str, dict]) -> None:
    _, report = quick_run
    assert set(report) == {"meta", "cases", "summary", "planning_speed"}
    assert {"cases", "worse_than_dtensor", "worse_details",
            "geomean_recv_max_over_lower_bound"} <= set(report["summary"])
    assert report["cases"], "no cases ran"
    for row in report["cases"]:
        assert {"id", "mesh", "shape", "src", "dst", "meshcomm", "dtensor",
                "dtensor_placements"} <= set(row)
        assert {"recv_max", "recv_sum", "collectives", "peak_max",
                "lower_bound_max"} <= set(row["meshcomm"])
        assert set(row["dtensor"]) == {"default", "min_cost"}
    speed = report["planning_speed"]
    ours, theirs = speed["meshcomm"], speed["dtensor"]
    assert speed["cases"]
    assert set(ours["cold_p50_s_by_case"]) == set(theirs["cold_p50_s_by_case"]) == set(
        speed["cases"])
    # a cached plan is a lookup: far faster than planning cold (about 6000x when measured)
    assert ours["cached_p50_s"] * 100 < ours["cold_p50_s"], ours
    assert speed["ratios"]["dtensor_cached_over_meshcomm_cached"] == pytest.approx(
        theirs["cached_p50_s"] / ours["cached_p50_s"])


def test_dtensor_runs_are_checked_and_counted(quick_run: tuple[str, dict]) -> None:
    _, report = quick_run
    measured = [d for row in report["cases"] for d in row["dtensor"].values()
                if isinstance(d, dict) and "error" not in d]
    assert measured and all(d["ok"] for d in measured)
    by_id = {row["id"]: row for row in report["cases"]}
    # tp=4, (8, 16) float32, "(tp a) b" -> "a (tp b)": one all_to_all, 3 blocks of 32 bytes.
    assert by_id["c01"]["dtensor"]["default"]["recv_max"] == 96
    assert by_id["c01"]["dtensor"]["default"]["collectives"] == 1
    assert by_id["c01"]["meshcomm"]["recv_max"] == 96


def test_summary_lines_are_printed(quick_run: tuple[str, dict]) -> None:
    stdout, _ = quick_run
    assert "cases where meshcomm moves more bytes or uses more peak memory" in stdout
    assert "geometric mean of meshcomm max-rank received bytes / lower bound" in stdout


def test_crossmesh_scale_quick_run_writes_its_json(tmp_path: Path) -> None:
    """benchmarks/crossmesh_scale.py --quick: every case planned by counting (no transfer
    listed in the plan), each rank's own blocks found when it runs, every receiver's blocks
    found (times are reported, never asserted)."""
    out = tmp_path / "crossmesh_scale.json"
    script = SCRIPT.parent / "crossmesh_scale.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [c["id"] for c in report["cases"]][:2] == ["64->64 rows to tp", "128->128 rows to tp"]
    for case in report["cases"]:
        assert case["transfers"] == 0 and case["plan_s"] > 0
        assert all(r["transfers"] > 0 for r in case["run"].values())
        assert case["receiver"] and all(r["blocks"] > 0 for r in case["receiver"].values())


def test_cp_vs_torch_quick_run_is_exact_and_counts_its_bytes(tmp_path: Path) -> None:
    """benchmarks/cp_vs_torch.py --quick (4 gloo ranks): every row equals anchor (a)'s output
    and gradients, each meshcomm strategy's bytes on the wire equal its `Cost.sent_bytes` on
    every rank, and every grid case has one pick (times are reported, never asserted)."""
    out = tmp_path / "cp_vs_torch.json"
    script = SCRIPT.parent / "cp_vs_torch.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out),
                           "--timeout", str(scaled(120))],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"meta", "calibration", "rows", "ratios", "ring", "grid", "summary"} <= set(report)
    impls = {"torch_allgather", "torch_ulysses", "allgather", "ulysses", "ring"}
    assert {r["impl"] for r in report["rows"]} == impls
    for row in report["rows"]:
        assert row["max_rel_diff"] < 1e-4, row
        assert row["step_s"] > 0 and row["peak_bytes"] >= 0
        if row["impl"] in impls - {"torch_allgather", "torch_ulysses"}:
            assert row["sent_bytes_by_rank"] == row["cost_sent_bytes_by_rank"], row
    assert {r["impl"] for r in report["ratios"]} == {"allgather", "ulysses", "ring"}
    assert report["ring"] and all(r["math_s"] > 0 and r["comm_s"] > 0 for r in report["ring"])
    grid = report["grid"]
    assert grid and all(g["pick"] in g["measured_s"] for g in grid)
    assert report["summary"]["grid_cases"] == len(grid)
    assert "auto within 10% of the fastest in" in proc.stdout
