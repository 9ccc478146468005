"""Fit the gloo figures of the default cost model: one latency and one bandwidth.

Runs all_reduce, all_to_all and a ring of send/recv (every rank sends to the next and
receives from the one before) on 4 and 8 gloo processes on this machine, for messages of
8 B to 4 MiB, and fits `time = alpha + beta * bytes` per collective and world size, where
`bytes` is what the busiest rank sends in the planner's byte model of that collective
(ring all_reduce 2(g-1)/g of the tensor, pairwise all_to_all (g-1)/g, a send/recv all of
it). The default `CostModel(backend="gloo")` takes the medians of the fitted alphas and of
1/beta (`meshcomm/planner/values.py`, `BACKEND_FIGURES`).

    python benchmarks/calibrate_gloo.py [--worlds 4 8] [--json PATH]

Each size is timed as the least over repetitions of the slowest rank's time (a barrier
before each repetition): the machine's load from other jobs only adds time. Times depend on the machine and its load: compare runs made on
the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [8 * 4 ** k for k in range(10)]          # 8 B ... 2 MiB
SIZES.append(4 << 20)                             # ... 4 MiB
OPS = ("all_reduce", "all_to_all", "send_recv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reps(nbytes: int) -> int:
    return 30 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 else 5


def _one(op: str, x: torch.Tensor, rank: int, world: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
    else:
        out = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, out, (rank - 1) % world)])
        for r in reqs:
            r.wait()


def _rank(rank: int, world: int, port: int, queue: "mp.Queue[object]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for op in OPS:
        for nbytes in SIZES:
            numel = max(world, nbytes // 4 // world * world)   # divisible for all_to_all
            x = torch.ones(numel)
            for _ in range(3):
                _one(op, x, rank, world)
            times = []
            for _ in range(_reps(nbytes)):
                dist.barrier()
                t = time.perf_counter()
                _one(op, x, rank, world)
                took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times.append(float(took))
            rows.append({"op": op, "bytes": numel * 4, "s": min(times)})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _busiest(op: str, nbytes: int, world: int) -> float:
    """Bytes the busiest rank sends in the planner's model of `op` on `world` ranks."""
    if op == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    if op == "all_to_all":
        return (world - 1) / world * nbytes
    return float(nbytes)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares `y = alpha + beta x`, weighted by 1/y (relative errors), so the small
    messages fix alpha and the large ones beta."""
    w = [1 / y ** 2 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    beta = (sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
            / sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)))
    beta = max(beta, 1e-15)
    return max(my - beta * mx, 0.0), beta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--json", type=Path,
                    default=Path(__file__).parent / "results" / "calibrate_gloo.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    fits, raw = [], []
    for world in args.worlds:
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=900)
        for p in procs:
            p.join(timeout=120)
        for op in OPS:
            mine = [r for r in rows if r["op"] == op]
            alpha, beta = _fit([_busiest(op, r["bytes"], world) for r in mine],
                               [r["s"] for r in mine])
            fits.append({"world": world, "op": op, "alpha_s": alpha, "bandwidth": 1 / beta})
            print(f"world {world} {op:10s} alpha {alpha * 1e6:8.1f} us"
                  f"  bandwidth {1 / beta / 1e9:6.2f} GB/s  "
                  + " ".join(f"{r['bytes']}B:{r['s'] * 1e6:.0f}us" for r in mine[::2]))
        raw += [{"world": world, **r} for r in rows]
    alpha = statistics.median(f["alpha_s"] for f in fits)
    bandwidth = statistics.median(f["bandwidth"] for f in fits)
    print(f"median: latency_s {alpha:.3g}, bandwidth {bandwidth:.3g} B/s"
          f" (one latency = {alpha * bandwidth / 1024:.0f} KiB)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"latency_s": alpha, "bandwidth": bandwidth,
                                     "fits": fits, "timings": raw}, indent=1) + "\n")


if __name__ == "__main__":
    main()
