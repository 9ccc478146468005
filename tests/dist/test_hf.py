"""Hugging Face transformers models (built from configs: nothing is downloaded) trained under
meshcomm on 4 gloo ranks, against the same model trained in one process: tiny Llama
(grouped-query attention) and GPT-2 (transformers' Conv1D, tied embeddings by default),
under `fully_shard`, `parallelize` + `fully_shard`, tied weights, a padding row and gradient
checkpointing. Skipped where transformers is not installed (it is in the `test` extra).

Data parallel convention (as FSDP2's): each data-parallel rank's loss is the mean over its
share of the batch, gradients are averaged, so training equals one process on the batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ranks_fixture

import meshcomm as mc

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")

BATCH, SEQ, STEPS, VOCAB = 4, 12, 3, 64
LLAMA_TP = {"model.embed_tokens": "embedding",
            "model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}
GPT2_TP = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
# name -> (model, config options, mesh, tensor-parallel plan or None, gradient checkpointing)
CASES: dict[str, tuple[str, dict[str, Any], str, dict[str, str] | None, bool]] = {
    "llama fsdp": ("llama", {}, "dp=4", None, False),
    "llama tied, padding row, tp+fsdp": ("llama", {"tie_word_embeddings": True,
                                                   "pad_token_id": 0}, "dp=2 tp=2",
                                         LLAMA_TP, False),
    "llama gradient checkpointing": ("llama", {}, "dp=4", None, True),
    "gpt2 tied, fsdp": ("gpt2", {}, "dp=4", None, False),
    "gpt2 conv1d tp+fsdp, checkpointing": ("gpt2", {}, "dp=2 tp=2", GPT2_TP, True),
}


def build(kind: str, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    if kind in ("llama", "qwen2"):        # qwen2: llama's shape with q, k, v biases
        config_class, model_class = ((transformers.LlamaConfig, transformers.LlamaForCausalLM)
                                     if kind == "llama" else
                                     (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
        config = config_class(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attn_implementation="eager", **options)
        return model_class(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="eager", **options)
    return transformers.GPT2LMHeadModel(config)


def blocks(model: Any) -> list[Any]:
    return list(model.model.layers if hasattr(model, "model") else model.transformer.h)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    x[:, -3:] = 0          # padding tokens (row 0 of the embedding) in every sequence
    return x


def train(model: Any, x: torch.Tensor, checkpointing: bool = False) -> list[torch.Tensor]:
    model.train()
    if checkpointing:      # transformers 5.x renamed gradient_checkpointing_enable
        getattr(model, "activation_checkpointing_enable",
                getattr(model, "gradient_checkpointing_enable", None))()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def full(p: Any) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, options, mesh, plan, checkpointing) in CASES.items():
        bound = mc.init_mesh(mesh)
        model = build(kind, options)
        if plan is not None:
            mc.nn.parallelize(model, bound, plan, axis="tp")
        for block in blocks(model):
            mc.nn.fully_shard(block, bound, axis="dp")
        mc.nn.fully_shard(model, bound, axis="dp")
        dp, n = bound.mesh.coords(rank)["dp"], bound.mesh.axis_size("dp")
        share = BATCH // n
        losses = torch.stack(train(model, tokens()[dp * share:(dp + 1) * share], checkpointing))
        torch.distributed.all_reduce(losses)
        tied = (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
        out[name] = {"losses": (losses / world).tolist(), "tied": tied,
                     "params": {k: full(p) for k, p in model.named_parameters()}}
    return out


four = ranks_fixture(worker, 4, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_a_hugging_face_model_trains_as_in_one_process(four: list[dict[str, Any]],
                                                       name: str) -> None:
    kind, options, _, _, checkpointing = CASES[name]
    ref = build(kind, options)
    want = torch.stack(train(ref, tokens(), checkpointing))
    got = four[0][name]
    torch.testing.assert_close(torch.tensor(got["losses"]), want, rtol=2e-5, atol=1e-6)
    assert got["tied"] == (ref.get_output_embeddings().weight
                           is ref.get_input_embeddings().weight)
    for key, p in ref.named_parameters():
        torch.testing.assert_close(got["params"][key], p.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{name}: {key}: {m}")
