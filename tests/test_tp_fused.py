"""Fused projections and plans from the model, without processes: `parse_style`'s table and
errors, `FusedRows` (which rows each rank holds), `fused_parts` on GPT-2 and Phi-3,
`tp_plan_of` on the models transformers 5.x declares plans for (and its refusals), and
`parallelize`'s refusals before anything is split (on torch's fake process group, in a
fresh interpreter). The gloo runs are tests/dist/test_hf_fused.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import in_fresh_interpreter

import meshcomm as mc
from meshcomm.errors import StyleError
from meshcomm.nn.hf_plan import LocalSizes, fused_parts, unknown_fused
from meshcomm.nn.parallel import FusedRows, parse_style

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=8, num_key_value_heads=4)


class OwnMLP(torch.nn.Module):
    """An MLP meshcomm has never read, with a module named as transformers names a fused
    gate and up projection: its layout is not guessed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(32, 128, bias=False)
        self.down_proj = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x)[..., ::2])   # interleaved, not halves


def model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "own mlp":
        return torch.nn.Sequential(OwnMLP())
    if kind == "codegen":     # qkv_proj interleaves q, v, k by groups: not q | k | v
        return transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
            vocab_size=64, n_positions=8, n_ctx=8, n_embd=32, n_layer=1, n_head=4,
            rotary_dim=4, bos_token_id=1, eos_token_id=1))
    if kind == "phi3 attention without config":   # its code reads self.config
        phi3 = model("phi3")
        del phi3.model.layers[0].self_attn.config
        return phi3
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=8, n_embd=32, n_layer=1, n_head=4))
    config, cls = {
        "phi3": (lambda: transformers.Phi3Config(pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=1, **COMMON),
                 transformers.Phi3ForCausalLM),
        "qwen3": (lambda: transformers.Qwen3Config(head_dim=4, **COMMON),
                  transformers.Qwen3ForCausalLM),
        "llama": (lambda: transformers.LlamaConfig(**COMMON), transformers.LlamaForCausalLM),
        "mistral": (lambda: transformers.MistralConfig(**COMMON),
                    transformers.MistralForCausalLM),
        "gemma2": (lambda: transformers.Gemma2Config(head_dim=4, **COMMON),
                   transformers.Gemma2ForCausalLM),
        "mixtral": (lambda: transformers.MixtralConfig(**COMMON),
                    transformers.MixtralForCausalLM),
    }[kind]
    return cls(config())


@pytest.mark.parametrize(("text", "want"), [
    ("colwise", ("colwise", ())),
    ("colwise_fused", ("colwise_fused", ())),
    ("colwise_fused(3)", ("colwise_fused", (3,))),
    ("colwise_fused(64, 16, 16)", ("colwise_fused", (64, 16, 16))),
    ("replicated_grad_sum", ("replicated_grad_sum", ())),
])
def test_a_style_text_reads_as_its_name_and_numbers(text: str,
                                                    want: tuple[str, tuple[int, ...]]) -> None:
    assert parse_style(text) == want


@pytest.mark.parametrize(("text", "message"), [
    ("colwise_fusd", "parallelize: style 'colwise_fusd' is not one of"),
    ("colwise(2)", "parallelize: cannot read style 'colwise(2)': only 'colwise_fused' takes"
                   " numbers"),
    ("colwise_fused(a, b)", "parallelize: cannot read style 'colwise_fused(a, b)'"),
    ("colwise_fused(3", "parallelize: cannot read style 'colwise_fused(3'"),
])
def test_a_bad_style_text_is_refused_with_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(StyleError, match=re.escape(message)):
        parse_style(text)


def test_a_bad_style_names_the_pattern_it_was_given_for() -> None:
    with pytest.raises(StyleError, match=re.escape(
            "parallelize: cannot read style 'colwise(2)' for 'layers.*.up': only")):
        parse_style("colwise(2)", "layers.*.up")


def test_the_new_styles_are_in_STYLES() -> None:
    fused, grad_sum = mc.nn.STYLES["colwise_fused"], mc.nn.STYLES["replicated_grad_sum"]
    assert fused.fused and fused.grad_sum and fused.outputs == "split"
    assert fused.kind is torch.nn.Linear and fused.split is None     # the weight stays whole
    assert grad_sum == mc.nn.STYLES["sp_params"]                     # one mechanism, two names
    fused_sp = mc.nn.STYLES["colwise_fused_sp"]
    assert fused_sp.fused and fused_sp.grad_sum and fused_sp.inputs == "local"   # as colwise_sp
    assert {n for n, s in mc.nn.STYLES.items() if s.fused} == {"colwise_fused",
                                                                "colwise_fused_sp"}


