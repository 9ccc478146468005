"""Fused projections (`colwise_fused`), per-head norms (`replicated_grad_sum`) and the plan
taken from the model (`parallelize(model, bound, "auto")`) on 4 gloo ranks, against one
process: a toy q|k|v module (nn.Linear and transformers' Conv1D, biases, grouped-query part
sizes) forward and backward in float64 on an unnamed mesh (axis "d0"), and Phi-3 (fused
`qkv_proj` with grouped-query sizes, `gate_up_proj`), GPT-2 (`c_attn`, a Conv1D; tied
embeddings) and Qwen3 (per-head `q_norm` / `k_norm`) trained 3 steps in float32, under the
model's own plan and under a hand-written one (Phi-3 also sequence parallel), with and
without fully_shard, on axis "tp"
or "mp", with transformers' activation checkpointing (GPT-2: its attention recomputed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ranks_fixture
from torch import nn

import meshcomm as mc

transformers = pytest.importorskip("transformers", reason="transformers is not installed"
                                   " (pip install -e '.[test]' installs it)")
# the one-process training loop (3 SGD steps) and the parameter gather of the other HF tests
from test_hf import full, train  # noqa: E402

BATCH, SEQ, VOCAB = 4, 8, 64          # 3 steps: test_hf.train
PHI3_PLAN = {"model.embed_tokens": "embedding",
             "model.layers.*.self_attn.qkv_proj": "colwise_fused",
             "model.layers.*.self_attn.o_proj": "rowwise",
             "model.layers.*.mlp.gate_up_proj": "colwise_fused(2)",
             "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}
_L = "model.layers.*."
# sequence parallelism: the fused projections inside sp_input blocks leave their input's
# gradient partial for the block's reduce_scatter (colwise_fused_sp)
PHI3_SP = {"model.embed_tokens": "embedding_sp", _L + "*_layernorm": "sp_params",
           "model.norm": "sp_params", _L + "self_attn": "sp_input", _L + "mlp": "sp_input",
           _L + "self_attn.qkv_proj": "colwise_fused_sp", _L + "self_attn.o_proj": "rowwise_sp",
           _L + "mlp.gate_up_proj": "colwise_fused_sp(2)", _L + "mlp.down_proj": "rowwise_sp",
           "lm_head": "colwise_gather_sp"}
GPT2_PLAN = {"transformer.h.*.attn.c_attn": "colwise_fused",
             "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
# name -> (model, mesh, plan: "auto" or a mapping, tensor-parallel axis, checkpointing)
CASES: dict[str, tuple[str, str, Any, str, bool]] = {
    "phi3 auto, tp+fsdp": ("phi3", "dp=2 tp=2", "auto", "tp", False),
    "phi3 hand-written, tp=4": ("phi3", "tp=4", PHI3_PLAN, "tp", False),
    "phi3 sequence parallel, tp=4": ("phi3", "tp=4", PHI3_SP, "tp", False),
    "gpt2 auto (tied), tp+fsdp": ("gpt2", "dp=2 tp=2", "auto", "tp", False),
    "gpt2 hand-written, tp=4, checkpointing": ("gpt2", "tp=4", GPT2_PLAN, "tp", True),
    "qwen3 auto, mp=4": ("qwen3", "mp=4", "auto", "mp", False),
}


def build(kind: str) -> Any:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                  attn_implementation="eager")
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            pad_token_id=0, bos_token_id=1, eos_token_id=1, **common))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=4, **common))
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def tokens() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


class Conv1D(nn.Module):
    """transformers' Conv1D as it is written there: weight (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(nf, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class Qkv(nn.Module):
    """q|k|v from one projection, split by sizes it reads off its output (so they are the
    local ones under tensor parallelism), then a rowwise-able output projection. nn.Linear:
    parts 16, 8, 8 (two q per k, as grouped-query attention); Conv1D: 8, 8, 8."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.conv = conv
        self.qkv = Conv1D(24, 8) if conv else nn.Linear(8, 32, dtype=torch.float64)
        self.out = nn.Linear(8 if conv else 16, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.qkv(x)
        if self.conv:
            q, k, v = parts.chunk(3, dim=-1)
            return self.out(q * torch.tanh(k) + v)
        h = parts.shape[-1] // 4
        q, k, v = parts.split([2 * h, h, h], dim=-1)
        y = q.unflatten(-1, (h, 2)) * torch.tanh(k).unsqueeze(-1) + v.unsqueeze(-1)
        return self.out(y.flatten(-2))


TOY_PLANS = {False: {"qkv": "colwise_fused(16, 8, 8)", "out": "rowwise"},
             True: {"qkv": "colwise_fused(3)", "out": "rowwise"}}


def toy_input() -> torch.Tensor:
    return torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def toy(conv: bool, bound: Any = None) -> dict[str, torch.Tensor]:
    """The toy's output, the input's gradient and the parameters' gradients (whole)."""
    model = Qkv(conv)
    if bound is not None:
        mc.nn.parallelize(model, bound, TOY_PLANS[conv], axis="d0")
    x = toy_input().requires_grad_()
    y = model(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
    assert x.grad is not None
    out = {"y": y.detach(), "x.grad": x.grad}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[f"{name}.grad"] = full(p.grad)
    return out


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unnamed = mc.init_mesh("d0=4")           # an unnamed mesh's axis: "d0"
    for conv in (False, True):
        out[f"toy conv={conv}"] = toy(conv, unnamed)
    out["styles"] = {}
    for name, (kind, mesh, plan, axis, checkpointing) in CASES.items():
        bound = mc.init_mesh(mesh)
        model = build(kind)
        mc.nn.parallelize(model, bound, plan, axis=axis)
        out["styles"][name] = {n: mc.nn.tp_style(m) for n, m in model.named_modules()
                               if mc.nn.tp_style(m) is not None}
        if "dp" in bound.mesh.axis_names:
            for block in (model.model.layers if hasattr(model, "model") else model.transformer.h):
                mc.nn.fully_shard(block, bound, axis="dp")
            mc.nn.fully_shard(model, bound, axis="dp")
            dp, n = bound.mesh.coords(rank)["dp"], bound.mesh.axis_size("dp")
        else:
            dp, n = 0, 1
        share = BATCH // n
        losses = torch.stack(train(model, tokens()[dp * share:(dp + 1) * share],
                                   checkpointing))
        torch.distributed.all_reduce(losses)
        out[name] = {"losses": (losses / world).tolist(),
                     "params": {k: full(p) for k, p in model.named_parameters()}}
    return out


four = ranks_fixture(worker, 4, timeout_s=400)


@pytest.mark.parametrize("conv", [False, True], ids=["linear 16,8,8", "conv1d 3 parts"])
def test_a_fused_projection_is_exact_forward_and_backward(four: list[dict[str, Any]],
                                                          conv: bool) -> None:
    want = toy(conv)
    for rank, got in enumerate(four):
        for key, value in want.items():
            torch.testing.assert_close(got[f"toy conv={conv}"][key], value, rtol=1e-12,
                                       atol=1e-12, msg=lambda m, k=key: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_with_fused_projections_trains_as_in_one_process(four: list[dict[str, Any]],
                                                                 name: str) -> None:
    kind, checkpointing = CASES[name][0], CASES[name][4]
    ref = build(kind)
    want = torch.stack(train(ref, tokens(), checkpointing))
    got = four[0][name]
    torch.testing.assert_close(torch.tensor(got["losses"]), want, rtol=1e-5, atol=1e-6)
    for key, p in ref.named_parameters():
        for rank in range(4):   # every rank's copy: replicated parameters did not drift
            torch.testing.assert_close(four[rank][name]["params"][key], p.detach(), rtol=1e-5,
                                       atol=1e-6, msg=lambda m, k=key: f"{name}: {k}: {m}")


def test_the_models_own_plan_gives_the_fused_and_grad_sum_styles(
        four: list[dict[str, Any]]) -> None:
    styles = four[0]["styles"]
    phi3 = styles["phi3 auto, tp+fsdp"]
    # q 8 heads x 4, k and v 4 heads x 4: grouped-query sizes; gate and up 64 each
    assert phi3["model.layers.0.self_attn.qkv_proj"] == "colwise_fused(32,16,16)"
    assert phi3["model.layers.0.mlp.gate_up_proj"] == "colwise_fused(64,64)"
    assert phi3["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["gpt2 auto (tied), tp+fsdp"]["transformer.h.1.attn.c_attn"] \
        == "colwise_fused(32,32,32)"
    qwen3 = styles["qwen3 auto, mp=4"]
    assert qwen3["model.layers.0.self_attn.q_norm"] == "replicated_grad_sum"
    assert qwen3["model.layers.0.self_attn.k_norm"] == "replicated_grad_sum"
