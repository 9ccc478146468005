"""Sequence parallelism on Hugging Face Llama and Mistral: the collectives of one training step
under meshcomm's `parallelize` (no position_ids passed: meshcomm/nn/sequence.py fills
them) beside PyTorch's `parallelize_module` with its sequence-parallel styles.

Run: `python benchmarks/hf_sp_bytes.py [--world 4] [--json PATH] [--timeout S]`.

The models and meshcomm's plan are tests/dist/test_hf_sp.py's (tiny configs, nothing
downloaded; Mistral with a sliding window of 4 in a sequence of 16), on `tp=<world>` with
4 kv heads. PyTorch runs the same splits as `RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))` (the embedding), `SequenceParallel()` (the norms),
`PrepareModuleInput` to `Replicate()` (attention, MLP), `ColwiseParallel()` (q, k, v,
gate, up), `RowwiseParallel(output_layouts=Shard(1))` (o, down) and
`ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())` (lm_head), with
DTensor activations between the blocks (`use_local_output=False`), which is how its
model sees the whole sequence's length. Each side trains one warm-up step, then one
counted step (forward, backward, SGD step): every collective dispatched on rank 0,
counted as benchmarks/train_vs_fsdp2.py counts them (`CollectiveCounter`: kind, group
size, bytes this rank sends). The losses are printed beside one process's.
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
import test_hf_sp as sp  # noqa: E402  (the tiny configs and meshcomm's plan)
from hf_tp_bytes import print_sides, step  # noqa: E402  (benchmarks/, beside this)

MODELS = {"llama": {"num_key_value_heads": 4},
          "mistral": {"sliding_window": 4, "num_key_value_heads": 4}}


def torch_plan() -> dict[str, Any]:
    """PyTorch's sequence-parallel styles for the same splits as `sp.SP`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layers = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1), use_local_output=False),
        layers + "input_layernorm": SequenceParallel(),
        layers + "post_attention_layernorm": SequenceParallel(),
        "model.norm": SequenceParallel(),
        layers + "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        layers + "self_attn.[qkv]_proj": ColwiseParallel(),
        layers + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1),
                                                     use_local_output=False),
        layers + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        layers + "mlp.[gu][ap]*_proj": ColwiseParallel(),
        layers + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1),
                                                  use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def run(model: Any) -> dict[str, Any]:
    """One warm-up step, then one counted: the losses and the counted step's collectives."""
    x = sp.batch(False)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [step(model, opt, x)]
    with CollectiveCounter() as counter:
        losses.append(step(model, opt, x))
    return {"losses": losses, "comm": summarize(counter.records)}


def one_process(kind: str) -> list[float]:
    model, x = sp.build(kind, MODELS[kind]), sp.batch(False)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return [step(model, opt, x) for _ in range(2)]


def worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    out: dict[str, Any] = {}
    for kind, options in MODELS.items():
        bound = mc.init_mesh(f"tp={world}")
        model = sp.build(kind, options)
        mc.nn.parallelize(model, bound, sp.SP, axis="tp")
        out[f"{kind} meshcomm"] = run(model)
        model = sp.build(kind, options)
        parallelize_module(model, bound.device_mesh, torch_plan())
        out[f"{kind} torch"] = run(model)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    results = run_ranks(worker, args.world, timeout_s=args.timeout)[0]
    print(f"one sequence-parallel training step on tp={args.world}, rank 0 (bytes it sends)")
    print_sides(results, {kind: list(one_process(kind)) for kind in MODELS}, width=62)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
