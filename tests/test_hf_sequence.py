"""The positions hook of sequence parallelism on Hugging Face models (meshcomm/nn/sequence.py),
in one process, on whole sequences: the positions and masks it gives a base model are the
ones the model builds itself, so its logits are unchanged bit for bit, for causal, padded,
sliding-window and per-layer-type (Gemma2, Qwen3) masks, eager and sdpa; and the models and
calls it cannot serve are refused with the fix. tests/dist/test_hf_sp.py trains with it on a
split sequence."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from meshcomm.core.errors import ShapeError, StyleError
from meshcomm.nn.sequence import install_sequence_hooks, sequence_hooks

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")

SEQ, VOCAB = 16, 64
# name -> (config, model, options)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama eager": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama sdpa": ("LlamaConfig", "LlamaForCausalLM", {"attn_implementation": "sdpa"}),
    "mistral sliding window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "gemma2 hybrid": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4, "head_dim": 8}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1,
                                                "bos_token_id": 1}),
}


def build(name: str) -> Any:
    config, model, options = MODELS[name]
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": SEQ, "attn_implementation": "eager", **options}))


def hooked(model: Any, plan: dict[str, str] | None = None) -> Any:
    install_sequence_hooks(sequence_hooks(model, plan or {"model.embed_tokens": "embedding_sp"},
                                          "tp"))
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :5] = 0                    # row 0 left-padded
    return x, mask


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_hook_gives_the_masks_and_positions_the_model_builds(name: str,
                                                                 padded: bool) -> None:
    x, mask = inputs()
    kwargs = {"input_ids": x, "attention_mask": mask if padded else None}
    with torch.no_grad():
        want = build(name)(**kwargs).logits
        got = hooked(build(name))(**kwargs).logits
    assert torch.equal(got, want)


def test_the_hook_fills_global_positions_and_masks() -> None:
    model = hooked(build("mistral sliding window"))
    seen: dict[str, Any] = {}
    model.model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    model(input_ids=inputs()[0])
    assert torch.equal(seen["position_ids"], torch.arange(SEQ)[None])
    allowed = seen["attention_mask"][0, 0] == 0          # eager: 0 where a key is visible
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    assert torch.equal(allowed, (k <= q) & (k > q - 4))


def test_a_model_where_it_cannot_work_is_refused() -> None:
    llama = build("llama eager")
    llama.model.extra = torch.nn.Embedding(SEQ, 32)     # e.g. learned positions, added
    msg = ("parallelize: model.embed_tokens (embedding_sp) splits the sequence over 'tp' inside"
           " model (LlamaModel), but model.extra (an nn.Embedding beside it, e.g. positions or"
           " token types) would look up the whole sequence and the model adds the two. fix:"
           " give model.extra 'embedding_sp' too")
    with pytest.raises(StyleError, match=re.escape(msg)):
        hooked(llama)
    assert hooked(llama, {"model.embed_tokens": "embedding_sp", "model.extra": "embedding_sp"})


@pytest.mark.parametrize("plan", [{"transformer.wte": "embedding_sp"},
                                  {"transformer.wte": "embedding_sp",
                                   "transformer.wpe": "embedding_sp"}])
def test_gpt2_is_refused_before_any_communication(plan: dict[str, str]) -> None:
    """GPT2Model views its last hidden state by the whole sequence after ln_f, folding the
    rows' shares together: refused when the plan is read, not after a forward's
    collectives."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4))
    msg = ("parallelize: transformer.wte (embedding_sp) splits the sequence over 'tp' inside"
           " transformer (GPT2Model), whose forward views its last hidden state by the whole"
           " sequence's length after its final norm (GPT2Model: .view(-1, whole sequence,"
           " hidden)), which would fold this rank's share of several rows into one; nothing"
           " was split. fix: use 'embedding' and the styles without _sp for this model")
    with pytest.raises(StyleError, match=re.escape(msg)):
        hooked(gpt2, plan)


def test_a_call_where_it_cannot_work_raises_before_the_model_runs() -> None:
    model = hooked(build("llama eager"))
    x, mask = inputs()
    with pytest.raises(ShapeError, match=re.escape(
            "parallelize: model (LlamaModel) was called without input_ids, but its token"
            " embedding model.embed_tokens (embedding_sp) is where the sequence is split;"
            " passed embeddings would run whole. fix: pass input_ids, or parallelize the"
            " model with 'embedding'")):
        model(inputs_embeds=torch.zeros(2, SEQ, 32))
    with pytest.raises(ShapeError, match=re.escape(
            "parallelize: model got attention_mask of shape (2, 8), whose last dim is not 16;"
            " input_ids hold 16 tokens, the whole sequence, which model.embed_tokens"
            " (embedding_sp) splits. fix: pass attention_mask for the whole sequence, as in"
            " one process (or none)")):
        model(input_ids=x, attention_mask=mask[:, :8])


def test_other_models_get_no_hook() -> None:
    plain = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 8))
    assert sequence_hooks(plain, {"0": "embedding_sp"}, "tp") == []
    assert sequence_hooks(build("llama eager"), {"model.embed_tokens": "embedding"}, "tp") == []
