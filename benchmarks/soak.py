"""Soak: thousands of random reshards on 4 gloo processes, each checked exactly, memory watched.

Run: `python benchmarks/soak.py [--quick] [--count N] [--pool P] [--plan-cache C] [--json PATH]`.

Every rank runs the same `count` transitions (default 2000) from a pool of `pool` random
ones (default 400) on a `dp=2 tp=2` mesh, each of the pool once, then random draws: random shapes (even and uneven), layouts (block,
cyclic, several axes on a dim, partial sums/max/min/avg) and dtypes. Each result is
compared bit for bit with `mc.sim.execute` of the same plan (the data is integer-valued,
so every reduction order gives the same bits). The plan caches are bounded at
`--plan-cache` entries (default 128, below the pool, so plans are evicted and made again
all the time); at 20 checkpoints each rank records its resident memory (from
/proc/self/statm, after a garbage collection) and the plan caches' fill. Memory is stable
when the resident size stops growing once every cache is warm: the report gives the
growth over the second half of the run, which must stay under `--max-growth-mb`.

Also measured (`check_cost`): the time a cached `mc.reshard` call takes with check mode
off and on (median over alternating blocks, per rank), for a plan with one all_gather and
for a plan with no step, and the same for a one-element `mc.collectives.all_reduce`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import meshcomm as mc
from meshcomm.testing import random_layout
from meshcomm.runtime.launch import run_ranks

DEFAULT_JSON = Path(__file__).parent / "results" / "soak.json"
MESH = "dp=2 tp=2"
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12)
OPS = ("sum", "max", "min", "avg")
DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)
CHECKPOINTS = 20
Case = tuple[tuple[int, ...], str, str, torch.dtype]


# -- the cases: the same on every rank ---------------------------------------------------
def cases(pool: int, seed: int) -> list[Case]:
    """`pool` transitions that plan, drawn with `seed` (so every rank draws the same)."""
    mesh, rng, out = mc.Mesh(MESH), random.Random(seed), []
    while len(out) < pool:
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(SIZES) for _ in range(ndim))
        dtype = rng.choice(DTYPES)
        ops = OPS if dtype.is_floating_point else OPS[:3]
        src = random_layout(rng, mesh, ndim, ops, "ijk")
        op = mc.Layout(src).reduce_op
        dst = random_layout(rng, mesh, ndim, (op,) if op else ops, "ijk")
        try:
            mc.plan(mesh, shape, src, dst, dtype=dtype)
        except mc.errors.MeshcommError:
            continue
        out.append((shape, src, dst, dtype))
    return out


def ints(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer-valued data, so every reduction order gives the same bits."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=gen).to(dtype)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- what every rank runs -----------------------------------------------------------------
def soak_rank(rank: int, world: int, count: int, pool: int, plan_cache: int, seed: int,
              cost_reps: int) -> dict[str, Any]:
    mc.planner.set_plan_cache_size(plan_cache)
    bound = mc.init_mesh(MESH)
    mesh, pos = bound.mesh, bound.mesh.position(rank)
    todo, draw = cases(pool, seed), random.Random(seed + 1)
    every = max(1, count // CHECKPOINTS)
    checkpoints, problems, kinds = [], [], set()
    start = time.perf_counter()
    for i in range(count):
        k = i if i < pool else draw.randrange(pool)   # every case once first: warm caches
        shape, src, dst, dtype = todo[k]
        p = mc.plan(mesh, shape, src, dst, dtype=dtype)
        kinds |= {s.kind for s in p.steps}
        locs = mc.sim.scatter(ints(shape, k, dtype), mesh, src)
        want = mc.sim.execute(p, locs).outputs[pos]
        got = mc.reshard(locs[pos], bound, src, dst, shape=shape)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            problems.append(f'reshard {i} (case {k}) {shape} {dtype} "{src}" -> "{dst}"'
                            f" on rank {rank} differs from sim")
        if (i + 1) % every == 0 or i + 1 == count:
            gc.collect()
            checkpoints.append({"reshards": i + 1, "rss_bytes": rss_bytes(),
                                "plan_cache": mc.planner.plan_cache_info()})
    elapsed = time.perf_counter() - start
    return {"rank": rank, "checkpoints": checkpoints, "problems": problems[:20],
            "mismatches": len(problems), "kinds": sorted(kinds), "seconds": elapsed,
            "check_cost": check_cost(bound, cost_reps) if cost_reps else None}


def check_cost(bound: mc.BoundMesh, reps: int) -> dict[str, dict[str, Any]]:
    """Median µs per call with check mode off and on, in alternating blocks of reps/10, and
    the collective calls check mode adds to one call (as the wire module recorded them:
    kind and input bytes)."""
    from meshcomm.executors.distributed import wire

    x = torch.ones(4, 8)
    calls = {
        "reshard_all_gather": lambda on: mc.reshard(x, bound, "(dp b) h", "b h", check=on),
        "reshard_no_step": lambda on: mc.reshard(x, bound, "(dp b) h", "(dp b) h", check=on),
        # `+ 0` waits for the functional collective's result
        "all_reduce_1_elem": lambda on: mc.collectives.all_reduce(x[0, :1], bound, ("dp", "tp"),
                                                                  check=on) + 0,
    }
    out = {}
    block = max(1, reps // 10)
    for name, call in calls.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):                      # warm-up: plans, fingerprints, groups
            call(True)
            call(False)
        for b in range(10):
            for on in (b % 2 == 0, b % 2 == 1):
                for _ in range(block):
                    t = time.perf_counter()
                    call(on)
                    times[on].append(time.perf_counter() - t)
        off, on_ = statistics.median(times[False]) * 1e6, statistics.median(times[True]) * 1e6
        heard = {}
        for on in (False, True):
            with wire.recording() as calls:
                call(on)
            heard[on] = [[w.kind, w.numel_in * size] for w, size in calls]
        added = list(heard[True])
        for made in heard[False]:    # what the unchecked call makes, the checked one makes too
            added.remove(made)
        out[name] = {"off_us": round(off, 1), "on_us": round(on_, 1),
                     "added_us": round(on_ - off, 1), "calls_off": heard[False],
                     "added_calls": added}
    return out


# -- the report -----------------------------------------------------------------------------
def run(count: int = 2000, pool: int = 400, plan_cache: int = 128, seed: int = 0,
        cost_reps: int = 0, timeout_s: float = 600.0) -> dict[str, Any]:
    """The soak's report: per-rank checkpoints, mismatches, memory growth, check cost."""
    t = time.perf_counter()
    ranks = run_ranks(soak_rank, 4, count, pool, plan_cache, seed, cost_reps,
                      timeout_s=timeout_s)
    wall = time.perf_counter() - t
    growth = []
    for r in ranks:
        cps = r["checkpoints"]
        half = cps[len(cps) // 2 - 1] if len(cps) > 1 else cps[0]
        growth.append((cps[-1]["rss_bytes"] - half["rss_bytes"]) / 2**20)
    fills = [cp["plan_cache"] for r in ranks for cp in r["checkpoints"]]
    return {
        "meta": {"mesh": MESH, "ranks": 4, "backend": "gloo", "count": count, "pool": pool,
                 "plan_cache": plan_cache, "seed": seed, "torch": torch.__version__,
                 "python": platform.python_version(), "cpus": os.cpu_count()},
        "summary": {
            "reshards_per_rank": count, "mismatches": sum(r["mismatches"] for r in ranks),
            "step_kinds": sorted({k for r in ranks for k in r["kinds"]}),
            "rss_start_mb": [round(r["checkpoints"][0]["rss_bytes"] / 2**20, 1) for r in ranks],
            "rss_end_mb": [round(r["checkpoints"][-1]["rss_bytes"] / 2**20, 1) for r in ranks],
            "rss_growth_second_half_mb": [round(g, 2) for g in growth],
            "plan_cache_max_fill": max(max(f["plans"], f["calls"]) for f in fills),
            "plan_cache_maxsize": plan_cache,
            "soak_seconds_per_rank": [round(r["seconds"], 1) for r in ranks],
            "wall_seconds": round(wall, 1),
        },
        "problems": [p for r in ranks for p in r["problems"]][:20],
        "checkpoints": {str(r["rank"]): [
            {"reshards": cp["reshards"], "rss_mb": round(cp["rss_bytes"] / 2**20, 2),
             "plans": cp["plan_cache"]["plans"], "calls": cp["plan_cache"]["calls"],
             "misses": cp["plan_cache"]["misses"]}
            for cp in r["checkpoints"]] for r in ranks},
        "check_cost": {str(r["rank"]): r["check_cost"] for r in ranks} if cost_reps else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="200 reshards from a pool of 50, plan cache 16, no cost run")
    parser.add_argument("--count", type=int, help="reshards per rank (default 2000)")
    parser.add_argument("--pool", type=int, help="distinct transitions (default 400)")
    parser.add_argument("--plan-cache", type=int, help="plan cache bound (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-reps", type=int, help="timed calls per check-cost case"
                        " (default 2000; 0 skips it)")
    parser.add_argument("--max-growth-mb", type=float, default=4.0,
                        help="fail when a rank's RSS grows more over the second half")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    quick = (200, 50, 16, 0) if args.quick else (2000, 400, 128, 2000)
    count = args.count or quick[0]
    pool = args.pool or quick[1]
    cache = args.plan_cache if args.plan_cache is not None else quick[2]
    reps = args.cost_reps if args.cost_reps is not None else quick[3]
    report = run(count, pool, cache, args.seed, reps, args.timeout)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    s = report["summary"]
    print(f"{count} reshards per rank on 4 gloo ranks ({MESH}), pool {pool}, plan cache {cache}:"
          f" {s['mismatches']} mismatches against sim, step kinds {', '.join(s['step_kinds'])}")
    print(f"RSS MB start {s['rss_start_mb']} end {s['rss_end_mb']}; growth over the second"
          f" half {s['rss_growth_second_half_mb']}; plan cache fill <= {s['plan_cache_max_fill']}"
          f" (bound {cache}); wall {s['wall_seconds']} s")
    for rank, cost in (report["check_cost"] or {}).items():
        print(f"check mode cost, rank {rank}: " + "; ".join(
            f"{k} {v['off_us']} -> {v['on_us']} us (+{v['added_us']})" for k, v in cost.items()))
    for p in report["problems"]:
        print("PROBLEM", p)
    ok = (s["mismatches"] == 0 and s["plan_cache_max_fill"] <= cache
          and max(s["rss_growth_second_half_mb"]) <= args.max_growth_mb)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
