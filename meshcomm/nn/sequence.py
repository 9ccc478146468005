"""Sequence parallelism on Hugging Face models: global positions and masks for a split sequence.

Under `embedding_sp` the token embeddings leave the embedding split over the sequence (dim 1),
so a transformers base model (`LlamaModel`, `MistralModel`, `Gemma2Model`, ...) that derives
its default `position_ids` and its attention masks from the embedding output's length would
derive them from this rank's share: rotary positions of the wrong length, a causal mask of
the wrong size ("size of tensor a (32) must match ... (16)" inside the model).

`parallelize` therefore puts `SequencePositions`, a forward pre-hook, on the base model that
holds an `embedding_sp` embedding (the nearest module above it with a `config` whose
`get_input_embeddings()` is that embedding). Every rank holds the token ids whole, so from
their length the hook fills what the caller left out, as the model itself would for the
whole sequence:

- `position_ids`: `arange(seq)` after the tokens the cache has seen;
- `cache_position` (for a forward that takes one): the same positions as a vector;
- `attention_mask`: the masks transformers' `create_masks_for_generate` builds for the whole
  sequence (causal, padding, sliding window, one per layer type for a hybrid model such as
  Gemma2), which a model takes as prepared, as under `generate`. A mask the caller prepared
  (4-D, or a dict per layer type) passes as it is.

The attention modules (`sp_input`) see the whole sequence, so whole-sequence positions and
masks are what they need. Nothing here communicates: the checks run before the embedding's
reduce_scatter. A model that cannot work this way is refused when it is parallelized (a
forward without `position_ids` or `attention_mask`, a layer type transformers has no mask
for, another embedding added to the token embeddings but not split over the sequence, a
base model that views its output by the whole sequence's length: `WHOLE_SEQUENCE_VIEW`), and
a call that cannot (token embeddings passed in, positions or a padding mask of another
length) raises before the model runs. Other models are left as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ShapeError, StyleError

SEQUENCE_EMBEDDING = "embedding_sp"
HOOK_ATTR = "_meshcomm_sequence_positions"
_CACHE_NAMES = ("cache", "past_key_values")    # transformers 5 renames the second


@dataclass(frozen=True)
class SequencePositions:
    """The pre-hook of a Hugging Face base model `root` whose token embedding `embedding`
    splits the sequence: fills `position_ids`, `cache_position` and `attention_mask` for the
    whole sequence where the call leaves them out (see the module's docstring)."""

    root: str                      # the base model's name in the parallelized module
    embedding: str                 # its embedding_sp module's name
    params: tuple[str, ...]        # its forward's parameter names, in order

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        named = dict(zip(self.params, args))
        named.update(kwargs)
        ids = named.get("input_ids")
        if not isinstance(ids, Tensor):
            raise ShapeError(
                f"parallelize: {self.root} ({type(module).__name__}) was called without"
                f" input_ids, but its token embedding {self.embedding} ({SEQUENCE_EMBEDDING})"
                " is where the sequence is split; passed embeddings would run whole. fix:"
                " pass input_ids, or parallelize the model with 'embedding'")
        batch, seq = ids.shape[0], ids.shape[-1]
        cache = next((named[k] for k in _CACHE_NAMES if named.get(k) is not None), None)
        past = int(cache.get_seq_length()) if cache is not None else 0
        positions = named.get("position_ids")
        if positions is None:
            positions = (torch.arange(seq, device=ids.device) + past).unsqueeze(0)
            named["position_ids"] = positions
        self._check_length("position_ids", positions, seq, seq)
        if "cache_position" in self.params and named.get("cache_position") is None:
            named["cache_position"] = torch.arange(past, past + seq, device=ids.device)
        mask = named.get("attention_mask")
        if mask is None or (isinstance(mask, Tensor) and mask.dim() == 2):
            if mask is not None:
                self._check_length("attention_mask", mask, past + seq, seq)
            named["attention_mask"] = _masks(module, self._dtype(module, ids), batch, seq,
                                             mask, cache, positions)
        return (), named

    def check_output(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     out: Any) -> None:
        """The forward hook beside the pre-hook: the base model's last hidden state must
        still be this rank's share of the sequence, batch first. A model that reshapes it by
        the whole sequence's length (as GPT2Model views it as (-1, whole sequence, hidden)
        after its final norm) would fold the shares of several rows into one, silently. The
        known ones (`WHOLE_SEQUENCE_VIEW`) are refused at `parallelize`, before any
        communication; another is refused here, after its forward but before a loss is
        computed from it (every rank alike, so none waits)."""
        ids = kwargs.get("input_ids")
        hidden = getattr(out, "last_hidden_state", None)
        if hidden is None and isinstance(out, (tuple, list)) and out:
            hidden = out[0]
        if not isinstance(ids, Tensor) or not isinstance(hidden, Tensor) or hidden.dim() < 2:
            return
        if hidden.shape[0] != ids.shape[0]:
            raise ShapeError(
                f"parallelize: {self.root} ({type(module).__name__}) returned a hidden state"
                f" of shape {tuple(hidden.shape)} for {ids.shape[0]} rows of {ids.shape[-1]}"
                f" tokens: the model reshaped this rank's share of the sequence by the whole"
                f" sequence's length, mixing rows. Sequence parallelism cannot split this"
                f" model's sequence below {self.root or 'the model'}. fix: use 'embedding'"
                " and the styles without _sp for this model")

    def _check_length(self, name: str, t: Tensor, want: int, seq: int) -> None:
        if t.shape[-1] != want:
            raise ShapeError(
                f"parallelize: {self.root} got {name} of shape {tuple(t.shape)}, whose last"
                f" dim is not {want}; input_ids hold {seq} tokens, the whole sequence, which"
                f" {self.embedding} ({SEQUENCE_EMBEDDING}) splits. fix: pass {name} for the"
                " whole sequence, as in one process (or none)")

    def _dtype(self, module: nn.Module, ids: Tensor) -> torch.dtype:
        """The dtype the embeddings will have: an additive (eager) mask takes it."""
        if torch.is_autocast_enabled(ids.device.type):
            return torch.get_autocast_dtype(ids.device.type)
        weight = module.get_submodule(self._relative()).weight   # a DTensor's dtype is
        assert isinstance(weight, Tensor), f"{self.embedding}.weight is {type(weight)}"
        return weight.dtype                                        # its local tensor's

    def _relative(self) -> str:
        return self.embedding[len(self.root) + 1:] if self.root else self.embedding


def _masks(root: nn.Module, dtype: torch.dtype, batch: int, seq: int, mask: Tensor | None,
           cache: Any, positions: Tensor) -> Any:
    """The masks `root` builds for `seq` tokens (transformers sizes them from its first
    argument's batch and length: a stand-in with no elements gives the whole sequence's)."""
    from transformers.masking_utils import create_masks_for_generate
    whole = torch.empty((batch, seq, 0), dtype=dtype, device=positions.device)
    return create_masks_for_generate(config=getattr(root, "config"), inputs_embeds=whole,
                                     attention_mask=mask, cache=cache, position_ids=positions)


MASK_PARAMS = ("config", "inputs_embeds", "attention_mask", "cache", "position_ids")
# base models (transformers 5) that view their last hidden state as (-1, whole sequence,
# hidden) after the final norm: a split sequence would be folded across rows
WHOLE_SEQUENCE_VIEW = frozenset({
    "GPT2Model", "DecisionTransformerGPT2Model", "GPTNeoModel", "GPTBigCodeModel",
    "ImageGPTModel", "OpenAIGPTModel", "BarkCausalModel", "BarkFineModel", "ClvpDecoder"})


def _mask_builder_fits() -> bool:
    """Whether the installed transformers builds masks as `_masks` calls it (5.x)."""
    try:
        from transformers.masking_utils import create_masks_for_generate
    except ImportError:
        return False
    names = tuple(inspect.signature(create_masks_for_generate).parameters)
    return names[:len(MASK_PARAMS)] == MASK_PARAMS


def sequence_hooks(module: nn.Module, targets: Mapping[str, str], axis: str
                   ) -> list[tuple[nn.Module, Callable[..., Any]]]:
    """The (base model, pre-hook) pairs that give the Hugging Face models under `module`
    global positions and masks where `targets` (module name -> style) splits their sequence;
    empty for other models. Raises StyleError for a model where it cannot work, before
    anything is changed."""
    modules = dict(module.named_modules())
    hooks: list[tuple[nn.Module, Callable[..., Any]]] = []
    for name, style in targets.items():
        if style != SEQUENCE_EMBEDDING:
            continue
        found = _base_model(modules, name)
        if found is None or hasattr(found[1], HOOK_ATTR):
            continue
        root_name, root = found
        params = tuple(n for n, p in inspect.signature(root.forward).parameters.items()
                       if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        _check_model(root_name, root, name, params, targets, modules, axis)
        hooks.append((root, SequencePositions(root_name, name, params)))
    return hooks


def install_sequence_hooks(hooks: list[tuple[nn.Module, Callable[..., Any]]]) -> None:
    """Register each pre-hook of `sequence_hooks` on its base model (once)."""
    for root, hook in hooks:
        root.register_forward_pre_hook(hook, with_kwargs=True)
        if isinstance(hook, SequencePositions):
            root.register_forward_hook(hook.check_output, with_kwargs=True)
        setattr(root, HOOK_ATTR, hook)


def _base_model(modules: Mapping[str, nn.Module], name: str
                ) -> tuple[str, nn.Module] | None:
    """The nearest module above `name` that is a transformers model whose input embedding it
    is (it has a `config`), or None."""
    emb, parts = modules[name], name.split(".")
    for n in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:n])
        m = modules[owner]
        get = getattr(m, "get_input_embeddings", None)
        if hasattr(m, "config") and callable(get) and _safe_call(get) is emb:
            return owner, m
    return None


