"""Sequence parallelism on Hugging Face models (built from configs: nothing is downloaded) with
no extra arguments: `mc.nn.parallelize` with the `*_sp` styles puts a pre-hook on the base
model (meshcomm/nn/sequence.py) that gives it the whole sequence's positions and masks, so
`model(input_ids=..., labels=...)` trains as in one process, on 4 gloo ranks:

- Llama on dp=2 tp=2 under `fully_shard`, without position_ids;
- Mistral with a sliding window (4) shorter than the sequence (16), on tp=4;
- Gemma2 (sliding and full layers: a mask per layer type; tied embeddings), on tp=4;
- Llama with a left-padded batch and its attention_mask, on dp=2 tp=2 under `fully_shard`;
- the hook adds no collective: a step without position_ids makes the same calls as one
  given the global position_ids;
- a model or a call where it cannot work raises a meshcomm error naming the fix (GPT-2, whose
  base model views its output by the whole sequence; token embeddings passed in; position_ids of one rank's share).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import ranks_fixture

import meshcomm as mc
from meshcomm.core.errors import ShapeError, StyleError
from meshcomm.executors.distributed import wire

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")

BATCH, SEQ, STEPS, VOCAB, PAD, LAYERS = 4, 16, 3, 64, 5, 2
SP = {"model.embed_tokens": "embedding_sp",
      "model.layers.*.*_layernorm": "sp_params", "model.norm": "sp_params",
      "model.layers.*.self_attn": "sp_input", "model.layers.*.self_attn.[qkv]_proj": "colwise_sp",
      "model.layers.*.self_attn.o_proj": "rowwise_sp",
      "model.layers.*.mlp": "sp_input", "model.layers.*.mlp.[gu][ap]*_proj": "colwise_sp",
      "model.layers.*.mlp.down_proj": "rowwise_sp", "lm_head": "colwise_gather_sp"}
# name -> (model, config options, mesh, padded batch)
CASES: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "llama dp=2 tp=2": ("llama", {}, "dp=2 tp=2", False),
    "mistral sliding window 4, tp=4": ("mistral", {"sliding_window": 4,
                                                   "num_key_value_heads": 4}, "tp=4", False),
    "llama padded, dp=2 tp=2": ("llama", {"pad_token_id": 0}, "dp=2 tp=2", True),
    # sliding and full layers (a mask per layer type), tied embeddings, soft-capping
    "gemma2 hybrid, sliding window 4, tp=4": ("gemma2", {
        "sliding_window": 4, "num_key_value_heads": 4, "head_dim": 8,
        "query_pre_attn_scalar": 8, "pad_token_id": 0}, "tp=4", False),
}


def build(kind: str, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[kind]
    config = config_class(**{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": SEQ, "attn_implementation": "eager", **options})
    return model_class(config)


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Token ids, their attention mask (None: no padding) and labels. A padded batch pads
    rows 0 and 2 on the left by PAD tokens (id 0, label -100), so each half of the batch (a
    dp rank's share) holds as many labels as the other."""
    x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if not padded:
        return x, None, x
    mask = torch.ones_like(x)
    mask[::2, :PAD] = 0
    x = x.masked_fill(mask == 0, 0)
    return x, mask, x.masked_fill(mask == 0, -100)


def train(model: Any, padded: bool, rows: slice = slice(None)) -> list[float]:
    x, mask, labels = (t[rows] if t is not None else None for t in batch(padded))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


def full(p: Any) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def calls(model: Any, **kwargs: Any) -> list[tuple[str, int, int]]:
    """The collectives of one forward and backward: (kind, elements in, out)."""
    x = batch(False)[0]
    with wire.recording() as heard:
        model(input_ids=x, labels=x, **kwargs).loss.backward()
    model.zero_grad()
    return [(w.kind, w.numel_in, w.numel_out) for w, _ in heard]


