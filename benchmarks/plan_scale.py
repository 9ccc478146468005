"""Planning speed at production scale (up to 4,096 ranks), meshcomm beside DTensor's planners.

Run: `python benchmarks/plan_scale.py [--quick] [--limit-s S] [--reps N] [--json PATH]
[--threads T] [--case ID ...] [--random N] [--random-limit-s S] [--random-small N]
[--against PATH]` (`--quick`: 5 cases, 1 rep, 20 s limit, 10 random transitions at 256
and at 1,024 ranks; it reports and never asserts a time). `--random-small N` and
`--against PATH` run `plan_fuzz_time.py`'s sections after the rest (see there): the
slowest of N random cold plans on <= 64 ranks, and the fixed small cases planned by
another checkout and by this one in turn (the ratio of cold times).

Random section (`--random N`, default 100 per world size): N transitions each on meshes of
256, 1,024 and 4,096 ranks (`RANDOM_MESHES`) with production shapes (`RANDOM_SHAPES`),
drawn with fixed seeds (the world size), about a third of them shard-order swaps (the
factors of each dim reordered); one cold plan each (every cache emptied), DTensor's greedy
and min-cost planners beside it where the layouts have placements, each under
`--random-limit-s`. Reported per world size: p50, p90 and max, and whether the targets of
issue 22 hold (`RANDOM_TARGETS_MS`: p50 <= 5 ms and max <= 100 ms at 1,024 ranks, max <= 1 s
at 4,096).

Per case, meshcomm:
- cold plan: median of N `mc.plan` calls, every functools cache of every `meshcomm*` module
  emptied before each (`clear_meshcomm_caches`), layout parsing included; and cold with the
  inputs built: every cache but those of parsed layouts, placements and mesh tables
  (`INPUT_CACHES`), as DTensor has its DTensorSpec and DeviceMesh objects built before it
  plans (the "built" columns; the fair ratio to DTensor). A full garbage collection runs
  before each cold call (both planners), which leaves the CPU caches cold; "warm" times
  the inputs-built call without it, beside DTensor's min-cost planner timed the same way
  (the `warm/DTmin` column);
- cached call: per-call mean of `mc.plan` with the plan in its cache;
- memory: tracemalloc peak during one cold plan, and what the caches retain after it
  (traced bytes after minus before; Python allocations only);
- element scaling: the cold plan of the same transition with 4,096x the elements (one dim
  times 4,096: the largest dim that divides evenly by the whole mesh, else the largest dim,
  so divisibility, and unevenness of the other dims, are kept), as a time ratio big/small;
  small and big cold plans alternate, N pairs, so load on the machine hits both alike.

Per case, DTensor, in the same process: a fake process group (`FakeStore`, no processes)
of the largest world size in the run, and a `DeviceMesh` over the first N ranks per mesh.
Layouts become placements with `mc.dtensor.to_placements`; `DTensorSpec(mesh, placements,
tensor_meta=TensorMeta(shape, stride, float32))` on both ends. Cold: median of N calls of
`_redistribute._gen_transform_infos_non_cached(src, dst, use_graph_based_transform)` with
False (greedy, DTensor's default) and True (min-cost graph search), its planner cache
(`clear_redistribute_planner_cache`) and `_gen_transform_infos` emptied before each;
DTensor itself switches to the graph search when a spec has a non-default shard order
("forced" below). Cached: per-call mean of `_gen_transform_infos(src, dst)`.

Torch runs with one intra-op thread (`--threads`): the planner's tensors are small, and on
a shared CPU torch's thread pool made the same cold plan 20x slower from one moment to
the next. Every cold call runs under a SIGALRM limit (`--limit-s`) and reports "timeout"
instead of hanging; anything that raises or does not map is reported "n/a" with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import signal
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import meshcomm as mc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_vs_dtensor as pvd  # noqa: E402  (its Case: id, mesh, shape, src, dst)

DEFAULT_JSON = Path(__file__).parent / "results" / "plan_scale.json"
SCALE = 4096
MB = 1e6
Measure = float | str  # a number, or why there is none ("timeout (> 30 s)", "n/a: ...")


@dataclass(frozen=True)
class Case(pvd.Case):
    one_collective: bool  # one collective can make the change (not always at the bound)


def suite() -> list[Case]:
    big4 = "dp=16 cp=4 tp=8 ep=2"
    rows = [
        ("s01", "dp=8 tp=8", (8192, 8192), "(dp a) (tp b)", "(dp a) b", True),
        ("s02", "dp=8 tp=8", (50257, 4096), "(tp a) b", "a (tp b)", True),
        ("s03", "pp=4 dp=8 tp=8", (16, 4096, 8192), "(dp b) s (tp h)", "(dp b) s h", True),
        ("s04", big4, (131072, 4096), "(dp a) (tp b)", "(dp a) b", True),
        ("s05", big4, (131072, 4096), "(dp a) (tp b)", "(tp a) (dp b)", True),
        ("s06", big4, (131072, 4096), "(dp a) b | sum(tp)", "(dp tp a) b", True),
        ("s07", "dp=2 tp=2 cp=2", (4194304, 4, 4), "(dp b) s h", "b s h", True),
        ("a16", "dp=4 tp=4", (64, 64), "(dp a) (tp b)", "(tp a) (dp b)", True),
        ("a64", "dp=8 tp=8", (64, 64), "(dp a) (tp b)", "(tp a) (dp b)", True),
        ("a256", "dp=16 tp=16", (64, 64), "(dp a) (tp b)", "(tp a) (dp b)", True),
        ("a1024", "dp=32 tp=32", (64, 64), "(dp a) (tp b)", "(tp a) (dp b)", True),
        ("v256", "dp=16 tp=16", (50257, 4096), "(tp v) h", "v (tp h)", True),
        ("v1024", "dp=32 tp=32", (50257, 4096), "(tp v) h", "v (tp h)", True),
        ("g256", "dp=16 tp=16", (50257, 4096), "(dp tp v) h", "v h", True),
        ("g1024", "dp=32 tp=32", (50257, 4096), "(dp tp v) h", "v h", True),
        ("r256", "a=4 b=4 c=4 d=4", (4096, 1024), "(a b c d x) y", "(d c b a x) y", True),
        ("p256", "pp=4 dp=8 tp=8", (16, 4096, 8192), "b s h | sum(dp, tp)", "(dp b) s (tp h)",
         True),
        ("u256", "dp=64 tp=1 pp=4", (8192, 4096), "(dp tp b) h", "b (pp h)", True),
        # a reduction over tp and a move over dp: no single collective does both
        ("t1024", big4, (131072, 4096), "(dp a) b | sum(tp)", "a (dp tp b)", False),
    ]
    return [Case(*row) for row in rows]


QUICK_IDS = ("s01", "s06", "a16", "a1024", "r256")


# -- the random section: fixed seeds, production meshes and shapes, shard-order swaps -------
RANDOM_MESHES = {
    256: ("dp=16 tp=16", "pp=4 dp=8 tp=8", "dp=4 cp=4 tp=4 ep=4", "dp=256"),
    1024: ("dp=64 tp=16", "dp=128 tp=8", "pp=4 dp=32 tp=8", "dp=16 cp=4 tp=8 ep=2"),
    4096: ("dp=512 tp=8", "pp=8 dp=64 tp=8", "dp=32 cp=8 tp=8 ep=2", "dp=256 tp=16"),
}
RANDOM_SHAPES = ((8192, 8192), (50257, 4096), (16, 4096, 8192), (64, 14336),
                 (8, 4096, 32, 128), (131072, 4096), (4096, 11008))
RANDOM_OPS = ("sum", "avg", "max", "min")
RANDOM_TARGETS_MS = {1024: {"p50": 5.0, "max": 100.0}, 4096: {"max": 1000.0}}  # issue 22


def random_cases(ranks: int, count: int, seed: int) -> list[tuple[str, tuple[int, ...], str,
                                                                     str, bool]]:
    """`count` valid transitions (mesh, shape, src, dst, is a shard-order swap) on meshes of
    `ranks` ranks, drawn from `random.Random(seed)`: about a third are shard-order swaps
    (the factors of each dim of `src` reordered), the rest two random layouts (the same
    pending op or none)."""
    import random

    from meshcomm.testing import random_layout

    rng = random.Random(seed)
    out: list[tuple[str, tuple[int, ...], str, str, bool]] = []
    tries = 0
    while len(out) < count and tries < 200 * count:
        tries += 1
        spec, shape = rng.choice(RANDOM_MESHES[ranks]), rng.choice(RANDOM_SHAPES)
        mesh, ndim = mc.Mesh(spec), len(shape)
        src = random_layout(rng, mesh, ndim, RANDOM_OPS, name_inside=0.3)
        op = mc.Layout(src).reduce_op
        try:
            mc.Layout(src).placements(mesh, shape)
        except mc.errors.MeshcommError:
            continue
        swap = rng.random() < 1 / 3
        for _ in range(8 if swap else 1):   # a swap that fits the shape, if one is drawn
            dst = (_swapped(rng, mc.Layout(src)) if swap else
                   random_layout(rng, mesh, ndim, (op,) if op else RANDOM_OPS, name_inside=0.3))
            try:
                if dst is not None and dst != src:
                    mc.Layout(dst).placements(mesh, shape)
                    out.append((spec, shape, src, dst, swap))
                    break
            except mc.errors.MeshcommError:
                continue
    return out


def _swapped(rng: Any, layout: mc.Layout) -> str | None:
    """`layout` with the factors of each dim of two or more shuffled; None if none has two."""
    dims = [[f.name for f in d.factors] for d in layout.dims]
    if not any(len(d) > 1 for d in dims):
        return None
    for d in dims:
        rng.shuffle(d)
    return str(mc.Layout.of_dims(dims, layout.reduce_op, layout.partial_axes))


def random_section(counts: dict[int, int], limit_s: float, meshes: dict[str, Any]
                   ) -> dict[str, Any]:
    """Cold meshcomm plans of the random transitions, beside DTensor's two planners."""
    rows = []
    for ranks, count in counts.items():
        for spec, shape, src, dst, swap in random_cases(ranks, count, seed=ranks):
            case = Case(f"x{ranks}-{len(rows)}", spec, shape, src, dst, False)
            m, _ = cold_ms(lambda: mc.plan(mc.Mesh(spec), shape, src, dst),  # noqa: B023
                           clear_meshcomm_caches, 1, limit_s)
            d = dtensor_entry(case, meshes, 1, limit_s)
            rows.append({"ranks": ranks, "mesh": spec, "shape": list(shape), "src": src,
                         "dst": dst, "swap": swap, "meshcomm_cold_ms": m,
                         "dtensor_greedy_cold_ms": d["greedy_cold_ms"],
                         "dtensor_min_cost_cold_ms": d["min_cost_cold_ms"]})
        print(f"  done random {ranks}", file=sys.stderr, flush=True)
    return {"rows": rows, "summary": random_summary(rows, limit_s)}