def test_fused_rows_give_each_rank_a_slice_of_every_part() -> None:
    rows = FusedRows((8, 4, 4), 4)
    assert [rows.rows(i) for i in range(4)] == [((0, 2), (8, 9), (12, 13)),
                                                ((2, 4), (9, 10), (13, 14)),
                                                ((4, 6), (10, 11), (14, 15)),
                                                ((6, 8), (11, 12), (15, 16))]
    w = torch.arange(16.0).view(16, 1).expand(16, 3)
    assert rows.take(w, 0, 1)[:, 0].tolist() == [2, 3, 9, 13]
    assert rows.take(w.t(), 1, 3)[0].tolist() == [6, 7, 11, 15]   # a Conv1D's weight
    # every row is held by exactly one rank
    held = sorted(r for i in range(4) for a, b in rows.rows(i) for r in range(a, b))
    assert held == list(range(16))
    assert str(rows) == "colwise_fused(8,4,4)"


def test_fused_rows_offer_what_docs_api_describes() -> None:
    """rows, take and the style text: nothing that only tests would call."""
    assert sorted(n for n in vars(FusedRows) if not n.startswith("_")) == ["rows", "take"]


def test_fused_parts_come_from_the_model() -> None:
    phi3 = model("phi3")
    qkv = fused_parts(phi3, "model.layers.0.self_attn.qkv_proj",
                      phi3.model.layers[0].self_attn.qkv_proj)
    assert qkv is not None and qkv.parts == (32, 16, 16)   # 8 q heads, 4 kv heads, size 4
    assert qkv.owner == "model.layers.0.self_attn"
    assert dict(qkv.attrs) == {"config.num_attention_heads": 8, "num_key_value_heads": 4}
    up = fused_parts(phi3, "model.layers.0.mlp.gate_up_proj", phi3.model.layers[0].mlp.gate_up_proj)
    assert up is not None and up.parts == (64, 64) and not up.attrs
    gpt2 = model("gpt2")
    c_attn = fused_parts(gpt2, "transformer.h.0.attn.c_attn", gpt2.transformer.h[0].attn.c_attn)
    assert c_attn is not None and c_attn.parts == (32, 32, 32)
    assert dict(c_attn.attrs)["split_size"] == 32
    class Phi3Own(type(phi3.model.layers[0].mlp)):      # a subclass is its base
        pass
    phi3.model.layers[0].mlp.__class__ = Phi3Own
    assert fused_parts(phi3, "model.layers.0.mlp.gate_up_proj",
                       phi3.model.layers[0].mlp.gate_up_proj) == up
    llama = model("llama")
    assert fused_parts(llama, "model.layers.0.self_attn.q_proj",
                       llama.model.layers[0].self_attn.q_proj) is None
    assert fused_parts(gpt2, "transformer.h.0.mlp.c_fc", gpt2.transformer.h[0].mlp.c_fc) is None


def test_a_fused_name_under_an_owner_meshcomm_has_not_read_gets_no_parts() -> None:
    """The name alone is not a layout: CodeGen's qkv_proj is q, v, k interleaved by groups,
    and an MLP of one's own may interleave gate and up."""
    codegen = model("codegen")
    name = "transformer.h.0.attn.qkv_proj"
    assert fused_parts(codegen, name, codegen.get_submodule(name)) is None
    assert unknown_fused(codegen, name) == "CodeGenAttention"
    own = model("own mlp")
    assert fused_parts(own, "0.gate_up_proj", own[0].gate_up_proj) is None
    assert unknown_fused(own, "0.gate_up_proj") == "OwnMLP"
    phi3 = model("phi3")
    assert unknown_fused(phi3, "model.layers.0.mlp.gate_up_proj") is None
    assert unknown_fused(phi3, "model.layers.0.mlp.down_proj") is None


