"""Tensor-parallel plans from the model: fused projections and Hugging Face TP plans.

transformers is never imported: models are told by their class names and fields, as
`parallel._is_conv1d` tells a `Conv1D`.

Two things live here, both about what a model says of itself:

- `fused_parts(root, name, module)`: the parts (q, k, v; gate, up) a fused projection's
  output rows are made of, for owners whose layout was read in transformers' code
  (`FUSED_OWNERS`; another owner's parts are never guessed: `unknown_fused`), found from
  the module's owner and the model config, and the owner's attributes that hold the global
  sizes its own code splits the output by (GPT-2's `split_size`, Phi-3's
  `num_attention_heads`): `LocalSizes` gives them their per-rank values while the owner
  runs (a config's through a `ConfigView`, made once), so the model's own `.split` /
  slicing works on local sizes.
- `tp_plan_of(model)`: the model's declared plan (`model.tp_plan`: the class's `_tp_plan`
  and the config's `base_model_tp_plan`, merged by transformers) in meshcomm styles; an
  entry with no meshcomm style raises StyleError naming the module and the style.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.errors import StyleError

FUSED = "colwise_fused"
GRAD_SUM = "replicated_grad_sum"


@dataclass(frozen=True)
class Fused:
    """A fused projection as its model declares it: the output sizes of its parts, in order,
    and the attributes of its owner (the module that calls it) that hold global sizes its
    code splits the output by, with their global values (each divides over the axis)."""

    parts: tuple[int, ...]
    owner: str = ""
    attrs: tuple[tuple[str, int], ...] = ()


def _config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _heads(owner: nn.Module, root: nn.Module) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head size) of an attention module, from its config."""
    config = _config(owner) or _config(root)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    size = getattr(owner, "head_dim", None) or getattr(config, "head_dim", None) \
        or getattr(config, "hidden_size") // heads
    return heads, int(kv), int(size)


# The owners (transformers 5.24, read in their modeling code) whose fused projection's output
# rows are parts stacked one after another, by the projection's attribute name. A subclass
# counts as its base (matched along the MRO); any other owner's parts are not guessed.
FUSED_OWNERS: Mapping[str, frozenset[str]] = {
    # c_attn (Conv1D): q | k | v, each `split_size` wide, cut by `.split(self.split_size)`
    "c_attn": frozenset({"GPT2Attention", "DecisionTransformerGPT2Attention"}),
    # qkv_proj: q | k | v, cut at config.num_attention_heads * head_dim and
    # num_key_value_heads * head_dim (grouped-query sizes)
    "qkv_proj": frozenset({"Phi3Attention", "Phi4MultimodalAttention"}),
    # gate_up_proj: two equal halves, cut by `.chunk(2, dim=-1)`
    "gate_up_proj": frozenset({
        "Phi3MLP", "Phi4MultimodalMLP", "Phi4MultimodalAudioMLP", "GlmMLP", "Glm4MLP",
        "Glm4vTextMLP", "GlmImageTextMLP", "GlmOcrTextMLP", "DiaMLP", "EsmFold2SwiGLU",
        "Dots3NoteAudioMLP", "MiniMaxM3VLDenseMLP"}),
}


def _known_owner(owner: nn.Module, attr: str) -> bool:
    known = FUSED_OWNERS.get(attr, frozenset())
    return any(c.__name__ in known for c in type(owner).__mro__)


