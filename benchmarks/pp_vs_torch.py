"""Pipeline parallelism on real gloo processes (127.0.0.1): meshcomm's `mc.nn.Pipeline` beside
`torch.distributed.pipelining` (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B), same model, same stage split, same microbatches, in one run.

Run: `python benchmarks/pp_vs_torch.py [--quick] [--json PATH] [--timeout S]`.

4 processes, one intra-op thread each. The model is a stack of `BLOCKS` Linear(H, H) + GELU
blocks, float32, mean-squared-error loss, the same initial weights and batch on every rank:
GPipe and 1F1B run 4 stages of BLOCKS / 4 blocks (stage s on rank s), interleaved 1F1B 8
stages of BLOCKS / 8 blocks (stage s on rank s % 4). meshcomm: one single-rank mesh per
stage (`mc.init_mesh(mc.Mesh("x=1", ranks=[r]))`), layouts "b h" both sides.

- Step time: after warm-up steps, meshcomm's and torch's steps alternate (which goes first
  alternates too) so both meet the same load; each step's time is its slowest rank's
  (barrier, then the step), and the figure is the median over the repeats. Gradients are
  dropped (`grad = None`) between steps, outside the timing, so every step is the same.
- Bytes: what each rank hands the wire in one step, counted twice for meshcomm
  (`wire.recording()`, and every tensor of a point-to-point send, `c10d.send`, seen by a
  TorchDispatchMode) and the second way for torch (its pipelining sends through the same
  `dist.isend` / `batch_isend_irecv`); torch's one-time shape metadata (first step) is not in
  it.
- Peak memory: the most tensor bytes a rank holds at once during a step, beyond the model's
  parameters and gradients before it: the tensors the pipeline object keeps between steps
  (found by walking its references: torch's preallocated receive buffers; meshcomm keeps
  none) plus the most torch's CPU allocator holds during the step beyond what was live
  before it (`torch.profiler`, `profile_memory=True`, every allocation and free of its
  trace in time order, on one extra untimed step; the gradients made in the step are in
  it, the same for both). tracemalloc does not see tensors and peak RSS does not move once
  the allocator holds the pages. Gloo's own buffers are not in it.
- Simulator: `StageCosts` from per-stage forward and backward times of one microbatch and a
  hand-off time (one microbatch's activation, every rank sending to the next at once,
  through the pipeline's own prepared hand-offs; a bare gloo exchange gives a second
  prediction, `predicted_s_gloo_hop`),
  sampled after every timed pair of steps (so under the same load) with every rank timing
  its own stages at once; `simulate(pipe.schedule, costs).step_time` against the measured
  median step time. A second prediction ("in-run") takes each stage's forward and backward
  time from the pipeline itself: the median length of that stage's actions in the last
  timed step, recorded by `Pipeline(record=True)` (compute as it ran, beside the other
  ranks); that step's recorded timeline gives the measured bubble fraction beside the
  simulated one.
- Exactness: the first step's loss and every stage's gradients, meshcomm against torch.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import meshcomm as mc
from meshcomm.executors.distributed import wire
from meshcomm.nn.pipeline import Action, Event, Pipeline, Stage, StageCosts, simulate, timeline
from meshcomm.runtime.launch import run_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DEFAULT_JSON = Path(__file__).parent / "results" / "pp_vs_torch.json"
WORLD = 4


# -- model -------------------------------------------------------------------------------------
def block(h: int, seed: int) -> nn.Module:
    """Linear(h, h) + GELU with weights from `seed` (the same on every rank and copy)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(h, h), nn.GELU())


