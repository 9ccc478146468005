"""Context-parallel attention on real gloo processes (127.0.0.1): meshcomm's strategies beside
the CPU-runnable PyTorch anchors, forward + backward, float32, causal.

Run: `python benchmarks/cp_vs_torch.py [--quick] [--json PATH] [--timeout S]`.

One spawn per world size (4 and 8 processes; --quick: 4), one intra-op thread per process.
q, k, v are (1, 8, s, 64), "(dp b) h (cp s) d" (contiguous; dp=1 but in the grid), the same
global tensors on every rank.

- Table: each meshcomm strategy (`mc.nn.attention(..., strategy=...)`) and two anchors on
  the same shapes: (a) all-gather K/V by DTensor `redistribute` (Shard(seq) -> Replicate,
  `to_local(grad_placements=[Partial()])` so that dK, dV are reduce-scattered: the true
  gradient) + `F.scaled_dot_product_attention` with the causal mask of this rank's queries
  (torchtitan's current form); (b) Ulysses: q, k, v `redistribute` Shard(seq) ->
  Shard(heads), SDPA (`is_causal`), the output back. Step time: the median over
  a few steps after one warm-up, each step's time the slowest rank's. Peak memory: the
  most tensor bytes a step holds at once beyond what was live before it, the largest
  rank's, from torch's CPU memory accounting (`torch.profiler`, `profile_memory=True`, on
  one extra untimed step; tracemalloc does not see tensors, and peak RSS does not move
  once the allocator holds the pages). Gloo's own buffers are not in it. Bytes: what this rank
  hands the wire, measured (meshcomm: `wire.recording()`; the anchors: the collectives
  DTensor dispatches, counted as benchmarks/train_vs_fsdp2.py counts them), beside
  meshcomm's analytic `Cost.sent_bytes`. Exactness: the output and dq, dk, dv of every
  row against anchor (a)'s.
- The ring: its step time beside its math alone (the messages replaced by local copies,
  every rank computing at once as in the step) and its messages alone (the same
  point-to-point schedule, no math), the three taken in turn so that they meet the same
  load (`interleaved`: each step the slowest rank's, the least of the repeats).
- The auto grid: (sequence, heads, kv heads, cp size) cases where every strategy is timed
  in turn (`interleaved`); `auto`'s pick under a cost model calibrated here is within
  10 % of the fastest measured, or not. Calibration (`calibrate`): per wire (all_gather,
  reduce_scatter, all_to_all as meshcomm's plans run them, and the ring's point-to-point
  shift) a latency per hop and a bandwidth fitted to a small and a large message; the
  attention FLOP rate from unmasked fused blocks run on every rank at once. `pick` uses
  the ring shift's figures for every collective, `pick_wires` each wire its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_vs_fsdp2 import CollectiveCounter, summarize  # benchmarks/, beside this

import meshcomm as mc
from meshcomm.executors.distributed import wire
from meshcomm.nn.attention import ring as ring_module
from meshcomm.nn.attention.blocks import block, block_grads
from meshcomm.nn.attention.timing import hops
from meshcomm.runtime.collectives import post_shift
from meshcomm.runtime.launch import run_ranks

LAYOUT = "(dp b) h (cp s) d"
D = 64
STRATEGIES = ("allgather", "ulysses", "ring")
ANCHORS = ("torch_allgather", "torch_ulysses")
DEFAULT_JSON = Path(__file__).parent / "results" / "cp_vs_torch.json"
Step = Callable[[], tuple[torch.Tensor, ...]]


# -- inputs and steps ----------------------------------------------------------------------
def inputs(dp: int, cp: int, seq: int, heads: int, kv_heads: int, rank: int
           ) -> tuple[torch.Tensor, ...]:
    """This rank's q, k, v and output gradient: the same global tensors on every rank,
    batch row `rank // cp`, sequence chunk `rank % cp`."""
    g = torch.Generator().manual_seed(seq * 100 + heads * 10 + kv_heads)
    glob = [torch.randn(dp, n, seq, D, generator=g) for n in (heads, kv_heads, kv_heads, heads)]
    row, chunk = rank // cp, rank % cp
    return tuple(x[row:row + 1].chunk(cp, dim=2)[chunk].contiguous() for x in glob)


def meshcomm_step(bound: mc.BoundMesh, strategy: str, x: tuple[torch.Tensor, ...],
                  cost_model: mc.CostModel | None = None, flops: float | None = None) -> Step:
    q, k, v, dy = x

    def step() -> tuple[torch.Tensor, ...]:
        lq, lk, lv = (t.detach().requires_grad_() for t in (q, k, v))
        y = mc.nn.attention(lq, lk, lv, bound, LAYOUT, causal=True, strategy=strategy,
                            cost_model=cost_model, flops=flops)
        y.backward(dy)
        return y.detach(), lq.grad, lk.grad, lv.grad
    return step


def torch_step(anchor: str, world: int, rank: int, x: tuple[torch.Tensor, ...]) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, dy = x
    s = q.shape[2]
    qpos = torch.arange(rank * s, (rank + 1) * s)
    causal = torch.arange(world * s)[None, :] <= qpos[:, None]

    def dt(t: torch.Tensor, dim: int) -> DTensor:
        return DTensor.from_local(t, dm, [Shard(dim)], run_check=False)

    def step() -> tuple[torch.Tensor, ...]:
        lq, lk, lv = (t.detach().requires_grad_() for t in (q, k, v))
        if anchor == "torch_allgather":
            kf, vf = (dt(t, 2).redistribute(dm, [Replicate()]).to_local(
                grad_placements=[Partial()]) for t in (lk, lv))
            y = F.scaled_dot_product_attention(lq, kf, vf, attn_mask=causal)
        else:
            qh, kh, vh = (dt(t, 2).redistribute(dm, [Shard(1)]).to_local() for t in (lq, lk, lv))
            yh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            y = dt(yh, 1).redistribute(dm, [Shard(2)]).to_local()
        y.backward(dy)
        return y.detach(), lq.grad, lk.grad, lv.grad
    return step


# -- measuring -------------------------------------------------------------------------------
def timed(step: Callable[[], Any], repeat: int) -> float:
    """Median seconds of `repeat` steps on this rank, each started together on every rank."""
    times = []
    for _ in range(repeat):
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(steps: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Seconds of each of `steps` (warmed up first), taken in turn `repeat` times so that
    every one meets the same load (other processes on the machine only add time): each
    step's time is its slowest rank's, and each entry the least over the repeats."""
    for step in steps.values():
        step()
    times = torch.zeros(len(steps), repeat, dtype=torch.float64)
    for r in range(repeat):
        for i, step in enumerate(steps.values()):
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[i, r] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: times[i].min().item() for i, name in enumerate(steps)}