def _safe_call(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except (AttributeError, NotImplementedError):   # a model without an input embedding
        return None


def _check_model(root_name: str, root: nn.Module, emb: str, params: tuple[str, ...],
                 targets: Mapping[str, str], modules: Mapping[str, nn.Module],
                 axis: str) -> None:
    what = (f"parallelize: {emb} ({SEQUENCE_EMBEDDING}) splits the sequence over {axis!r}"
            f" inside {root_name or 'the model'} ({type(root).__name__})")
    if not _mask_builder_fits():
        import transformers
        raise StyleError(
            f"{what}, but transformers {transformers.__version__} has no"
            f" masking_utils.create_masks_for_generate({', '.join(MASK_PARAMS)}), which"
            " meshcomm builds the whole sequence's masks with. fix: install transformers 5"
            " (pip install -U transformers), or use 'embedding' and the styles without _sp")
    folds = next((c.__name__ for c in type(root).__mro__ if c.__name__ in WHOLE_SEQUENCE_VIEW),
                 None)
    if folds is not None:
        raise StyleError(
            f"{what}, whose forward views its last hidden state by the whole sequence's"
            f" length after its final norm ({folds}: .view(-1, whole sequence, hidden)), which"
            " would fold this rank's share of several rows into one; nothing was split. fix:"
            " use 'embedding' and the styles without _sp for this model (tensor parallelism"
            " without sequence parallelism)")
    missing = [p for p in ("position_ids", "attention_mask") if p not in params]
    if missing:
        raise StyleError(
            f"{what}, whose forward takes no {' or '.join(missing)}, so meshcomm cannot give"
            " it the whole sequence's positions and masks. fix: use 'embedding' and the"
            " styles without _sp for this model")
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    config = getattr(root, "config").get_text_config()
    unknown = sorted(set(getattr(config, "layer_types", None) or ())
                     - set(LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING))
    if unknown:
        raise StyleError(
            f"{what}, whose layer types {unknown} have no mask transformers can build ahead"
            " of the model, so its masks would be built for this rank's share of the"
            " sequence. fix: use 'embedding' and the styles without _sp for this model")
    prefix = f"{root_name}." if root_name else ""
    for child, m in root.named_children():
        full = prefix + child
        if full != emb and isinstance(m, nn.Embedding) and targets.get(full) != SEQUENCE_EMBEDDING:
            raise StyleError(
                f"{what}, but {full} (an nn.Embedding beside it, e.g. positions or token"
                " types) would look up the whole sequence and the model adds the two. fix:"
                f" give {full} '{SEQUENCE_EMBEDDING}' too")
