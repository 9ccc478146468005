"""Host time of one pipeline step (`mc.nn.Pipeline.step`) as one rank of an N-rank job, beside
torch.distributed.pipelining's schedule step, with the pipeline fixed and the world growing.

Run: `python benchmarks/pp_host_scale.py [--quick] [--ranks 8,128,1024] [--json PATH]`.

Each world size runs in a fresh process (`--one N`), which acts as rank r of N through torch's
fake process group (`dist.init_process_group("fake", store=FakeStore(), rank=r,
world_size=N)`: every message returns at once), so what is timed is each library's own host
work. The mesh is `pp=4 dp=N/(4 tp) tp=tp` (tp = 2 at 8 ranks, else 8): the pipeline (4
pipeline ranks, 8 microbatches) stays the same while dp x tp grows. Rank r = N/4 + 1 is
position (dp 0, tp 1) of pipeline rank 1, so at every N it runs the same stages (a middle
one: it receives and sends both ways). Each stage is `Linear(16, 16) + Tanh` on tiny CPU
tensors, one row per microbatch and dp rank:

- meshcomm: `Stage(mc.init_mesh(stage mesh, backend="fake"), "(dp b) h", "(dp b) h", ...)`
  on `mc.nn.stage_meshes(mesh, "pp")`, `Pipeline(..., microbatches=8)` for gpipe, 1f1b and
  interleaved_1f1b (8 stages, two a pipeline rank), hand-offs planned between stage meshes;
- torch: `PipelineStage` on the pp group of `init_device_mesh("cpu", (4, dp, tp))`, with
  every stage's input, output and gradient shapes given, under `ScheduleGPipe`,
  `Schedule1F1B`, `ScheduleInterleaved1F1B`. Its first step votes over the pipeline whether
  the shapes are known (one int sent stage to stage); under the fake group the vote receives
  zeros, which reads "unknown" and starts a shape exchange of pickled objects that cannot
  run there, so the vote is set to its real-job outcome, STATIC (every stage passed plain
  tensor shapes), by replacing the schedule's `_warmup_p2p`. Nothing else is changed.

Each row: the median of `--repeat` steps after one warm-up step, one intra-op thread; the
tensor ops one step runs (aten calls seen by a TorchDispatchMode); and the Python function
calls of one step (cProfile). Op counts and calls that grow with N are a per-rank loop in the
step. "growth" is a library's figure at the largest N over its figure at the smallest.
`--quick`: 8 and 128 ranks, 2 steps, to check that everything runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from host_scale import op_count, step_time  # benchmarks/, beside this
from torch import nn

import meshcomm as mc

PP, MICROBATCHES, H = 4, 8, 16
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DEFAULT_JSON = Path(__file__).parent / "results" / "pp_host_scale.json"


def shape(n: int) -> tuple[int, int, int]:
    """(dp, tp, rank) of an n-rank world: tp = 2 at 8 ranks, else 8; rank (dp 0, tp 1) of
    pipeline rank 1."""
    tp = 2 if n < 4 * 8 else 8
    assert n % (PP * tp) == 0, f"{n} ranks do not split as pp={PP} x dp x tp={tp}"
    return n // (PP * tp), tp, n // PP + 1


def block(s: int) -> nn.Module:
    torch.manual_seed(s)
    return nn.Sequential(nn.Linear(H, H), nn.Tanh())


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def n_stages(schedule: str) -> int:
    return 2 * PP if schedule == "interleaved_1f1b" else PP


def meshcomm_step(n: int, schedule: str) -> Callable[[], None]:
    from meshcomm.nn.pipeline import Pipeline, Stage, stage_meshes

    dp, tp, _ = shape(n)
    bounds = [mc.init_mesh(m, backend="fake")
              for m in stage_meshes(mc.Mesh(f"pp={PP} dp={dp} tp={tp}"), "pp")]
    count = n_stages(schedule)
    stages = [Stage(bounds[s % PP], "(dp b) h", "(dp b) h",
                    block(s) if bounds[s % PP].in_mesh else None) for s in range(count)]
    pipe = Pipeline(stages, schedule, microbatches=MICROBATCHES, shapes=(dp, H), loss_fn=mse)
    x, t = torch.randn(MICROBATCHES, H), torch.randn(MICROBATCHES, H)
    params = [q for s in pipe.mine for q in stages[s].module.parameters()]  # type: ignore[union-attr]

    def step() -> None:
        pipe.step(x if 0 in pipe.mine else None, t if count - 1 in pipe.mine else None)
        for q in params:
            q.grad = None
    return step


def torch_step(n: int, schedule: str) -> Callable[[], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining._utils import InferenceMode

    dp, tp, _ = shape(n)
    dm = init_device_mesh("cpu", (PP, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    group, me, count = dm.get_group("pp"), dm.get_local_rank("pp"), n_stages(schedule)
    one = torch.empty(1, H)
    stages = [PipelineStage(block(s), s, count, torch.device("cpu"), input_args=one,
                            output_args=one, input_grads=one, output_grads=one, group=group)
              for s in range(me, count, PP)]
    if schedule == "interleaved_1f1b":
        sched: Any = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=mse)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], MICROBATCHES, loss_fn=mse)

    def static(own: Any, has_backward: bool, p2p_done: bool) -> None:
        for st in own:                # the vote's outcome in a real job: shapes all given
            st._inference_mode = InferenceMode.STATIC
    sched._warmup_p2p = static
    x, t = torch.randn(MICROBATCHES, H), torch.randn(MICROBATCHES, H)
    params = [q for st in stages for q in st.submod.parameters()]

    def step() -> None:
        if me == 0:
            sched.step(x)
        elif me == PP - 1:
            sched.step(target=t)
        else:
            sched.step()
        for q in params:
            q.grad = None
    return step


def python_calls(step: Callable[[], None]) -> int:
    """Python function calls of one step (a count that grows with N: a loop over ranks)."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    return int(pstats.Stats(prof).total_calls)   # type: ignore[attr-defined]