def stage_module(s: int, n: int, cfg: dict[str, Any]) -> nn.Module:
    per = cfg["blocks"] // n
    return nn.Sequential(*[block(cfg["hidden"], 1000 + b) for b in range(s * per, (s + 1) * per)])


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def batch(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (cfg["batch"], cfg["hidden"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- counting ----------------------------------------------------------------------------------
class SendCounter(TorchDispatchMode):
    """Bytes of every tensor handed to a point-to-point send (`c10d.send`, which `dist.isend`
    and `dist.batch_isend_irecv` dispatch on gloo) while active: meshcomm's hand-offs and
    torch's pipelining alike."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.c10d.send.default:
            self.sent += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def held_bytes(root: object, exclude: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (through containers,
    objects and closures; not through modules' globals or classes), less those of `exclude`
    (data pointers: the parameters and their gradients)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.untyped_storage().nbytes():
                ptr = obj.untyped_storage().data_ptr()
                if ptr not in exclude:
                    storages[ptr] = obj.untyped_storage().nbytes()
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, (types.ModuleType, type, str, bytes, int, float, bool)):
            continue
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
            if isinstance(obj, types.MethodType):
                todo.append(obj.__self__)
            todo.extend(c.cell_contents for c in fn.__closure__ or () if _filled(c))
            todo.extend(fn.__defaults__ or ())
            continue
        todo.extend(gc.get_referents(obj))
    return sum(storages.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def param_ptrs(modules: list[nn.Module]) -> set[int]:
    out = set()
    for m in modules:
        for p in m.parameters():
            out.add(p.untyped_storage().data_ptr())
            if p.grad is not None:
                out.add(p.grad.untyped_storage().data_ptr())
    return out


def step_peak(step: Callable[[], Any]) -> int:
    """The most tensor bytes the step holds at once beyond what was live before it: torch's
    CPU allocator's every allocation and free in time order (`torch.profiler` with
    `profile_memory=True`, its trace's "[memory]" events: exact, where summing each op's net
    bytes in start order is not once ops nest)."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


# -- the two pipelines -------------------------------------------------------------------------
class Side:
    """One implementation on this rank: `step()` runs a training step and gives the loss
    (last stage's rank) or None; `modules` are this rank's stages' modules by stage."""

    def __init__(self, obj: object, step: Callable[[], torch.Tensor | None],
                 modules: dict[int, nn.Module]) -> None:
        self.obj, self.step, self.modules = obj, step, modules

    def zero(self) -> None:
        for m in self.modules.values():
            for p in m.parameters():
                p.grad = None


def mine_of(rank: int, n: int) -> list[int]:
    return [s for s in range(n) if s % dist.get_world_size() == rank]


def meshcomm_side(rank: int, name: str, n: int, cfg: dict[str, Any],
                  modules: dict[int, nn.Module], x: torch.Tensor, t: torch.Tensor) -> Side:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[s % dist.get_world_size()])) for s in range(n)]
    stages = [Stage(meshes[s], "b h", "b h", modules.get(s)) for s in range(n)]
    pipe = Pipeline(stages, name, microbatches=cfg["microbatches"],
                    shapes=(cfg["batch"] // cfg["microbatches"], cfg["hidden"]),
                    loss_fn=mse, dtype=torch.float32, record=True)
    first, last = 0 in pipe.mine, n - 1 in pipe.mine

    def step() -> torch.Tensor | None:
        return pipe.step(x if first else None, t if last else None)
    return Side(pipe, step, modules)


def torch_side(rank: int, name: str, n: int, cfg: dict[str, Any],
               modules: dict[int, nn.Module], x: torch.Tensor, t: torch.Tensor) -> Side:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    stages = [PipelineStage(modules[s], s, n, torch.device("cpu")) for s in sorted(modules)]
    m = cfg["microbatches"]
    if name == "interleaved_1f1b":
        sched: Any = ScheduleInterleaved1F1B(stages, m, loss_fn=mse)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], m, loss_fn=mse)
    first, last = 0 in modules, n - 1 in modules

    def step() -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        sched.step(*args, target=t if last else None, losses=losses if last else None,
                   return_outputs=False)
        return torch.stack(losses).mean() if last else None
    return Side(sched, step, modules)