def random_summary(rows: list[dict[str, Any]], limit_s: float) -> dict[str, Any]:
    """Per world size: meshcomm p50 / p90 / max (timeouts rank as +inf), DTensor's beside
    (on the transitions its placements express), and the targets met."""
    out: dict[str, Any] = {}
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        cold = [r["meshcomm_cold_ms"] for r in mine]
        stats = {"cases": len(mine), "swaps": sum(r["swap"] for r in mine),
                 "meshcomm_timeouts": sum(isinstance(v, str) and v.startswith("timeout")
                                          for v in cold),
                 "meshcomm_p50_ms": _stat(cold, statistics.median_low, limit_s),
                 "meshcomm_p90_ms": _stat(cold, lambda v: v[int(0.9 * (len(v) - 1))],
                                          limit_s),
                 "meshcomm_max_ms": _stat(cold, max, limit_s)}
        for key in ("greedy", "min_cost"):
            vals = [r[f"dtensor_{key}_cold_ms"] for r in mine]
            stats[f"dtensor_{key}_cases"] = sum(not isinstance(v, str) or
                                                v.startswith("timeout") for v in vals)
            stats[f"dtensor_{key}_p50_ms"] = _stat(vals, statistics.median_low, limit_s)
            stats[f"dtensor_{key}_max_ms"] = _stat(vals, max, limit_s)
        targets = RANDOM_TARGETS_MS.get(ranks, {})
        stats["targets_ms"] = targets
        stats["targets_met"] = all(
            isinstance(stats[f"meshcomm_{k}_ms"], float) and stats[f"meshcomm_{k}_ms"] <= v
            for k, v in targets.items())
        out[str(ranks)] = stats
    return out


