"""Partial sources between two meshes, planned by this checkout and by another (the last
release), side by side: what direct delivery of partials to their owners changes.

Run: `python benchmarks/crossmesh_partials.py --against PATH [--random N] [--seed S]
[--reps R] [--latency-s L] [--large N] [--json PATH]` (`--latency-s 0`: plan on bytes alone, as
`CostModel(latency_s=0.0)`; by default the default cost model; `--large N`: the first N
of the 256-rank cases, default all 4).

The cases: issue 39's cross-mesh cases, the partial sources of
tests/dist/test_crossmesh_runtime.py, and N (default 500) random ones drawn with
`meshcomm.testing.random_layout`: two meshes of 1 to 3 axes (sizes 1 to 4, at most 32
ranks each; a fifth of them unnamed, axes d0, d1, ...), the destination's first rank drawn
so that the meshes are disjoint, overlapping or nested; a source with a pending sum, avg,
max or min, a destination with or without one; then 4 cases of 256 -> 256 ranks moving a
50257 x 8192 tensor with a pending sum (`LARGE`: where the direct step wins, its listing is
most of a cold plan; each printed with its time old -> new). Each case is planned cold
(every meshcomm cache emptied, one torch thread) `--reps` times by a worker process per
checkout, in turn (old, new, old, new, ...). Printed: how many cases receive less and more
at the busiest rank, the more ones split by modelled cost (a plan may receive more only
where it is cheaper), and the cold time, as the sum and the median of per-case ratios new / old.
Timings on a loaded machine are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AXES = ("dp", "tp", "cp", "sp", "pp", "ep")
SIZES = (1, 2, 2, 2, 3, 4, 4)
DIM_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 64)
OPS = ("sum", "sum", "avg", "max", "min")
Case = tuple[str, list[int], str, list[int], tuple[int, ...], str, str, str]
ISSUE: list[Case] = [
    ("sp=4", list(range(4)), "cp=4 ep=3 dp=4", list(range(48)), (4, 8, 12), "a b c | sum(sp)",
     "a (cp b) (c dp ep)", "int64"),
    ("tp=2 sp=1", [0, 1], "tp=2", [0, 1], (4,), "a | sum(sp)", "(tp a)", "float32"),
]

# 256 -> 256 ranks, a vocab x hidden tensor: where the direct step wins on a large mesh, its
# listing is what cold planning costs (the same ranks, disjoint ranks, half overlapping)
LARGE: list[Case] = [
    (a, list(range(fa, fa + 256)), b, list(range(fb, fb + 256)), (50257, 8192), src, dst,
     "float32")
    for a, fa, b, fb, src, dst in [
        ("dp=32 tp=8", 0, "dp=16 tp=16", 256, "(dp v) e | sum(tp)", "(dp v) (tp e)"),
        ("dp=32 tp=8", 0, "dp=16 tp=16", 128, "(dp v) e | sum(tp)", "(tp v) (dp e)"),
        ("tp=8 dp=32", 0, "dp=32 tp=8", 256, "(dp v) e | sum(tp)", "(dp v) (tp e)"),
        ("tp=8 dp=32", 0, "dp=32 tp=8", 0, "(dp v) e | sum(tp)", "(tp v) (dp e)"),
    ]]


def named_cases() -> list[Case]:
    """Issue 39's cases and the partial sources of tests/dist/test_crossmesh_runtime.py."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "dist")]
    from test_crossmesh_runtime import MESHES, NAMED

    out = list(ISSUE)
    for _, s, d, shape, src, dst, dtype in NAMED:
        if "|" in src:
            a, b = MESHES[s], MESHES[d]
            out.append((_spec(a), list(a.ranks), _spec(b), list(b.ranks), tuple(shape), src, dst,
                        str(dtype).removeprefix("torch.")))
    return out


def _spec(mesh: Any) -> str:
    return " ".join(f"{a}={n}" for a, n in mesh.axes.items())