def test_local_sizes_hold_while_the_owner_runs_and_never_touch_the_shared_config() -> None:
    phi3 = model("phi3")
    attn = phi3.model.layers[0].self_attn
    seen = []
    local = LocalSizes(attn, (("config.num_attention_heads", 8), ("num_key_value_heads", 4)), 4)
    local.pre(attn, ())
    seen.append((attn.config.num_attention_heads, attn.num_key_value_heads))
    assert attn.config is not phi3.config and phi3.config.num_attention_heads == 8
    assert isinstance(attn.config, type(phi3.config))
    assert attn.config.hidden_size == phi3.config.hidden_size
    local.post(attn, (), None)
    seen.append((attn.config.num_attention_heads, attn.num_key_value_heads))
    assert seen == [(2, 1), (8, 4)] and attn.config is phi3.config
    local.pre(attn, ())            # a forward that never reached post (it raised) ...
    local.pre(attn, ())            # ... is undone by the next one first
    local.post(attn, (), None)
    assert (attn.config, attn.num_key_value_heads) == (phi3.config, 4)


def test_a_local_size_reads_the_same_under_every_name_the_config_maps() -> None:
    """GPT-2 stores heads as `n_head` and maps `num_attention_heads` to it: a local size
    given under either name reads under both, and the shared config keeps its own."""
    from transformers import GPT2Config

    from meshcomm.nn.hf_plan import config_view

    shared = GPT2Config(n_head=8, n_embd=64)
    for given in ("n_head", "num_attention_heads"):
        view = config_view(shared, {given: 2})
        assert (view.n_head, view.num_attention_heads) == (2, 2), given
        assert view.n_embd == view.hidden_size == 64 and isinstance(view, GPT2Config)
    assert (shared.n_head, shared.num_attention_heads) == (8, 8)
    both = config_view(shared, {"n_head": 2, "num_attention_heads": 3})   # each as given
    assert (both.n_head, both.num_attention_heads) == (2, 3)


def test_local_sizes_copy_nothing_per_forward_and_see_later_config_changes() -> None:
    """The config a running owner sees is made once, when it is wrapped: every forward gets
    the same one, and a change to the shared config after that shows through it."""
    phi3 = model("phi3")
    attn = phi3.model.layers[0].self_attn
    local = LocalSizes(attn, (("config.num_attention_heads", 8),), 4)
    views = []
    for implementation in ("eager", "sdpa"):
        phi3.config._attn_implementation = implementation
        local.pre(attn, ())
        views.append(attn.config)
        assert (attn.config._attn_implementation, attn.config.num_attention_heads) == \
            (implementation, 2)
        local.post(attn, (), None)
    assert views[0] is views[1]
    assert phi3.config.num_attention_heads == 8