def random_lines(section: dict[str, Any]) -> list[str]:
    def num(v: Measure) -> str:
        return v if isinstance(v, str) else f"{v:.1f}"

    lines = []
    for ranks, s in section["summary"].items():
        target = ", ".join(f"{k} <= {v:g} ms" for k, v in s["targets_ms"].items())
        lines.append(
            f"random {ranks} ranks ({s['cases']} transitions, {s['swaps']} shard-order swaps):"
            f" meshcomm cold p50 {num(s['meshcomm_p50_ms'])} / p90 {num(s['meshcomm_p90_ms'])}"
            f" / max {num(s['meshcomm_max_ms'])} ms ({s['meshcomm_timeouts']} timed out);"
            f" DTensor greedy p50 {num(s['dtensor_greedy_p50_ms'])} / max"
            f" {num(s['dtensor_greedy_max_ms'])} ms, min-cost p50"
            f" {num(s['dtensor_min_cost_p50_ms'])} / max {num(s['dtensor_min_cost_max_ms'])} ms"
            f" ({s['dtensor_min_cost_cases']} expressible)"
            + (f"; target {target}: {'met' if s['targets_met'] else 'NOT met'}" if target
               else ""))
    return lines


# -- limits, caches, timers ----------------------------------------------------------------
class PlanTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so no `except Exception` in a planner swallows it."""


@contextlib.contextmanager
def time_limit(limit_s: float) -> Iterator[None]:
    def _raise(signum: int, frame: Any) -> None:
        raise PlanTimeout

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# Caches of the inputs alone (parsed layouts, their placements on a mesh and shape, the
# mesh's groups and coordinates): what DTensor has built before it plans, in its
# DTensorSpec and DeviceMesh objects.
INPUT_CACHES = ("core.notation.parse", "core.layout._parse_layout", "core.layout._resolve",
                "core.mesh._groups", "planner.blocks.coords_table",
                "planner.blocks.group_positions")


def clear_meshcomm_caches(keep_inputs: bool = False) -> int:
    """Empty every functools cache held by a module-level attribute of a `meshcomm*` module
    (with `keep_inputs`, all but `INPUT_CACHES`), and every mesh's memo of plans.

    Returns how many distinct caches were cleared (an alias, e.g. a function imported into
    a second module, counts once).
    """
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("meshcomm") or module is None:
            continue
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)
            if isinstance(value, type) or not callable(clear) or id(value) in seen:
                continue
            where = f"{value.__module__.removeprefix('meshcomm.')}.{value.__qualname__}"
            if keep_inputs and where in INPUT_CACHES:
                continue
            seen.add(id(value))
            clear()
    sys.modules["meshcomm.planner.plan"].clear_memos()
    return len(seen)


def clear_planning_caches() -> int:
    """`clear_meshcomm_caches(keep_inputs=True)`: a new transition between built inputs."""
    return clear_meshcomm_caches(keep_inputs=True)


def cold_ms(call: Callable[[], Any], clear: Callable[[], Any], reps: int,
            limit_s: float, collect: bool = True) -> tuple[Measure, int]:
    """Median ms of `call` after `clear` (and a full garbage collection, which leaves the
    CPU caches cold, unless `collect` is False: "warm"), and the reps run; fewer once they
    pass `limit_s`."""
    times: list[float] = []
    for _ in range(reps):
        clear()
        if collect:
            gc.collect()
        try:
            with time_limit(limit_s):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
        except PlanTimeout:
            return f"timeout (> {limit_s:g} s)", len(times) + 1
        except Exception as exc:
            return _reason(exc), len(times) + 1
        if sum(times) > limit_s:
            break
    return statistics.median(times) * 1e3, len(times)


def cached_us(call: Callable[[], Any], budget_s: float = 0.2, most: int = 20000) -> float:
    """Mean µs per call of an already cached `call`, over ~`budget_s` (at most `most` calls)."""
    call()
    calls, t0 = 0, time.perf_counter()
    while calls < most and (calls < 100 or time.perf_counter() - t0 < budget_s):
        call()
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e6


def _reason(exc: BaseException) -> str:
    return f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _short(value: Measure) -> str:
    """The first word of a reason ("timeout", "n/a"), or ">=N" for a bounded ratio."""
    if not isinstance(value, str):
        return str(value)
    if ">=" in value:
        return ">=" + value.split(">=")[1].strip()
    return value.split(" ")[0].split(":")[0]


# -- meshcomm side -------------------------------------------------------------------------
def scaled_shape(mesh: mc.Mesh, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with SCALE x the elements: one dim times SCALE (see the module docstring)."""
    even = [d for d, n in enumerate(shape) if n % mesh.size == 0]
    pick = max(even or range(len(shape)), key=lambda d: shape[d])
    return tuple(n * SCALE if d == pick else n for d, n in enumerate(shape))


