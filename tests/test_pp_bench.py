"""benchmarks/pp_vs_torch.py --quick (4 gloo ranks) runs end to end and writes its JSON: for
GPipe, 1F1B and interleaved 1F1B, meshcomm's Pipeline and torch.distributed.pipelining give
the same loss and gradients (float32), send the same bytes, and every figure is there (times
are reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pp_vs_torch.py"


def test_quick_run_agrees_with_torch_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "pp_vs_torch.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out),
                           "--timeout", str(scaled(240))],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"meta", "rows", "summary"} <= set(report)
    rows = {r["schedule"]: r for r in report["rows"]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved_1f1b"}
    assert rows["interleaved_1f1b"]["stages"] == 8 and rows["gpipe"]["stages"] == 4
    for name, r in rows.items():
        assert r["loss_abs_diff"] <= 1e-5 * max(1.0, abs(r["loss"])), (name, r["loss_abs_diff"])
        assert r["grad_max_rel_diff"] < 1e-4, (name, r["grad_max_rel_diff"])
        sent = r["sent_bytes_by_rank"]
        # meshcomm's own record equals what reached gloo, and torch sends as much
        assert sent["meshcomm_wire"] == sent["meshcomm_p2p"] == sent["torch_p2p"], (name, sent)
        assert all(b > 0 for b in sent["meshcomm_wire"]), (name, sent)
        assert r["step_s"]["meshcomm"] > 0 and r["step_s"]["torch"] > 0
        assert r["predicted_s"] > 0 and r["predicted_s_gloo_hop"] > 0
        assert len(r["costs"]["forward_s"]) == r["stages"] and r["costs"]["hop_s"] > 0
        assert all(p > 0 for side in r["peak_bytes_by_rank"].values() for p in side)
    assert report["summary"]["losses_agree"] is True
    assert set(report["summary"]["time_ratio"]) == set(rows)
    assert "losses and gradients agree (float32): True" in proc.stdout
