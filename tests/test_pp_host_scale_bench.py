"""benchmarks/pp_host_scale.py --quick runs end to end, writes its JSON, and a pipeline step
runs as many tensor ops at 128 ranks as at 8 (no per-rank loop in a step), for meshcomm and
for torch.distributed.pipelining alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pp_host_scale.py"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def test_quick_run_and_op_counts_do_not_grow_with_ranks(tmp_path: Path) -> None:
    out = tmp_path / "pp_host_scale.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["ranks"], r["schedule"]) for r in rows} == {
        (n, s) for n in (8, 128) for s in SCHEDULES}
    assert {(r["ranks"], r["rank"], r["dp"], r["tp"]) for r in rows} == {
        (8, 3, 1, 2), (128, 33, 4, 8)}
    for schedule in SCHEDULES:
        mine = {r["ranks"]: r for r in rows if r["schedule"] == schedule}
        for lib in ("meshcomm", "torch"):
            assert mine[8][f"{lib}_ops"] == mine[128][f"{lib}_ops"] > 0, (schedule, lib, mine)
            assert all(r[f"{lib}_s"] > 0 and r[f"{lib}_calls"] > 0 for r in mine.values())
    # two stages a pipeline rank: twice the ops of one
    ops = {r["schedule"]: r["meshcomm_ops"] for r in rows if r["ranks"] == 8}
    assert ops["interleaved_1f1b"] == 2 * ops["1f1b"], ops
    assert [g["schedule"] for g in result["growth"]] == list(SCHEDULES)
    assert all(g["meshcomm_ops_growth"] == 1.0 for g in result["growth"])
