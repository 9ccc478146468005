"""Training a Llama-style model on 4 gloo processes: PyTorch FSDP2 and FSDP2 + tensor parallel
against the same model trained in one process (the PyTorch side of a side-by-side benchmark).

Run: `python benchmarks/train_vs_fsdp2.py [--steps N] [--layers L] [--dim D] [--batch B]
[--seq S] [--configs fsdp2,fsdp2_tp] [--json PATH]`.

The model is `examples/llama.py` (default: dim 256, 8 layers, 8 heads with 4 key/value
heads, SwiGLU, RMSNorm, vocab 4096). Every configuration builds it from the same seed, so
all start from identical weights, and trains it with AdamW on the same global batches
(random counting sequences, seeded: random data the model can learn, so the losses move).
Each configuration runs in fresh processes (`run_ranks`), one after the other:

- `1 process`: the reference, one process (a 1-rank gloo group that never communicates).
- `fsdp2`: `fully_shard` on every TransformerBlock, then on the root, over a 1-D mesh of 4
  (`init_device_mesh("cpu", (4,))`); each rank trains on 1/4 of the global batch.
- `fsdp2_tp`: a (dp=2, tp=2) mesh. `parallelize_module` over tp (ColwiseParallel for wq, wk,
  wv, w1, w3; RowwiseParallel for wo, w2; the embedding row-wise with a replicated input,
  the output projection column-wise with a replicated output), then `fully_shard` per
  block and on the root over dp. Each dp rank trains on 1/2 of the global batch; the two
  tp ranks of a dp rank see the same rows.
- `fsdp2_tp_sp`: `fsdp2_tp` with torchtitan's sequence-parallel plan (SequenceParallel
  norms, PrepareModuleInput before attention and the MLP).
- `fsdp2_hsdp`: HSDP, `fully_shard` over a (rep=2, dp=2) mesh: shards over dp, replicas
  over rep, gradients reduce_scattered over dp then all_reduced over rep; each of the 4
  ranks trains on 1/4 of the global batch.
- `meshcomm_*`: the same with `mc.nn.fully_shard` (`replicate="rep"` for HSDP) and
  `mc.nn.parallelize`; `meshcomm_fsdp_no_prefetch` turns prefetch off.

The loss of a step is the mean over the global batch: each rank takes the mean over its
rows and FSDP2 averages gradients over the dp ranks (equal rows per rank, so the average of
the means is the global mean); the reported loss averages the dp ranks' losses.

Measured per configuration:
- losses per step, and the largest relative difference to the 1-process losses;
- step time: per step the slowest rank's time from a barrier to the end of
  `optimizer.step()` (the loss read back included), median over the steps after
  `--warmup` (2);
- bytes sent per step per rank: every collective of a warm-up step, seen by a
  TorchDispatchMode on the `c10d` and `_c10d_functional` ops (FSDP2's process-group calls,
  DTensor's functional collectives, also those DTensor issues inside its own dispatch),
  with meshcomm's conventions for a group of g ranks: all_gather sends (g-1) x its input,
  reduce_scatter and all_to_all (g-1)/g of their input, all_reduce 2 (g-1)/g of its tensor.
  The mode costs Python time per op, so it watches the warm-up steps only; the timed steps
  run without it. Checked at start against collectives of known size (`counter_check`);
- memory per rank: `state` is exact (the bytes of this rank's parameters, gradients and
  AdamW states after the last step, local shards only); `peak RSS` is the process's peak
  resident set over the training steps (Linux VmHWM, reset with /proc/self/clear_refs at
  the first step; `ru_maxrss` where that is not possible) and `+train` that peak less the
  RSS at the first step (the memory training adds on top of the built, sharded model).

Adding a configuration (meshcomm's own, say): write `fn(model, rank, mesh_info) -> model`
and register it with `@config("name", dp=..., tp=..., mesh=...)` below the marked place; the common
training loop, the measurements and the table pick it up. Put a pair in `RATIOS` to get a
column of its time, bytes and memory relative to another configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama

from meshcomm.runtime.launch import run_ranks

REFERENCE = "1 process"


# -- meshes and the registry of configurations ----------------------------------------------
@dataclass
class MeshInfo:
    """Where this rank sits: rank = dp_rank * tp + tp_rank (dp outer, tp inner; the order
    of `init_device_mesh("cpu", (dp, tp))` and of meshcomm's `Mesh("dp=.. tp=..")`)."""

    rank: int
    world_size: int
    dp: int
    tp: int
    _mesh: Any = field(default=None, repr=False)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def device_mesh(self) -> Any:
        """torch's DeviceMesh for this layout, made once: 1-D ("dp",) when tp == 1, else
        2-D ("dp", "tp")."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            if self.tp == 1:
                self._mesh = init_device_mesh("cpu", (self.dp,), mesh_dim_names=("dp",))
            else:
                self._mesh = init_device_mesh("cpu", (self.dp, self.tp),
                                              mesh_dim_names=("dp", "tp"))
        return self._mesh


ConfigFn = Callable[[nn.Module, int, MeshInfo], nn.Module]


@dataclass(frozen=True)
class Config:
    name: str
    fn: ConfigFn
    dp: int          # the batch is split over dp (tp ranks see the same rows)
    tp: int
    mesh: str | None = None     # the mesh the configuration builds, when not "dp=.. tp=.."

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def mesh_text(self) -> str:
        return self.mesh or f"dp={self.dp}" + (f" tp={self.tp}" if self.tp > 1 else "")


CONFIGS: dict[str, Config] = {}
# (numerator, denominator) pairs of configurations: ratio columns in the table and JSON
RATIOS: list[tuple[str, str]] = []


def config(name: str, *, dp: int, tp: int = 1, mesh: str | None = None
           ) -> Callable[[ConfigFn], ConfigFn]:
    def register(fn: ConfigFn) -> ConfigFn:
        CONFIGS[name] = Config(name, fn, dp, tp, mesh)
        return fn
    return register


def _single(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    return model


SINGLE = Config(REFERENCE, _single, 1, 1)


@config("fsdp2", dp=4)
def fsdp2(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_info.device_mesh()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@config("fsdp2_tp", dp=2, tp=2)
def fsdp2_tp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = mesh_info.device_mesh()
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    block_plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


@config("fsdp2_tp_sp", dp=2, tp=2)
def fsdp2_tp_sp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    """FSDP2 + tensor parallel + sequence parallel (activations between blocks split over
    the sequence), the torchtitan way."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = mesh_info.device_mesh()
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


@config("fsdp2_hsdp", dp=4, mesh="rep=2 dp=2")
def fsdp2_hsdp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    """HSDP: FSDP2 on a 2-D mesh replicates over dim 0 and shards over dim 1; the batch is
    split over all 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ==== meshcomm: the same model, unmodified, with mc.nn.fully_shard / mc.nn.parallelize ====
MESHCOMM_TP_PLAN = {
    "tok_embeddings": "embedding", "output": "colwise_gather",
    "layers.*.attention.w[qkv]": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w[13]": "colwise", "layers.*.feed_forward.w2": "rowwise",
}


def meshcomm_sharded(model: nn.Module, mesh: str, tp_plan: dict[str, str] | None = None,
                     **fsdp: Any) -> nn.Module:
    """meshcomm's side of every pair: `parallelize` over tp with `tp_plan` (if any), then
    `fully_shard` on every block and on the root with the `fsdp` options."""
    import meshcomm as mc

    bound = mc.init_mesh(mesh)
    if tp_plan is not None:
        mc.nn.parallelize(model, bound, tp_plan, axis="tp")
    for block in model.layers:
        mc.nn.fully_shard(block, bound, **fsdp)
    return mc.nn.fully_shard(model, bound, **fsdp)


@config("meshcomm_fsdp", dp=4)
def meshcomm_fsdp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    return meshcomm_sharded(model, "dp=4")


@config("meshcomm_fsdp_tp", dp=2, tp=2)
def meshcomm_fsdp_tp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    return meshcomm_sharded(model, "dp=2 tp=2", MESHCOMM_TP_PLAN, axis="dp")


MESHCOMM_SP_PLAN = {
    "tok_embeddings": "embedding_sp", "norm": "sp_params", "output": "colwise_gather_sp",
    "layers.*.attention_norm": "sp_params", "layers.*.ffn_norm": "sp_params",
    "layers.*.attention": "sp_input", "layers.*.feed_forward": "sp_input",
    "layers.*.attention.w[qkv]": "colwise_sp", "layers.*.attention.wo": "rowwise_sp",
    "layers.*.feed_forward.w[13]": "colwise_sp", "layers.*.feed_forward.w2": "rowwise_sp",
}


@config("meshcomm_fsdp_tp_sp", dp=2, tp=2)
def meshcomm_fsdp_tp_sp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    return meshcomm_sharded(model, "dp=2 tp=2", MESHCOMM_SP_PLAN, axis="dp")


@config("meshcomm_hsdp", dp=4, mesh="rep=2 dp=2")
def meshcomm_hsdp(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    """HSDP: shards over dp, replicas over rep; the batch is split over all 4 ranks."""
    return meshcomm_sharded(model, "rep=2 dp=2", axis="dp", replicate="rep")


@config("meshcomm_fsdp_no_prefetch", dp=4)
def meshcomm_fsdp_no_prefetch(model: nn.Module, rank: int, mesh_info: MeshInfo) -> nn.Module:
    """meshcomm_fsdp with prefetch off: every all_gather waited on where it is issued."""
    return meshcomm_sharded(model, "dp=4", prefetch=False)


RATIOS += [("meshcomm_fsdp", "fsdp2"), ("meshcomm_fsdp_tp", "fsdp2_tp"),
           ("meshcomm_fsdp_tp_sp", "fsdp2_tp_sp"), ("meshcomm_hsdp", "fsdp2_hsdp"),
           ("meshcomm_fsdp", "meshcomm_fsdp_no_prefetch")]
# =============================================================================================


# -- counting the bytes of collectives -----------------------------------------------------
_PAYLOAD_ARGS = ("input_tensor", "input_tensors", "input_list", "inputs", "input", "tensors")


def _kind(op_name: str) -> str | None:
    name = op_name.replace("_", "")
    for key, kind in (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
                      ("allreduce", "all_reduce"), ("alltoall", "all_to_all"),
                      ("broadcast", "broadcast")):
        if key in name:
            return kind
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def sent_bytes(kind: str, payload: int, group: int) -> int:
    """Bytes one rank sends for a collective over `group` ranks whose input on this rank
    has `payload` bytes (meshcomm's planner conventions, planner/traffic.py)."""
    if group <= 1:
        return 0
    if kind == "all_gather":
        return (group - 1) * payload
    if kind in ("reduce_scatter", "all_to_all"):
        return payload - payload // group
    if kind == "all_reduce":
        return 2 * (payload - payload // group)
    if kind == "broadcast":      # counted as if every rank sent its share of a scatter-gather
        return payload - payload // group
    raise ValueError(kind)


class CollectiveCounter(TorchDispatchMode):
    """Records every collective dispatched while active: kind, group size, payload bytes
    and bytes sent. DTensor arguments are passed on (NotImplemented) so that DTensor's own
    dispatch runs first, and the collectives it issues come back through this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional"):
            self._record(func, args, kwargs)
        return out

    def _record(self, func: Any, args: Any, kwargs: Any) -> None:
        name = func._overloadpacket.__name__
        kind = _kind(name)
        if kind is None:           # wait_tensor, barrier, send/recv, ...: not counted
            return
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        payload = next(_nbytes(named[k]) for k in _PAYLOAD_ARGS if k in named)
        group = _group_size(named)
        self.records.append({"op": f"{namespace_of(func)}.{name}", "kind": kind,
                             "group": group, "payload": payload,
                             "sent": sent_bytes(kind, payload, group)})


def namespace_of(func: Any) -> str:
    return "funcol" if func.namespace == "_c10d_functional" else "c10d"


def _group_size(named: dict[str, Any]) -> int:
    if "group_size" in named:
        return int(named["group_size"])
    if "process_group" in named:
        group = named["process_group"]
        if isinstance(group, torch.ScriptObject):     # how the dispatcher hands it over
            group = dist.ProcessGroup.unbox(group)
        return int(group.size())
    if "group_name" in named:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return int(_resolve_process_group(named["group_name"]).size())
    raise ValueError(f"no group among {sorted(named)}")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        entry = by_kind.setdefault(f"{r['kind']}({r['group']})", {"calls": 0, "sent": 0})
        entry["calls"] += 1
        entry["sent"] += r["sent"]
    return {"sent": sum(r["sent"] for r in records), "calls": len(records), "by_kind": by_kind}


def counter_check(rank: int, world: int) -> dict[str, Any]:
    """Collectives of known size through the counter: process-group calls (FSDP2's path),
    functional collectives, DTensor redistributions, and a DTensor op that must move data
    inside its dispatch. Returns {case: (counted, expected)} and whether all agree."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    n = 1024 * world                     # float32 elements
    b = 4 * n
    cases: dict[str, tuple[int, int]] = {}

    def measure(label: str, expected: int | None, fn: Callable[[], Any]) -> None:
        with CollectiveCounter() as counter:
            fn()
        got = summarize(counter.records)["sent"]
        if expected is None:          # only that something was seen
            expected = got if got > 0 else -1
        cases[label] = (got, expected)

    x = torch.ones(n)
    # (torch before 2.12 names them all_gather_into_tensor / reduce_scatter_tensor)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    measure("dist.all_gather_single", (world - 1) * b,
            lambda: gather(torch.empty(world * n), x))
    measure("dist.reduce_scatter_single", b - b // world,
            lambda: scatter(torch.empty(n // world), x))
    measure("dist.all_reduce", 2 * (b - b // world), lambda: dist.all_reduce(x.clone()))
    measure("funcol.all_reduce", 2 * (b - b // world),
            lambda: funcol.all_reduce(x, "sum", dist.group.WORLD).wait())
    measure("DTensor Shard(0) -> Replicate", (world - 1) * b,
            lambda: DTensor.from_local(x, mesh, [Shard(0)]).full_tensor())
    measure("DTensor Partial -> Replicate", 2 * (b - b // world),
            lambda: DTensor.from_local(x, mesh, [Partial()]).redistribute(
                mesh, [Replicate()]).to_local())
    # softmax over a sharded dim: DTensor gathers that dim inside its own dispatch
    y = DTensor.from_local(torch.ones(16, 64), mesh, [Shard(1)])
    measure("DTensor softmax over Shard(1) (inside dispatch)", (world - 1) * 16 * 64 * 4,
            lambda: torch.softmax(y, dim=1).to_local())
    ok = all(got == want for got, want in cases.values())
    return {"ok": ok, "cases": cases}


# -- the common training loop ----------------------------------------------------------------
def _status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    optim = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params), "optimizer": optim}


def train_worker(rank: int, world: int, name: str, model_cfg: dict[str, Any],
                 run_cfg: dict[str, Any]) -> dict[str, Any]:
    import warnings

    # FSDP2 warns that the root returns a view (ColwiseParallel's replicated logits are
    # one); nothing here writes into the logits in place, so that warning does not apply.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    cfg = SINGLE if name == REFERENCE else CONFIGS[name]
    assert world == cfg.world_size, (world, cfg)
    info = MeshInfo(rank, world, cfg.dp, cfg.tp)
    check = counter_check(rank, world) if run_cfg["counter_check"] and world > 1 else None

    args = llama.ModelArgs(**model_cfg)
    model = llama.Transformer(args)               # every configuration: the same weights
    model = cfg.fn(model, rank, info)
    opt = torch.optim.AdamW(model.parameters(), lr=run_cfg["lr"])
    steps, batch, seq = run_cfg["steps"], run_cfg["batch"], run_cfg["seq"]
    data = llama.counting_batches(steps, batch, seq, args.vocab_size, run_cfg["seed"] + 1)
    rows = batch // cfg.dp
    data = data[:, info.dp_rank * rows:(info.dp_rank + 1) * rows]

    gc.collect()
    rss_start = _status_kib("VmRSS")
    hwm_reset = _reset_peak_rss()
    maxrss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses, times, comm = [], [], []
    for step in range(steps):
        tokens = data[step]
        counting = step < run_cfg["warmup"]
        counter = CollectiveCounter() if counting else None
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        if counter is not None:
            counter.__enter__()
        try:
            loss = llama.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
        times.append(time.perf_counter() - start)
        losses.append(value)
        if counter is not None:
            comm.append(summarize(counter.records))
    peak = _status_kib("VmHWM") if hwm_reset else None
    memory = {"state": state_bytes(model, opt), "rss_start_kib": rss_start,
              "peak_rss_kib": peak if peak is not None else resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss,
              "peak_source": "VmHWM" if peak is not None else "ru_maxrss",
              "ru_maxrss_start_kib": maxrss_start}
    return {"rank": rank, "dp_rank": info.dp_rank, "tp_rank": info.tp_rank, "losses": losses,
            "times": times, "comm": comm, "memory": memory, "counter_check": check}


# -- running, summarizing, printing ------------------------------------------------------------
def run_config(cfg: Config, model_cfg: dict[str, Any], run_cfg: dict[str, Any],
               timeout_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    ranks = run_ranks(train_worker, cfg.world_size, cfg.name, model_cfg, run_cfg,
                      timeout_s=timeout_s)
    wall = time.perf_counter() - start
    steps = run_cfg["steps"]
    warm = min(run_cfg["warmup"], steps - 1)
    dp_heads = [r for r in ranks if r["tp_rank"] == 0]
    losses = [statistics.fmean(r["losses"][s] for r in dp_heads) for s in range(steps)]
    tp_spread = max((abs(r["losses"][s] - q["losses"][s]) / abs(q["losses"][s])
                     for r in ranks for q in ranks if r["dp_rank"] == q["dp_rank"]
                     for s in range(steps)), default=0.0)
    step_times = [max(r["times"][s] for r in ranks) for s in range(steps)]
    comm_last = [r["comm"][-1] for r in ranks] if ranks[0]["comm"] else []
    comm_first = [r["comm"][0] for r in ranks] if ranks[0]["comm"] else []
    mem = [r["memory"] for r in ranks]
    return {
        "name": cfg.name, "mesh": cfg.mesh_text if cfg.world_size > 1 else "-",
        "world_size": cfg.world_size, "wall_s": wall, "losses": losses,
        "losses_by_rank": [r["losses"] for r in ranks],
        "loss_spread_within_tp": tp_spread,
        "step_times_s": step_times, "step_time_median_s": statistics.median(step_times[warm:]),
        "comm_steps_counted": len(ranks[0]["comm"]),
        "sent_per_step_by_rank": [c["sent"] for c in comm_last],
        "sent_per_step_max": max((c["sent"] for c in comm_last), default=0),
        "collectives_per_step_max": max((c["calls"] for c in comm_last), default=0),
        "collectives_by_kind_rank0": comm_last[0]["by_kind"] if comm_last else {},
        "first_step_sent_by_rank": [c["sent"] for c in comm_first],
        "memory_by_rank": mem,
        "state_bytes_max": max(sum(m["state"].values()) for m in mem),
        "peak_rss_kib_max": max(m["peak_rss_kib"] for m in mem),
        "train_rss_kib_max": max(m["peak_rss_kib"] - (m["rss_start_kib"] or 0) for m in mem),
        "peak_source": mem[0]["peak_source"],
        "counter_check": next((r["counter_check"] for r in ranks if r["counter_check"]), None),
    }


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render(report: dict[str, Any]) -> str:
    runs = report["runs"]
    ref = runs[REFERENCE]
    lines = []
    m = report["model"]
    r = report["run"]
    lines.append(f"model: dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads"
                 f" ({m['n_kv_heads']} kv), ffn {report['ffn_hidden_dim']}, vocab"
                 f" {m['vocab_size']}: {report['n_params']:,} parameters"
                 f" ({mib(4 * report['n_params'])} MiB float32)")
    lines.append(f"training: {r['steps']} steps, AdamW lr {r['lr']}, global batch {r['batch']}"
                 f" x seq {r['seq']}, gloo on CPU, 1 thread per process, {os.cpu_count()} cores")
    lines.append("")
    names = list(runs)
    head = f"{'step':>4}" + "".join(f"  {n:>12}" for n in names)
    lines.append(head)
    for s in range(r["steps"]):
        lines.append(f"{s + 1:>4}" + "".join(f"  {runs[n]['losses'][s]:>12.6f}" for n in names))
    lines.append("")
    cols = ("config", "mesh", "max rel diff", "step ms", "sent MiB/step/rank", "colls/step",
            "state MiB/rank", "peak RSS MiB/rank", "+train MiB")
    rows = []
    for n in names:
        run = runs[n]
        rows.append((n, run["mesh"], f"{run['max_rel_diff']:.1e}" if n != REFERENCE else "-",
                     f"{1000 * run['step_time_median_s']:.1f}",
                     mib(run["sent_per_step_max"]) if run["world_size"] > 1 else "0",
                     str(run["collectives_per_step_max"]), mib(run["state_bytes_max"]),
                     f"{run['peak_rss_kib_max'] / 1024:.1f}",
                     f"{run['train_rss_kib_max'] / 1024:.1f}"))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    for row in [cols, *rows]:    # two text columns, then numbers
        lines.append("  ".join(v.rjust(w) if i > 1 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(row, widths))))
    lines.append("")
    for n in names:
        kinds = runs[n]["collectives_by_kind_rank0"]
        if kinds:
            parts = ", ".join(f"{v['calls']} {k} {mib(v['sent'])} MiB" for k, v in kinds.items())
            lines.append(f"{n} (rank 0, one step): {parts}")
    for num, den in report["ratios"]:
        if num in runs and den in runs:
            q = report["ratio_values"][f"{num}/{den}"]
            lines.append(f"{num} / {den}: step time {q['step_time']:.2f}x, bytes sent"
                         f" {q['sent']:.2f}x, state {q['state']:.2f}x,"
                         f" peak RSS {q['peak_rss']:.2f}x")
    lines.append("")
    lines.append(f"step ms: median over steps {r['warmup'] + 1}..{r['steps']} of the slowest"
                 " rank's step. sent: bytes one rank sends in a warm-up step (busiest rank),"
                 " counted at the c10d/funcol ops.")
    lines.append(f"state: this rank's parameters + gradients + AdamW states (exact). peak RSS:"
                 f" {ref['peak_source']} over the training steps; +train: that peak less the"
                 " RSS at the first step.")
    checks = [run["counter_check"] for run in runs.values() if run["counter_check"]]
    if checks:
        lines.append("byte counter check: " + ("ok" if all(c["ok"] for c in checks) else
                                               f"FAILED {checks[0]['cases']}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows per step)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (bytes counted there)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--tol", type=float, default=1e-5, help="largest relative loss difference")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--no-counter-check", action="store_true")
    p.add_argument("--json", type=Path, help="write every number here")
    a = p.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    for n in names:
        if a.batch % CONFIGS[n].dp:
            p.error(f"--batch {a.batch} does not split over dp={CONFIGS[n].dp} ({n})")
    if a.steps < 1 or a.warmup < 1 or a.warmup >= a.steps:
        p.error("need 1 <= --warmup < --steps")

    model_cfg = dict(dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                     vocab_size=a.vocab, max_seq_len=max(a.seq, 64), seed=a.seed)
    run_cfg = dict(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, seed=a.seed,
                   warmup=a.warmup, counter_check=not a.no_counter_check)
    margs = llama.ModelArgs(**model_cfg)
    with torch.device("meta"):
        n_params = sum(q.numel() for q in llama.Transformer(margs).parameters())
    start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    for cfg in [SINGLE] + [CONFIGS[n] for n in names]:
        print(f"running {cfg.name} on {cfg.world_size} process(es) ...", flush=True)
        runs[cfg.name] = run_config(cfg, model_cfg, run_cfg, a.timeout)
        runs[cfg.name]["max_rel_diff"] = max_rel_diff(runs[cfg.name]["losses"],
                                                      runs[REFERENCE]["losses"])
    ratio_values = {}
    for num, den in RATIOS:
        if num in runs and den in runs:
            x, y = runs[num], runs[den]
            ratio_values[f"{num}/{den}"] = {
                "step_time": x["step_time_median_s"] / y["step_time_median_s"],
                "sent": x["sent_per_step_max"] / y["sent_per_step_max"]
                if y["sent_per_step_max"] else math.nan,
                "state": x["state_bytes_max"] / y["state_bytes_max"],
                "peak_rss": x["peak_rss_kib_max"] / y["peak_rss_kib_max"]}
    report = {"model": model_cfg, "ffn_hidden_dim": margs.ffn_hidden_dim, "n_params": n_params,
              "run": run_cfg, "runs": runs, "ratios": RATIOS, "ratio_values": ratio_values,
              "meta": {"torch": torch.__version__, "python": platform.python_version(),
                       "cpus": os.cpu_count(), "platform": platform.platform()},
              "wall_s": time.perf_counter() - start}
    print(render(report))
    worst = max((runs[n]["max_rel_diff"] for n in names), default=0.0)
    checks_ok = all(run["counter_check"]["ok"] for run in runs.values() if run["counter_check"])
    ok = worst <= a.tol and checks_ok
    report["ok"] = ok
    print(f"{'OK' if ok else 'FAIL'}: largest relative loss difference {worst:.2e}"
          f" (tolerance {a.tol:g}); total {report['wall_s']:.1f} s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