def peak_bytes(step: Step) -> tuple[int, tuple[torch.Tensor, ...]]:
    """The most tensor bytes one step holds at once beyond what was live before it, from
    torch's CPU memory accounting (the profiler's `profile_memory`: every allocation and
    free of torch's CPU allocator, op by op, in time order; a buffer allocated and freed
    inside one op counts at its net)."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, out


def measured(name: str, step: Step) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """(bytes this rank sent, peak bytes, output and gradients) of one untimed step (the
    warm-up): bytes from meshcomm's wire records, or the collectives DTensor dispatches
    for the anchors; peak bytes as `peak_bytes`."""
    if name in ANCHORS:
        with CollectiveCounter() as counter:
            peak, out = peak_bytes(step)
        return int(summarize(counter.records)["sent"]), peak, out
    with wire.recording() as heard:
        peak, out = peak_bytes(step)
    return sum(w.sent * size for w, size in heard), peak, out


def max_rel_diff(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(got, want))


# The moves that calibrate each wire, on the sequence's axis: (src, dst, global shape of n
# elements per rank over a group of g).
MOVES: dict[str, tuple[str, str, Callable[[int, int], tuple[int, ...]]]] = {
    "all_gather": ("(cp s)", "s", lambda g, n: (g * n,)),
    "reduce_scatter": ("s | sum(cp)", "(cp s)", lambda g, n: (g * n,)),
    "all_to_all": ("a (cp s)", "(cp a) s", lambda g, n: (g, n)),
}
WIRES = (*MOVES, "p2p")
SMALL, LARGE = 16, 2**18          # elements per rank of a calibration message (1 MiB)


def slowest_s(fn: Callable[[], Any], repeat: int, rounds: int = 3) -> float:
    """Seconds of one call of `fn` with every rank calling it at once: per rank the least
    over `rounds` of the mean of `repeat` calls (each round started together), then the
    slowest rank's."""
    fn()
    best = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best.append((time.perf_counter() - t0) / repeat)
    worst = torch.tensor([min(best)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def wire_call(bound: mc.BoundMesh, wire: str, n: int) -> tuple[Callable[[], Any], int]:
    """(one call of `wire` over the sequence's axis with n elements per rank, the busiest
    rank's bytes as `timing.plan_time` counts them)."""
    if wire == "p2p":
        x = torch.ones(n)
        return lambda: post_shift(x, bound, "cp").wait(), 4 * n
    src, dst, shape_of = MOVES[wire]
    shape = shape_of(bound.mesh.group_size(("cp",)), n)
    p = mc.plan(bound.mesh, shape, src, dst)
    assert [s.wire for s in p.collectives] == [wire], p
    x = torch.ones(mc.Layout.parse(src).local_shape(bound.mesh, shape, bound.rank))
    step = p.collectives[0]
    return (lambda: mc.reshard(x, bound, src, dst, shape=shape),
            max(max(step.send_bytes), max(step.recv_bytes)))


def wire_figures(bound: mc.BoundMesh, wire: str) -> tuple[float, float]:
    """(latency per hop, bandwidth) of `wire` over the sequence's axis, every rank sending at
    once: fitted to a small and a large message as `timing.plan_time` models them
    (`hops` latencies + busiest bytes / bandwidth)."""
    steps = hops(wire, bound.mesh.group_size(("cp",)))
    (small, small_bytes), (large, large_bytes) = (wire_call(bound, wire, n) for n in (SMALL, LARGE))
    small_s, large_s = slowest_s(small, 20), slowest_s(large, 5)
    bandwidth = (large_bytes - small_bytes) / max(large_s - small_s, 1e-6)
    return max(small_s - small_bytes / bandwidth, 0.0) / steps, bandwidth


def calibrate(bound: mc.BoundMesh, rank: int) -> dict[str, Any]:
    """The machine's figures, every rank working at once (the slowest rank's): per wire
    (all_gather, reduce_scatter, all_to_all as meshcomm's plans run them; "p2p": the ring's
    shift), the latency per hop and the bandwidth (`wire_figures`); and the FLOP rate of
    attention blocks as the strategies run them (fused, no mask: forward + backward, 14
    FLOPs per pair, head and head dim)."""
    wires = {w: wire_figures(bound, w) for w in WIRES}
    q, k = torch.randn(1, 8, 256, D), torch.randn(1, 8, 1024, D)

    def blocks() -> None:
        out, lse = block(q, k, k, None, D ** -0.5)
        block_grads(q, k, k, out, out, lse, (out * out).sum(-1), None, D ** -0.5)
    rate = 14 * 8 * 256 * 1024 * D / slowest_s(blocks, 2)
    return {"wires": {w: {"latency_s": lat, "bandwidth": bw} for w, (lat, bw) in wires.items()},
            "latency_s": wires["p2p"][0], "bandwidth": wires["p2p"][1], "flops": rate}


def cost_model(cal: dict[str, Any], wires: bool) -> mc.CostModel:
    """The calibrated CostModel: the ring shift's figures for every collective, or (`wires`)
    each wire its own."""
    return mc.CostModel(latency_s=cal["latency_s"], bandwidth=cal["bandwidth"], backend="gloo",
                        wires={w: (f["latency_s"], f["bandwidth"])
                               for w, f in cal["wires"].items()} if wires else ())


def ring_alone(bound: mc.BoundMesh, x: tuple[torch.Tensor, ...], repeat: int
               ) -> dict[str, float]:
    """The ring's step, its math alone (each shift replaced by a local copy: every rank
    computes at once, as in the step) and its messages alone (the same point-to-point
    schedule, forward and backward, without the math), taken in turn (`interleaved`) so
    that the three meet the same load."""
    class Copied:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def wait(self) -> torch.Tensor:
            return self.t.clone()

    real = ring_module.post_shift
    ring_step = meshcomm_step(bound, "ring", x)

    def math_alone() -> None:
        ring_module.post_shift = lambda t, *a, **kw: Copied(t)  # type: ignore[assignment]
        try:
            ring_step()
        finally:
            ring_module.post_shift = real
    q, k, v, _ = x
    kv0 = torch.stack([k, v])
    size = bound.mesh.group_size(("cp",))

    def messages() -> None:
        kv = kv0
        for _ in range(size - 1):                        # forward: size - 1 hops
            kv = post_shift(kv, bound, "cp").wait()
        acc, travelling = torch.zeros_like(kv0), None    # backward: blocks and dK/dV
        for step in range(size):
            arriving = post_shift(kv, bound, "cp") if step + 1 < size else None
            if travelling is not None:
                acc = travelling.wait()
            travelling = post_shift(acc, bound, "cp")
            if arriving is not None:
                kv = arriving.wait()
        assert travelling is not None
        travelling.wait()
    got = interleaved({"ring_s": ring_step, "math_s": math_alone, "comm_s": messages}, repeat)
    return got


def progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


# -- one world -------------------------------------------------------------------------------
def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    bound = mc.init_mesh(f"dp=1 cp={world}")
    cal = calibrate(bound, rank)
    cm = cost_model(cal, wires=False)
    rows, ring = [], []
    for seq in cfg["seqs"]:
        x = inputs(1, world, seq, 8, 8, rank)
        steps: dict[str, Step] = {a: torch_step(a, world, rank, x) for a in ANCHORS}
        steps |= {s: meshcomm_step(bound, s, x) for s in STRATEGIES}
        costs = {c.strategy: c for c in mc.nn.attention_costs(
            *x[:3], bound, LAYOUT, causal=True, cost_model=cm, flops=cal["flops"])}
        reference: tuple[torch.Tensor, ...] | None = None
        for name in (*ANCHORS, *STRATEGIES):
            sent, peak, out = measured(name, steps[name])           # also the warm-up
            reference = reference or out
            step_s = timed(steps[name], cfg["repeat"])
            cost = costs.get(name)
            rows.append({"world": world, "seq": seq, "impl": name, "step_s": step_s,
                         "peak_bytes": peak, "sent_bytes": sent,
                         "cost_sent_bytes": None if cost is None else cost.sent_bytes,
                         "model_s": None if cost is None else cost.time_s,
                         "max_rel_diff": max_rel_diff(out, reference)})
        alone = ring_alone(bound, x, cfg["repeat_grid"])
        progress(rank, f"world {world} seq {seq}: table and ring done")
        ring.append({"world": world, "seq": seq, **alone,
                     "model_comm_s": costs["ring"].comm_s,
                     "model_compute_s": costs["ring"].compute_s})
    grid = [grid_case(rank, world, cal, cfg["repeat_grid"], *case)
            for case in cfg["grid"] if case[3] <= world]
    progress(rank, f"world {world}: grid done")
    return {"calibration": cal, "rows": rows, "ring": ring, "grid": grid}


def grid_case(rank: int, world: int, cal: dict[str, Any], repeat: int, seq: int,
              heads: int, kv_heads: int, cp: int) -> dict[str, Any]:
    """Every strategy measured on one case, and auto's pick under the calibrated model: the
    ring shift's figures for every collective (`pick`), and each wire its own
    (`pick_wires`)."""
    dp = world // cp
    bound = mc.init_mesh(f"dp={dp} cp={cp}")
    x = inputs(dp, cp, seq, heads, kv_heads, rank)
    explained, by_wire = (mc.nn.attention_explain(
        *x[:3], bound, LAYOUT, causal=True, cost_model=cost_model(cal, wires),
        flops=cal["flops"]) for wires in (False, True))
    measured = interleaved({s: meshcomm_step(bound, s, x) for s in STRATEGIES}, repeat)
    return {"world": world, "seq": seq, "heads": heads, "kv_heads": kv_heads, "cp": cp,
            "pick": explained.pick, "measured_s": measured,
            "model_s": {c.strategy: c.time_s for c in explained.costs},
            "pick_wires": by_wire.pick,
            "model_wires_s": {c.strategy: c.time_s for c in by_wire.costs}}


# -- summarizing -------------------------------------------------------------------------------
def merge(by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's figures as one: times and memory the slowest / largest rank's, bytes
    the busiest rank's, exactness the worst (the ring's and the grid's times are each
    step's slowest rank's already)."""
    first = by_rank[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        mine = [r["rows"][i] for r in by_rank]
        rows.append({**row, "step_s": max(r["step_s"] for r in mine),
                     "peak_bytes": max(r["peak_bytes"] for r in mine),
                     "sent_bytes": max(r["sent_bytes"] for r in mine),
                     "sent_bytes_by_rank": [r["sent_bytes"] for r in mine],
                     "cost_sent_bytes_by_rank": [r["cost_sent_bytes"] for r in mine],
                     "max_rel_diff": max(r["max_rel_diff"] for r in mine)})
    # the ring's three times are the slowest rank's already (`interleaved`)
    ring = [{**{k: v for k, v in row.items() if k != "ring_s"}, "step_s": row["ring_s"]}
            for row in first["ring"]]
    grid = []
    for i, case in enumerate(first["grid"]):
        measured = case["measured_s"]
        fastest = min(measured.values())
        picks = {r["grid"][i]["pick"] for r in by_rank}
        assert len(picks) == 1, f"ranks picked differently: {picks}"
        grid.append({**case, "measured_s": measured, "fastest": min(measured, key=measured.get),
                     "pick_over_fastest": measured[case["pick"]] / fastest,
                     "within_10pct": measured[case["pick"]] <= 1.1 * fastest,
                     "wires_pick_over_fastest": measured[case["pick_wires"]] / fastest,
                     "wires_within_10pct": measured[case["pick_wires"]] <= 1.1 * fastest})
    return {"calibration": first["calibration"], "rows": rows, "ring": ring, "grid": grid}


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (world, seq) and meshcomm strategy: its step time and peak memory over each
    anchor's, from the same run."""
    out = []
    for r in rows:
        if r["impl"] in ANCHORS:
            continue
        same = {a["impl"]: a for a in rows if a["world"] == r["world"] and a["seq"] == r["seq"]
                and a["impl"] in ANCHORS}
        out.append({"world": r["world"], "seq": r["seq"], "impl": r["impl"],
                    **{f"time_over_{a}": r["step_s"] / same[a]["step_s"] for a in ANCHORS},
                    **{f"memory_over_{a}": r["peak_bytes"] / max(1, same[a]["peak_bytes"])
                       for a in ANCHORS}})
    return out


def render(report: dict[str, Any]) -> str:
    mib = 2**20
    lines = ["world  seq   impl             step ms  peak MiB  sent MiB (Cost)   "
             "vs torch_allgather  vs torch_ulysses  rel diff"]
    rat = {(r["world"], r["seq"], r["impl"]): r for r in report["ratios"]}
    for r in report["rows"]:
        cost = "" if r["cost_sent_bytes"] is None else f"({r['cost_sent_bytes'] / mib:.2f})"
        ratio = rat.get((r["world"], r["seq"], r["impl"]))
        vs = "" if ratio is None else "  ".join(
            f"{ratio[f'time_over_{a}']:5.2f}x t {ratio[f'memory_over_{a}']:4.2f}x m"
            for a in ANCHORS)
        lines.append(f"{r['world']:5d}  {r['seq']:4d}  {r['impl']:15s} {r['step_s'] * 1e3:8.0f}"
                     f"  {r['peak_bytes'] / mib:8.1f}  {r['sent_bytes'] / mib:7.2f} {cost:9s}"
                     f"  {vs:36s}  {r['max_rel_diff']:.1e}")
    lines.append("\nring: step vs max(math alone, messages alone), taken in turn")
    for r in report["ring"]:
        lines.append(f"  world {r['world']} seq {r['seq']}: step {r['step_s'] * 1e3:.0f} ms,"
                     f" math alone {r['math_s'] * 1e3:.0f} ms, messages alone"
                     f" {r['comm_s'] * 1e3:.0f} ms, step / max"
                     f" {r['step_s'] / max(r['math_s'], r['comm_s']):.2f}, step / sum"
                     f" {r['step_s'] / (r['math_s'] + r['comm_s']):.2f}")
    lines.append("\nauto grid (measured ms per strategy; * auto's pick)")
    for g in report["grid"]:
        cells = "  ".join(f"{'*' if s == g['pick'] else ' '}{s} {g['measured_s'][s] * 1e3:6.0f}"
                          for s in STRATEGIES)
        lines.append(f"  world {g['world']} cp {g['cp']} seq {g['seq']:5d} heads {g['heads']}"
                     f"/{g['kv_heads']}: {cells}  pick/fastest {g['pick_over_fastest']:.2f}"
                     f"  (per wire: {g['pick_wires']} {g['wires_pick_over_fastest']:.2f})")
    s = report["summary"]
    lines.append(f"auto within 10% of the fastest in {s['auto_within_10pct']}/{s['grid_cases']}"
                 f" cases ({s['auto_within_10pct_fraction']:.0%}); with each wire's own"
                 f" figures in {s['auto_wires_within_10pct']}/{s['grid_cases']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 ranks, short sequences")
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--timeout", type=float, default=900.0, help="per world size, s")
    args = parser.parse_args(argv)
    if args.quick:
        worlds, cfg = [4], {"seqs": [256], "repeat": 1, "repeat_grid": 1,
                            "grid": [(256, 8, 8, 4), (256, 8, 2, 2)]}
    else:
        worlds = [4, 8]
        cfg = {"seqs": [2048, 4096], "repeat": 3, "repeat_grid": 3,
               "grid": [(seq, h, hk, cp) for seq in (512, 1024) for h, hk in ((8, 8), (8, 1))
                        for cp in (2, 4, 8)]}
    load_start = os.getloadavg()
    per_world = []
    for world in worlds:
        world_cfg = {**cfg, "grid": [c for c in cfg["grid"] if world // 2 <= c[3] <= world]}
        per_world.append(merge(run_ranks(worker, world, world_cfg, timeout_s=args.timeout)))
        print(f"world {world} done", flush=True)
    rows = [r for w in per_world for r in w["rows"]]
    grid = [g for w in per_world for g in w["grid"]]
    within = sum(g["within_10pct"] for g in grid)
    report = {
        "meta": {"torch": torch.__version__, "python": platform.python_version(),
                 "machine": platform.machine(), "quick": args.quick, "dtype": "float32",
                 "layout": LAYOUT, "causal": True, "threads_per_rank": 1,
                 "memory": "peak tensor bytes over the step (torch.profiler profile_memory)",
                 "loadavg_1_5_15_start": load_start, "loadavg_1_5_15_end": os.getloadavg(),
                 "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])},
        "calibration": {w["rows"][0]["world"]: w["calibration"] for w in per_world},
        "rows": rows, "ratios": ratios(rows),
        "ring": [r for w in per_world for r in w["ring"]], "grid": grid,
        "summary": {"grid_cases": len(grid), "auto_within_10pct": within,
                    "auto_wires_within_10pct": sum(g["wires_within_10pct"] for g in grid),
                    "auto_within_10pct_fraction": within / max(1, len(grid))},
    }
    print(render(report))
    out = args.json or DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