def _plan_facts(p: mc.Plan) -> dict[str, Any]:
    return {"steps": [f"{s.kind}({','.join(s.axes)})" if s.axes else s.kind for s in p.steps],
            "collectives": len(p.collectives), "recv_max_bytes": max(p.recv_bytes),
            "lower_bound_max_bytes": max(p.lower_bound_bytes), "bound_ratio": p.bound_ratio}


def _memory(call: Callable[[], Any], limit_s: float) -> tuple[Measure, Measure]:
    clear_meshcomm_caches()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with time_limit(limit_s):
            call()
        current, peak = tracemalloc.get_traced_memory()
    except PlanTimeout:
        return f"timeout (> {limit_s:g} s)", f"timeout (> {limit_s:g} s)"
    except Exception as exc:
        return _reason(exc), _reason(exc)
    finally:
        tracemalloc.stop()
    return (peak - before) / MB, (current - before) / MB


def meshcomm_entry(case: Case, reps: int, limit_s: float) -> dict[str, Any]:
    """Cold and cached plan times, memory, element scaling and the plan's steps and bytes."""
    mesh = mc.Mesh(case.mesh)
    small = lambda: mc.plan(mesh, case.shape, case.src, case.dst)  # noqa: E731
    out: dict[str, Any] = {}
    out["cold_ms"], out["cold_reps"] = cold_ms(small, clear_meshcomm_caches, reps, limit_s)
    if not isinstance(out["cold_ms"], str):
        out["cold_inputs_built_ms"], _ = cold_ms(small, clear_planning_caches, reps, limit_s)
        out["warm_inputs_built_ms"], _ = cold_ms(small, clear_planning_caches, reps, limit_s,
                                                 collect=False)
    if isinstance(out["cold_ms"], str):
        skip = f"skipped: cold plan {_short(out['cold_ms'])}"
        out |= {k: skip for k in ("cached_us", "peak_mb", "retained_mb", "scaled_cold_ms",
                                  "scale_ratio", "steps")}
        out["scaled_shape"] = list(scaled_shape(mesh, case.shape))
        return out
    out |= _plan_facts(small())
    out["cached_us"] = cached_us(small)
    out["peak_mb"], out["retained_mb"] = _memory(small, limit_s)
    big_shape = scaled_shape(mesh, case.shape)
    big = lambda: mc.plan(mesh, big_shape, case.src, case.dst)  # noqa: E731
    out["scaled_shape"] = list(big_shape)
    out |= _scaling(small, big, reps, limit_s)
    if not isinstance(out["scale_ratio"], str):
        out["scaled_same_steps"] = _plan_facts(big())["steps"] == out["steps"]
    return out


