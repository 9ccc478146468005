"""Every runtime path on the meta device, standing in for a GPU: one process acts as rank 3 of
an 8-rank job (torch's fake process group) and runs every plan kind through `mc.reshard`,
and the Llama example under `parallelize` + `fully_shard` (+ sequence parallelism, mixed
precision, HSDP) with the vocabulary-parallel loss, forward and backward, on meta tensors.

A tensor a runtime path makes without `device=` is a CPU tensor, and mixing it with a meta
tensor raises, as mixing a CPU tensor with a CUDA one does; a host sync (`.item()`,
`.tolist()`) on a meta tensor raises too. (FakeTensorMode "cuda" tensors cannot be copied in
a CPU-only torch build, so meta is the stand-in.) The work runs in a fresh interpreter: the
fake process group is process-wide.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from conftest import in_fresh_interpreter

ROOT = Path(__file__).resolve().parents[1]
MESH = "dp=2 tp=4"
LLAMA_MESH = "dp=4 tp=2"
# (shape, src, dst) on dp=2 tp=4: together every step kind and local action
CASES = [
    ((8, 16), "(dp a) (tp b)", "a b"),                       # all_gather
    ((8, 16), "(dp a) (tp b)", "(tp a) (dp b)"),             # send_recv
    ((8, 16), "a b | sum(tp)", "(tp a) b"),                  # slice, reduce_scatter, all_gather
    ((8, 16), "a b | sum(tp)", "a b"),                       # reducing send_recv, all_gather
    ((8, 16), "(dp a) b | sum(tp)", "(dp a) b"),             # all_reduce
    ((8, 16), "(dp a) (tp b)", "(dp tp a) b"),               # all_to_all
    ((8, 16), "(dp tp a) b", "(tp dp a) b"),                 # collective_permute
    ((7, 16), "(dp tp a) b", "(tp dp a) b"),                 # send_recv, uneven
    ((8, 16), "a b", "(dp a) b | sum(tp)"),                  # local reindex
    ((8, 16), "(dp a) b | max(tp)", "a (dp b)"),             # all_to_all + all_reduce(max)
    ((5, 16), "(dp tp a) b", "a (tp b)"),                    # uneven all_gather, empty shard
    ((5, 3), "(tp a) b | max(dp)", "(dp a) b"),              # send_recv tree
    ((3,), "a | avg(tp)", "(tp dp a)"),                      # tree, empty shards
]


def worker() -> dict[str, Any]:
    """Runs in a fresh interpreter; returns the kinds run and the problems found."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import meshcomm as mc

    sys.path.insert(0, str(ROOT / "examples"))
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    bound = mc.init_mesh(MESH, backend="fake")
    problems, kinds = [], set()
    for shape, src, dst in CASES:
        where = f'{shape} "{src}" -> "{dst}"'
        x = torch.empty(mc.Layout(src).local_shape(bound.mesh, shape, 3), device="meta")
        try:
            y = mc.reshard(x, bound, src, dst, shape=shape)
        except Exception as exc:      # noqa: BLE001 - reported as data to the test
            problems.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        p = mc.plan(bound.mesh, shape, src, dst)
        kinds |= {s.action if s.kind == "local" else s.kind for s in p.steps}
        want = mc.Layout(dst).local_shape(bound.mesh, shape, 3)
        if y.device.type != "meta" or tuple(y.shape) != want:
            problems.append(f"{where}: got {y.device} {tuple(y.shape)}, want meta {want}")
    bound = mc.init_mesh(LLAMA_MESH, backend="fake")     # 2 kv heads: tp=2
    for name, run in (("tp+fsdp", lambda: llama(bound, sp=False, mp=False, hsdp=False)),
                      ("sp+fsdp", lambda: llama(bound, sp=True, mp=False, hsdp=False)),
                      ("tp+fsdp bf16", lambda: llama(bound, sp=False, mp=True, hsdp=False)),
                      ("hsdp", lambda: llama(bound, sp=False, mp=False, hsdp=True))):
        try:
            problems += [f"{name}: {p}" for p in run()]
        except Exception as exc:      # noqa: BLE001
            import traceback
            problems.append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return {"kinds": sorted(kinds), "problems": problems}


def llama(bound: Any, *, sp: bool, mp: bool, hsdp: bool) -> list[str]:
    """One training step of the Llama example on meta: every gradient a meta tensor."""
    import torch
    from llama import Transformer
    from train_llama import PLAN, SP_PLAN, model_args

    import meshcomm as mc

    with torch.device("meta"):
        model = Transformer(model_args(251))
    policy = mc.nn.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    if hsdp:     # shard over tp, replicate over dp: no tensor parallelism
        kwargs: dict[str, Any] = {"axis": "tp", "replicate": "dp"}
    else:
        mc.nn.parallelize(model, bound, SP_PLAN if sp else PLAN, axis="tp")
        kwargs = {"axis": "dp"}
    for block in model.layers:
        mc.nn.fully_shard(block, bound, mp_policy=policy, **kwargs)
    mc.nn.fully_shard(model, bound, mp_policy=policy, **kwargs)
    tokens = torch.zeros(2, 17, dtype=torch.long, device="meta")
    logits = model(tokens[:, :-1])
    if sp or hsdp:
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
    else:
        loss = mc.nn.vocab_parallel_cross_entropy(logits, tokens[:, 1:], bound, "tp",
                                                  vocab_size=251)
    loss.backward()
    problems = []
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad is None or grad.device.type != "meta":
            problems.append(f"{name}: gradient {None if grad is None else grad.device}")
    return problems


def test_every_plan_kind_and_training_block_runs_on_meta() -> None:
    report = in_fresh_interpreter("test_meta_device", "worker")
    assert not report["problems"], "\n".join(report["problems"])
    assert set(report["kinds"]) >= {"all_gather", "all_to_all", "reduce_scatter", "all_reduce",
                                    "collective_permute", "send_recv", "slice", "reindex"}
