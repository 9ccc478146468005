"""Tensor parallelism on Hugging Face Llama and Mistral: the collectives of one training step
under meshcomm's `parallelize` beside PyTorch's `parallelize_module` running the same plan.

Run: `python benchmarks/hf_tp_bytes.py [--world 4] [--json PATH] [--timeout S]`.

The models and the plan are tests/dist/test_hf_table.py's (tiny configs, nothing
downloaded): vocabulary rows split (`embedding`, `colwise_gather` on `lm_head`), q, k, v,
gate, up `colwise`, o, down `rowwise`, on `tp=<world>`. PyTorch runs the same plan as
`RowwiseParallel(input_layouts=Replicate())` (the embedding), `ColwiseParallel(
output_layouts=Replicate())` (lm_head), `ColwiseParallel()` and `RowwiseParallel()`.
Each side trains one warm-up step, then one counted step (forward, backward, SGD step):
every collective dispatched on rank 0, counted as benchmarks/train_vs_fsdp2.py counts
them (`CollectiveCounter`: kind, group size, bytes this rank sends). The losses of the
steps are printed beside one process's, so the byte counts are of two runs that agree.
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


def run(model: Any) -> dict[str, Any]:
    """One warm-up step, then one counted: the losses and the counted step's collectives."""
    x = table.tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [step(model, opt, x)]
    with CollectiveCounter() as counter:
        losses.append(step(model, opt, x))
    return {"losses": losses, "comm": summarize(counter.records)}


def worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    out: dict[str, Any] = {}
    for kind in MODELS:
        bound = mc.init_mesh(f"tp={world}")
        model = table.build(kind)
        mc.nn.parallelize(model, bound, table.LLAMA_TP, axis="tp")
        out[f"{kind} meshcomm"] = run(model)
        model = table.build(kind)
        parallelize_module(model, bound.device_mesh, torch_plan(table.LLAMA_TP))
        out[f"{kind} torch"] = run(model)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    results = run_ranks(worker, args.world, timeout_s=args.timeout)[0]
    print(f"one training step on tp={args.world}, rank 0 (bytes this rank sends)")
    print(f"{'model':8} {'side':9} {'calls':>5} {'bytes':>9}  by kind (calls, bytes)"
          "                          losses (one process)")
    for kind in MODELS:
        ref = table.one_process(kind)["losses"][:2].tolist()
        for side in ("meshcomm", "torch"):
            r = results[f"{kind} {side}"]
            comm = r["comm"]
            kinds = ", ".join(f"{k} {v['calls']} {v['sent']}"
                              for k, v in sorted(comm["by_kind"].items()))
            losses = " ".join(f"{v:.6f}" for v in r["losses"])
            print(f"{kind:8} {side:9} {comm['calls']:5d} {comm['sent']:9d}  {kinds:42}"
                  f" {losses} ({' '.join(f'{v:.6f}' for v in ref)})")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