def _scaling(small: Callable[[], Any], big: Callable[[], Any], reps: int,
             limit_s: float) -> dict[str, Any]:
    """Cold times of `small` and `big` in alternation (load on the machine hits both alike)."""
    pairs: list[tuple[float, float]] = []
    for _ in range(reps):
        a, _n = cold_ms(small, clear_meshcomm_caches, 1, limit_s)
        b, _n = cold_ms(big, clear_meshcomm_caches, 1, limit_s)
        if isinstance(a, str):
            why = f"n/a: the small plan gave {a} in the pairs"
            return {"scaled_cold_ms": why, "scale_ratio": why}
        if isinstance(b, str):
            bounded = b.startswith("timeout")
            return {"scaled_cold_ms": b, "scale_ratio": f"timeout: >= {limit_s * 1e3 / a:.0f}x"
                    if bounded else b}
        pairs.append((a, b))
        if sum(a + b for a, b in pairs) > limit_s * 1e3:
            break
    big_ms = statistics.median(b for _, b in pairs)
    return {"scaled_cold_ms": big_ms, "scaled_reps": len(pairs),
            "scale_ratio": big_ms / statistics.median(a for a, _ in pairs)}


# -- DTensor side --------------------------------------------------------------------------
def init_fake_world(world_size: int) -> None:
    """One fake process group of `world_size` ranks in this process (rank 0; no peers)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def device_mesh(mesh: mc.Mesh, cache: dict[str, Any]) -> Any:
    """A DeviceMesh over ranks 0..mesh.size-1 of the fake world, one per mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    key = str(mesh)
    if key not in cache:
        ranks = torch.arange(mesh.size).reshape(mesh.shape)
        cache[key] = DeviceMesh("cpu", ranks, mesh_dim_names=mesh.axis_names)
    return cache[key]


def _spec(dmesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), stride, torch.float32)
    return DTensorSpec(dmesh, tuple(placements), tensor_meta=meta)


