"""Host time per step of the training blocks at 8 to 4,096 ranks, beside PyTorch, in one process.

Run: `python benchmarks/host_scale.py [--quick] [--ranks 8,128,1024,4096] [--json PATH]`.

One process acts as rank 3 of an N-rank job through torch's fake process group
(`dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=N)`): every
collective returns at once, so the time left is each library's own host work (Python,
tensor ops, hook and autograd overhead). For each N, one after the other, in this process:

- `fully_shard`: 8 blocks of `Linear(H, H) + GELU` (H = 1024), each block and then the root
  wrapped, one forward + backward of a (16, H) batch; PyTorch FSDP2
  (`torch.distributed.fsdp.fully_shard` on a 1-D DeviceMesh) beside `mc.nn.fully_shard`
  (on `mc.init_mesh(f"dp={N}", backend="fake")`), each with its defaults (prefetch on,
  reshard after forward);
- `fully_shard+mp`: the same with bfloat16 parameters and float32 reduction
  (FSDP2's `MixedPrecisionPolicy` beside `mc.nn.MixedPrecision`);
- `hsdp`: FSDP2 on a 2-D `(N/8, 8)` mesh (replicate, shard) beside
  `mc.nn.fully_shard(axis="dp", replicate="rep")` on `rep=N/8 dp=8`;
- `parallelize`: 8 blocks of `Linear(H, 4H) + GELU + Linear(4H, H)`, colwise then rowwise
  over tp=8 of a `(N/8, 8)` mesh, one forward + backward: `parallelize_module` with
  `ColwiseParallel` / `RowwiseParallel` beside `mc.nn.parallelize`;
- `reshard`: a (2N, H) tensor `[Shard(0), Shard(1)]` on `(N/8, 8)` to `[Shard(0), Replicate()]`
  and to `[Shard(0), Shard(0)]`, 8 times each: `DTensor.redistribute` beside `mc.reshard`
  of the local tensor (`"(dp a) (tp b)"` to `"(dp a) b"` and `"(dp tp a) b"`);
- `reshard_partial`: the same tensor `[Shard(0), Partial()]` (`"(dp a) b | sum(tp)"`) to
  `[Shard(1), Replicate()]` (`"a (dp b)"`: from 128 ranks on, meshcomm's plan is one
  send_recv over all N ranks, each taking its block's partials from their holders and
  adding them; on 8 ranks, dp=1, one all_reduce over tp) and to `[Shard(0), Shard(0)]`
  (`"(dp tp a) b"`);
- `vocab_parallel_ce`: the loss of (4, 64) positions over a vocabulary of 8H split over tp=8,
  forward + backward, 8 times: `F.cross_entropy` of DTensor logits under `loss_parallel()`
  beside `mc.nn.vocab_parallel_cross_entropy`.

Not here: the MoE blocks (`mc.nn.experts` exchanges token counts first, and a fake
collective returns no counts) and checkpoints (DCP plans with all_gather_object, which needs
real data; `load_checkpoint` reads one rank's blocks with `receiver_transfers`, measured by
benchmarks/crossmesh_scale.py).

Each row is the median of `--repeat` steps after one warm-up step (which also records
meshcomm's prefetch order), with one intra-op thread, and the number of tensor ops one step
runs (aten calls seen by a TorchDispatchMode, collectives included: on a GPU, kernel
launches and collective calls; a count that grows with N is a per-rank loop in the step).
A mode sees a DTensor's op once, at the DTensor level (DTensor runs its local ops inside
that one call), so PyTorch's counts of DTensor code are lower than what it launches. The ratio is meshcomm over PyTorch
(below 1: meshcomm spends less host time); "growth" is a library's time at the largest N
over its time at 8 ranks; "own" growth is the same for the step's time less the time
inside the backend's collective ops (c10d and functional-collective ops, timed in separate
steps under a dispatch mode): the fake group's own work, which grows with N (it copies one
slice per peer for an all_gather, or an all_to_all with split sizes), taken out. "lines"
counts the lines of meshcomm's own Python one step runs (`sys.settrace`): exact where times
are noisy, and a count that grows with N is a loop over ranks.
`--quick` runs H = 60 (uneven shards at every N), 2 blocks, N in 8 and 128, 2 steps: it
checks that everything runs and prints the table, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import meshcomm as mc

RANK = 3
DEVICE = torch.device("cpu")     # --device: where parameters, batches and shards live
DEFAULT_JSON = Path(__file__).parent / "results" / "host_scale.json"


def model(hidden: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
                           for _ in range(blocks)]).to(DEVICE)


def start_world(n: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=n)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def step_time(step: Callable[[], None], repeat: int) -> float:
    step()                           # warm-up: caches, recorded order
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        sync()                       # on a GPU: the step's kernels finished too
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _OpCount(TorchDispatchMode):
    """Counts the tensor ops (aten calls, collectives included) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _BackendTime(TorchDispatchMode):
    """Seconds spent inside the process group's collective ops (namespaces c10d and
    _c10d_functional, waits included) run under it: on the fake backend, its own host work
    (an all_gather or an all_to_all with split sizes copies one slice per peer, O(N))."""

    def __init__(self) -> None:
        super().__init__()
        self.s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.s += time.perf_counter() - t0


