"""meshcomm plans vs torch DTensor `redistribute`, side by side, on a suite of layout changes.

Run: `python benchmarks/plan_vs_dtensor.py [--quick] [--json PATH]`.

For every case the script reports, per planner, the bytes each rank receives (max and
sum over ranks), the number of collectives and the peak memory (max over ranks), and the
lower bound on received bytes from `meshcomm.planner.bounds`.

How DTensor is measured. Each case runs on real gloo processes (4 or 8, via
`meshcomm.runtime.launch.run_ranks`), once with DTensor's default (greedy) planner and once under
`torch.distributed.tensor._redistribute.use_min_cost_redistribution_plan()` (its
graph-based Dijkstra planner); non-default shard orders always use the graph planner. A
`TorchDispatchMode` records every `_c10d_functional` op that `redistribute` issues
(kind, group size, the rank's position in the group, input and output sizes), and bytes
follow meshcomm's formulas (meshcomm/planner/moves.py): all_gather receives the other blocks,
reduce_scatter (g-1) output chunks, all_reduce (T - c_i) + (g-1) c_i with `torch.chunk`
chunks c_i of the flat tensor, all_to_all the chunks of the others. On CPU DTensor
replaces its all_to_all by an all_gather (gloo has no `_dtensor.shard_dim_alltoall`); the
script swaps in an exact equivalent of the NCCL path (pad, split, one
`all_to_all_single`), so DTensor is counted as it runs on GPUs. Every DTensor result is
checked against `meshcomm.executors.sim.scatter` of the global tensor under the destination layout,
and every source against the global tensor (`full_tensor`), so both sides do the same job.

Peak memory, both sides: the source is held throughout; a step holds its input and output
(for DTensor: each collective's input and output buffers, padding included, and each local
chunk); the first step's input is the source itself. Peak = max over steps, per rank.

Layouts map to DTensor placements by `dtensor_placements`, i.e. `mc.dtensor.to_placements`
(meshcomm/interop/placements.py): a group "(a1 a2 ... name)" becomes Shard(dim) on each axis, in shard
order a1, a2, ... (non-default orders as `_StridedShard`, the encoding DTensor 2.13 decodes
into `shard_order`); "| op(axes)" becomes Partial(op). Cyclic groups "(name axis)" and sized
factors map to a lone `_StridedShard`, which torch 2.13 redistributes wrongly in some
transitions, so they are "n/a" for DTensor here and still compared with the lower bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import meshcomm as mc
from meshcomm import planner
from meshcomm.core.reduce_ops import chunk_sizes
from meshcomm.executors.sim import scatter
from meshcomm.runtime.launch import run_ranks

PLANNERS = ("default", "min_cost")
DEFAULT_JSON = Path(__file__).parent / "results" / "plan_vs_dtensor.json"


@dataclass(frozen=True)
class Case:
    id: str
    mesh: str
    shape: tuple[int, ...]
    src: str
    dst: str


def _suite() -> list[Case]:
    rows = [
        # 1-D mesh, 4 ranks
        ("tp=4", (8, 16), "(tp a) b", "a (tp b)"),
        ("tp=4", (8, 16), "(tp a) b", "a b"),
        ("tp=4", (8, 16), "a b", "a (tp b)"),
        ("tp=4", (8, 16), "a b | sum(tp)", "a b"),
        ("tp=4", (8, 16), "a b | sum(tp)", "(tp a) b"),
        ("tp=4", (8, 16), "a b | max(tp)", "a b"),
        ("tp=4", (8, 16), "a b | avg(tp)", "a (tp b)"),
        ("tp=4", (10, 6), "(tp a) b", "a (tp b)"),
        ("tp=4", (10, 6), "(tp a) b", "a b"),
        ("tp=4", (10, 6), "a b | sum(tp)", "(tp a) b"),
        ("tp=4", (8, 16), "(a tp) b", "(tp a) b"),
        # 2-D mesh, 4 ranks
        ("dp=2 tp=2", (8, 8, 16), "(dp b) s (tp h)", "b (dp s) (tp h)"),
        ("dp=2 tp=2", (8, 8, 16), "(dp b) s (tp h)", "b s h"),
        ("dp=2 tp=2", (8, 8, 16), "(dp tp b) s h", "(tp dp b) s h"),
        ("dp=2 tp=2", (8, 8, 16), "(dp b) (tp s) h", "(tp b) (dp s) h"),
        ("dp=2 tp=2", (8, 8, 16), "b s h | sum(dp, tp)", "(dp b) s (tp h)"),
        ("dp=2 tp=2", (8, 8, 16), "(dp b) s h | sum(tp)", "(dp b) s (tp h)"),
        ("dp=2 tp=2", (8, 8, 16), "(dp b) s h | sum(tp)", "(dp b) s h"),
        ("dp=2 tp=2", (8, 8, 16), "b s h", "(dp tp b) s h"),
        ("dp=2 tp=2", (8, 8, 16), "(dp tp b) s h", "b s h"),
        ("dp=2 tp=2", (5, 6, 7), "(dp b) s (tp h)", "b (dp s) (tp h)"),
        # 2-D mesh, 8 ranks
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s (tp h)", "(dp b) (tp s) h"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s (tp h)", "(tp b) s (dp h)"),
        ("dp=2 tp=4", (8, 16, 32), "(tp dp b) s h", "(dp tp b) s h"),
        ("dp=2 tp=4", (8, 16, 32), "(dp tp b) s h", "b (tp dp s) h"),
        ("dp=2 tp=4", (8, 16, 32), "b s h | sum(dp, tp)", "b s (dp tp h)"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s h | sum(tp)", "(dp b) (tp s) h"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s (tp h)", "b s h"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) s h | max(tp)", "(dp b) s (tp h)"),
        ("dp=2 tp=4", (7, 10, 6), "(dp b) s (tp h)", "b (dp s) (tp h)"),
        ("dp=2 tp=4", (7, 10, 6), "(dp b) (tp s) h", "(tp b) (dp s) h"),
        ("dp=2 tp=4", (8, 16, 32), "(dp b) (tp s) h", "(dp b) s (tp h)"),
        # 3-D mesh, 8 ranks, 4-dim tensors
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a w) (b x) (c y) z", "w x y (a b c z)"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a b c w) x y z", "(c b a w) x y z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a w) (b x) (c y) z", "(c w) (a x) (b y) z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "w x y z | sum(a, b, c)", "(a b c w) x y z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a w) x y z | sum(b, c)", "(a w) (b x) (c y) z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a w) (b x) (c y) z", "w x y z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(a b w) x (c y) z", "(b a w) (c x) y z"),
        ("a=2 b=2 c=2", (5, 6, 7, 3), "(a w) (b x) (c y) z", "(c w) (a x) (b y) z"),
        ("a=2 b=2 c=2", (8, 8, 8, 8), "(w a) x y z", "(a b c w) x y z"),
    ]
    return [Case(f"c{i:02d}", *row) for i, row in enumerate(rows, 1)]


QUICK_IDS = ("c01", "c05", "c12", "c14", "c16", "c37")
TIMING_MESH = "a=2 b=2 c=2"


# -- layouts as DTensor placements ---------------------------------------------------
def dtensor_placements(mesh: mc.Mesh, layout: str, shape: tuple[int, ...] | None = None
                       ) -> tuple[tuple[Any, ...], ...] | str:
    """Per mesh axis ("shard", dim, split_factor) | ("replicate",) | ("partial", op), or why not.

    The exact mapping `mc.dtensor.to_placements` (meshcomm/interop/placements.py), for layouts whose every dim
    is blocks "(axes... name)". Cyclic and sized groups map too (a lone _StridedShard), but
    torch 2.13 redistributes those wrongly in some transitions (docs/dtensor.md): "n/a" here.
    Without `shape`, an even shape stands in (block placements do not depend on it).
    """
    parsed = mc.Layout(layout)
    names = mesh.axis_names
    for d, dim in enumerate(parsed.dims):
        rest = [f for f in dim.factors if f.name not in names]
        if any(f.size is not None for f in rest) or len(rest) > 1:
            return f"n/a: dim {d} {dim} has sized or several local factors"
        if rest and dim.factors[-1] != rest[0]:
            return f"n/a: dim {d} {dim} puts a mesh axis inside the local name (cyclic)"
    if shape is None:
        shape = tuple(math.prod(mesh.axis_size(f.name) for f in dim.factors if f.name in names)
                      for dim in parsed.dims)
    try:
        placements = mc.dtensor.to_placements(mesh, shape, parsed)
    except mc.errors.InteropError as exc:
        return f"n/a: {str(exc).splitlines()[0]}"
    out: list[tuple[Any, ...]] = []
    for p in placements:
        kind = type(p).__name__
        out.append(("replicate",) if kind == "Replicate" else ("partial", p.reduce_op)
                   if kind == "Partial" else ("shard", p.dim, getattr(p, "split_factor", 1)))
    return tuple(out)


def _placement_text(desc: tuple[tuple[Any, ...], ...] | str) -> str:
    if isinstance(desc, str):
        return desc
    words = {"replicate": lambda p: "R", "partial": lambda p: f"P({p[1]})",
             "shard": lambda p: f"S({p[1]})" if p[2] == 1 else f"SS({p[1]},sf={p[2]})"}
    return "[" + ", ".join(words[p[0]](p) for p in desc) + "]"


# -- meshcomm side --------------------------------------------------------------------
def meshcomm_row(case: Case) -> dict[str, Any]:
    mesh = mc.Mesh(case.mesh)
    try:
        p = mc.plan(mesh, case.shape, case.src, case.dst)
    except Exception as exc:  # reported, never fixed here
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"recv_max": max(p.recv_bytes), "recv_sum": sum(p.recv_bytes),
            "collectives": len(p.collectives), "peak_max": max(p.peak_bytes),
            "lower_bound_max": max(p.lower_bound_bytes),
            "steps": [f"{s.kind}({','.join(s.axes)})" if s.axes else s.kind for s in p.steps]}


def _clear_meshcomm_plan_cache() -> None:
    """Empty both plan caches (setting their size empties them)."""
    size = planner.plan_cache_info()["maxsize"]
    planner.set_plan_cache_size(size)
    assert planner.plan_cache_info()["plans"] == 0


def time_meshcomm(cases: list[Case], reps: int) -> dict[str, Any]:
    """p50 seconds of a cold plan (plan caches cleared) and of a cached `mc.plan` call.

    Cold clears only the plan caches: parsed layouts stay cached, as in a program that
    plans a new change between layouts it already uses.
    """
    cold, cached, per_case = [], [], {}
    for case in cases:
        mesh = mc.Mesh(case.mesh)
        mine = []
        for _ in range(reps):
            _clear_meshcomm_plan_cache()
            t0 = time.perf_counter()
            mc.plan(mesh, case.shape, case.src, case.dst)
            mine.append(time.perf_counter() - t0)
        cold += mine
        per_case[case.id] = statistics.median(mine)
        shape, src, dst = case.shape, case.src, case.dst   # as DTensor's side: prebuilt
        cached.append(_per_call(lambda: mc.plan(mesh, shape, src, dst)))
    return {"cold_p50_s": statistics.median(cold), "cached_p50_s": statistics.median(cached),
            "cold_p50_s_by_case": per_case}


def _per_call(fn: Any, calls: int = 2000) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


# -- DTensor side (runs in every rank) -------------------------------------------------
_RECORDERS: list[_Recorder] = []


class _Recorder(TorchDispatchMode):
    """Records each functional collective (and, via patches, each local chunk) it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        self.ops_seen: set[str] = set()

    def __enter__(self) -> _Recorder:
        _RECORDERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _RECORDERS.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("_c10d_functional", "_dtensor", "c10d"):
            self.ops_seen.add(f"{func.namespace}.{func._opname}")
            if func._opname not in ("wait_tensor", "_wrap_tensor_autograd"):
                bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
                self.events.append(_collective_event(func._opname, bound, out))
        return out