def errors(bound: mc.BoundMesh) -> dict[str, str]:
    """The message of each call that cannot work (every rank raises before communicating)."""
    out: dict[str, str] = {}
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4))
    try:
        mc.nn.parallelize(gpt2, bound, {"transformer.wte": "embedding_sp",
                                       "transformer.wpe": "embedding_sp",
                                       "lm_head": "colwise_gather_sp"}, axis="tp")
    except StyleError as e:
        out["gpt2"] = str(e)
    llama = build("llama", {})
    mc.nn.parallelize(llama, bound, SP, axis="tp")
    x = batch(False)[0]
    for name, kwargs in (("inputs_embeds", {"inputs_embeds": torch.zeros(BATCH, SEQ, 32)}),
                         ("local positions", {"input_ids": x,
                                              "position_ids": torch.arange(SEQ // 4)[None]})):
        try:
            llama(**kwargs)
        except ShapeError as e:
            out[name] = str(e)
    return out


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, options, mesh, padded) in CASES.items():
        bound = mc.init_mesh(mesh)
        model = build(kind, options)
        mc.nn.parallelize(model, bound, SP, axis="tp")
        rows = slice(None)
        if "dp" in bound.mesh.axis_names:
            for layer in model.model.layers:
                mc.nn.fully_shard(layer, bound, axis="dp")
            mc.nn.fully_shard(model, bound, axis="dp")
            dp, share = bound.mesh.coords(rank)["dp"], BATCH // bound.mesh.axis_size("dp")
            rows = slice(dp * share, (dp + 1) * share)
        losses = torch.tensor(train(model, padded, rows))
        torch.distributed.all_reduce(losses)
        out[name] = {"losses": (losses / world).tolist(),
                     "params": {k: full(p) for k, p in model.named_parameters()}}
        if kind == "mistral":
            out["calls"] = (calls(model), calls(model, position_ids=torch.arange(SEQ)[None]))
    out["errors"] = errors(mc.init_mesh("tp=4"))
    return out


four = ranks_fixture(worker, 4, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_hugging_face_model_trains_as_in_one_process(
        four: list[dict[str, Any]], name: str) -> None:
    kind, options, _, padded = CASES[name]
    ref = build(kind, options)
    want = train(ref, padded)
    for r in four:
        torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(want),
                                   rtol=1e-5, atol=1e-6)
        for key, p in ref.named_parameters():
            torch.testing.assert_close(r[name]["params"][key], p.detach(), rtol=1e-5,
                                       atol=1e-6, msg=lambda m, key=key: f"{name}: {key}: {m}")


def test_the_sliding_window_and_the_padding_change_the_result() -> None:
    """The cases above would pass alike without the window or the mask otherwise."""
    assert train(build("mistral", {"sliding_window": 4, "num_key_value_heads": 4}), False) \
        != train(build("mistral", {"sliding_window": None, "num_key_value_heads": 4}), False)
    x, mask, labels = batch(True)
    model = build("llama", {"pad_token_id": 0})
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=x, attention_mask=mask).logits[:, PAD:],
                                  model(input_ids=x).logits[:, PAD:])


def test_the_positions_hook_adds_no_collective(four: list[dict[str, Any]]) -> None:
    for r in four:
        without, given = r["calls"]
        assert without == given
        kinds = [kind for kind, _, _ in without]
        # L layers, each with two sp_input blocks (attention, MLP): forward, an all_gather
        # in and a reduce_scatter out of each, then lm_head's all_gather of the sequence
        # and of the vocabulary after embed_tokens' reduce_scatter; backward, each move's
        # opposite; sp_params: one all_reduce per norm (two a layer and the final one)
        counts = {"all_gather": 2 * LAYERS + 2 + 2 * LAYERS + 1,
                  "reduce_scatter": 2 * LAYERS + 1 + 2 * LAYERS + 1,
                  "all_reduce": 2 * LAYERS + 1}
        assert {k: kinds.count(k) for k in set(kinds)} == counts


def test_a_model_or_call_where_it_cannot_work_raises_a_meshcomm_error(
        four: list[dict[str, Any]]) -> None:
    got = four[0]["errors"]
    assert re.search(r"inside transformer \(GPT2Model\), whose forward views its last hidden"
                     r" state by the whole sequence's length.*nothing was split", got["gpt2"])
    assert "called without input_ids" in got["inputs_embeds"]
    assert "fix: pass input_ids" in got["inputs_embeds"]
    assert re.search(r"position_ids of shape \(1, 4\), whose last dim is not 16.*fix: pass"
                     r" position_ids for the whole sequence", got["local positions"])
    assert all(r["errors"] == got for r in four)
