"""The Hugging Face compatibility table, run: Llama, Qwen3, Mistral, Gemma2 (tied embeddings),
Phi-3 (fused `qkv_proj`, `gate_up_proj`), GPT-2 (Conv1D, fused `c_attn`, tied) and Mixtral
(experts), each built from a tiny transformers config (nothing is downloaded), trained for
3 steps on 4 gloo ranks under each mode it supports, against the same model trained in one
process: losses and final parameters equal within 1e-5 relative (float32).

Modes (the mesh of the 4 ranks, and what is applied):
- `fsdp`: `dp=4`, `fully_shard` on every block and the root;
- `tp`: `tp=4`, `parallelize` with the model's plan below, nothing else;
- `tp+fsdp`: `dp=2 tp=2`, `parallelize` over tp, then `fully_shard` over dp;
- `sp`: `tp=4`, the sequence-parallel styles (activations between blocks split over the
  sequence).

The tiny configs: 2 layers, hidden 64, 8 query heads and 4 key/value heads (grouped-query
attention that still splits over tp=4), vocabulary 64, eager attention, dropout 0; the
sequence (12) is longer than the sliding windows (8) of Mistral and Gemma2. One 4-rank job
trains every row, one after another (as tests/dist/test_hf.py does), and reports each row's
result or the meshcomm error it raised.

Data parallel convention (as FSDP2's, and tests/dist/test_hf.py's): each dp rank's loss is
the mean over its share of the batch, gradients are averaged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import outcome, ranks_fixture

import meshcomm as mc

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")
# the batch, the one-process training loop and the parameter gather of the other HF tests
from test_hf import BATCH, SEQ, VOCAB, full, tokens, train  # noqa: E402

SIZES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": SEQ, "attn_implementation": "eager",
         "bos_token_id": 1, "eos_token_id": 2}
WINDOW = 8                                 # sliding window, shorter than SEQ
RTOL = 1e-5                                # losses; parameters: per tensor, in norm


def _config(kind: str) -> Any:
    """The tiny config of model `kind`."""
    t = transformers
    if kind == "llama":
        return t.LlamaConfig(**SIZES)
    if kind == "qwen3":                     # per-head q_norm / k_norm
        return t.Qwen3Config(**SIZES, head_dim=8)
    if kind == "mistral":
        return t.MistralConfig(**SIZES, sliding_window=WINDOW)
    if kind == "gemma2":                    # tied embeddings, soft-capping, sliding layers
        return t.Gemma2Config(**SIZES, head_dim=8, query_pre_attn_scalar=8,
                              sliding_window=WINDOW, pad_token_id=0)
    if kind == "phi3":                      # fused qkv_proj and gate_up_proj
        return t.Phi3Config(**SIZES, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
    if kind == "mixtral":                   # 4 experts, top-2
        return t.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    assert kind == "gpt2", f"no tiny config for {kind!r}"
    return t.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager", bos_token_id=1, eos_token_id=2)


MODEL_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
               "gpt2": "GPT2LMHeadModel"}


def build(kind: str) -> Any:
    """Model `kind` from its tiny config, with the same weights on every call."""
    torch.manual_seed(0)
    return getattr(transformers, MODEL_CLASS[kind])(_config(kind))


def blocks(model: Any) -> list[Any]:
    return list(model.model.layers if hasattr(model, "model") else model.transformer.h)


# -- hand-written plans --------------------------------------------------------------------------
_L = "model.layers.*."
ATTENTION = {_L + "self_attn.[qkv]_proj": "colwise", _L + "self_attn.o_proj": "rowwise"}
MLP = {_L + "mlp.gate_proj": "colwise", _L + "mlp.up_proj": "colwise",
       _L + "mlp.down_proj": "rowwise"}
VOCAB_SPLIT = {"model.embed_tokens": "embedding", "lm_head": "colwise_gather"}
LLAMA_TP = {**VOCAB_SPLIT, **ATTENTION, **MLP}
# Qwen3's q_norm / k_norm run on this rank's heads only: their gradients are summed over tp
QWEN3_TP = {**LLAMA_TP, _L + "self_attn.[qk]_norm": "replicated_grad_sum"}
# Phi-3: q|k|v (grouped-query sizes, found from the config) and gate|up split part by part
PHI3_TP = {**VOCAB_SPLIT, _L + "self_attn.qkv_proj": "colwise_fused",
           _L + "self_attn.o_proj": "rowwise", _L + "mlp.gate_up_proj": "colwise_fused(2)",
           _L + "mlp.down_proj": "rowwise"}
# Mixtral: attention split; the router and experts (3-D parameters) stay replicated over
# tp, computed alike on every tp rank from the replicated block input
MIXTRAL_TP = {**VOCAB_SPLIT, **ATTENTION}
# GPT-2 (Conv1D): the fused c_attn part by part, the MLP, the tied vocabulary rows
GPT2_TP = {"transformer.wte": "embedding", "lm_head": "colwise_gather",
           "transformer.h.*.attn.c_attn": "colwise_fused",
           "transformer.h.*.attn.c_proj": "rowwise",
           "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
HAND_WRITTEN = {"llama": LLAMA_TP, "mistral": LLAMA_TP, "gemma2": LLAMA_TP, "qwen3": QWEN3_TP,
                "phi3": PHI3_TP, "mixtral": MIXTRAL_TP, "gpt2": GPT2_TP}
# sequence parallelism: every norm on the sequence-split stream sums its gradients over tp
LLAMA_SP = {"model.embed_tokens": "embedding_sp", _L + "*_layernorm": "sp_params",
            "model.norm": "sp_params", _L + "self_attn": "sp_input",
            _L + "self_attn.[qkv]_proj": "colwise_sp", _L + "self_attn.o_proj": "rowwise_sp",
            _L + "mlp": "sp_input", _L + "mlp.gate_proj": "colwise_sp",
            _L + "mlp.up_proj": "colwise_sp", _L + "mlp.down_proj": "rowwise_sp",
            "lm_head": "colwise_gather_sp"}
# Mixtral: its experts act token by token, so they run on this rank's share of the sequence
# (no gather): the router's and the experts' gradients are summed over tp, as the norms'
MIXTRAL_SP = {**{k: v for k, v in LLAMA_SP.items() if ".mlp" not in k},
              _L + "mlp.gate": "sp_params", _L + "mlp.experts": "sp_params"}
SEQUENCE_PARALLEL = {"llama": LLAMA_SP, "mistral": LLAMA_SP, "gemma2": LLAMA_SP,
                     "qwen3": {**LLAMA_SP, _L + "self_attn.[qk]_norm": "replicated_grad_sum"},
                     "mixtral": MIXTRAL_SP}
# fused projections inside an sp_input block: colwise_fused_sp leaves the input's gradient
# partial for the block's reduce_scatter (colwise_fused there is refused: summed twice)
PHI3_SP = {**{k: v for k, v in LLAMA_SP.items() if "proj" not in k},
           _L + "self_attn.qkv_proj": "colwise_fused_sp", _L + "self_attn.o_proj": "rowwise_sp",
           _L + "mlp.gate_up_proj": "colwise_fused_sp(2)", _L + "mlp.down_proj": "rowwise_sp"}
# GPT-2 cannot split its sequence: GPT2Model views its last hidden state as (-1, whole
# sequence, hidden) after ln_f, which folds a split (4, 3, 64) into (1, 12, 64). Two plans
# try, and each is refused (test_gpt2_under_sequence_parallelism_is_refused): ln_f as
# sp_input (gathering before the view) has nothing inside that leaves its gradient partial,
# so its reduce_scatter would sum a whole gradient again; ln_f as sp_params reaches the view,
# and GPT2Model is refused for it when the plan is read (sequence.WHOLE_SEQUENCE_VIEW).
_H = "transformer.h.*."
GPT2_SP_BLOCKS = {"transformer.wte": "embedding_sp", "transformer.wpe": "embedding_sp",
                  _H + "ln_[12]": "sp_params", _H + "attn": "sp_input",
                  _H + "attn.c_attn": "colwise_fused_sp", _H + "attn.c_proj": "rowwise_sp",
                  _H + "mlp": "sp_input", _H + "mlp.c_fc": "colwise_sp",
                  _H + "mlp.c_proj": "rowwise_sp"}
GPT2_SP = {"gathered after ln_f": {**GPT2_SP_BLOCKS, "transformer.ln_f": "sp_input",
                                   "lm_head": "colwise_gather"},
           "gathered at lm_head": {**GPT2_SP_BLOCKS, "transformer.ln_f": "sp_params",
                                   "lm_head": "colwise_gather_sp"}}


@dataclass(frozen=True)
class Row:
    """One row of the table: a model trained under one mode with one plan ("auto": the
    model's own, `parallelize(model, bound, "auto")`)."""

    kind: str
    mode: str                       # fsdp, tp, tp+fsdp, sp
    plan: dict[str, str] | str | None = None
    marks: tuple[Any, ...] = field(default=())

    @property
    def mesh(self) -> str:
        return {"fsdp": "dp=4", "tp": "tp=4", "tp+fsdp": "dp=2 tp=2", "sp": "tp=4"}[self.mode]


ROWS: dict[str, Row] = {}
for _kind in MODEL_CLASS:
    ROWS[f"{_kind} fsdp"] = Row(_kind, "fsdp")
for _kind, _plan in HAND_WRITTEN.items():
    ROWS[f"{_kind} tp"] = Row(_kind, "tp", _plan)
    ROWS[f"{_kind} tp+fsdp"] = Row(_kind, "tp+fsdp", _plan)
    if _kind != "mixtral":          # its plan splits the experts, which meshcomm refuses
        ROWS[f"{_kind} tp+fsdp auto"] = Row(_kind, "tp+fsdp", "auto")
for _kind, _plan in SEQUENCE_PARALLEL.items():
    ROWS[f"{_kind} sp"] = Row(_kind, "sp", _plan)
ROWS["phi3 sp"] = Row("phi3", "sp", PHI3_SP)


def run_row(row: Row, rank: int, world: int) -> dict[str, Any]:
    """Train `row` on this rank: its losses (mean over the ranks), whether the embeddings
    are still one tensor, and every parameter whole."""
    bound = mc.init_mesh(row.mesh)
    model = build(row.kind)
    if row.plan is not None:
        mc.nn.parallelize(model, bound, row.plan, axis="tp")
    x = tokens()
    if "dp" in bound.mesh.axis_names:
        for block in blocks(model):
            mc.nn.fully_shard(block, bound, axis="dp")
        mc.nn.fully_shard(model, bound, axis="dp")
        dp, n = bound.mesh.coords(rank)["dp"], bound.mesh.axis_size("dp")
        x = x[dp * (BATCH // n):(dp + 1) * (BATCH // n)]
    losses = torch.stack(train(model, x, checkpointing=False))
    torch.distributed.all_reduce(losses)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {"losses": (losses / world).tolist(), "tied": tied,
            "params": {k: full(p) for k, p in model.named_parameters()}}


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, row in ROWS.items():
        try:
            out[name] = run_row(row, rank, world)
        except Exception as err:        # every rank fails alike: the row reports it
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    # Mixtral declares its experts split over tp (packed_colwise, moe_tp_experts)
    out["mixtral auto"] = outcome(lambda: mc.nn.parallelize(build("mixtral"),
                                                            mc.init_mesh("tp=4"), "auto"))
    for how, plan in GPT2_SP.items():
        out[f"gpt2 sp, {how}"] = outcome(lambda plan=plan: run_row(Row("gpt2", "sp", plan),
                                                                   rank, world))
    return out


four = ranks_fixture(worker, 4, timeout_s=400)


@functools.cache
def one_process(kind: str) -> dict[str, Any]:
    model = build(kind)
    losses = train(model, tokens(), checkpointing=False)
    return {"losses": torch.stack(losses), "params": {k: p.detach() for k, p in
                                                      model.named_parameters()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms): one number per tensor, so that a weight
    element near zero does not make rounding look like an error."""
    got, want = got.detach(), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", [pytest.param(n, marks=r.marks) for n, r in ROWS.items()])
def test_each_row_trains_as_in_one_process(four: list[dict[str, Any]], name: str) -> None:
    """Every rank's copy: a replicated parameter that drifts on one rank fails the row."""
    want = one_process(ROWS[name].kind)
    for rank, result in enumerate(four):
        got = result[name]
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(torch.tensor(got["losses"]), want["losses"], rtol=RTOL,
                                   atol=0)
        assert got["tied"] == want["tied"]
        assert got["params"].keys() == want["params"].keys()
        errors = {key: relative_error(got["params"][key], p)
                  for key, p in want["params"].items()}
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= RTOL, \
            f"{name}, rank {rank}: {worst} is {errors[worst]:.2e} off (relative)"


def test_gpt2_under_sequence_parallelism_is_refused(four: list[dict[str, Any]]) -> None:
    """Neither way of splitting GPT-2's sequence trains silently wrong, and both are refused
    when the plan is read, before any communication: gathering after ln_f for its sp_input,
    gathering at lm_head for GPT2Model's view of its output by the whole sequence."""
    for result in four:
        after, at = result["gpt2 sp, gathered after ln_f"], result["gpt2 sp, gathered at lm_head"]
        assert after.startswith("StyleError: parallelize: transformer.ln_f (sp_input) gathers"
                                " the sequence"), after
        assert at.startswith("StyleError: parallelize: transformer.wte (embedding_sp) splits"
                             " the sequence over 'tp' inside transformer (GPT2Model), whose"
                             " forward views its last hidden state by the whole sequence's"
                             " length"), at


def test_mixtrals_own_plan_is_refused_before_anything_is_split(
        four: list[dict[str, Any]]) -> None:
    """Its declared plan splits the experts' stacked parameters, which no meshcomm style
    does: a StyleError naming the parameter and the style, the model left as it was."""
    for result in four:
        assert result["mixtral auto"].startswith("StyleError: "), result["mixtral auto"]
        assert "mlp.experts.gate_up_proj" in result["mixtral auto"]
        assert "'packed_colwise'" in result["mixtral auto"]
        assert "nothing was split" in result["mixtral auto"]