def _collective_event(op: str, bound: dict[str, Any], out: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = bound["group_name"]
    pg = _resolve_process_group(group) if isinstance(group, str) else group
    g, pos = pg.size(), dist.get_group_rank(pg, dist.get_rank())
    x = bound["input"]
    item, n_in, n_out = x.element_size(), x.numel(), out.numel()
    kind = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
            "broadcast": "broadcast"}.get(op, op)
    if kind == "all_gather":
        recv = n_out - n_in
    elif kind == "reduce_scatter":
        recv = (g - 1) * n_out
    elif kind == "all_reduce":
        c = chunk_sizes(n_in, g)[pos]
        recv = (n_in - c) + (g - 1) * c
    elif kind == "all_to_all":
        splits = bound.get("output_split_sizes") or [x.shape[0] // g] * g
        row = n_out // max(sum(splits), 1)
        recv = n_out - splits[pos] * row
    elif kind == "broadcast":
        recv = 0 if pos == bound["src"] else n_out
    else:
        raise AssertionError(f"unexpected collective {op} in DTensor redistribute")
    return {"kind": kind, "group_size": g, "in_bytes": n_in * item, "out_bytes": n_out * item,
            "recv_bytes": recv * item}


def _record_local(orig: Any) -> Any:
    def wrapper(self: Any, local_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, local_tensor, *args, **kwargs)
        for rec in _RECORDERS:
            item = local_tensor.element_size()
            rec.events.append({"kind": "local", "group_size": 1, "recv_bytes": 0,
                               "in_bytes": local_tensor.numel() * item,
                               "out_bytes": out.numel() * item})
        return out
    return wrapper


def _all_to_all_as_on_gpu(x: torch.Tensor, gather_dim: int, shard_dim: int, mesh: Any,
                          mesh_dim: int) -> torch.Tensor:
    """What `_dtensor.shard_dim_alltoall` does with NCCL, as one gloo all_to_all_single."""
    import torch.distributed._functional_collectives as funcol

    g = mesh.size(mesh_dim)
    n = x.size(shard_dim)
    assert n % g == 0, f"padded shard dim {shard_dim} of size {n} does not divide by {g}"
    blocks = torch.stack([x.narrow(shard_dim, j * (n // g), n // g) for j in range(g)])
    got = funcol.all_to_all_single(blocks.contiguous(), None, None, (mesh, mesh_dim))
    got = got.wait() if isinstance(got, funcol.AsyncCollectiveTensor) else got
    return torch.cat(list(got.unbind(0)), dim=gather_dim).contiguous()


def _install_patches() -> None:
    from torch.distributed.tensor import placement_types as pt

    pt.shard_dim_alltoall = _all_to_all_as_on_gpu
    pt.Shard._replicate_to_shard = _record_local(pt.Shard._replicate_to_shard)
    pt._StridedShard._replicate_to_strided_shard = _record_local(
        pt._StridedShard._replicate_to_strided_shard)


def _build_placements(desc: tuple[tuple[Any, ...], ...]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in desc:
        if p[0] == "replicate":
            out.append(Replicate())
        elif p[0] == "partial":
            out.append(Partial(p[1]))
        else:
            out.append(Shard(p[1]) if p[2] == 1 else _StridedShard(p[1], split_factor=p[2]))
    return out


def _device_mesh(spec: str) -> Any:
    from itertools import combinations

    from torch.distributed.device_mesh import init_device_mesh

    mesh = mc.Mesh(spec)
    dmesh = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.axis_names)
    # Flattened sub-meshes let DTensor merge same-kind collectives over several axes.
    for k in range(2, len(mesh.axis_names) + 1):
        for names in combinations(mesh.axis_names, k):
            with contextlib.suppress(Exception):
                dmesh[names]._flatten()
    return dmesh


def _global(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _run_dtensor(rank: int, case: Case, src: Any, dst: Any, dmesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as redist

    mesh = mc.Mesh(case.mesh)
    x = _global(case.shape)
    local = scatter(x, mesh, case.src)[rank]
    want = scatter(x, mesh, case.dst)[rank]
    start = DTensor.from_local(local, dmesh, _build_placements(src), run_check=False,
                               shape=torch.Size(case.shape), stride=_stride(case.shape))
    out: dict[str, Any] = {"src_ok": bool(torch.equal(start.full_tensor(), x)),
                           "src_bytes": local.numel() * local.element_size()}
    for planner in PLANNERS:
        redist._gen_transform_infos.cache_clear()
        force = redist.use_min_cost_redistribution_plan(True) if planner == "min_cost" \
            else contextlib.nullcontext()
        try:
            with force, _Recorder() as rec:
                got = start.redistribute(dmesh, _build_placements(dst)).to_local()
            out[planner] = {"events": rec.events, "ops_seen": sorted(rec.ops_seen),
                            "ok": bool(got.shape == want.shape and torch.equal(got, want))}
        except Exception as exc:
            out[planner] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return out


def _time_dtensor(jobs: list[tuple[Case, Any, Any]], meshes: dict[str, Any],
                  reps: int) -> dict[str, float]:
    from torch.distributed.tensor import _redistribute as redist
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    greedy, graph, cached, per_case = [], [], [], {}
    for case, src, dst in jobs:
        meta = TensorMeta(torch.Size(case.shape), _stride(case.shape), torch.float32)
        dmesh = meshes[case.mesh]
        a = DTensorSpec(dmesh, tuple(_build_placements(src)), tensor_meta=meta)
        b = DTensorSpec(dmesh, tuple(_build_placements(dst)), tensor_meta=meta)
        for sink, graph_based, key in ((greedy, False, "default"), (graph, True, "min_cost")):
            mine = []
            for _ in range(reps):
                t0 = time.perf_counter()
                redist._gen_transform_infos_non_cached(a, b, graph_based)
                mine.append(time.perf_counter() - t0)
            sink += mine
            per_case.setdefault(case.id, {})[key] = statistics.median(mine)
        cached.append(_per_call(lambda: redist._gen_transform_infos(a, b)))
    return {"cold_default_p50_s": statistics.median(greedy),
            "cold_min_cost_p50_s": statistics.median(graph),
            "cached_p50_s": statistics.median(cached), "cold_p50_s_by_case": per_case}


def _dtensor_rank(rank: int, world_size: int, jobs: list[tuple[Case, Any, Any]],
                  timing_ids: tuple[str, ...], reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    # DTensor logs a warning per unmergeable multi-axis collective; the table shows them.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _install_patches()
    meshes: dict[str, Any] = {}
    results = {}
    for case, src, dst in jobs:
        if case.mesh not in meshes:
            meshes[case.mesh] = _device_mesh(case.mesh)
        results[case.id] = _run_dtensor(rank, case, src, dst, meshes[case.mesh])
    timing = None
    if rank == 0 and timing_ids:
        timing = _time_dtensor([j for j in jobs if j[0].id in timing_ids], meshes, reps)
    dist.barrier()
    return {"results": results, "timing": timing}


# -- merging, summary, printing ----------------------------------------------------------
def _dtensor_summary(per_rank: list[dict[str, Any]], planner: str) -> dict[str, Any]:
    runs = [r[planner] for r in per_rank]
    if any("error" in r for r in runs):
        return {"error": next(r["error"] for r in runs if "error" in r)}
    recv, peak = [], []
    for r, src in zip(runs, per_rank):
        recv.append(sum(e["recv_bytes"] for e in r["events"]))
        held = src["src_bytes"]
        steps = [e["in_bytes"] + e["out_bytes"] + (held if k else 0)
                 for k, e in enumerate(r["events"])]
        peak.append(max([held, *steps]))
    events = runs[0]["events"]
    return {"recv_max": max(recv), "recv_sum": sum(recv), "peak_max": max(peak),
            "collectives": max(sum(e["kind"] != "local" for e in r["events"]) for r in runs),
            "steps": [e["kind"] if e["kind"] == "local" else f"{e['kind']}(g={e['group_size']})"
                      for e in events],
            "ok": all(r["ok"] for r in runs) and all(s["src_ok"] for s in per_rank),
            "ops_seen": sorted({op for r in runs for op in r["ops_seen"]})}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0


def _ratio(got: int, bound: int) -> float:
    return 1.0 if got == bound else (math.inf if bound == 0 else got / bound)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    worse: list[dict[str, Any]] = []
    ratios = []
    for row in rows:
        m = row["meshcomm"]
        if "error" in m:
            worse.append({"case": row["id"], "why": m["error"]})
            continue
        ratios.append(_ratio(m["recv_max"], m["lower_bound_max"]))
        for planner, d in row["dtensor"].items():
            if not isinstance(d, dict) or "error" in d or not d["ok"]:
                continue
            why = [k for k in ("recv_max", "recv_sum", "peak_max") if m[k] > d[k]]
            if why:
                worse.append({"case": row["id"], "planner": planner, "worse_in": why,
                              "meshcomm": {k: m[k] for k in why}, "dtensor": {k: d[k] for k in why}})
    return {"cases": len(rows), "worse_than_dtensor": len({w["case"] for w in worse}),
            "worse_details": worse, "geomean_recv_max_over_lower_bound": _geomean(ratios)}


def _cell(d: Any) -> str:
    if not isinstance(d, dict):
        return f"{'n/a':>24}"
    if "error" in d:
        return f"{'error':>24}"
    flag = "" if d.get("ok", True) else "!"
    return f"{d['recv_max']:>7} {d['recv_sum']:>7} {d['collectives']:>2} {d['peak_max']:>5}{flag:1}"


def _steps(d: Any) -> str:
    if not isinstance(d, dict):
        return str(d).split(":")[0]
    return "error" if "error" in d else ("[" + ", ".join(d["steps"]) + "]")


def render(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':<4} {'mesh':<11} {'shape':<13} {'src -> dst':<48} {'bound':>7} "
            f"| {'meshcomm max/sum/coll/peak':>24} | {'dtensor default':>24} "
            f"| {'dtensor min-cost':>24} | mc/LB")
    lines = [head, "-" * len(head)]
    for row in rows:
        m = row["meshcomm"]
        bound = m.get("lower_bound_max", "?")
        ratio = _ratio(m["recv_max"], m["lower_bound_max"]) if "error" not in m else math.nan
        lines.append(
            f"{row['id']:<4} {row['mesh']:<11} {str(tuple(row['shape'])).replace(' ', ''):<13} "
            f"{row['src'] + ' -> ' + row['dst']:<48} {bound:>7} | {_cell(m)} | "
            f"{_cell(row['dtensor'].get('default'))} | {_cell(row['dtensor'].get('min_cost'))} "
            f"| {ratio:.2f}")
        lines.append(f"{'':<4} steps: meshcomm {_steps(m)}; DTensor default"
                     f" {_steps(row['dtensor'].get('default'))}; min-cost"
                     f" {_steps(row['dtensor'].get('min_cost'))}")
    lines.append("bytes: received per rank (max over ranks, sum over ranks); coll: collectives;"
                 " peak: max-rank bytes; '!' = DTensor result differed from the expected shards")
    return "\n".join(lines)


def run(cases: list[Case], reps: int, timeout_s: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    jobs: dict[int, list[tuple[Case, Any, Any]]] = {}
    for case in cases:
        mesh = mc.Mesh(case.mesh)
        src = dtensor_placements(mesh, case.src, case.shape)
        dst = dtensor_placements(mesh, case.dst, case.shape)
        rows.append({**asdict(case), "meshcomm": meshcomm_row(case),
                     "dtensor_placements": {"src": _placement_text(src), "dst": _placement_text(dst)},
                     "dtensor": {}})
        if isinstance(src, str) or isinstance(dst, str):
            rows[-1]["dtensor"] = {p: "n/a" for p in PLANNERS}
        elif "partial" in {p[0] for p in dst}:
            rows[-1]["dtensor"] = {p: "n/a: DTensor cannot redistribute to Partial" for p in PLANNERS}
        else:
            jobs.setdefault(mesh.size, []).append((case, src, dst))
    timing_ids = tuple(c.id for c, _, _ in jobs.get(8, []) if c.mesh == TIMING_MESH)
    dt_timing = None
    by_id = {row["id"]: row for row in rows}
    for world_size, batch in sorted(jobs.items()):
        ids = timing_ids if world_size == 8 else ()
        per_rank = run_ranks(_dtensor_rank, world_size, batch, ids, reps, timeout_s=timeout_s)
        dt_timing = per_rank[0]["timing"] or dt_timing
        for case, _, _ in batch:
            results = [r["results"][case.id] for r in per_rank]
            by_id[case.id]["dtensor"] = {p: _dtensor_summary(results, p) for p in PLANNERS}
    timed = [c for c in cases if c.id in timing_ids] or [c for c in cases if c.mesh == TIMING_MESH]
    mc_timing = time_meshcomm(timed, reps) if timed else None
    speed: dict[str, Any] = {"cases": [c.id for c in timed], "meshcomm": mc_timing,
                             "dtensor": dt_timing}
    if mc_timing and dt_timing:
        speed["ratios"] = {
            "dtensor_cold_default_over_meshcomm_cold": dt_timing["cold_default_p50_s"] / mc_timing["cold_p50_s"],
            "dtensor_cold_min_cost_over_meshcomm_cold": dt_timing["cold_min_cost_p50_s"] / mc_timing["cold_p50_s"],
            "dtensor_cached_over_meshcomm_cached": dt_timing["cached_p50_s"] / mc_timing["cached_p50_s"]}
    ops = sorted({op for row in rows for d in row["dtensor"].values() if isinstance(d, dict)
                  for op in d.get("ops_seen", [])})
    return {"meta": {"torch": torch.__version__, "dtensor_planners": {
                "default": "greedy (graph-based when the shard order is not the default)",
                "min_cost": "torch.distributed.tensor._redistribute.use_min_cost_redistribution_plan()"},
                "dtensor_ops_seen": ops, "peak_model": "source held throughout + input and output"
                " of each step (first step's input is the source)"},
            "cases": rows, "summary": summarize(rows), "planning_speed": speed}


def _speed_lines(speed: dict[str, Any]) -> list[str]:
    m, d = speed.get("meshcomm"), speed.get("dtensor")
    if not m:
        return ["planning speed: no 3-axis cases in this run"]
    us = 1e6
    lines = [f"planning speed on {TIMING_MESH}, 4-dim tensors ({len(speed['cases'])} transitions):",
             f"  meshcomm cold plan p50 {m['cold_p50_s'] * us:9.1f} us   cached mc.plan p50"
             f" {m['cached_p50_s'] * us:7.2f} us"]
    if d:
        r = speed["ratios"]
        lines += [f"  DTensor  cold default p50 {d['cold_default_p50_s'] * us:9.1f} us   cold min-cost"
                  f" p50 {d['cold_min_cost_p50_s'] * us:9.1f} us   cached _gen_transform_infos p50"
                  f" {d['cached_p50_s'] * us:7.2f} us",
                  f"  ratios DTensor/meshcomm: cold default {r['dtensor_cold_default_over_meshcomm_cold']:.2f}x,"
                  f" cold min-cost {r['dtensor_cold_min_cost_over_meshcomm_cold']:.2f}x,"
                  f" cached {r['dtensor_cached_over_meshcomm_cached']:.2f}x"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases, few timing repeats")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process group")
    args = parser.parse_args(argv)
    cases = _suite()
    if args.quick:
        cases = [c for c in cases if c.id in QUICK_IDS]
    report = run(cases, reps=3 if args.quick else 20, timeout_s=args.timeout)
    print(render(report["cases"]))
    s = report["summary"]
    print(f"DTensor ops seen: {', '.join(report['meta']['dtensor_ops_seen'])}")
    for line in _speed_lines(report["planning_speed"]):
        print(line)
    for w in s["worse_details"]:
        print(f"  worse: {w}")
    print(f"cases where meshcomm moves more bytes or uses more peak memory than a DTensor planner:"
          f" {s['worse_than_dtensor']} of {s['cases']} (target 0)")
    print(f"geometric mean of meshcomm max-rank received bytes / lower bound:"
          f" {s['geomean_recv_max_over_lower_bound']:.4f} (target <= 1.05)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
