"""Tensor parallelism on Hugging Face Llama and Mistral: the collectives of one training step
under meshcomm's `parallelize` beside PyTorch's `parallelize_module` running the same plan.

Run: `python benchmarks/hf_tp_bytes.py [--mesh "tp=4"] [--json PATH] [--timeout S]`.

The models and the plan are tests/dist/test_hf_table.py's (tiny configs, nothing
downloaded): vocabulary rows split (`embedding`, `colwise_gather` on `lm_head`), q, k, v,
gate, up `colwise`, o, down `rowwise`, on `--mesh` (`tp=4`; `dp=2 tp=2` adds
`fully_shard` over dp of every block and the root on both sides: meshcomm's and FSDP2's).
PyTorch runs the same plan as `RowwiseParallel(input_layouts=Replicate())` (the embedding),
`ColwiseParallel(output_layouts=Replicate())` (lm_head), `ColwiseParallel()` and
`RowwiseParallel()`.
Each side trains one warm-up step, then one counted step (forward, backward, SGD step):
every collective dispatched on rank 0, counted as benchmarks/train_vs_fsdp2.py counts
them (`CollectiveCounter`: kind, group size, bytes this rank sends). The losses of the
steps (the mean over the ranks) are printed beside one process's, so the byte counts are
of two runs that agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from train_vs_fsdp2 import CollectiveCounter, summarize  # benchmarks/, beside this

import meshcomm as mc
from meshcomm.runtime.launch import run_ranks

sys.path[:0] = [str(Path(__file__).parents[1] / "tests"),
                str(Path(__file__).parents[1] / "tests" / "dist")]
import test_hf_table as table  # noqa: E402  (the tiny configs and the hand-written plan)

MODELS = ("llama", "mistral")


def torch_plan(plan: dict[str, str]) -> dict[str, Any]:
    """meshcomm's plan as PyTorch's parallel styles (the same splits and moves)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate())}
    return {pattern: styles[style]() for pattern, style in plan.items()}


def step(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def run(model: Any, x: torch.Tensor) -> dict[str, Any]:
    """One warm-up step, then one counted: the losses and the counted step's collectives."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [step(model, opt, x)]
    with CollectiveCounter() as counter:
        losses.append(step(model, opt, x))
    mean = torch.tensor(losses)               # the mean over the dp shares (after counting)
    torch.distributed.all_reduce(mean)
    world = torch.distributed.get_world_size()
    return {"losses": (mean / world).tolist(), "comm": summarize(counter.records)}


def worker(rank: int, world: int, mesh: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    out: dict[str, Any] = {}
    for kind in MODELS:
        bound = mc.init_mesh(mesh)
        x = table.tokens()
        dp = bound.mesh.axis_size("dp") if "dp" in bound.mesh.axis_names else 1
        if dp > 1:                     # this dp rank's share of the batch
            i = bound.mesh.coords(rank)["dp"]
            x = x[i * (table.BATCH // dp):(i + 1) * (table.BATCH // dp)]
        model = table.build(kind)
        mc.nn.parallelize(model, bound, table.LLAMA_TP, axis="tp")
        if dp > 1:
            for block in table.blocks(model):
                mc.nn.fully_shard(block, bound, axis="dp")
            mc.nn.fully_shard(model, bound, axis="dp")
        out[f"{kind} meshcomm"] = run(model, x)
        model = table.build(kind)
        device_mesh = bound.device_mesh
        parallelize_module(model, device_mesh["tp"] if dp > 1 else device_mesh,
                           torch_plan(table.LLAMA_TP))
        if dp > 1:
            for block in table.blocks(model):
                fully_shard(block, mesh=device_mesh["dp"])
            fully_shard(model, mesh=device_mesh["dp"])
        out[f"{kind} torch"] = run(model, x)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="tp=4",
                        help='"tp=4", or "dp=2 tp=2" (fully_shard over dp on both sides)')
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    world = mc.Mesh(args.mesh).size
    results = run_ranks(worker, world, args.mesh, timeout_s=args.timeout)[0]
    print(f"one training step on {args.mesh}, rank 0 (bytes this rank sends)")
    print_sides(results, {kind: table.one_process(kind)["losses"][:2].tolist()
                          for kind in MODELS}, width=42)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def print_sides(results: dict[str, Any], refs: dict[str, list[float]], width: int) -> None:
    """Per model (`refs`: its losses in one process), meshcomm's and torch's row: calls,
    bytes, by kind, and losses beside one process's."""
    print(f"{'model':8} {'side':9} {'calls':>5} {'bytes':>9}  {'by kind (calls, bytes)':{width}}"
          " losses (one process)")
    for kind, ref in refs.items():
        for side in ("meshcomm", "torch"):
            r = results[f"{kind} {side}"]
            comm = r["comm"]
            kinds = ", ".join(f"{k} {v['calls']} {v['sent']}"
                              for k, v in sorted(comm["by_kind"].items()))
            losses = " ".join(f"{v:.6f}" for v in r["losses"])
            print(f"{kind:8} {side:9} {comm['calls']:5d} {comm['sent']:9d}  {kinds:{width}}"
                  f" {losses} ({' '.join(f'{v:.6f}' for v in ref)})")


if __name__ == "__main__":
    sys.exit(main())