def test_a_fused_forward_does_not_work_out_its_rows_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Which rows of every part this rank takes is worked out once, when the module is
    wrapped; a forward only narrows and concatenates."""
    from meshcomm.nn.parallel import _TP

    bound = mc.nn.planning_mesh("tp=4")
    layer = torch.nn.Linear(4, 16)
    tp = _TP(layer, "qkv", "colwise_fused", bound, "tp", FusedRows((8, 4, 4), 4))
    asked: list[int] = []
    rows = FusedRows.rows
    monkeypatch.setattr(FusedRows, "rows", lambda self, i: asked.append(i) or rows(self, i))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            args, kwargs = tp.pre(layer, (x,), {})
            out = tp.post(layer, args, layer.forward(*args, **kwargs))
            assert out is not None
    assert asked == []
    assert out.shape == (2, 4)
    want = layer(x)                              # whole: rank 0's rows 0-1, 8, 12
    assert torch.equal(out, want[:, [0, 1, 8, 12]])


def test_the_plan_of_phi3_splits_its_fused_projections_part_by_part() -> None:
    plan = mc.nn.tp_plan_of(model("phi3"))
    assert plan == {"lm_head": "colwise_gather", "model.embed_tokens": "embedding",
                    "model.layers.*.self_attn.qkv_proj": "colwise_fused",
                    "model.layers.*.self_attn.o_proj": "rowwise",
                    "model.layers.*.mlp.gate_up_proj": "colwise_fused",
                    "model.layers.*.mlp.down_proj": "rowwise"}


def test_the_plan_of_qwen3_sums_its_per_head_norms() -> None:
    plan = mc.nn.tp_plan_of(model("qwen3"))
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_grad_sum"
    assert plan["model.layers.*.self_attn.k_norm"] == "replicated_grad_sum"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_the_plan_of_a_plain_model_is_its_own_in_meshcomm_names(kind: str) -> None:
    m = model(kind)
    plan = mc.nn.tp_plan_of(m)
    assert plan["model.embed_tokens"] == "embedding" and plan["lm_head"] == "colwise_gather"
    for pattern, style in m.tp_plan.items():
        if style in ("colwise", "rowwise"):
            assert plan[pattern] == style
    assert set(plan) == set(m.tp_plan)


def test_gpt2_declares_no_plan_so_meshcomm_gives_its_own() -> None:
    plan = mc.nn.tp_plan_of(model("gpt2"))
    assert plan["transformer.h.*.attn.c_attn"] == "colwise_fused"
    assert plan["transformer.h.*.mlp.c_fc"] == "colwise"
    assert plan["transformer.wte"] == "embedding"


def test_an_entry_with_no_meshcomm_style_is_refused_naming_module_and_style() -> None:
    with pytest.raises(StyleError, match=re.escape(
            "parallelize: the model's plan gives the parameter"
            " model.layers.0.mlp.experts.gate_up_proj ('model.layers.*.mlp.experts.gate_up_proj')"
            " the style 'packed_colwise' (a packed (stacked) weight parameter split part by"
            " part), which has no meshcomm style; nothing was split.")):
        mc.nn.tp_plan_of(model("mixtral"))


class Declared(torch.nn.Module):
    """A model that declares a plan in transformers' names: a gathered colwise layer that is
    not fused, then a rowwise layer that splits its replicated input itself."""

    tp_plan = {"block.a": "colwise_gather_output", "block.b": "rowwise_split_input"}

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Module()
        self.block.a, self.block.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)


def test_a_rowwise_split_input_after_an_unfused_gather_is_refused() -> None:
    with pytest.raises(StyleError, match=re.escape(
            "parallelize: the model's plan gives block.b ('block.b') the style"
            " 'rowwise_split_input' (a rowwise layer that splits its replicated input"
            " itself), which has no meshcomm style; nothing was split.")):
        mc.nn.tp_plan_of(Declared())


def test_a_gathered_fused_projection_with_no_split_input_after_it_is_refused() -> None:
    """colwise_fused leaves the output split for the owner's rowwise_split_input; a plan that
    gathers a fused projection and has no such layer after it would hand on a share."""
    config = transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=1, **COMMON)
    config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items()
                                 if not k.endswith("down_proj")}
    phi3 = transformers.Phi3ForCausalLM(config)
    with pytest.raises(StyleError, match=re.escape(
            "parallelize: the model's plan gives the fused projection"
            " 'model.layers.*.mlp.gate_up_proj' (colwise_gather_output) a gathered output, and"
            " meshcomm's colwise_fused leaves it split for a rowwise_split_input layer of"
            " model.layers.0.mlp, which the plan does not have; nothing was split.")):
        mc.nn.tp_plan_of(phi3)


def test_a_model_with_no_plan_is_refused() -> None:
    with pytest.raises(StyleError, match=re.escape(
            "parallelize: Linear declares no tensor-parallel plan")):
        mc.nn.tp_plan_of(torch.nn.Linear(2, 2))


# -- parallelize's refusals, before anything is split (fake process group) -----------------
REFUSALS: dict[str, tuple[str, Any]] = {
    "colwise on gpt2 c_attn": ("gpt2", {"transformer.h.*.attn.c_attn": "colwise"}),
    "colwise on phi3 qkv_proj": ("phi3", {"model.layers.*.self_attn.qkv_proj": "colwise"}),
    "colwise on phi3 gate_up_proj": ("phi3", {"model.layers.*.mlp.gate_up_proj": "colwise"}),
    "auto on mixtral": ("mixtral", "auto"),
    "fused without parts": ("llama", {"model.layers.*.self_attn.q_proj": "colwise_fused"}),
    "fused parts that do not add up": ("llama", {"model.layers.*.mlp.up_proj":
                                                 "colwise_fused(32, 16)"}),
    "fused parts that do not divide": ("llama", {"model.layers.*.mlp.up_proj":
                                                 "colwise_fused(62, 2)"}),
    "fused parts unlike the model's": ("phi3", {"model.layers.*.mlp.gate_up_proj":
                                                "colwise_fused(4)"}),
    "a plan that is a word": ("llama", "automatic"),
    "colwise_sp on a fused projection": ("phi3", {"model.layers.*.self_attn": "sp_input",
                                                  "model.layers.*.self_attn.qkv_proj":
                                                  "colwise_sp"}),
    "fused inside sp_input": ("phi3", {"model.layers.*.mlp": "sp_input",
                                       "model.layers.*.mlp.gate_up_proj": "colwise_fused"}),
    "colwise inside sp_input": ("llama", {"model.layers.*.mlp": "sp_input",
                                          "model.layers.*.mlp.up_proj": "colwise"}),
    "colwise_sp outside sp_input": ("llama", {"model.layers.*.mlp.up_proj": "colwise_sp"}),
    "sp_input with nothing partial inside": ("llama", {"model.norm": "sp_input"}),
    "fused on an unread owner, no parts": ("codegen", {"transformer.h.*.attn.qkv_proj":
                                                       "colwise_fused"}),
    "colwise on an unread owner's fused name": ("own mlp", {"0.gate_up_proj": "colwise"}),
    "an owner without the sizes it splits by": ("phi3 attention without config", {
        "model.layers.*.self_attn.qkv_proj": "colwise_fused"}),
    "explicit parts on an unread owner (taken)": ("codegen", {
        "transformer.h.*.attn.qkv_proj": "colwise_fused(12)"}),
    "gpt2 under sequence parallelism": ("gpt2", {
        "transformer.wte": "embedding_sp", "transformer.wpe": "embedding_sp",
        "transformer.h.*.attn": "sp_input", "transformer.h.*.attn.c_attn": "colwise_fused_sp",
        "transformer.h.*.attn.c_proj": "rowwise_sp", "transformer.h.*.ln_[12]": "sp_params",
        "transformer.ln_f": "sp_params", "lm_head": "colwise_gather_sp"}),
}


def refusals() -> dict[str, Any]:
    """Runs in a fresh interpreter: each refusal's error, and whether anything changed."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    bound = mc.init_mesh("tp=4", backend="fake")
    out = {}
    for name, (kind, plan) in REFUSALS.items():
        m = model(kind)
        before = {k: (type(p).__name__, tuple(p.shape)) for k, p in m.named_parameters()}
        try:
            mc.nn.parallelize(m, bound, plan, axis="tp")
            error = "none"
        except Exception as exc:   # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        after = {k: (type(p).__name__, tuple(p.shape)) for k, p in m.named_parameters()}
        hooked = [n for n, x in m.named_modules() if mc.nn.tp_style(x) is not None]
        out[name] = {"error": error, "unchanged": before == after and not hooked}
    return out


