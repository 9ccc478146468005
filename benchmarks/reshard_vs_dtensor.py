"""meshcomm `reshard` vs DTensor `redistribute`: wall time on the same gloo processes.

Run: `python benchmarks/reshard_vs_dtensor.py [--quick] [--json PATH] [--no-eight]`.

Every case runs both ways in the same processes (4 ranks, then 8 unless --no-eight or
--quick): a warm-up, then N iterations, each side after its own barrier and the two sides
in turn first; an iteration takes as long as its slowest rank. A case reports each side's
median over iterations and the median of the per-iteration ratio meshcomm / DTensor (under
1: meshcomm is faster), with a 95 % interval for it; a tensor under 4 KiB is timed as 20
calls back to back per iteration (its call is shorter than the ranks' spread leaving a
barrier). Both results are checked against
`mc.sim.scatter` of the global tensor. Layouts become DTensor placements with the mapper
of `plan_vs_dtensor.py`, and DTensor's all_to_all runs as on GPUs (its gloo fallback is an
all_gather; see that script), so both sides move what they would move with NCCL.

Also measured: the Python overhead of a cached `mc.reshard` call (its time minus the bare
functional collective its plan makes, on a tiny tensor; and a plan with no collective);
the CPU time per call of a P -> R all_reduce of an (8, 8) tensor on 4 ranks through
`mc.reshard`, DTensor's `redistribute` and funcol's bare `all_reduce`; and
`mc.reshard_many` against a loop of `mc.reshard` over 50 small tensors.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_vs_dtensor as pvd  # noqa: E402  (the layout -> placements mapper)

import meshcomm as mc  # noqa: E402
from meshcomm.executors.distributed import wire
from meshcomm.runtime.launch import run_ranks

DEFAULT_JSON = Path(__file__).parent / "results" / "reshard_vs_dtensor.json"


Case = pvd.Case  # one case type for both benchmarks


def suite(scale: int) -> list[Case]:
    """Transitions DTensor can express (no partial destination), at `scale` rows."""
    n = scale
    rows = [
        ("dp=2 tp=2", (n, 256), "(dp b) (tp h)", "b h"),
        ("dp=2 tp=2", (n, 256), "(dp b) h", "b (dp h)"),
        ("dp=2 tp=2", (n, 256), "b h | sum(tp)", "(tp b) h"),
        ("dp=2 tp=2", (n, 256), "b h | sum(dp, tp)", "b h"),
        ("dp=2 tp=2", (n, 256), "(dp b) h | sum(tp)", "(dp b) (tp h)"),
        ("dp=2 tp=2", (n, 256), "b h", "(dp b) (tp h)"),
        ("dp=2 tp=2", (n, 256), "(dp b) (tp h)", "(tp b) (dp h)"),
        ("dp=2 tp=2", (n, 256), "(dp tp b) h", "(tp dp b) h"),
        ("dp=2 tp=2", (8, n // 8, 256), "(dp b) s (tp h)", "b (dp s) (tp h)"),
        ("tp=4", (n, 256), "(tp a) b", "a (tp b)"),
        ("tp=4", (n, 256), "a b | sum(tp)", "(tp a) b"),
        ("tp=4", (n - 2, 256), "(tp a) b", "a b"),
        ("tp=4", (8, 8), "a b | sum(tp)", "a b"),        # tiny: the call's own cost shows
        ("tp=4", (16, 12), "a b | sum(tp)", "a b"),
    ]
    eight = [
        ("a=2 b=2 c=2", (n, 256), "(a b c w) x", "w x"),
        ("a=2 b=2 c=2", (n, 256), "(a w) (b c x)", "w (a b c x)"),
        ("a=2 b=2 c=2", (n, 256), "w x | sum(a, b, c)", "(a b c w) x"),
        ("a=2 b=2 c=2", (8, n // 8, 256), "(a w) (b x) (c y)", "(c w) (a x) (b y)"),
        ("a=2 b=2 c=2", (8, 8), "w x | sum(a, b, c)", "w x"),
    ]
    return ([Case(f"r{i:02d}", *row) for i, row in enumerate(rows, 1)]
            + [Case(f"e{i:02d}", *row) for i, row in enumerate(eight, 1)])


QUICK_IDS = ("r01", "r02", "r03")
TINY_BYTES = 2**12      # a global tensor under this many bytes is a tiny case ...
TINY_CALLS = 20         # ... timed as this many calls back to back per iteration


# -- helpers that run in every rank ---------------------------------------------------------
def _done(t: torch.Tensor) -> torch.Tensor:
    """The tensor with its collective finished (functional collectives are lazy)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _timed(fn: Callable[[], Any], reps: int, barrier: Callable[[], None],
           clock: Callable[[], float] = time.perf_counter) -> list[float]:
    out = []
    for _ in range(reps):
        barrier()
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def _global(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=gen).float()


