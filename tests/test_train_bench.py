"""benchmarks/train_vs_fsdp2.py on a tiny model: every configuration (1 process, FSDP2,
FSDP2 + TP (+ SP), FSDP2 HSDP, meshcomm FSDP with and without prefetch, meshcomm FSDP x TP
(+ SP), meshcomm HSDP) trains to the same
losses, meshcomm sends the same bytes as PyTorch, and the JSON holds the ratios. Speed is
reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_vs_fsdp2.py"


def test_tiny_run_matches_pytorch_in_losses_and_bytes(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--warmup", "2",
                           "--layers", "1", "--dim", "64", "--vocab", "256", "--seq", "16",
                           "--timeout", str(scaled(240)), "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"]
    ratios = report["ratio_values"]
    assert set(ratios) == {"meshcomm_fsdp/fsdp2", "meshcomm_fsdp_tp/fsdp2_tp",
                           "meshcomm_fsdp_tp_sp/fsdp2_tp_sp", "meshcomm_hsdp/fsdp2_hsdp",
                           "meshcomm_fsdp/meshcomm_fsdp_no_prefetch"}
    assert ratios["meshcomm_fsdp/fsdp2"]["sent"] == 1.0
    assert ratios["meshcomm_fsdp_tp/fsdp2_tp"]["sent"] == 1.0
    assert ratios["meshcomm_fsdp_tp_sp/fsdp2_tp_sp"]["sent"] == 1.0
    assert ratios["meshcomm_hsdp/fsdp2_hsdp"]["sent"] == 1.0
    assert ratios["meshcomm_hsdp/fsdp2_hsdp"]["state"] == 1.0
    assert ratios["meshcomm_fsdp/fsdp2"]["state"] == 1.0
    assert "OK: largest relative loss difference" in proc.stdout