def fused_parts(root: nn.Module, name: str, module: nn.Module) -> Fused | None:
    """The parts of `module` (named `name` in `root`) if its owner is one whose fused layout
    meshcomm knows (`FUSED_OWNERS`): GPT-2's `attn.c_attn` (q, k, v of the model width),
    Phi-3's `self_attn.qkv_proj` (q, k, v with grouped-query sizes from the config) and
    `mlp.gate_up_proj` (gate, up: halves); None otherwise (see `unknown_fused`)."""
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name)
    if not _known_owner(owner, attr):
        return None
    width = int(getattr(module, "nf", 0) or getattr(module, "out_features", 0))
    if attr == "c_attn" and hasattr(owner, "split_size"):
        split, heads = int(getattr(owner, "split_size")), int(getattr(owner, "num_heads"))
        n = width // split
        return Fused((split,) * n, owner_name, (("split_size", split), ("num_heads", heads),
                                                 ("embed_dim", split)))
    if attr == "qkv_proj":
        found = _heads(owner, root)
        if found is None:
            return None
        heads, kv, size = found
        attrs: tuple[tuple[str, int], ...] = (("config.num_attention_heads", heads),)
        if hasattr(owner, "num_key_value_heads"):
            attrs += (("num_key_value_heads", kv),)
        return Fused((heads * size, kv * size, kv * size), owner_name, attrs)
    if attr == "gate_up_proj" and width % 2 == 0 and width:
        return Fused((width // 2, width // 2))
    return None


def unknown_fused(root: nn.Module, name: str) -> str | None:
    """The class of the owner of `name` when the module is named as transformers names fused
    projections (`FUSED_OWNERS`' keys: c_attn, qkv_proj, gate_up_proj) but its owner is not
    one whose layout meshcomm knows (CodeGen's qkv_proj interleaves q, v and k by groups,
    MiniMax's by heads, Zamba2 adds an adapter to gate_up_proj's output); else None."""
    owner_name, _, attr = name.rpartition(".")
    if attr not in FUSED_OWNERS:
        return None
    owner = root.get_submodule(owner_name)
    return None if _known_owner(owner, attr) else type(owner).__name__


class LocalSizes:
    """Forward hooks of `owner`, an owner of fused projections: while it runs, its attributes
    that hold global sizes (`Fused.attrs`) hold this rank's share (`size // n`). A dotted
    `config.x` is read from a `ConfigView` made once here, which holds the shares and reads
    every other field from the shared config (so a later change to it is seen): the model's
    config, shared by every layer, never changes, and a forward copies nothing. `post` runs
    even when the forward raises."""

    def __init__(self, owner: nn.Module, attrs: tuple[tuple[str, int], ...], n: int) -> None:
        self.n = n
        self.plain = tuple((a, size // n) for a, size in attrs if "." not in a)
        self.views: dict[str, Any] = {}        # field (config) -> its view while owner runs
        dotted: dict[str, dict[str, int]] = {}
        for path, size in attrs:
            if "." in path:
                field, attr = path.split(".", 1)
                dotted.setdefault(field, {})[attr] = size // n
        for field, local in sorted(dotted.items()):
            self.views[field] = config_view(getattr(owner, field), local)
        self.saved: list[tuple[str, Any]] = []

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.post(module, args, None)       # nothing is left over, but be sure
        for field, view in self.views.items():
            shared = getattr(module, field)
            if shared is not object.__getattribute__(view, "_meshcomm_shared"):
                view = self.views[field] = config_view(     # the owner got another config
                    shared, object.__getattribute__(view, "_meshcomm_local"))
            self.saved.append((field, shared))
            setattr(module, field, view)
        for attr, size in self.plain:
            self.saved.append((attr, getattr(module, attr)))
            setattr(module, attr, size)

    def post(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        for attr, value in reversed(self.saved):
            setattr(module, attr, value)
        self.saved = []


class ConfigView:
    """A model config as one owner sees it while it runs: the names in `_meshcomm_local`
    hold this rank's sizes; every other attribute is the shared config's, read (and
    written) through. An instance is of a subclass of the shared config's class
    (`config_view`), so `isinstance` checks still hold."""

    def __getattribute__(self, name: str) -> Any:
        local = object.__getattribute__(self, "_meshcomm_local")
        if name in local:
            return local[name]
        return getattr(object.__getattribute__(self, "_meshcomm_shared"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        local = object.__getattribute__(self, "_meshcomm_local")
        if name in local:
            local[name] = value
        else:
            setattr(object.__getattribute__(self, "_meshcomm_shared"), name, value)


@functools.lru_cache(maxsize=256)
def _view_class(cls: type[Any]) -> type[Any]:
    """The class of a view of a `cls` config: one per config class (a subclass of it)."""
    return type(f"Local{cls.__name__}", (ConfigView, cls), {"__module__": __name__})


def config_view(shared: Any, local: Mapping[str, int]) -> Any:
    """A `ConfigView` of `shared` whose attributes `local` hold the given values, also under
    their other names in a transformers config's `attribute_map` (an alias given reads
    through its stored name, and a stored name through its aliases).

    >>> class Config:
    ...     heads, width = 8, 32
    >>> view = config_view(Config(), {"heads": 2})
    >>> view.heads, view.width, isinstance(view, Config)
    (2, 32, True)
    """
    names = dict(getattr(shared, "attribute_map", None) or {})     # alias -> stored name
    stored = {names[k]: v for k, v in local.items() if k in names}
    aliases = {alias: local[name] for alias, name in names.items() if name in local}
    values = {**stored, **aliases, **local}     # a name given keeps its own value
    view: Any = object.__new__(_view_class(shared.__class__))
    object.__setattr__(view, "_meshcomm_local", values)
    object.__setattr__(view, "_meshcomm_shared", shared)
    return view


# transformers' style names -> meshcomm's (None: no meshcomm style; see _refuse)
_SAME = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "embedding_rowwise": "embedding",
    "replicated_with_grad_allreduce": GRAD_SUM,
}
_SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")   # rowwise on a replicated input
_MISSING = {
    "packed_colwise": "a packed (stacked) weight parameter split part by part",
    "packed_rowwise": "a packed weight parameter split along its last dim",
    "moe_tp_experts": "experts split over the axis (use fully_shard, or mc.nn.MoE over an"
                      " expert axis)",
    "moe_identity_expert": "an identity expert inside split experts",
    "sequence_parallel": "sequence parallelism on a norm (meshcomm's sp_params, with the"
                         " *_sp styles around it)",
    "embedding_colwise": "an embedding split along its hidden dim",
    "mla_kv_a_proj": "MLA's kv_a projection",
    "all_reduce": "an all_reduce of a module's partial output",
    "local_params": "a module run on its parameters' local shards",
    "replicate": "a replicated parameter without a gradient sum",
    "gather": "a gathered output",
    "local_colwise": "colwise on local tensors",
    "local_rowwise": "rowwise on local tensors",
    "local": "local tensors",
}
# models that declare no plan of their own: meshcomm's, in the same form
_KNOWN = {
    "GPT2LMHeadModel": {"transformer.wte": "embedding",
                        "transformer.h.*.attn.c_attn": FUSED,
                        "transformer.h.*.attn.c_proj": "rowwise",
                        "transformer.h.*.mlp.c_fc": "colwise",
                        "transformer.h.*.mlp.c_proj": "rowwise",
                        "lm_head": "colwise_gather"},
    "GPT2Model": {"wte": "embedding", "h.*.attn.c_attn": FUSED, "h.*.attn.c_proj": "rowwise",
                  "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
}


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan `model` declares in transformers' style names: its merged
    `tp_plan` (class `_tp_plan` and config `base_model_tp_plan`), else empty."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and hasattr(model, prefix):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return {**dict(getattr(type(model), "_tp_plan", None) or {}), **base}


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """`model`'s own tensor-parallel plan in meshcomm styles, to print, edit and pass to
    `parallelize` (which `parallelize(model, bound, "auto")` does).

    >>> mc.nn.tp_plan_of(qwen3)["model.layers.*.self_attn.q_norm"]  # doctest: +SKIP
    'replicated_grad_sum'

    A module the model declares fused (`fused_parts`) gets `colwise_fused`, and a rowwise
    layer whose input the model's plan replicates (`rowwise_split_input`, after a gathered
    fused projection) gets `rowwise` beside it. Raises StyleError naming the module and the
    style for an entry meshcomm has no style for, and for a model that declares no plan.
    """
    declared = declared_plan(model)
    if not declared:
        known = _KNOWN.get(type(model).__name__)
        if known is not None:
            return dict(known)
        raise StyleError(
            f"parallelize: {type(model).__name__} declares no tensor-parallel plan (no"
            " `base_model_tp_plan` on its config, no `_tp_plan` on its class); fix: pass a"
            " plan, e.g. {'layers.*.attn.q': 'colwise', 'layers.*.attn.o': 'rowwise'}")
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    fused_owners: set[str] = set()
    gathered: dict[str, tuple[str, str]] = {}     # owner -> (pattern, style) of a gathered fused
    for pattern, hf_style in declared.items():
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if hf_style in _MISSING or (hf_style not in _SAME and hf_style not in _SPLIT_INPUT):
            _refuse(pattern, hf_style, names or [
                f"the parameter {n}" for n, _ in model.named_parameters()
                if fnmatch.fnmatchcase(n, pattern)])
        fused = [n for n in names if fused_parts(model, n, modules[n]) is not None]
        if fused and hf_style in ("colwise", "colwise_gather_output", "colwise_rep"):
            out[pattern] = FUSED
            fused_owners.update(n.rpartition(".")[0] for n in fused)
            if hf_style != "colwise":
                gathered.update({n.rpartition(".")[0]: (pattern, hf_style) for n in fused})
        elif hf_style in _SAME:
            out[pattern] = _SAME[hf_style]
        else:
            out[pattern] = hf_style          # resolved below, once every fused owner is known
    consumed: set[str] = set()
    for pattern, style in out.items():
        if style in _SPLIT_INPUT:
            names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
            if not names or any(n.rpartition(".")[0] not in fused_owners for n in names):
                _refuse(pattern, style, names)
            consumed.update(n.rpartition(".")[0] for n in names)
            out[pattern] = "rowwise"
    for owner, (pattern, hf_style) in gathered.items():
        if owner not in consumed:      # colwise_fused leaves the output split: none takes it
            raise StyleError(
                f"parallelize: the model's plan gives the fused projection {pattern!r}"
                f" ({hf_style}) a gathered output, and meshcomm's colwise_fused leaves it split"
                f" for a rowwise_split_input layer of {owner}, which the plan does not have;"
                " nothing was split. fix: pass a plan of your own (mc.nn.STYLES), or shard"
                " this model with fully_shard")
    return out


def _refuse(pattern: str, hf_style: str, names: list[str]) -> None:
    what = _MISSING.get(hf_style, "a style meshcomm does not know")
    where = names[0] if names else pattern
    if hf_style in _SPLIT_INPUT:
        what = "a rowwise layer that splits its replicated input itself"
    raise StyleError(
        f"parallelize: the model's plan gives {where} ({pattern!r}) the style {hf_style!r}"
        f" ({what}), which has no meshcomm style; nothing was split. fix: pass a plan of"
        " your own (mc.nn.tp_plan_of raises the same; meshcomm's styles are mc.nn.STYLES),"
        " or shard this model with fully_shard")