@pytest.fixture(scope="module")
def refused() -> dict[str, Any]:
    return in_fresh_interpreter("test_tp_fused", "refusals")  # type: ignore[no-any-return]


@pytest.mark.parametrize(("name", "message"), [
    ("colwise on gpt2 c_attn", "StyleError: parallelize: transformer.h.0.attn.c_attn is a fused"
     " projection (3 parts of sizes (32, 32, 32) stacked along its output), so 'colwise'"
     " would give each rank whole parts instead of a slice of every part; fix: give"
     " 'transformer.h.*.attn.c_attn' the style 'colwise_fused'"),
    ("colwise on phi3 qkv_proj", "StyleError: parallelize: model.layers.0.self_attn.qkv_proj"
     " is a fused projection (3 parts of sizes (32, 16, 16)"),
    ("colwise on phi3 gate_up_proj", "StyleError: parallelize: model.layers.0.mlp.gate_up_proj"
     " is a fused projection (2 parts of sizes (64, 64)"),
    ("auto on mixtral", "StyleError: parallelize: the model's plan gives the parameter"
     " model.layers.0.mlp.experts.gate_up_proj"),
    ("fused without parts", "StyleError: parallelize: model.layers.0.self_attn.q_proj"
     " (colwise_fused): its model declares no parts for it"),
    ("fused parts that do not add up", "ShapeError: parallelize: model.layers.0.mlp.up_proj"
     " (colwise_fused(32, 16)): parts (32, 16) add up to 48, but it has 64 output rows"),
    ("fused parts that do not divide", "ShapeError: parallelize: model.layers.0.mlp.up_proj"
     " (colwise_fused(62, 2)): parts (62, 2) do not all divide over 4 ranks"),
    ("fused parts unlike the model's", "StyleError: parallelize:"
     " model.layers.0.mlp.gate_up_proj (colwise_fused(4)): parts (32, 32, 32, 32), but its"
     " model declares (64, 64)"),
    ("a plan that is a word", "StyleError: parallelize: plan 'automatic' is neither"),
    ("colwise_sp on a fused projection", "StyleError: parallelize:"
     " model.layers.0.self_attn.qkv_proj is a fused projection (3 parts of sizes (32, 16, 16)"
     " stacked along its output), so 'colwise_sp' would give each rank whole parts instead of"
     " a slice of every part; fix: give 'model.layers.*.self_attn.qkv_proj' the style"
     " 'colwise_fused_sp'"),
    ("fused inside sp_input", "StyleError: parallelize: model.layers.0.mlp.gate_up_proj"
     " (colwise_fused) is inside model.layers.0.mlp (sp_input), which reduce_scatters its"
     " input's gradient; 'colwise_fused' all_reduces that gradient as well, so it would be"
     " summed twice. fix: use 'colwise_fused_sp' for model.layers.0.mlp.gate_up_proj"),
    ("colwise inside sp_input", "StyleError: parallelize: model.layers.0.mlp.up_proj (colwise)"
     " is inside model.layers.0.mlp (sp_input)"),
    ("colwise_sp outside sp_input", "StyleError: parallelize: model.layers.0.mlp.up_proj"
     " (colwise_sp) leaves its input's gradient partial for an enclosing sp_input module to"
     " sum, but no module around it is sp_input. fix: give its block 'sp_input', or use"
     " 'colwise'"),
    ("sp_input with nothing partial inside", "StyleError: parallelize: model.norm (sp_input)"
     " gathers the sequence and reduce_scatters its gradient, which only a partial gradient"
     " from a module inside it ('colwise_sp', 'colwise_fused_sp') makes right; it has none"),
    ("fused on an unread owner, no parts", "StyleError: parallelize:"
     " transformer.h.0.attn.qkv_proj (colwise_fused): its owner CodeGenAttention is not one"
     " whose layout meshcomm knows (it knows Phi3Attention, Phi4MultimodalAttention); fix:"
     " name them"),
    ("colwise on an unread owner's fused name", "StyleError: parallelize: 0.gate_up_proj is"
     " named as transformers names a fused projection (parts such as q, k, v or gate, up in"
     " one weight), but its owner OwnMLP is not one whose layout meshcomm knows (it knows"
     " DiaMLP, Dots3NoteAudioMLP, EsmFold2SwiGLU, Glm4MLP, Glm4vTextMLP, GlmImageTextMLP,"
     " GlmMLP, GlmOcrTextMLP, MiniMaxM3VLDenseMLP, Phi3MLP, Phi4MultimodalAudioMLP,"
     " Phi4MultimodalMLP), so 'colwise' might give each rank whole parts instead of a slice"
     " of every part; nothing was split. fix: if its output rows are its parts one after"
     " another, name their sizes, e.g. '0.gate_up_proj': 'colwise_fused(64, 16, 16)'; else"
     " leave it and the layer that takes its output out of the plan"),
    ("an owner without the sizes it splits by", "StyleError: parallelize:"
     " model.layers.0.self_attn.qkv_proj is fused and its owner model.layers.0.self_attn"
     " (Phi3Attention) splits its output by config.num_attention_heads, which meshcomm makes"
     " this rank's share while it runs, but it has no config; nothing was split. fix: give"
     " model.layers.0.self_attn its config as transformers builds it"),
    ("gpt2 under sequence parallelism", "StyleError: parallelize: transformer.wte"
     " (embedding_sp) splits the sequence over 'tp' inside transformer (GPT2Model), whose"
     " forward views its last hidden state by the whole sequence's length after its final"
     " norm"),
])
def test_parallelize_refuses_before_anything_is_split(refused: dict[str, Any], name: str,
                                                      message: str) -> None:
    assert refused[name]["error"].startswith(message), refused[name]["error"]
    assert refused[name]["unchanged"]


def test_explicit_parts_on_an_owner_meshcomm_has_not_read_are_taken(
        refused: dict[str, Any]) -> None:
    """The user's own `colwise_fused(...)` is the layout meshcomm does not guess."""
    assert refused["explicit parts on an unread owner (taken)"]["error"] == "none"