def random_cases(count: int, seed: int) -> list[Case]:
    """`count` valid partial sources between two meshes (see the module doc)."""
    import meshcomm as mc
    from meshcomm.testing import random_layout

    rng = random.Random(seed)
    out: list[Case] = []

    def mesh_spec() -> str:
        n = rng.randint(1, 3)
        names = ([f"d{i}" for i in range(n)] if rng.random() < 0.2
                 else rng.sample(AXES, n))
        return " ".join(f"{a}={rng.choice(SIZES)}" for a in names)

    while len(out) < count:
        a, b = mesh_spec(), mesh_spec()
        src_mesh = mc.Mesh(a)
        size_b = mc.Mesh(b).size
        if src_mesh.size > 32 or size_b > 32:
            continue
        first = rng.randint(0, src_mesh.size)
        dst_mesh = mc.Mesh(dict(mc.Mesh(b).axes), ranks=range(first, first + size_b))
        if dst_mesh == src_mesh:
            continue
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(DIM_SIZES) for _ in range(ndim))
        src = random_layout(rng, src_mesh, ndim, (rng.choice(OPS),), "ijk", name_inside=0.3)
        if "|" not in src:
            continue
        op = mc.Layout(src).reduce_op
        dst = random_layout(rng, dst_mesh, ndim, (rng.choice(("sum", "max", op)),), "ijk",
                            name_inside=0.3)
        try:
            mc.Layout(src).placements(src_mesh, shape)
            mc.Layout(dst).placements(dst_mesh, shape)
        except mc.errors.MeshcommError:
            continue
        dtype = "float32" if op == "avg" or rng.random() < 0.6 else "int64"
        out.append((a, list(src_mesh.ranks), b, list(dst_mesh.ranks), shape, src, dst, dtype))
    return out


# -- the worker: plans cases cold, one per line read, in its own process ------------------
def worker(root: str, cases_path: str, latency_s: str) -> None:
    """Reads a case index per line and answers its cold plan time in ms and its busiest
    rank's sent and received bytes, modelled cost and steps, as JSON (or a reason)."""
    sys.path.insert(0, root)
    import gc

    import torch

    import meshcomm as mc
    assert Path(mc.__file__).resolve().is_relative_to(Path(root).resolve()), mc.__file__
    torch.set_num_threads(1)
    cases = json.loads(Path(cases_path).read_text())
    cost = None if latency_s == "default" else mc.CostModel(latency_s=float(latency_s))
    sys.path.insert(0, str(HERE))
    from plan_fuzz_time import clear_caches as clear  # every meshcomm cache: a cold plan

    # import every module planning needs (meshcomm imports its planner at the first plan)
    mc.plan(mc.Mesh("w=2"), (4,), "a | sum(w)", "(q a)", dst_mesh=mc.Mesh("q=2", ranks=[2, 3]))
    for line in sys.stdin:
        a, ranks_a, b, ranks_b, shape, src, dst, dtype = cases[int(line)]
        src_mesh = mc.Mesh(dict(mc.Mesh(a).axes), ranks=ranks_a)
        dst_mesh = mc.Mesh(dict(mc.Mesh(b).axes), ranks=ranks_b)
        clear()
        gc.collect()
        try:
            t0 = time.perf_counter()
            p = mc.plan(src_mesh, tuple(shape), src, dst, dtype=getattr(torch, dtype),
                        dst_mesh=dst_mesh, cost_model=cost)
            ms = (time.perf_counter() - t0) * 1e3
            out: dict[str, Any] = {
                "ms": ms, "sent": max(p.send_bytes), "recv": max(p.recv_bytes),
                "cost": p.cost, "steps": len(p.steps), "bound": max(p.lower_bound_bytes),
                "direct": any(s.action == "direct" and s.dst_mesh is not None
                              for s in p.steps)}
        except Exception as exc:   # reported, not raised: the other side may plan it
            out = {"ms": f"n/a: {type(exc).__name__}: {str(exc)[:120]}"}
        print(json.dumps(out), flush=True)