def backend_time(step: Callable[[], None], repeat: int) -> float:
    """Median seconds of one step inside the backend's collective ops (`_BackendTime`): the
    step's time less this is the library's own host work."""
    times = []
    for _ in range(repeat):
        with _BackendTime() as mode:
            step()
        sync()
        times.append(mode.s)
    return statistics.median(times)


PACKAGE = str(Path(mc.__file__).parent)


def python_lines(step: Callable[[], None]) -> int:
    """Lines of meshcomm's own Python one step runs (line events under `sys.settrace`, a
    loop's every pass counted): unlike a time, exact, so a count that grows with N is a
    per-rank loop in meshcomm's step."""
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    sys.settrace(calls)
    try:
        step()
    finally:
        sys.settrace(None)
    return count


def op_count(step: Callable[[], None]) -> int:
    """Tensor ops of one step: on a GPU each is a kernel launch or a collective call, so a
    count that grows with the world size is a per-rank loop in the step."""
    with _OpCount() as mode:
        step()
    return mode.ops


def training_step(m: nn.Module, hidden: int) -> Callable[[], None]:
    x = torch.randn(16, hidden, device=DEVICE)

    def step() -> None:
        m(x).float().sum().backward()
        for p in m.parameters():
            p.grad = None
    return step


# -- the configurations: (name, PyTorch's step, meshcomm's step) per world size ---------------
def fsdp2(n: int, hidden: int, blocks: int, mp: bool, hsdp: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dm = (init_device_mesh(DEVICE.type, (n // 8, 8), mesh_dim_names=("rep", "dp")) if hsdp
          else init_device_mesh(DEVICE.type, (n,), mesh_dim_names=("dp",)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else MixedPrecisionPolicy()
    m = model(hidden, blocks)
    for block in m:
        fully_shard(block, mesh=dm, mp_policy=policy)
    return fully_shard(m, mesh=dm, mp_policy=policy)


def meshcomm(n: int, hidden: int, blocks: int, mp: bool, hsdp: bool) -> nn.Module:
    bound = mc.init_mesh(f"rep={n // 8} dp=8" if hsdp else f"dp={n}", backend="fake")
    policy = mc.nn.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    kwargs: dict[str, Any] = {"axis": "dp", "mp_policy": policy,
                              "replicate": "rep" if hsdp else None}
    m = model(hidden, blocks)
    for block in m:
        mc.nn.fully_shard(block, bound, **kwargs)
    return mc.nn.fully_shard(m, bound, **kwargs)


def mlp(hidden: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                         nn.Linear(4 * hidden, hidden)) for _ in range(blocks)]
                         ).to(DEVICE)


TP = {f"{i}.{j}": style for i in range(64) for j, style in ((0, "colwise"), (2, "rowwise"))}


def tp_pytorch(n: int, hidden: int, blocks: int) -> Callable[[], None]:
    """parallelize_module (ColwiseParallel / RowwiseParallel) on tp=8 of (N/8, 8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dm = init_device_mesh(DEVICE.type, (n // 8, 8), mesh_dim_names=("dp", "tp"))
    m = mlp(hidden, blocks)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(m, dm["tp"], {k: styles[v]() for k, v in TP.items()
                                     if int(k.split(".")[0]) < blocks})
    return training_step(m, hidden)


def tp_meshcomm(n: int, hidden: int, blocks: int) -> Callable[[], None]:
    """mc.nn.parallelize (colwise / rowwise) on tp=8 of dp=N/8 tp=8."""
    bound = mc.init_mesh(f"dp={n // 8} tp=8", backend="fake")
    m = mlp(hidden, blocks)
    mc.nn.parallelize(m, bound, {k: v for k, v in TP.items() if int(k.split(".")[0]) < blocks},
                      axis="tp")
    return training_step(m, hidden)


# a (2N, H rounded down to a multiple of 8) tensor "(dp a) (tp b)" on (N/8, 8): to "(dp a) b" (all_gather over tp)
# and to "(dp tp a) b" (all_to_all over tp); DTensor placements [S0, S1] -> [S0, R] / [S0, S0]
RESHARDS = {"(dp a) b": "S0 R", "(dp tp a) b": "S0 S0"}
# from a pending sum over tp, "(dp a) b | sum(tp)" ([S0, P]): to "a (dp b)" ([S1, R]; from
# 128 ranks on a send_recv over all N ranks follows the reduction) and to "(dp tp a) b" ([S0, S0])
PARTIAL_RESHARDS = {"a (dp b)": "S1 R", "(dp tp a) b": "S0 S0"}
SOURCES = {"(dp a) (tp b)": "S0 S1", "(dp a) b | sum(tp)": "S0 P"}


def _placements(text: str) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    words = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    return [words[w] for w in text.split()]


def reshard_pytorch(n: int, hidden: int, blocks: int, src: str = "(dp a) (tp b)",
                    dsts: dict[str, str] = RESHARDS) -> Callable[[], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dm = init_device_mesh(DEVICE.type, (n // 8, 8), mesh_dim_names=("dp", "tp"))
    shape = (2 * n, hidden - hidden % 8)
    bound = mc.Mesh(f"dp={n // 8} tp=8")
    local = torch.randn(mc.Layout(src).local_shape(bound, shape, 3), device=DEVICE)
    dt = DTensor.from_local(local, dm, _placements(SOURCES[src]), run_check=False,
                            shape=torch.Size(shape), stride=(shape[1], 1))
    targets = [_placements(text) for text in dsts.values()]

    def step() -> None:
        for _ in range(blocks):
            for placements in targets:
                dt.redistribute(dm, placements)
    return step


def reshard_meshcomm(n: int, hidden: int, blocks: int, src: str = "(dp a) (tp b)",
                     dsts: dict[str, str] = RESHARDS) -> Callable[[], None]:
    bound = mc.init_mesh(f"dp={n // 8} tp=8", backend="fake")
    shape = (2 * n, hidden - hidden % 8)
    local = torch.randn(mc.Layout(src).local_shape(bound.mesh, shape, 3), device=DEVICE)

    def step() -> None:
        for _ in range(blocks):
            for dst in dsts:
                mc.reshard(local, bound, src, dst, shape=shape)
    return step


def partial_pair() -> tuple[Callable[..., Callable[[], None]], ...]:
    src = "(dp a) b | sum(tp)"
    return (lambda n, h, b: reshard_pytorch(n, h, b, src, PARTIAL_RESHARDS),
            lambda n, h, b: reshard_meshcomm(n, h, b, src, PARTIAL_RESHARDS))


def _logits(n: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's (4, 64, V/8) slice of logits over a vocabulary V = 8 * hidden, targets."""
    vocab = 8 * hidden
    local = torch.randn(4, 64, hidden, device=DEVICE, requires_grad=True)
    target = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0)
                           ).to(DEVICE)
    return local, target, vocab


def ce_pytorch(n: int, hidden: int, blocks: int) -> Callable[[], None]:
    """F.cross_entropy of DTensor logits [Shard(-1)] on tp=8 under `loss_parallel()`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    dm = init_device_mesh(DEVICE.type, (n // 8, 8), mesh_dim_names=("dp", "tp"))["tp"]
    local, target, vocab = _logits(n, hidden)

    def step() -> None:
        for _ in range(blocks):
            logits = DTensor.from_local(local, dm, [Shard(2)], run_check=False,
                                        shape=torch.Size((4, 64, vocab)),
                                        stride=(64 * vocab, vocab, 1))
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                         target.flatten())
                loss.backward()
    return step


def ce_meshcomm(n: int, hidden: int, blocks: int) -> Callable[[], None]:
    """mc.nn.vocab_parallel_cross_entropy of the same logits on tp=8."""
    bound = mc.init_mesh(f"dp={n // 8} tp=8", backend="fake")
    local, target, vocab = _logits(n, hidden)

    def step() -> None:
        for _ in range(blocks):
            loss = mc.nn.vocab_parallel_cross_entropy(local, target, bound, "tp",
                                                      vocab_size=vocab)
            loss.backward()
    return step


def fsdp_pair(mp: bool, hsdp: bool) -> tuple[Callable[..., Callable[[], None]], ...]:
    return (lambda n, h, b: training_step(fsdp2(n, h, b, mp, hsdp), h),
            lambda n, h, b: training_step(meshcomm(n, h, b, mp, hsdp), h))


# name -> (PyTorch's step, meshcomm's step), each built from (ranks, hidden, blocks)
CONFIGS = {"fully_shard": fsdp_pair(False, False),
           "fully_shard+mp": fsdp_pair(True, False),
           "hsdp": fsdp_pair(False, True),
           "parallelize": (tp_pytorch, tp_meshcomm),
           "reshard": (reshard_pytorch, reshard_meshcomm),
           "reshard_partial": partial_pair(),
           "vocab_parallel_ce": (ce_pytorch, ce_meshcomm)}


def run(ranks: list[int], hidden: int, blocks: int, repeat: int,
        only: list[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    for name, (theirs, ours) in CONFIGS.items():
        if only is not None and name not in only:
            continue
        for n in ranks:
            start_world(n)
            times, ops, backend = {}, {}, {}
            for lib, build in (("pytorch", theirs), ("meshcomm", ours)):
                step = build(n, hidden, blocks)
                times[lib] = step_time(step, repeat)
                ops[lib] = op_count(step)
                backend[lib] = backend_time(step, repeat)
                if lib == "meshcomm":
                    lines = python_lines(step)
            rows.append({"block": name, "ranks": n, "pytorch_s": times["pytorch"],
                         "meshcomm_s": times["meshcomm"],
                         "ratio": times["meshcomm"] / times["pytorch"],
                         "pytorch_ops": ops["pytorch"], "meshcomm_ops": ops["meshcomm"],
                         "pytorch_backend_s": backend["pytorch"],
                         "meshcomm_backend_s": backend["meshcomm"], "meshcomm_lines": lines})
            print(f"{name:16s} {n:6d}  pytorch {times['pytorch'] * 1e3:9.1f} ms"
                  f" ({ops['pytorch']} ops, backend {backend['pytorch'] * 1e3:.1f} ms)"
                  f"  meshcomm {times['meshcomm'] * 1e3:9.1f} ms ({ops['meshcomm']} ops,"
                  f" backend {backend['meshcomm'] * 1e3:.1f} ms, {lines} lines)"
                  f"  ratio {rows[-1]['ratio']:.2f}x",
                  flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| block | ranks | PyTorch | meshcomm | ratio | tensor ops (PyTorch / meshcomm)"
             " | meshcomm's Python lines |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['block']} | {r['ranks']:,} | {r['pytorch_s'] * 1e3:.1f} ms"
                     f" | {r['meshcomm_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x"
                     f" | {r['pytorch_ops']} / {r['meshcomm_ops']}"
                     f" | {r.get('meshcomm_lines', '')} |")
    lines += ["", "| block | PyTorch growth | meshcomm growth | PyTorch own | meshcomm own |",
              "|---|---|---|---|---|"]
    for block in dict.fromkeys(r["block"] for r in rows):
        mine = [r for r in rows if r["block"] == block]
        lo, hi = mine[0], mine[-1]
        lines.append(f"| {block} ({lo['ranks']:,} -> {hi['ranks']:,}) |"
                     f" {hi['pytorch_s'] / lo['pytorch_s']:.2f}x |"
                     f" {hi['meshcomm_s'] / lo['meshcomm_s']:.2f}x |"
                     f" {_own(hi, 'pytorch') / _own(lo, 'pytorch'):.2f}x |"
                     f" {_own(hi, 'meshcomm') / _own(lo, 'meshcomm'):.2f}x |")
    return "\n".join(lines)


def _own(row: dict[str, Any], lib: str) -> float:
    """A library's own host time of a row: its step less the time inside the backend's
    collective ops (at least a microsecond)."""
    return max(row[f"{lib}_s"] - row.get(f"{lib}_backend_s", 0.0), 1e-6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 and 128 ranks")
    parser.add_argument("--ranks", default=None, help="comma-separated world sizes")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps per row")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where tensors live"
                        " (on cuda each step ends with a synchronize)")
    parser.add_argument("--only", default=None, help="comma-separated blocks, e.g."
                        f" fully_shard,parallelize (of {', '.join(CONFIGS)})")
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON}"
                        " (not written with --quick unless given)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    only = None if args.only is None else args.only.split(",")
    if only is not None and set(only) - set(CONFIGS):
        parser.error(f"--only {args.only}: no block {sorted(set(only) - set(CONFIGS))};"
                     f" the blocks are {', '.join(CONFIGS)}")
    torch.set_num_threads(1)
    hidden, blocks = (60, 2) if args.quick else (1024, 8)
    ranks = [int(r) for r in (args.ranks or ("8,128" if args.quick else "8,128,1024,4096"))
             .split(",")]
    repeat = args.repeat or (2 if args.quick else 5)
    rows = run(ranks, hidden, blocks, repeat, only)
    if dist.is_initialized():
        dist.destroy_process_group()
    print()
    print(table(rows))
    out = args.json or (None if args.quick else DEFAULT_JSON)
    if out is not None:
        meta = {"hidden": hidden, "blocks": blocks, "repeat": repeat, "rank": RANK,
                "device": str(DEVICE),
                "torch": torch.__version__, "threads": 1, "command": " ".join(sys.argv)}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
