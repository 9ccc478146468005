"""Planning between two meshes at production scale: `mc.plan(..., dst_mesh=)` (every rank's
transfers) and one loading rank's blocks of a checkpoint (`receiver_transfers`, what
`mc.nn.load_checkpoint` computes per tensor), on model shapes (vocab 50257 x hidden 8192).

Run: `python benchmarks/crossmesh_scale.py [--quick] [--json PATH]` (`--quick`: the cases
up to 256 ranks). It reports times and never asserts one. There is no DTensor column:
DTensor has no plan between two meshes.

Per case: the cold time of one `mc.plan` between the meshes (the plan caches emptied
first), the number of transfers it lists (0 where it is planned by counting: every element
with one holder, so each rank lists its own blocks when it runs), the cold time of that
per-rank listing (`Step.rank_transfers`) for the first source rank and the last destination
rank, and the cold time of `receiver_transfers` for the first and the last rank of the
destination (median of 3).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import meshcomm as mc
from meshcomm.planner import search
from meshcomm.planner.states import from_layout
from meshcomm.planner.rank_transfers import receiver_transfers

SHAPE = (50257, 8192)
CASES = [   # (id, source mesh, source layout, destination mesh, destination layout)
    ("64->64 rows to tp", "dp=64", "(dp v) e", "dp=8 tp=8", "(tp v) e"),
    ("128->128 rows to tp", "dp=128", "(dp v) e", "dp=16 tp=8", "(tp v) e"),
    ("256->256 rows to tp", "dp=256", "(dp v) e", "dp=32 tp=8", "(tp v) e"),
    ("256->128 rows to cols", "dp=256", "(dp v) e", "dp=16 tp=8", "v (dp tp e)"),
    ("512->512 rows to tp", "dp=512", "(dp v) e", "dp=64 tp=8", "(tp v) e"),
    ("1024->1024 rows to tp", "dp=1024", "(dp v) e", "dp=128 tp=8", "(tp v) e"),
    ("1024->1024 rows to cols", "dp=1024", "(dp v) e", "dp=128 tp=8", "v (tp dp e)"),
    ("4096->4096 rows to tp", "dp=4096", "(dp v) e", "dp=512 tp=8", "(tp v) e"),
    ("1024 same ranks, rows to tp", "dp=1024", "(dp v) e", "dp=128 tp=8 @same", "(tp v) e"),
    # a replicated source: its senders are chosen (least loaded first), so the plan lists
    # every block (not planned by counting)
    ("256->256 replicated source", "dp=32 tp=8", "(dp v) e", "dp=256", "(dp v) e"),
]
QUICK = 4          # --quick: the first cases (up to 256 ranks)


def clear() -> None:
    """Empty the plan caches (`meshcomm.planner.plan` is shadowed by its function)."""
    sys.modules["meshcomm.planner.plan"].clear_memos()
    search.single_plan.cache_clear()


def run_case(case: tuple[str, str, str, str, str]) -> dict[str, Any]:
    name, src_text, src, dst_text, dst = case
    saved = mc.Mesh(src_text)
    same = dst_text.endswith(" @same")       # the destination on the source's own ranks
    here = mc.Mesh(dst_text.removesuffix(" @same"))
    first = 0 if same else max(saved.ranks) + 1
    renumbered = mc.Mesh(dict(here.axes), ranks=[first + p for p in range(here.size)])
    clear()
    start = time.perf_counter()
    p = mc.plan(saved, SHAPE, src, dst, dst_mesh=renumbered)
    plan_s = time.perf_counter() - start
    transfers = sum(len(s.transfers) for s in p.steps)
    # at run time each rank lists its own blocks (a plan counted, not listed): cold, for the
    # first source rank and the last destination rank
    step = next(s for s in p.steps if s.dst_mesh is not None)
    run = {}
    for rank in (saved.ranks[0], renumbered.ranks[-1]):
        start = time.perf_counter()
        mine = step.rank_transfers(rank)
        run[str(rank)] = {"s": time.perf_counter() - start, "transfers": len(mine)}
    a = from_layout(mc.Layout(src), saved, SHAPE)
    b = from_layout(mc.Layout(dst), here, SHAPE)
    receiver = {}
    for rank in (here.ranks[0], here.ranks[-1]) if step.transfers == () else ():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            blocks = receiver_transfers(a, saved, b, here, rank)
            times.append(time.perf_counter() - start)
        receiver[str(rank)] = {"median_s": statistics.median(times), "blocks": len(blocks)}
    return {"id": name, "src_mesh": src_text, "src": src, "dst_mesh": dst_text, "dst": dst,
            "ranks": len(p.ranks), "plan_s": plan_s, "transfers": transfers,
            "receiver": receiver, "run": run}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="cases up to 256 ranks only")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"shape {SHAPE} float32; times are cold, one thread")
    print(f"{'case':28} {'src -> dst':30} {'plan':>8} {'listed':>7} {'run: one rank':>14}"
          f" {'loader':>8} {'blocks':>6}")
    for case in CASES[:QUICK] if args.quick else CASES:
        r = run_case(case)
        rows.append(r)
        worst = max(r["receiver"].values(), key=lambda v: v["median_s"],
                    default={"median_s": float("nan"), "blocks": "-"})
        slow = max(r["run"].values(), key=lambda v: v["s"])
        print(f"{r['id']:28} {r['src_mesh'] + ' -> ' + r['dst_mesh']:30}"
              f" {r['plan_s']:7.3f}s {r['transfers']:7} {slow['s'] * 1e3:10.1f} ms"
              f" {worst['median_s'] * 1e3:6.1f}ms {worst['blocks']:6}", flush=True)
    if args.json:
        meta = {"torch": torch.__version__, "python": platform.python_version(),
                "platform": platform.platform()}
        Path(args.json).write_text(json.dumps({"meta": meta, "shape": SHAPE, "cases": rows},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