def dtensor_entry(case: Case, meshes: dict[str, Any], reps: int,
                  limit_s: float) -> dict[str, Any]:
    """DTensor greedy and min-cost cold plan times and the cached lookup, or why not."""
    from torch.distributed.tensor import _redistribute as redist
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    mesh = mc.Mesh(case.mesh)
    try:  # a layout without placements, or a mesh DTensor rejects: n/a, with the reason
        src_p = mc.dtensor.to_placements(mesh, case.shape, case.src)
        dst_p = mc.dtensor.to_placements(mesh, case.shape, case.dst)
        dmesh = device_mesh(mesh, meshes)
        src, dst = _spec(dmesh, src_p, case.shape), _spec(dmesh, dst_p, case.shape)
    except Exception as exc:
        why = _reason(exc)
        return {"placements": why, "greedy_cold_ms": why, "min_cost_cold_ms": why,
                "cached_us": why}
    out: dict[str, Any] = {"placements": {"src": str(list(src_p)), "dst": str(list(dst_p))}}
    out["greedy_forced_graph"] = not all(
        DTensorSpec.is_default_device_order(s.shard_order) for s in (src, dst)) or any(
        type(p).__name__ == "_StridedShard" for p in (*src_p, *dst_p))

    def clear() -> None:
        redist._gen_transform_infos.cache_clear()
        redist.clear_redistribute_planner_cache()

    for key, graph in (("greedy", False), ("min_cost", True)):
        once = lambda: redist._gen_transform_infos_non_cached(src, dst, graph)  # noqa: E731
        out[f"{key}_cold_ms"], out[f"{key}_reps"] = cold_ms(once, clear, reps, limit_s)
        if key == "min_cost" and not isinstance(out["min_cost_cold_ms"], str):
            out["min_cost_warm_ms"], _ = cold_ms(once, clear, reps, limit_s, collect=False)
        if not isinstance(out[f"{key}_cold_ms"], str):
            out[f"{key}_steps"] = len(once())
    clear()
    lookup = lambda: redist._gen_transform_infos(src, dst)  # noqa: E731
    try:
        with time_limit(limit_s):  # the first lookup plans
            lookup()
        out["cached_us"] = cached_us(lookup)
    except PlanTimeout:
        out["cached_us"] = f"timeout (> {limit_s:g} s)"
    except Exception as exc:
        out["cached_us"] = _reason(exc)
    return out


# -- the run, the summary, the table --------------------------------------------------------
def _ratio(m: Measure, d: Measure, limit_s: float) -> Measure:
    if isinstance(d, str):
        return f"n/a: DTensor {_short(d)}"
    if isinstance(m, str):
        return f"{_short(m)}: >= {limit_s * 1e3 / d:.0f}x" if m.startswith("timeout") \
            else f"n/a: meshcomm {_short(m)}"
    return m / d


def run(cases: list[Case], reps: int, limit_s: float,
        random_counts: dict[int, int] | None = None,
        random_limit_s: float = 10.0) -> dict[str, Any]:
    import torch.distributed as dist

    random_counts = {k: v for k, v in (random_counts or {}).items() if v}
    init_fake_world(max([mc.Mesh(c.mesh).size for c in cases] + list(random_counts)))
    meshes: dict[str, Any] = {}
    rows = []
    section = None
    try:
        for case in cases:
            row = {**asdict(case), "ranks": mc.Mesh(case.mesh).size,
                   "meshcomm": meshcomm_entry(case, reps, limit_s),
                   "dtensor": dtensor_entry(case, meshes, reps, limit_s)}
            row["meshcomm_over_dtensor_min_cost"] = _ratio(
                row["meshcomm"]["cold_ms"], row["dtensor"]["min_cost_cold_ms"], limit_s)
            row["inputs_built_over_dtensor_min_cost"] = _ratio(
                row["meshcomm"].get("cold_inputs_built_ms", row["meshcomm"]["cold_ms"]),
                row["dtensor"]["min_cost_cold_ms"], limit_s)
            row["warm_over_dtensor_min_cost_warm"] = _ratio(
                row["meshcomm"].get("warm_inputs_built_ms", row["meshcomm"]["cold_ms"]),
                row["dtensor"].get("min_cost_warm_ms", row["dtensor"]["min_cost_cold_ms"]),
                limit_s)
            rows.append(row)
            print(f"  done {case.id}", file=sys.stderr, flush=True)
        if random_counts:
            section = random_section(random_counts, random_limit_s, meshes)
    finally:
        dist.destroy_process_group()
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "reps": reps,
            "torch_threads": torch.get_num_threads(),
            "limit_s": limit_s, "scale": SCALE, "memory_unit": "MB = 1e6 bytes (tracemalloc)"}
    report = {"meta": meta, "cases": rows, "summary": summarize(rows, limit_s)}
    if section is not None:
        report["random"] = section
    return report


def _stat(values: list[Measure], pick: Callable[[list[float]], float], limit_s: float
          ) -> Measure:
    """`pick` over numbers with timeouts (also "timeout: >= Nx") ranked as +inf; n/a dropped."""
    nums = sorted(math.inf if isinstance(v, str) else v for v in values
                  if not isinstance(v, str) or v.startswith("timeout"))
    if not nums:
        return "n/a: no case finished"
    got = pick(nums)
    return f"timeout (a meshcomm plan > {limit_s:g} s)" if math.isinf(got) else got


