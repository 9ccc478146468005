"""benchmarks/cp_host_scale.py --quick runs end to end, writes its JSON, and an attention call
runs as many tensor ops at 64 ranks as at 8 (no per-rank loop in a call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cp_host_scale.py"


def test_quick_run_and_op_counts_do_not_grow_with_ranks(tmp_path: Path) -> None:
    out = tmp_path / "cp_host_scale.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["ranks"], r["strategy"]) for r in rows} == {
        (n, s) for n in (8, 64) for s in ("allgather", "ulysses", "ring", "hybrid")}
    for strategy in ("allgather", "ulysses", "ring", "hybrid"):
        ops = {r["ranks"]: r["meshcomm_ops"] for r in rows
               if r["strategy"] == strategy and r["cp"] == 8}
        assert ops[8] == ops[64] > 0, (strategy, ops)
        assert all(r["meshcomm_s"] > 0 and (r["pytorch_s"] is None) == (r["strategy"] in
                   ("ring", "hybrid")) for r in rows)