def _case_rank(case: Case, k: int, bound: Any, dmesh: Any, reps: int) -> dict[str, Any]:
    """Both sides of one case on this rank: checks and per-iteration seconds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mesh = bound.mesh
    pos = mesh.position(bound.rank)
    x = _global(case.shape, k)
    local = mc.sim.scatter(x, mesh, case.src)[pos]
    want = mc.sim.scatter(x, mesh, case.dst)[pos]
    src = pvd._build_placements(pvd.dtensor_placements(mesh, case.src))
    dst = pvd._build_placements(pvd.dtensor_placements(mesh, case.dst))
    start = DTensor.from_local(local, dmesh, src, run_check=False, shape=torch.Size(case.shape),
                               stride=pvd._stride(case.shape))

    def ours() -> torch.Tensor:
        return _done(mc.reshard(local, bound, case.src, case.dst, shape=case.shape))

    def theirs() -> torch.Tensor:
        return _done(start.redistribute(dmesh, dst).to_local())

    ok = torch.equal(ours(), want) and torch.equal(theirs(), want)
    for _ in range(3):
        ours(), theirs()
    # A tiny tensor's call takes less time than the ranks take to leave a barrier together
    # (milliseconds, with more processes than cores): such a case times TINY_CALLS calls
    # back to back per iteration, as a model step makes them, and reports the time per call.
    calls = TINY_CALLS if math.prod(case.shape) * x.element_size() < TINY_BYTES else 1

    def many(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()
        return run

    t_ours, t_theirs = [], []
    # Interleaved, so drifts in machine load hit both sides alike, and in turn first (ABBA),
    # so neither side always runs right after the other's barrier.
    sides = ((ours, t_ours), (theirs, t_theirs))
    for i in range(reps):
        for fn, times in sides if i % 2 == 0 else sides[::-1]:
            times += [t / calls for t in _timed(many(fn), 1, dist.barrier)]
    return {"ok": bool(ok), "meshcomm_s": t_ours, "dtensor_s": t_theirs, "calls": calls}


def _overhead_rank(bound: Any, reps: int) -> dict[str, float]:
    """Per-rank medians (seconds) of a cached reshard and of the bare collective it makes."""
    import torch.distributed as dist

    x = torch.ones(2, 16)
    name = bound.group_name(("dp", "tp"))
    src, dst, shape = "(dp tp b) h", "b h", (8, 16)
    plan = mc.plan(bound.mesh, shape, src, dst)
    assert [s.kind for s in plan.steps] == ["all_gather"], plan

    def ours() -> Any:
        return _done(mc.reshard(x, bound, src, dst, shape=shape))

    def bare() -> Any:      # what the plan's only step calls, without the final rearrange
        return _done(wire.all_gather_single(x.unsqueeze(0), 0, name))

    full = torch.ones(8, 16)

    def local_only() -> Any:   # a plan with no collective: a local slice
        return mc.reshard(full, bound, "b h", "(dp tp b) h", shape=shape)

    def no_step() -> Any:      # a plan with no step at all: the call's own cost
        return mc.reshard(x, bound, src, src, shape=shape)

    assert not mc.plan(bound.mesh, shape, src, src).steps
    for fn in (ours, bare, local_only, no_step):
        for _ in range(20):
            fn()
    # Wall time waits for the slowest rank; this thread's CPU time does not (gloo works and
    # waits in other threads), so the CPU difference is the Python cost even on a busy host.
    wall: dict[str, list[float]] = {"ours": [], "bare": []}
    cpu: dict[str, list[float]] = {"ours": [], "bare": []}
    for _ in range(reps):
        for key, fn in (("ours", ours), ("bare", bare)):
            wall[key] += _timed(fn, 1, dist.barrier)
            cpu[key] += _timed(fn, 1, dist.barrier, time.thread_time)
    t_local = _timed(local_only, reps, lambda: None)
    t_none = _timed(no_step, reps, lambda: None)
    t_plan = _timed(lambda: mc.plan(bound.mesh, shape, src, dst), reps, lambda: None)
    med = statistics.median
    return {"reshard_s": med(wall["ours"]), "bare_collective_s": med(wall["bare"]),
            "above_collective_best_s": min(wall["ours"]) - min(wall["bare"]),
            "reshard_cpu_s": med(cpu["ours"]), "bare_collective_cpu_s": med(cpu["bare"]),
            "local_plan_s": med(t_local), "no_step_plan_s": med(t_none),
            "cached_plan_s": med(t_plan)}


def _all_reduce_rank(bound: Any, dmesh: Any, reps: int) -> dict[str, float]:
    """Per-rank medians (seconds of this thread's CPU) of one P -> R all_reduce of an (8, 8)
    float32 tensor on a 1-D mesh: a cached reshard, DTensor's redistribute, and the bare
    functional all_reduce (funcol) that both make."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate

    (axis,) = bound.mesh.axis_names
    x = torch.ones(8, 8)
    src, dst = f"a b | sum({axis})", "a b"
    assert [s.kind for s in mc.plan(bound.mesh, (8, 8), src, dst).steps] == ["all_reduce"]
    start = DTensor.from_local(x, dmesh, [Partial()], run_check=False)
    name = bound.group_name(axis)
    fns = {"reshard": lambda: _done(mc.reshard(x, bound, src, dst, shape=(8, 8))),
           "dtensor": lambda: _done(start.redistribute(dmesh, [Replicate()]).to_local()),
           "funcol": lambda: _done(funcol.all_reduce(x, "sum", name))}
    for fn in fns.values():
        for _ in range(20):
            fn()
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            cpu[key] += _timed(fn, 1, dist.barrier, time.thread_time)
    return {f"all_reduce_{k}_cpu_s": statistics.median(v) for k, v in cpu.items()}


def _many_rank(bound: Any, reps: int, count: int) -> dict[str, Any]:
    """A loop of `count` reshards against one reshard_many, for gathers and for reductions."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for label, src, dst in (("all_gather", "(dp tp b) h", "b h"),
                            ("reduce_scatter", "b h | sum(dp, tp)", "(dp tp b) h")):
        items = [mc.distribute(_global((8 * (1 + i % 4), 64), i), bound, src)
                 for i in range(count)]

        def loop() -> list[torch.Tensor]:
            return [_done(mc.reshard(s.local, bound, src, dst, shape=s.shape)) for s in items]

        def many() -> list[torch.Tensor]:
            return [_done(s.local) for s in mc.reshard_many([(s, dst) for s in items])]

        ok = all(torch.equal(a, b) for a, b in zip(loop(), many()))
        for _ in range(2):
            loop(), many()
        t_loop, t_many = [], []
        for _ in range(reps):
            t_loop += _timed(loop, 1, dist.barrier)
            t_many += _timed(many, 1, dist.barrier)
        out[label] = {"ok": ok, "loop_s": t_loop, "many_s": t_many}
    return out


def _rank(rank: int, world: int, cases: list[Case], reps: int, extras: bool) -> dict[str, Any]:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from torch.distributed.tensor import placement_types as pt

    pt.shard_dim_alltoall = pvd._all_to_all_as_on_gpu   # DTensor's NCCL path (see pvd)
    torch.set_num_threads(1)
    bounds, dmeshes, results = {}, {}, {}
    for k, case in enumerate(cases):
        if case.mesh not in bounds:
            bounds[case.mesh] = mc.init_mesh(case.mesh)
            dmeshes[case.mesh] = pvd._device_mesh(case.mesh)
        results[case.id] = _case_rank(case, k, bounds[case.mesh], dmeshes[case.mesh], reps)
    report: dict[str, Any] = {"cases": results}
    if extras:
        bound = bounds.get("dp=2 tp=2") or mc.init_mesh("dp=2 tp=2")
        report["overhead"] = _overhead_rank(bound, 10 * reps)
        if "tp=4" not in bounds:
            bounds["tp=4"], dmeshes["tp=4"] = mc.init_mesh("tp=4"), pvd._device_mesh("tp=4")
        report["overhead"].update(_all_reduce_rank(bounds["tp=4"], dmeshes["tp=4"], 10 * reps))
        report["many"] = _many_rank(bound, max(2, reps // 3), 50)
    return report


# -- merging and printing in the parent --------------------------------------------------
def _slowest(per_rank: list[list[float]]) -> float:
    """Median over iterations of the slowest rank's time."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


def paired_ratio(ours: list[list[float]], theirs: list[list[float]]) -> tuple[float, float, float]:
    """The median over iterations of ours / theirs (each the slowest rank's time in that
    iteration), with a 95 % interval for that median (binomial order statistics).

    Both sides of an iteration ran back to back in the same processes, so a load spike
    that slows one iteration slows both and cancels in its ratio; a ratio of the two
    medians would mix iterations that ran under different loads.
    """
    pairs = sorted(max(o) / max(t) for o, t in zip(zip(*ours), zip(*theirs)))
    lo, hi = median_interval(len(pairs))
    return statistics.median(pairs), pairs[lo], pairs[hi]


def median_interval(n: int, alpha: float = 0.05) -> tuple[int, int]:
    """0-based indices (lo, hi) of the sorted sample of n whose values bound its median
    with confidence at least 1 - alpha, where n allows (distribution-free: the count of
    values below the median is Binomial(n, 1/2)); the widest, (0, n - 1), below that."""
    below, r = 0.0, 0
    while r < n and below + math.comb(n, r) / 2**n <= alpha / 2:
        below += math.comb(n, r) / 2**n
        r += 1
    return max(0, r - 1), min(n - 1, n - r)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def run(cases: list[Case], reps: int, timeout_s: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    extras: dict[str, Any] = {}
    for world in sorted({mc.Mesh(c.mesh).size for c in cases}):
        batch = [c for c in cases if mc.Mesh(c.mesh).size == world]
        first = world == min(mc.Mesh(c.mesh).size for c in cases)
        per_rank = run_ranks(_rank, world, batch, reps, first, timeout_s=timeout_s)
        for case in batch:
            res = [r["cases"][case.id] for r in per_rank]
            p = mc.plan(mc.Mesh(case.mesh), case.shape, case.src, case.dst)
            ours, theirs = (_slowest([r[k] for r in res]) for k in ("meshcomm_s", "dtensor_s"))
            ratio, lo, hi = paired_ratio([r["meshcomm_s"] for r in res],
                                         [r["dtensor_s"] for r in res])
            rows.append({**asdict(case), "world": world, "ok": all(r["ok"] for r in res),
                         "calls_per_iteration": res[0]["calls"],
                         "meshcomm_steps": [s.kind for s in p.collectives],
                         "meshcomm_s": ours, "dtensor_s": theirs, "ratio": ratio,
                         "ratio_95": [lo, hi], "ratio_of_medians": ours / theirs})
        if first:
            over = [r["overhead"] for r in per_rank]
            med = {k: statistics.median(o[k] for o in over) for k in over[0]}
            extras["overhead"] = {**med, "above_collective_median_s": statistics.median(
                o["reshard_s"] - o["bare_collective_s"] for o in over),
                "above_collective_cpu_s": statistics.median(
                o["reshard_cpu_s"] - o["bare_collective_cpu_s"] for o in over)}
            extras["many"] = {}
            for label in per_rank[0]["many"]:
                res = [r["many"][label] for r in per_rank]
                loop, many = (_slowest([r[k] for r in res]) for k in ("loop_s", "many_s"))
                extras["many"][label] = {"ok": all(r["ok"] for r in res), "loop_s": loop,
                                         "many_s": many, "gain": loop / many}
            extras["many"]["gain"] = _geomean([v["gain"] for v in extras["many"].values()])
    ratios = [r["ratio"] for r in rows]
    summary = {"cases": len(rows), "geomean_ratio": _geomean(ratios), "max_ratio": max(ratios),
               "worst_case": max(rows, key=lambda r: r["ratio"])["id"],
               "cases_over_1.1": [r["id"] for r in rows if r["ratio"] > 1.1]}
    meta = {"torch": torch.__version__, "backend": "gloo", "reps": reps,
            "timing": "per iteration the slowest rank; the two sides in turn first; ratio:"
                      " median over iterations of the paired ratio, with its 95 % interval;"
                      " times: medians over iterations; a tensor"
                      f" under {TINY_BYTES} B: {TINY_CALLS} calls back to back per"
                      " iteration, time per call",
            "dtensor_all_to_all": "as on GPUs (plan_vs_dtensor._all_to_all_as_on_gpu)"}
    return {"meta": meta, "cases": rows, "summary": summary, **extras}


def render(report: dict[str, Any]) -> str:
    head = (f"{'case':<4} {'mesh':<11} {'shape':<14} {'src -> dst':<42} {'meshcomm steps':<30}"
            f" {'meshcomm ms':>11} {'DTensor ms':>10} {'ratio':>6} {'95 %':>11}")
    lines = [head, "-" * len(head)]
    for r in report["cases"]:
        flag = "" if r["ok"] else "  (result differs!)"
        shape = str(tuple(r["shape"])).replace(" ", "")
        steps = ",".join(r["meshcomm_steps"]) or "-"
        lines.append(f"{r['id']:<4} {r['mesh']:<11} {shape:<14} {r['src'] + ' -> ' + r['dst']:<42}"
                     f" {steps:<30} {r['meshcomm_s'] * 1e3:>11.3f} {r['dtensor_s'] * 1e3:>10.3f}"
                     f" {r['ratio']:>6.2f} {r['ratio_95'][0]:>5.2f}-{r['ratio_95'][1]:<5.2f}{flag}")
    s = report["summary"]
    lines.append(f"geometric mean of wall-time ratio meshcomm/DTensor: {s['geomean_ratio']:.3f}"
                 f" (target <= 1.0); worst {s['worst_case']} at {s['max_ratio']:.2f}"
                 f" (target <= 1.1); cases over 1.1: {s['cases_over_1.1'] or 'none'}")
    if "overhead" in report:
        o = report["overhead"]
        us = {k: v * 1e6 for k, v in o.items()}
        lines.append(f"cached reshard of a (2, 16) shard (one all_gather): {us['reshard_s']:.1f} us"
                     f" wall; the bare collective: {us['bare_collective_s']:.1f} us; above the"
                     f" collective: {us['above_collective_best_s']:.1f} us best-case wall (target"
                     f" < 50); medians: {us['above_collective_median_s']:.1f} us wall,"
                     f" {us['above_collective_cpu_s']:.1f} us CPU of the calling thread")
        if "all_reduce_dtensor_cpu_s" in o:
            lines.append(f"P -> R all_reduce of (8, 8) on tp=4, CPU of the calling thread per"
                         f" call: reshard {us['all_reduce_reshard_cpu_s']:.1f} us, DTensor"
                         f" redistribute {us['all_reduce_dtensor_cpu_s']:.1f} us, bare funcol"
                         f" all_reduce {us['all_reduce_funcol_cpu_s']:.1f} us")
        lines.append(f"cached reshard with no step (src == dst): {us['no_step_plan_s']:.1f} us;"
                     f" with one local slice: {us['local_plan_s']:.1f} us; cached mc.plan:"
                     f" {us['cached_plan_s']:.2f} us")
    if "many" in report:
        for label, m in report["many"].items():
            if isinstance(m, dict):
                lines.append(f"50 tensors, {label}: loop of reshard {m['loop_s'] * 1e3:.2f} ms,"
                             f" reshard_many {m['many_s'] * 1e3:.2f} ms, gain {m['gain']:.1f}x"
                             + ("" if m["ok"] else " (results differ!)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 cases, 4 ranks, few repeats")
    parser.add_argument("--no-eight", action="store_true", help="skip the 8-rank cases")
    parser.add_argument("--reps", type=int, help="timed iterations per case")
    parser.add_argument("--cases", help="comma-separated case ids to run (default: all)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds per process group")
    args = parser.parse_args(argv)
    cases = suite(64 if args.quick else 1024)
    if args.quick:
        cases = [c for c in cases if c.id in QUICK_IDS]
    elif args.no_eight:
        cases = [c for c in cases if mc.Mesh(c.mesh).size == 4]
    if args.cases:
        cases = [c for c in cases if c.id in args.cases.split(",")]
    report = run(cases, reps=args.reps or (3 if args.quick else 30), timeout_s=args.timeout)
    print(render(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
