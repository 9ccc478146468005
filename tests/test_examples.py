"""Each example runs as a user would run it (a subprocess, small sizes) and says it succeeded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import scaled

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str) -> str:
    # the examples' own run_ranks timeouts are 240-300 s
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          check=False, text=True, timeout=scaled(300), cwd=ROOT,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "120"})
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    return done.stdout


def test_train_2d_matches_one_process() -> None:
    out = run_example("train_2d.py")
    assert re.search(r"^step\s+1 process\s+dp=2 tp=2\s+rel diff\s+fsdp=2 tp=2\s+rel diff$",
                     out, re.MULTILINE), out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+\d+\.\d+", line)]
    assert [int(r[0]) for r in rows] == list(range(1, 21))
    for r in rows:
        one, dp, d_dp, fsdp, d_fsdp = map(float, r[1:])
        assert abs(dp - one) <= 1e-5 * one and abs(fsdp - one) <= 1e-5 * one, r
        assert max(d_dp, d_fsdp) <= 1e-5
    losses = [float(r[1]) for r in rows]
    assert sum(losses[-5:]) < sum(losses[:5])          # it trains
    assert re.search(r"^OK: largest relative difference \S+ \(within 1e-05\) over 20 steps$",
                     out, re.MULTILINE), out


def test_moe_alltoall_matches_one_process() -> None:
    out = run_example("moe_alltoall.py")
    assert "rank  tokens  sent to r0..r3    received from r0..r3  per local expert" in out
    counts = re.findall(r"^  r(\d)\s+(\d+)\s+\[([\d, ]+)\]\s+\[([\d, ]+)\]", out, re.MULTILINE)
    assert [int(c[0]) for c in counts] == [0, 1, 2, 3]
    sent = [[int(v) for v in c[2].split(",")] for c in counts]
    received = [[int(v) for v in c[3].split(",")] for c in counts]
    assert [list(col) for col in zip(*sent)] == received      # what r sends q, q receives
    assert len({v for row in sent for v in row}) > 1          # uneven splits
    assert "the metadata exchange" in out
    assert out.rstrip().endswith("match the single-process reference within 1e-06")


def test_debug_layouts_prints_layouts_and_plans() -> None:
    out = run_example("debug_layouts.py")
    assert 'recipe "fsdp_tp" on Mesh(fsdp=2, tp=2), as rank 0 sees it' in out
    assert re.search(r"blocks\.0\.up\.weight\s+embed mlp\s+\(16, 32\)\s+\(fsdp embed\) \(tp mlp\)"
                     r"\s+\(8, 16\)\s+embed \(tp mlp\)\s+embed \(tp mlp\) \| avg\(fsdp\)", out)
    assert re.search(r"mlp hidden\s+batch seq mlp\s+\(4, 8, 32\)\s+\(fsdp batch\) seq \(tp mlp\)",
                     out)
    assert 'plan "(fsdp embed) (tp mlp)" -> "embed (tp mlp)"' in out
    assert "r3 fsdp1 tp1" in out                               # the picture
    assert "input grad (4, 8, 16)" in out and "all_reduce sum(tp) 1.0 KiB" in out
    assert "== fully_shard(blocks.0): the plans its unit runs, per parameter ==" in out
    assert ('  backward  up.weight regather (16, 32): "(fsdp embed) (tp mlp)" -> "embed (tp mlp)":'
            " all_gather(fsdp) 512 B") in out
    assert ('  backward  up.weight grad (16, 32): "embed (tp mlp) | avg(fsdp)" ->'
            ' "(fsdp embed) (tp mlp)": reduce_scatter avg(fsdp) 512 B') in out
    other = run_example("debug_layouts.py", "--mesh", "dp=2 tp=2")
    assert re.search(r"blocks\.0\.up\.weight\s+embed mlp\s+\(16, 32\)\s+embed \(tp mlp\)", other)
    assert "embed (tp mlp) | avg(dp)" in other


def test_train_llama_fsdp_x_tp_matches_one_process() -> None:
    """The unmodified Llama-style model under parallelize + fully_shard (dp=2 tp=2) with the
    vocab-parallel loss: every step's loss within 1e-5 of one process."""
    out = run_example("train_llama.py", "--steps", "6")
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\.\d+", line)]
    assert [int(r[0]) for r in rows] == list(range(1, 7))
    assert all(float(r[3]) <= 1e-5 for r in rows), rows
    assert "backward  reduce_scatter  layers.1" in out       # the schedule is printed
    assert re.search(r"^OK: largest relative difference \S+ \(within 1e-05\) over 6 steps$",
                     out, re.MULTILINE), out


def test_train_llama_with_sequence_parallelism_matches_one_process() -> None:
    out = run_example("train_llama.py", "--steps", "3", "--sequence-parallel")
    assert "with sequence parallelism" in out
    assert re.search(r"^OK: largest relative difference \S+ \(within 1e-05\) over 3 steps$",
                     out, re.MULTILINE), out


def test_llama_model_example_trains() -> None:
    out = run_example("llama.py", "--steps", "5")
    assert out.strip(), out