def summarize(rows: list[dict[str, Any]], limit_s: float) -> dict[str, Any]:
    cold = [r["meshcomm"]["cold_ms"] for r in rows]
    one = [r["meshcomm"]["cold_ms"] for r in rows if r["one_collective"]]
    ratios = [r["meshcomm_over_dtensor_min_cost"] for r in rows]
    built = [r["inputs_built_over_dtensor_min_cost"] for r in rows]
    warm = [r["warm_over_dtensor_min_cost_warm"] for r in rows]
    scaling = [r["meshcomm"]["scale_ratio"] for r in rows]
    at_least = [float(s.split(">=")[1].rstrip("x")) for s in scaling
                if isinstance(s, str) and ">=" in s]
    done = [s for s in scaling if not isinstance(s, str)]
    scale_max: Measure = max(done) if done else "n/a: no case finished"
    if at_least and max(at_least) > (max(done) if done else 0.0):
        scale_max = f"timeout: >= {max(at_least):.0f}x"
    return {
        "cases": len(rows),
        "meshcomm_timeouts": sum(isinstance(v, str) and v.startswith("timeout") for v in cold),
        "cold_p50_ms": _stat(cold, statistics.median_low, limit_s),
        "cold_max_ms": _stat(cold, max, limit_s),
        "one_collective_cold_p50_ms": _stat(one, statistics.median_low, limit_s),
        "median_ratio_to_dtensor_min_cost": _stat(ratios, statistics.median_low, limit_s),
        "median_ratio_inputs_built_to_dtensor_min_cost": _stat(built, statistics.median_low,
                                                               limit_s),
        "median_ratio_warm_to_dtensor_min_cost_warm": _stat(warm, statistics.median_low,
                                                            limit_s),
        "max_ratio_warm_to_dtensor_min_cost_warm": _stat(warm, max, limit_s),
        "max_element_scaling_ratio": scale_max,
    }


