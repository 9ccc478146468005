"""Host time of one attention call (forward + backward) with the sequence split over `cp`, as
rank 3 of an N-rank job, beside the CPU-runnable PyTorch anchors, in one process.

Run: `python benchmarks/cp_host_scale.py [--quick] [--ranks 8,128,1024] [--json PATH]`.

One process acts as rank 3 through torch's fake process group (every collective returns at
once), so what is timed is each library's own host work. For each N the mesh is
`dp=N/cp cp=cp` for cp = 8 and for cp = N/8 (the sequence over most of the job), q, k, v of
`(N/cp, 8, 16 cp, 16)` float32 ("(dp b) h (cp s) d": one batch row and 16 tokens per rank),
causal:

- `allgather`: `mc.nn.attention(..., strategy="allgather")` beside torchtitan's current
  form: K and V DTensors `[Shard(0), Shard(2)] -> [Shard(0), Replicate()]`
  (`redistribute`), then `F.scaled_dot_product_attention` of the local queries with a
  causal mask built from their positions;
- `ulysses`: `mc.nn.attention(..., strategy="ulysses")` beside DeepSpeed Ulysses from
  DTensor: q, k, v `[Shard(0), Shard(2)] -> [Shard(0), Shard(1)]`, SDPA, the output back.
- `ring` and `hybrid` (the sequence over `ca=2 cr=cp/2`: all_to_all on ca, the ring on
  cr): meshcomm alone (PyTorch's ring runs only with CUDA SDPA kernels); their op counts
  grow with the ring's steps (cp), never with N.

Each row: the median of `--repeat` calls after one warm-up, with one intra-op thread, and
the tensor ops one call runs (a count that grows with N is a per-rank loop). The ratio is
meshcomm over PyTorch (below 1: meshcomm spends less host time). PyTorch's anchors here
are timing references only: a replicated DTensor's gradient is a slice, not the sum the
gathered keys need, so their dK, dV are not attention's (meshcomm's are; see
tests/dist/test_attention.py).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from host_scale import RANK, op_count, start_world, step_time  # benchmarks/, beside this

import meshcomm as mc

LAYOUT = "(dp b) h (cp s) d"
STRATEGIES = ("allgather", "ulysses", "ring", "hybrid")
ANCHORED = ("allgather", "ulysses")    # PyTorch's ring runs on CUDA SDPA kernels only
H, PER_RANK, D = 8, 16, 16
DEFAULT_JSON = Path(__file__).parent / "results" / "cp_host_scale.json"


def measure(step: Callable[[], None], repeat: int) -> tuple[float, int]:
    """(median seconds, tensor ops) of `step`, as benchmarks/host_scale.py measures a step."""
    return step_time(step, repeat), op_count(step)


def _locals(n: int, cp: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(1, H, PER_RANK, D, requires_grad=True) for _ in range(3)]


def meshcomm_step(n: int, cp: int, strategy: str) -> Callable[[], None]:
    if strategy == "hybrid":       # the sequence over two axes: all_to_all on ca, ring on cr
        bound = mc.init_mesh(f"dp={n // cp} ca=2 cr={cp // 2}", backend="fake")
        layout = LAYOUT.replace("(cp s)", "(ca cr s)")
    else:
        bound, layout = mc.init_mesh(f"dp={n // cp} cp={cp}", backend="fake"), LAYOUT
    q, k, v = _locals(n, cp)

    def step() -> None:
        y = mc.nn.attention(q, k, v, bound, layout, causal=True, strategy=strategy)
        y.sum().backward()
    return step


def pytorch_step(n: int, cp: int, strategy: str) -> Callable[[], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dm = init_device_mesh("cpu", (n // cp, cp), mesh_dim_names=("dp", "cp"))
    q, k, v = _locals(n, cp)
    pos = dm.get_local_rank("cp")
    qpos = torch.arange(pos * PER_RANK, (pos + 1) * PER_RANK)
    kpos = torch.arange(cp * PER_RANK)
    causal = kpos[None, :] <= qpos[:, None]

    def dt(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, dm, [Shard(0), Shard(2)], run_check=False)

    def step() -> None:
        if strategy == "allgather":
            kf, vf = (dt(x).redistribute(dm, [Shard(0), Replicate()]).to_local() for x in (k, v))
            y = F.scaled_dot_product_attention(q, kf, vf, attn_mask=causal)
        else:
            qh, kh, vh = (dt(x).redistribute(dm, [Shard(0), Shard(1)]).to_local()
                          for x in (q, k, v))
            yh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            y = DTensor.from_local(yh, dm, [Shard(0), Shard(1)], run_check=False) \
                .redistribute(dm, [Shard(0), Shard(2)]).to_local()
        y.sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 ranks, 2 calls")
    parser.add_argument("--ranks", default=None, help="comma-separated world sizes")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = [int(r) for r in (args.ranks or ("8,64" if args.quick else "8,128,1024")).split(",")]
    repeat = args.repeat or (2 if args.quick else 20)
    rows = []
    for n in ranks:
        for cp in sorted({8, max(8, n // 8)}):
            if n % cp:
                continue
            for strategy in STRATEGIES:
                theirs: tuple[float | None, int | None] = (None, None)
                if strategy in ANCHORED:
                    start_world(n)
                    theirs = measure(pytorch_step(n, cp, strategy), repeat)
                start_world(n)
                ours = measure(meshcomm_step(n, cp, strategy), repeat)
                row = {"ranks": n, "cp": cp, "strategy": strategy,
                       "pytorch_s": theirs[0], "pytorch_ops": theirs[1],
                       "meshcomm_s": ours[0], "meshcomm_ops": ours[1],
                       "ratio": None if theirs[0] is None else ours[0] / theirs[0]}
                rows.append(row)
                anchor = ("pytorch       -  (no CPU anchor)       " if theirs[0] is None else
                          f"pytorch {theirs[0] * 1e3:7.2f} ms ({theirs[1]} ops)")
                ratio = "" if row["ratio"] is None else f"  ratio {row['ratio']:.2f}x"
                print(f"{strategy:10s} ranks {n:5d} cp {cp:4d}  {anchor}  meshcomm"
                      f" {ours[0] * 1e3:7.2f} ms ({ours[1]} ops){ratio}", flush=True)
    dist.destroy_process_group()
    out = args.json or DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rank": RANK, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