def measure(step: Callable[[], None], repeat: int) -> dict[str, Any]:
    seconds = step_time(step, repeat)
    return {"s": seconds, "ops": op_count(step), "calls": python_calls(step)}


def one_world(n: int, repeat: int) -> list[dict[str, Any]]:
    """The rows of an n-rank world, measured in this process as rank `shape(n)[2]`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dp, tp, rank = shape(n)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    rows = []
    for schedule in SCHEDULES:
        ours = measure(meshcomm_step(n, schedule), repeat)
        theirs = measure(torch_step(n, schedule), repeat)
        rows.append({"ranks": n, "rank": rank, "pp": PP, "dp": dp, "tp": tp,
                     "microbatches": MICROBATCHES, "schedule": schedule,
                     "meshcomm_s": ours["s"], "meshcomm_ops": ours["ops"],
                     "meshcomm_calls": ours["calls"], "torch_s": theirs["s"],
                     "torch_ops": theirs["ops"], "torch_calls": theirs["calls"],
                     "ratio": ours["s"] / theirs["s"]})
    dist.destroy_process_group()
    return rows


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per schedule: each figure at the largest N over the smallest."""
    out = []
    for schedule in SCHEDULES:
        mine = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["ranks"])
        lo, hi = mine[0], mine[-1]
        out.append({"schedule": schedule, "from": lo["ranks"], "to": hi["ranks"],
                    **{f"{k}_growth": hi[k] / lo[k] for k in (
                        "meshcomm_s", "meshcomm_ops", "meshcomm_calls", "torch_s",
                        "torch_ops", "torch_calls")}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 128 ranks, 2 steps")
    parser.add_argument("--ranks", default=None, help="comma-separated world sizes")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeat = args.repeat or (2 if args.quick else 20)
    if args.one is not None:             # a child: one world, its rows as JSON on stdout
        print(json.dumps(one_world(args.one, repeat)))
        return
    ranks = [int(r) for r in (args.ranks or ("8,128" if args.quick else "8,128,1024")).split(",")]
    rows: list[dict[str, Any]] = []
    for n in ranks:
        proc = subprocess.run([sys.executable, __file__, "--one", str(n), "--repeat",
                               str(repeat)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{n} ranks failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        for row in json.loads(proc.stdout.strip().splitlines()[-1]):
            rows.append(row)
            print(f"{row['schedule']:17s} ranks {n:5d} (dp {row['dp']:3d} tp {row['tp']})"
                  f"  meshcomm {row['meshcomm_s'] * 1e3:7.2f} ms {row['meshcomm_ops']:5d} ops"
                  f" {row['meshcomm_calls']:6d} calls  torch {row['torch_s'] * 1e3:7.2f} ms"
                  f" {row['torch_ops']:5d} ops {row['torch_calls']:6d} calls"
                  f"  ratio {row['ratio']:.2f}x", flush=True)
    grown = growth(rows)
    for g in grown:
        print(f"{g['schedule']:17s} {g['from']} -> {g['to']} ranks: meshcomm time x"
              f"{g['meshcomm_s_growth']:.2f} ops x{g['meshcomm_ops_growth']:.2f} calls x"
              f"{g['meshcomm_calls_growth']:.2f}; torch time x{g['torch_s_growth']:.2f} ops x"
              f"{g['torch_ops_growth']:.2f} calls x{g['torch_calls_growth']:.2f}")
    out = args.json or DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pp": PP, "microbatches": MICROBATCHES, "hidden": H,
                               "repeat": repeat, "rows": rows, "growth": grown}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