def _fmt(value: Any, spec: str, width: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{_short(str(value))[:width]:>{width}}"
    return f"{value:>{width}{spec}}"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


COLUMNS = (  # header, width, format, getter
    ("case", 6, "", lambda r: r["id"]), ("ranks", 5, "d", lambda r: r["ranks"]),
    ("1coll", 5, "", lambda r: "yes" if r["one_collective"] else "no"),
    ("mc cold ms", 10, ".2f", lambda r: r["meshcomm"]["cold_ms"]),
    ("built ms", 8, ".2f", lambda r: r["meshcomm"].get("cold_inputs_built_ms", "n/a")),
    ("cached µs", 9, ".2f", lambda r: r["meshcomm"]["cached_us"]),
    ("peak MB", 8, ".3f", lambda r: r["meshcomm"]["peak_mb"]),
    ("kept MB", 8, ".3f", lambda r: r["meshcomm"]["retained_mb"]),
    ("4096x", 7, ".2f", lambda r: r["meshcomm"]["scale_ratio"]),
    ("DT greedy ms", 12, ".3f", lambda r: r["dtensor"]["greedy_cold_ms"]),
    ("DT mincost ms", 13, ".3f", lambda r: r["dtensor"]["min_cost_cold_ms"]),
    ("DT cached µs", 12, ".2f", lambda r: r["dtensor"]["cached_us"]),
    ("mc/DTmin", 8, ".1f", lambda r: r["meshcomm_over_dtensor_min_cost"]),
    ("built/DTmin", 11, ".1f", lambda r: r["inputs_built_over_dtensor_min_cost"]),
    ("warm/DTmin", 10, ".2f", lambda r: r["warm_over_dtensor_min_cost_warm"]),
)


def render(report: dict[str, Any]) -> str:
    head = " ".join(f"{h:>{w}}" if i > 0 else f"{h:<{w}}" for i, (h, w, _, _) in
                    enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in report["cases"]:
        cells = [f"{r['id']:<6}"] + [_fmt(get(r), spec, w) for _, w, spec, get in COLUMNS[1:]]
        lines.append(" ".join(cells))
        m, d = r["meshcomm"], r["dtensor"]
        shape = str(tuple(r["shape"])).replace(" ", "")
        lines.append(f"       {r['mesh']} {shape}: {r['src']} -> {r['dst']}")
        if isinstance(m.get("steps"), list):
            note = " (DT greedy forced to graph search)" if d.get("greedy_forced_graph") else ""
            if isinstance(d["placements"], str):
                note = f" (DT {d['placements'][:80]})"
            recv, bound = _bytes(m["recv_max_bytes"]), _bytes(m["lower_bound_max_bytes"])
            lines.append(f"       meshcomm [{', '.join(m['steps'])}], recv max {recv} vs bound"
                         f" {bound};"
                         f" DT steps greedy {d.get('greedy_steps', '-')}, min-cost"
                         f" {d.get('min_cost_steps', '-')}{note}")
        else:
            lines.append(f"       meshcomm {m['cold_ms']}")
    return "\n".join(lines)


def summary_lines(report: dict[str, Any]) -> list[str]:
    s = report["summary"]

    def num(v: Measure, unit: str = "") -> str:
        return v if isinstance(v, str) else f"{v:.2f}{unit}"

    return [
        f"meshcomm cold plan over {s['cases']} cases: p50 {num(s['cold_p50_ms'], ' ms')},"
        f" max {num(s['cold_max_ms'], ' ms')} ({s['meshcomm_timeouts']} timed out)",
        f"meshcomm cold plan p50 over one-collective cases:"
        f" {num(s['one_collective_cold_p50_ms'], ' ms')}",
        f"median ratio meshcomm cold / DTensor min-cost cold:"
        f" {num(s['median_ratio_to_dtensor_min_cost'])}",
        f"median ratio meshcomm cold with inputs built / DTensor min-cost cold:"
        f" {num(s['median_ratio_inputs_built_to_dtensor_min_cost'])}",
        f"ratio meshcomm / DTensor min-cost, both warm (inputs built, no gc.collect()):"
        f" median {num(s['median_ratio_warm_to_dtensor_min_cost_warm'])},"
        f" max {num(s['max_ratio_warm_to_dtensor_min_cost_warm'])}",
        f"max element-scaling ratio ({SCALE}x elements, cold time big/small):"
        f" {num(s['max_element_scaling_ratio'])}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"cases {', '.join(QUICK_IDS)}, 1 rep, --limit-s 20")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="time limit per cold plan call (default 60, 20 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="cold reps (default 5; quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1; see the module docstring)")
    parser.add_argument("--case", action="append", default=[], help="run only these ids")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--random", type=int, default=None, metavar="N",
                        help="random transitions per world size, 256 / 1,024 / 4,096 ranks"
                             " (default 100; --quick: 10 at 256 and 1,024; 0: none)")
    parser.add_argument("--random-limit-s", type=float, default=10.0,
                        help="time limit per cold call in the random section (default 10)")
    parser.add_argument("--random-small", type=int, default=0, metavar="N",
                        help="N random transitions on <= 64 ranks, one cold plan each, max"
                             " printed (plan_fuzz_time.py; issue 39: max < 100 ms)")
    parser.add_argument("--against", type=Path, default=None, metavar="PATH",
                        help="a checkout of meshcomm (the last release): the fixed small"
                             " cases planned cold by it and by this one in turn, ratio printed"
                             " (plan_fuzz_time.py)")
    args = parser.parse_args(argv)
    limit_s = args.limit_s or (20.0 if args.quick else 60.0)
    reps = args.reps or (1 if args.quick else 5)
    count = args.random if args.random is not None else (10 if args.quick else 100)
    random_counts = {256: count, 1024: count} if args.quick else {
        256: count, 1024: count, 4096: count}
    cases = suite()
    wanted = set(args.case) or (set(QUICK_IDS) if args.quick else None)
    if wanted:
        unknown = wanted - {c.id for c in cases}
        if unknown:
            parser.error(f"unknown case ids {sorted(unknown)}; cases: {[c.id for c in cases]}")
        cases = [c for c in cases if c.id in wanted]
    torch.set_num_threads(args.threads)
    report = run(cases, reps, limit_s, random_counts, args.random_limit_s)
    print(render(report))
    print(f"limit {limit_s:g} s per cold call, {reps} reps; 1coll: one collective can do it;"
          f" kept MB: retained in caches; 4096x: cold time with {SCALE}x elements / cold time")
    for line in summary_lines(report):
        print(line)
    for line in random_lines(report["random"]) if "random" in report else []:
        print(line)
    if args.random_small or args.against is not None:
        import plan_fuzz_time as fuzz
        if args.random_small:
            report["random_small"] = fuzz.small_section(args.random_small, 64, limit_s)
            print("\n".join(fuzz.small_lines(report["random_small"])))
        if args.against is not None:
            report["against"] = fuzz.against_section(args.against, 300, 3, limit_s)
            print("\n".join(fuzz.against_lines(report["against"])))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
