"""One GPU, one NCCL rank: a Llama-style training step under PyTorch FSDP2 and under
`mc.nn.fully_shard`, bf16 mixed precision, side by side in one process run.

Run (on a machine with a CUDA GPU): `python benchmarks/gpu_train.py [--dim 1024]
[--layers 12] [--batch 8] [--seq 1024] [--steps 10] [--json PATH]`. On a machine without
one it says so and exits 0, so it can sit in a script that also runs elsewhere.

A world of one (NCCL, `127.0.0.1`) is what a one-GPU machine allows: NCCL refuses two
ranks on one GPU. Every collective still goes through NCCL (over a group of one), every
tensor lives on the GPU, and the step is real work, so this measures what the CPU cannot:
the wrappers' cost next to real kernels, and peak GPU memory. Configurations, each built
from the same seed (`examples/llama.py`), trained with AdamW on the same batches:

- `plain`: the model without wrapping, in bf16 autocast (the floor);
- `fsdp2`: `torch.distributed.fsdp.fully_shard` per block and on the root, with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`;
- `meshcomm`: `mc.nn.fully_shard` the same way with `MixedPrecision(bf16, fp32)`.

Per configuration: median step time over `--steps` after 3 warm-up steps (a step ends with
`torch.cuda.synchronize()`), peak GPU memory (`max_memory_allocated`), and the losses,
whose largest relative difference to FSDP2's is printed (bf16 compute: not bit-equal to
`plain`, which rounds elsewhere).

Each configuration runs in a process of its own: run one after another in one process,
the later one's peak carried about 0.75 GiB that the earlier one left allocated (whichever
ran second: FSDP2 after meshcomm showed 11.42 GiB, meshcomm after FSDP2 11.43 GiB; alone,
each peaks at 10.68-10.69 GiB on an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from llama import ModelArgs, Transformer  # noqa: E402

import meshcomm as mc  # noqa: E402


def build(args: argparse.Namespace) -> Transformer:
    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128,
                      n_kv_heads=max(1, args.dim // 512), vocab_size=args.vocab,
                      max_seq_len=args.seq, seed=0)
    return Transformer(margs).cuda()


def wrap(model: Transformer, how: str) -> Transformer:
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dm = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=dm, mp_policy=policy)
        fully_shard(model, mesh=dm, mp_policy=policy)
    elif how == "meshcomm":
        bound = mc.init_mesh("dp=1")
        policy_mc = mc.nn.MixedPrecision(torch.bfloat16, torch.float32)
        for block in model.layers:
            mc.nn.fully_shard(block, bound, mp_policy=policy_mc)
        mc.nn.fully_shard(model, bound, mp_policy=policy_mc)
    return model


def train(how: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = wrap(build(args), how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda",
                             generator=g) for _ in range(3 + args.steps)]
    losses, times = [], []

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16, enabled=how == "plain"):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i, tokens in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(tokens)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {"step_s": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated(),
           "losses": losses}
    if args.profile:     # one more step under the profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(batches[-1])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18,
                                          max_name_column_width=50)
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=50)
        out["profile"] = f"{how}: by GPU time\n{table}\n{how}: by CPU time\n{cpu}"
        print(out["profile"], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--configs", default="plain,fsdp2,meshcomm", help="of plain, fsdp2 and"
                   " meshcomm (fsdp2 is the reference: keep it)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables of"
                   " one more step of each configuration")
    p.add_argument("--rows-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_train: no CUDA device here; nothing measured")
        return 0
    if args.rows_json is not None:     # one configuration, in this process (see the doc)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        rows = {how: train(how, args) for how in args.configs.split(",")}
        dist.destroy_process_group()
        args.rows_json.write_text(json.dumps(rows))
        return 0
    rows = {how: _in_own_process(how, argv or sys.argv[1:]) for how in args.configs.split(",")}
    for r in rows.values():
        r.pop("profile", None)
    ref = rows["fsdp2"]["losses"]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; dim {args.dim},"
          f" {args.layers} layers, batch {args.batch} x seq {args.seq}, bf16")
    print("| config | step | peak GPU memory | vs FSDP2 step | largest loss difference to FSDP2 |")
    print("|---|---|---|---|---|")
    for how, r in rows.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        print(f"| {how} | {r['step_s'] * 1e3:.1f} ms | {r['peak_bytes'] / 2**30:.2f} GiB"
              f" | {r['step_s'] / rows['fsdp2']['step_s']:.3f}x | {diff:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "device": torch.cuda.get_device_name(0),
                                         "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


def _in_own_process(how: str, argv: list[str]) -> dict[str, Any]:
    """`train(how, ...)` in a new process; its row (so no configuration inherits memory)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        rest, skip = [], False
        for a in argv:                     # every argument but --configs (and its value)
            if skip or a.startswith("--configs"):
                skip = a == "--configs" and not skip
                continue
            rest.append(a)
        done = subprocess.run([sys.executable, __file__, *rest, "--configs", how,
                               "--rows-json", str(out)], timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"gpu_train: configuration {how} failed ({done.returncode})")
        row: dict[str, Any] = json.loads(out.read_text())[how]
        return row


if __name__ == "__main__":
    sys.exit(main())