# -- measuring ---------------------------------------------------------------------------------
def timed(sides: dict[str, Side], sample: Callable[[], torch.Tensor], warmup: int,
          repeat: int) -> tuple[dict[str, list[float]], torch.Tensor]:
    """Per side, each repeat's step time (its slowest rank's), the sides taking turns (which
    goes first alternates), and after each pair one `sample` of the stage costs, so that
    steps and costs meet the same load; the samples stacked."""
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n].step()
            sides[n].zero()
    times = torch.zeros(len(names), repeat, dtype=torch.float64)
    samples = []
    for r in range(repeat):
        for n in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            sides[n].step()
            times[names.index(n), r] = time.perf_counter() - t0
            sides[n].zero()
        samples.append(sample())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {n: times[i].tolist() for i, n in enumerate(names)}, torch.stack(samples)


def cost_sample(rank: int, n: int, modules: dict[int, nn.Module], cfg: dict[str, Any],
                pipe: Pipeline) -> torch.Tensor:
    """One sample of the stage costs, every rank at once (as in a step): per stage, the
    seconds of one microbatch's forward and backward as the step runs them (stage 0's input
    needs no gradient, the last stage's forward includes the loss), and one hand-off: every
    rank sends one microbatch's activation to the next and receives one from the previous,
    through meshcomm's prepared hand-offs (`pipe`: its executor's host work on both sides
    included) and as one bare gloo exchange. Returns [forward of each stage, backward of each
    stage, meshcomm hand-off, gloo hand-off]."""
    mbs, h, m = cfg["batch"] // cfg["microbatches"], cfg["hidden"], cfg["microbatches"]
    out = torch.zeros(2 * n + 2, dtype=torch.float64)
    target = torch.randn(mbs, h)
    gc.collect()
    dist.barrier()
    for s, module in modules.items():
        x = torch.randn(mbs, h, requires_grad=s > 0)
        t0 = time.perf_counter()
        y = module(x)
        if s == n - 1:
            y = mse(y, target) / m
        t1 = time.perf_counter()
        torch.autograd.backward(y, None if s == n - 1 else torch.ones_like(y))
        out[s], out[n + s] = t1 - t0, time.perf_counter() - t1
        module.zero_grad(set_to_none=True)
    dist.all_reduce(out)                  # each stage is timed by its one rank
    send, recv = torch.randn(mbs, h), torch.empty(mbs, h)
    hop = torch.zeros(1, dtype=torch.float64)
    dist.barrier()
    t0 = time.perf_counter()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % dist.get_world_size()),
           dist.P2POp(dist.irecv, recv, (rank - 1) % dist.get_world_size())]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    hop[0] = time.perf_counter() - t0
    dist.all_reduce(hop, op=dist.ReduceOp.MAX)
    out[2 * n + 1] = hop[0]
    out[2 * n] = handoff_s(pipe, rank, n, torch.randn(mbs, h))
    return out


def handoff_s(pipe: Pipeline, rank: int, n: int, x: torch.Tensor) -> float:
    """Seconds of one forward hand-off through the pipeline's prepared plans, the slowest
    rank's: rank r sends its first stage's output (boundary r) and receives the boundary
    into it (r - 1, or for rank 0 of an interleaved pipeline, the last rank's boundary into
    its second stage), every rank at once."""
    into = (rank - 1) % dist.get_world_size()
    recv = pipe.handoffs.get(("F", into)) if into < n - 1 and into + 1 in pipe.mine else None
    send = pipe.handoffs.get(("F", rank)) if rank < n - 1 else None
    dist.barrier()
    t0 = time.perf_counter()
    got = recv.ready.issue([None], steps=recv.post_steps) if recv is not None else None
    sent = send.ready.issue([x]) if send is not None else None
    for handle in (got, sent):
        if handle is not None:
            handle.wait()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def stage_costs(samples: torch.Tensor, n: int, cfg: dict[str, Any], hop: int = 0
                ) -> StageCosts:
    """`StageCosts` of the median of each figure over the samples (`cost_sample`), hand-offs
    as meshcomm's (`hop=0`) or bare gloo's (`hop=1`)."""
    med = samples.median(dim=0).values.tolist()
    act = cfg["batch"] // cfg["microbatches"] * cfg["hidden"] * 4
    send = (med[2 * n + hop],) * (n - 1)
    return StageCosts(tuple(med[:n]), tuple(med[n:2 * n]), (), send, send, (act,) * n)


