"""A Hugging Face Llama and a Qwen2 (built from configs: GQA, rotary positions; Qwen2's q, k,
v projections with biases) trained under context parallelism on 4 gloo ranks (`dp=2 cp=2`: batch over dp, sequence over cp, parameters
`fully_shard(axis="dp", replicate="cp")`), against the same model trained in one process:
losses and final parameters equal, for each case (the ring and Qwen2's Ulysses on a zigzag
split, moved there from the loader's contiguous one by `mc.reshard`). Token ids, position ids and the
labels (shifted before the split) follow one layout; the attention layers run
`mc.nn.attention` through transformers' attention registry (`register_hf_attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ranks_fixture

import meshcomm as mc
from meshcomm.executors.sim import scatter

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")
# the model, batch sizes and one-process training of the data-parallel Hugging Face tests
from test_hf import BATCH, SEQ, STEPS, VOCAB, build, train  # noqa: E402

TOKENS = "(dp b) (cp s)"                   # the loader's layout: ids, positions, labels
# (strategy, the sequence's split): a zigzag split is reached from the loader's with one
# planned reshard per tensor, the same plan for ids, positions and labels
# name -> (model, strategy, split)
CASES = {"allgather": ("llama", "allgather", "(cp s)"),
         "ulysses": ("llama", "ulysses", "(cp s)"),
         "ring": ("llama", "ring", "zigzag(cp s)"),
         "qwen2 ulysses zigzag": ("qwen2", "ulysses", "zigzag(cp s)")}
STRATEGIES = tuple(CASES)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next-token labels (-100 where there is none), shifted whole."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(x, -100)
    labels[:, :-1] = x[:, 1:]
    return x, labels


@functools.cache
def one_process(kind: str = "llama") -> dict[str, Any]:
    model = build(kind, {})
    losses = train(model, batch()[0], checkpointing=False)
    return {"losses": [loss.item() for loss in losses],
            "params": {n: p.detach() for n, p in model.named_parameters()}}


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 cp=2")
    mesh = bound.mesh
    x, labels = batch()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mine = [scatter(t, mesh, TOKENS)[rank] for t in (x, labels, positions)]
    count = int((labels != -100).sum())          # every rank knows the global count
    out: dict[str, Any] = {}
    for name, (kind, strategy, split) in CASES.items():
        ids, targets, pos = (mc.reshard(t, bound, TOKENS, f"(dp b) {split}",
                                        shape=(BATCH, SEQ)) for t in mine)
        model = build(kind, {})
        model.set_attn_implementation(mc.nn.register_hf_attention(
            bound, f"(dp b) h {split} d", name=f"meshcomm_{strategy}_{kind}",
            strategy=strategy))
        for layer in model.model.layers:
            mc.nn.fully_shard(layer, bound, axis="dp", replicate="cp")
        mc.nn.fully_shard(model, bound, axis="dp", replicate="cp")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(STEPS):
            logits = model(input_ids=ids, position_ids=pos).logits
            # this rank's share of the global mean; the units average over the 4 ranks
            total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                    ignore_index=-100, reduction="sum")
            loss = total * world / count
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(mc.reshard((total / count).detach().reshape(1), bound,
                                     "a | sum(dp, cp)", "a").item())
        out[name] = {"losses": losses,
                         "params": {n: p.detach().full_tensor()
                                    for n, p in model.named_parameters()}}
    return out


four = ranks_fixture(four_ranks, 4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_models_under_cp_train_as_one_process(strategy: str, four: list[Any]) -> None:
    want = one_process(CASES[strategy][0])
    for r in four:
        got = r[strategy]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-4, atol=1e-5,
                                       msg=f"{strategy} {name}")
