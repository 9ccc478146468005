"""Partial sources against the counting bound: how close the planner's bytes come.

Run: `python benchmarks/partial_bound.py [--n N] [--json PATH]`.

Draws random transitions from a pending reduction that resolve some of it
(`meshcomm.testing.partial_transition`: 15 meshes of 6 to 64 ranks, sum/avg/max/min, fixed
seeds), plans each one, and compares the busiest rank's received bytes with the counting
bound computed element by element (`meshcomm.testing.counting_bound`, an oracle separate
from the planner's own bound). Two samples: dims divisible by the meshes (64, 128 or 192),
and small dims (1 to 16) that `torch.chunk` splits unevenly. It prints, per sample, the
share of plans at the bound, the ratio's p50 / p90 / max and how many are above 1.5x, then
the worst cases; `--json` writes the same and every case's row (to compare two checkouts
case by case: run this script with PYTHONPATH naming the other one). Planning only:
nothing runs in a process group.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import meshcomm as mc
from meshcomm.testing import counting_bound, partial_transition

SAMPLES = (("divisible", True, 7), ("small", False, 8))
BYTES_ONLY = mc.CostModel(latency_s=0.0)


def _step_name(s: mc.Step) -> str:
    """A step as the worst cases print it: kind, tree, op of a send_recv, axes."""
    op = f" {s.op}" if s.kind == "send_recv" and s.op else ""
    return f"{s.kind}{' tree' if s.action == 'tree' else ''}{op}({','.join(s.axes)})"


def measure(n: int, even: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        mesh, shape, src, dst = partial_transition(rng, even)
        # bytes alone (no latency per round): the bound counts bytes, and the default
        # model's latency takes one collective over a tree on small tensors
        p = mc.plan(mesh, shape, src, dst, cost_model=BYTES_ONLY)
        bound = counting_bound(mesh, shape, src, dst)
        assert bound is not None and bound * 4 == max(p.lower_bound_bytes), str(p)
        rows.append({"mesh": str(mesh), "shape": list(shape), "src": src, "dst": dst,
                     "recv_max": max(p.recv_bytes), "bound": bound * 4,
                     "ratio": max(p.recv_bytes) / (bound * 4),
                     "steps": [_step_name(s) for s in p.steps]})
    ratios = sorted(r["ratio"] for r in rows)
    return {"n": n, "seed": seed, "at_bound": sum(r <= 1.0 for r in ratios) / n,
            "p50": ratios[n // 2], "p90": ratios[int(n * 0.9)], "max": ratios[-1],
            "above_1_5": sum(r > 1.5 for r in ratios),
            "worst": sorted(rows, key=lambda r: -r["ratio"])[:8], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400, help="transitions per sample (default 400)")
    ap.add_argument("--json", help="where to write results")
    args = ap.parse_args()
    out = {}
    for name, even, seed in SAMPLES:
        r = out[name] = measure(args.n, even, seed)
        print(f"{name} dims ({r['n']} transitions, seed {seed}): at the bound {r['at_bound']:.1%},"
              f" p50 {r['p50']:.2f}x, p90 {r['p90']:.2f}x, max {r['max']:.2f}x,"
              f" above 1.5x: {r['above_1_5']}")
        for w in r["worst"][:4]:
            print(f"  {w['ratio']:.2f}x {w['recv_max']} B vs {w['bound']} B  {w['mesh']}"
                  f" {tuple(w['shape'])} \"{w['src']}\" -> \"{w['dst']}\"  {' '.join(w['steps'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