KINDS = "FBIW"


def recorded(pipe: Pipeline) -> list[list[float]]:
    """Every rank's events of the pipeline's last step, as rows [rank, stage, kind, microbatch,
    start, end] (machine-wide `perf_counter` seconds: the ranks share one clock here)."""
    rows = max(len(r) for r in pipe.schedule.compute_only().rows)
    mine = torch.full((rows, 6), -1.0, dtype=torch.float64)
    for i, e in enumerate(pipe.events):
        mine[i] = torch.tensor([e.rank, e.action.stage, KINDS.index(e.action.kind),
                                e.action.microbatch, pipe.started + e.start,
                                pipe.started + e.end], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [row for t in every for row in t.tolist() if row[0] >= 0]


def in_run_costs(pipe: Pipeline, events: list[list[float]], like: StageCosts) -> StageCosts:
    """`like` with each stage's forward and backward replaced by the median length of that
    stage's actions in the recorded step (compute as it ran in the pipeline, under whatever
    else the machine ran at the time)."""
    n = pipe.schedule.n_stages
    took: dict[tuple[int, int], list[float]] = {}
    for _, s, k, _, t0, t1 in events:
        took.setdefault((int(s), int(k)), []).append(t1 - t0)
    med = {key: statistics.median(v) for key, v in took.items()}
    return StageCosts(tuple(med[(s, 0)] for s in range(n)), tuple(med[(s, 1)] for s in range(n)),
                      (), like.send_forward, like.send_backward, like.activation_bytes)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_schedule(rank: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    v = 2 if name == "interleaved_1f1b" else 1
    n = dist.get_world_size() * v
    mine = mine_of(rank, n)
    x, t = batch(cfg)
    mc_mods = {s: stage_module(s, n, cfg) for s in mine}
    torch_mods = {s: copy.deepcopy(m) for s, m in mc_mods.items()}
    sides = {"meshcomm": meshcomm_side(rank, name, n, cfg, mc_mods, x, t),
             "torch": torch_side(rank, name, n, cfg, torch_mods, x, t)}
    # the first step: exactness (and torch's one-time set-up)
    losses = {k: s.step() for k, s in sides.items()}
    loss_diff = (abs(losses["meshcomm"].item() - losses["torch"].item())
                 if losses["meshcomm"] is not None else 0.0)
    grad_diff = max(rel_diff(p.grad, q.grad) for s in mine for p, q in
                    zip(mc_mods[s].parameters(), torch_mods[s].parameters()))
    loss_value = None if losses["meshcomm"] is None else losses["meshcomm"].item()
    for s in sides.values():
        s.zero()
    # bytes, then memory, each on one untimed step
    with wire.recording() as heard, SendCounter() as mc_sent:
        sides["meshcomm"].step()
    sides["meshcomm"].zero()
    mc_wire = sum(w.sent * size for w, size in heard)
    with SendCounter() as torch_sent:
        sides["torch"].step()
    sides["torch"].zero()
    mc_p2p, torch_p2p = mc_sent.sent, torch_sent.sent
    peaks, held = {}, {}
    for k, side in sides.items():
        held[k] = held_bytes(side.obj, param_ptrs(list(side.modules.values())))
        peaks[k] = step_peak(side.step)
        side.zero()
    pipe = sides["meshcomm"].obj
    assert isinstance(pipe, Pipeline)
    times, samples = timed(sides, lambda: cost_sample(rank, n, mc_mods, cfg, pipe),
                           cfg["warmup"], cfg["repeat"])
    costs = stage_costs(samples, n, cfg)
    predicted = simulate(pipe.schedule, costs)
    events = recorded(pipe)          # the last timed step's, as it ran
    measured = timeline(
        pipe.schedule, [Event(int(r), Action(int(s), KINDS[int(k)], int(mb)), t0, t1)
                        for r, s, k, mb, t0, t1 in events])
    in_run = simulate(pipe.schedule, in_run_costs(pipe, events, costs))
    gloo_costs = stage_costs(samples, n, cfg, hop=1)
    return {"schedule": name, "stages": n, "loss": loss_value, "loss_abs_diff": loss_diff,
            "grad_max_rel_diff": grad_diff, "times": times,
            "sent": {"meshcomm_wire": mc_wire, "meshcomm_p2p": mc_p2p, "torch_p2p": torch_p2p},
            "held_bytes": held, "step_peak_bytes": peaks,
            "costs": {"forward_s": list(costs.forward), "backward_s": list(costs.backward),
                      "hop_s": costs.send_forward[0] if costs.send_forward else 0.0,
                      "gloo_hop_s": gloo_costs.send_forward[0] if n > 1 else 0.0},
            "predicted_s_gloo_hop": simulate(pipe.schedule, gloo_costs).step_time,
            "predicted_s": predicted.step_time, "predicted_bubble": predicted.bubble_fraction,
            "predicted_peak_bytes": list(predicted.peak_bytes),
            "recorded_step_s": measured.step_time, "recorded_busy_s": list(measured.busy),
            "recorded_bubble": measured.bubble_fraction,
            "predicted_s_in_run": in_run.step_time, "predicted_bubble_in_run":
                in_run.bubble_fraction,
            "costs_in_run": {"forward_s": list(in_run_costs(pipe, events, costs).forward),
                             "backward_s": list(in_run_costs(pipe, events, costs).backward)}}


def progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for name in cfg["schedules"]:
        out.append(run_schedule(rank, name, cfg))
        progress(rank, f"{name} done")
    return out


# -- summarizing -------------------------------------------------------------------------------
def merge(by_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per schedule: times (already the slowest rank's per step) as medians, bytes and peak
    memory per rank and their largest, the loss of the last stage's rank, the worst diffs."""
    rows = []
    for i, first in enumerate(by_rank[0]):
        mine = [r[i] for r in by_rank]
        times = first["times"]
        med = {k: statistics.median(v) for k, v in times.items()}
        peak = {k: [r["held_bytes"][k] + r["step_peak_bytes"][k] for r in mine]
                for k in ("meshcomm", "torch")}
        sent = {k: [r["sent"][k] for r in mine] for k in first["sent"]}
        loss = next(r["loss"] for r in mine if r["loss"] is not None)
        pred = first["predicted_s"]
        rows.append({
            "schedule": first["schedule"], "stages": first["stages"], "loss": loss,
            "loss_abs_diff": max(r["loss_abs_diff"] for r in mine),
            "grad_max_rel_diff": max(r["grad_max_rel_diff"] for r in mine),
            "step_s": med, "step_s_all": times,
            "time_ratio": med["meshcomm"] / med["torch"],
            "sent_bytes_by_rank": sent,
            "bytes_ratio": max(sent["meshcomm_wire"]) / max(1, max(sent["torch_p2p"])),
            "peak_bytes_by_rank": peak,
            "held_bytes_by_rank": {k: [r["held_bytes"][k] for r in mine] for k in peak},
            "step_peak_bytes_by_rank": {k: [r["step_peak_bytes"][k] for r in mine]
                                        for k in peak},
            "peak_ratio": max(peak["meshcomm"]) / max(1, max(peak["torch"])),
            "costs": first["costs"], "predicted_s": pred,
            "predicted_bubble": first["predicted_bubble"],
            "predicted_peak_bytes": first["predicted_peak_bytes"],
            "sim_error": pred / med["meshcomm"] - 1,
            "predicted_s_gloo_hop": first["predicted_s_gloo_hop"],
            "sim_error_gloo_hop": first["predicted_s_gloo_hop"] / med["meshcomm"] - 1,
            "sim_error_vs_torch": pred / med["torch"] - 1,
            "recorded_step_s": first["recorded_step_s"],
            "recorded_busy_s": first["recorded_busy_s"],
            "recorded_bubble": first["recorded_bubble"],
            "costs_in_run": first["costs_in_run"],
            "predicted_s_in_run": first["predicted_s_in_run"],
            "predicted_bubble_in_run": first["predicted_bubble_in_run"],
            "sim_error_in_run": first["predicted_s_in_run"] / med["meshcomm"] - 1,
        })
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    kib = 1024
    lines = ["schedule          mc ms  torch ms  time   sent KiB mc/torch  bytes  peak KiB"
             " mc/torch  peak   sim ms  sim err  in-run err  bubble sim/rec  loss diff"
             "  grad diff"]
    for r in rows:
        s, p = r["sent_bytes_by_rank"], r["peak_bytes_by_rank"]
        lines.append(
            f"{r['schedule']:16s} {r['step_s']['meshcomm'] * 1e3:6.1f}  "
            f"{r['step_s']['torch'] * 1e3:8.1f}  {r['time_ratio']:4.2f}x"
            f"  {max(s['meshcomm_wire']) / kib:8.0f}/{max(s['torch_p2p']) / kib:<8.0f}"
            f"  {r['bytes_ratio']:4.2f}x  {max(p['meshcomm']) / kib:7.0f}/"
            f"{max(p['torch']) / kib:<7.0f}  {r['peak_ratio']:4.2f}x  "
            f"{r['predicted_s'] * 1e3:6.1f}  {r['sim_error']:+6.1%}  "
            f"{r['sim_error_in_run']:+9.1%}  {r['predicted_bubble_in_run']:5.1%}/"
            f"{r['recorded_bubble']:<5.1%}  {r['loss_abs_diff']:.1e}"
            f"    {r['grad_max_rel_diff']:.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few repeats")
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--timeout", type=float, default=1800.0, help="s, for the whole run")
    parser.add_argument("--world", type=int, default=WORLD,
                        help=f"processes, one stage each (default {WORLD}; 2 gives each its"
                             " own core on a 2-core machine)")
    args = parser.parse_args(argv)
    if args.quick:
        cfg = {"hidden": 128, "batch": 32, "microbatches": 4, "blocks": 8, "warmup": 1,
               "repeat": 3}
    else:
        cfg = {"hidden": 1024, "batch": 256, "microbatches": 8, "blocks": 8, "warmup": 3,
               "repeat": 21}
    cfg["schedules"] = list(SCHEDULES)
    load_start = os.getloadavg()
    rows = merge(run_ranks(worker, args.world, cfg, timeout_s=args.timeout))
    report = {
        "meta": {"torch": torch.__version__, "python": platform.python_version(),
                 "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
                 "dtype": "float32", "world": args.world, "threads_per_rank": 1, **{
                     k: v for k, v in cfg.items() if k != "schedules"},
                 "model": f"{cfg['blocks']} x (Linear({cfg['hidden']}, {cfg['hidden']}) + GELU),"
                          " mse loss",
                 "time": "median over repeats of the slowest rank's step, sides alternating",
                 "bytes": "bytes this rank sends in one step (meshcomm: wire.recording();"
                          " torch: isend tensors through dist.batch_isend_irecv)",
                 "memory": "tensor bytes the pipeline object keeps between steps (reachable"
                           " tensors, parameters and gradients excluded) + peak tensor bytes"
                           " over the step beyond those live before it (torch.profiler"
                           " profile_memory)",
                 "loadavg_1_5_15_start": load_start, "loadavg_1_5_15_end": os.getloadavg(),
                 "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])},
        "rows": rows,
        "summary": {
            "time_ratio": {r["schedule"]: r["time_ratio"] for r in rows},
            "bytes_ratio": {r["schedule"]: r["bytes_ratio"] for r in rows},
            "peak_ratio": {r["schedule"]: r["peak_ratio"] for r in rows},
            "sim_error": {r["schedule"]: r["sim_error"] for r in rows},
            "losses_agree": all(r["loss_abs_diff"] <= 1e-5 * max(1.0, abs(r["loss"]))
                                and r["grad_max_rel_diff"] < 1e-4 for r in rows),
        },
    }
    print(render(rows))
    print(f"losses and gradients agree (float32): {report['summary']['losses_agree']}")
    out = args.json or DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