def run(roots: dict[str, Path], cases: list[Case], reps: int, latency_s: str
        ) -> dict[str, list[list[Any]]]:
    """Each case planned cold `reps` times by a worker per root, the workers in turn."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"crossmesh_partials_{os.getpid()}.json"
    path.write_text(json.dumps(cases))
    sys.path.insert(0, str(HERE))
    from plan_fuzz_time import Worker

    workers = {name: Worker(__file__, [str(root), str(path), latency_s])
               for name, root in roots.items()}
    out: dict[str, list[list[Any]]] = {name: [[] for _ in cases] for name in roots}
    try:
        for i in range(len(cases)):
            for _ in range(reps):
                for name, worker in workers.items():
                    out[name][i].append(worker.plan(i))
    finally:
        for worker in workers.values():
            worker.close()
    return out


def summary(cases: list[Case], got: dict[str, list[list[Any]]]) -> dict[str, Any]:
    rows, failed = [], 0
    for case, old, new in zip(cases, got["old"], got["new"]):
        if any(isinstance(r["ms"], str) for r in old + new):
            failed += 1
            continue
        o, n = old[0], new[0]
        rows.append({"case": case, "old": o, "new": n,
                     "old_ms": statistics.median(r["ms"] for r in old),
                     "new_ms": statistics.median(r["ms"] for r in new)})
    same_cost = [r for r in rows if round(r["new"]["cost"], 15) == round(r["old"]["cost"], 15)]
    cheaper = [r for r in rows if round(r["new"]["cost"], 15) < round(r["old"]["cost"], 15)]
    dearer = [r for r in rows if round(r["new"]["cost"], 15) > round(r["old"]["cost"], 15)]
    more = [r for r in rows if r["new"]["recv"] > r["old"]["recv"]]
    less = [r for r in rows if r["new"]["recv"] < r["old"]["recv"]]
    old_sum = sum(r["old_ms"] for r in rows)
    new_sum = sum(r["new_ms"] for r in rows)
    return {
        "cases": len(cases), "compared": len(rows), "failed": failed,
        "direct": sum(r["new"]["direct"] for r in rows),
        "recv_less": len(less), "recv_more": len(more),
        "recv_more_at_equal_cost": sum(r in same_cost for r in more),
        "recv_more_at_higher_cost": sum(r in dearer for r in more),
        "recv_more_cheaper": sum(r in cheaper for r in more),
        "cost_lower": len(cheaper), "cost_higher": len(dearer),
        "below_bound": sum(r["new"]["recv"] < r["new"]["bound"] for r in rows),
        "old_sum_ms": old_sum, "new_sum_ms": new_sum,
        "ratio_of_sums": new_sum / old_sum if old_sum else None,
        "median_ratio": statistics.median(r["new_ms"] / r["old_ms"] for r in rows)
        if rows else None,
        "old_max_ms": max((r["old_ms"] for r in rows), default=None),
        "new_max_ms": max((r["new_ms"] for r in rows), default=None),
        "rows": rows,
    }


def lines(title: str, s: dict[str, Any]) -> list[str]:
    return [
        f"{title}: {s['compared']} of {s['cases']} cases compared ({s['failed']} failed on a"
        f" side); {s['direct']} now deliver partials directly",
        f"  busiest rank receives less in {s['recv_less']}, more in {s['recv_more']} (at equal"
        f" modelled cost {s['recv_more_at_equal_cost']}, at higher cost"
        f" {s['recv_more_at_higher_cost']}, cheaper {s['recv_more_cheaper']}); modelled cost"
        f" lower in {s['cost_lower']}, higher in {s['cost_higher']}; below the bound:"
        f" {s['below_bound']}",
        f"  cold planning new / old: sum {s['old_sum_ms']:.0f} -> {s['new_sum_ms']:.0f} ms"
        f" ({s['ratio_of_sums']:.2f}x), median per case {s['median_ratio']:.2f}x, max"
        f" {s['old_max_ms']:.1f} -> {s['new_max_ms']:.1f} ms",
    ]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
        return 0
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, metavar="PATH",
                        help="a checkout of meshcomm (e.g. a worktree of the last release)")
    parser.add_argument("--new", type=Path, default=ROOT, metavar="PATH",
                        help="the checkout to compare (default: this one)")
    parser.add_argument("--random", type=int, default=500, metavar="N")
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--reps", type=int, default=3, help="cold plans a case a side")
    parser.add_argument("--latency-s", default="default",
                        help="the cost model's latency (default: the default cost model)")
    parser.add_argument("--large", type=int, default=len(LARGE), metavar="N",
                        help=f"the first N of the {len(LARGE)} 256-rank cases (seconds each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    report = {}
    for title, cases in (("named", named_cases()),
                         ("random", random_cases(args.random, args.seed)),
                         ("large", LARGE[:args.large])):
        if not cases:
            continue
        got = run({"old": args.against, "new": args.new}, cases, args.reps, args.latency_s)
        report[title] = summary(cases, got)
        print("\n".join(lines(title, report[title])), flush=True)
        if title == "large":
            for r in report[title]["rows"]:
                a, ra, b, rb, shape, src, dst, _ = r["case"]
                print(f"  {a} -> {b} @{rb[0]} {src!r} -> {dst!r}: {r['old_ms'] / 1e3:.2f} ->"
                      f" {r['new_ms'] / 1e3:.2f} s ({r['new_ms'] / r['old_ms']:.2f}x), direct"
                      f" {r['new']['direct']}, received {r['old']['recv']} ->"
                      f" {r['new']['recv']} B")
        if title == "named":
            for r in report[title]["rows"]:
                a, _, b, _, shape, src, dst, dtype = r["case"]
                print(f"  {a} -> {b} {tuple(shape)} {dtype} {src!r} -> {dst!r}: received"
                      f" {r['old']['recv']} -> {r['new']['recv']} B, sent {r['old']['sent']}"
                      f" -> {r['new']['sent']} B, steps {r['old']['steps']} ->"
                      f" {r['new']['steps']}")
    print(f"load {load} -> {Path('/proc/loadavg').read_text().split()[:3]}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
