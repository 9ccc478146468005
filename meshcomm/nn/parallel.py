"""`parallelize`: tensor parallelism on unmodified modules, planned by meshcomm.

`mc.nn.parallelize(model, bound, {"layers.*.attention.wq": "colwise", ...}, axis="tp")`
splits the weights of the named `nn.Linear` / `nn.Embedding` modules over mesh axis `axis`
(DTensor parameters, replicated over the other axes, so `fully_shard` can shard them
further over "dp") and wraps each module's forward with the activation moves its style
needs. Every move is a meshcomm plan on layouts (`d0 d1 ...` are the activation's dims;
the weight layouts below are `STYLES[name].on("tp", mesh)`, and another `axis` names it):

| style            | weight       | input                         | output                        |
|------------------|--------------|-------------------------------|-------------------------------|
| `colwise`        | `(tp d0) d1` | replicated; grad all_reduced  | last dim split `(tp dk)`      |
| `colwise_gather` | `(tp d0) d1` | as colwise                    | all_gather to replicated      |
| `rowwise`        | `d0 (tp d1)` | last dim split (from colwise) | `... | sum(tp)` -> all_reduce |
| `embedding`      | `(tp d0) d1` | replicated token ids          | `... | sum(tp)` -> all_reduce |
| `colwise_fused`  | whole, grad summed | as colwise              | this rank's part of each part |
| `replicated_grad_sum` | whole, grad summed | as is              | as is                         |

An `embedding` weight's d0 is its vocab rows; `rowwise` adds its bias after the all_reduce.
`colwise_fused` (also `colwise_fused(N)`, `colwise_fused(64, 16, 16)`: `parse_style`) is
for a weight whose output rows are parts (q, k, v; gate, up): each forward takes this rank's
rows of every part (`FusedRows`); parts the model declares and the owner's sizes that
follow them come from hf_plan.py, as does `plan="auto"` (`tp_plan_of`).

Sequence parallelism (`*_sp` styles, `sp_input`, `sp_params`) keeps the activations between
blocks split over the sequence (dim 1): `embedding_sp` and `rowwise_sp` reduce_scatter
instead of all_reduce, `sp_input` on a block's attention or MLP module all_gathers its
input (and reduce_scatters the gradient), `colwise_sp` (`colwise_fused_sp`) leaves its
input's gradient partial for that reduce_scatter (`_check_sequence_entries` refuses either
kind of input on the wrong side of an `sp_input`), `sp_params` all_reduces over tp the
gradients of the replicated parameters used on sequence-split activations (norms),
`colwise_gather_sp` gathers the sequence before an output layer. See `STYLES` and `Style`.

The moves are the recipe blocks' own (tensor_parallel.py): an `Entry` (Megatron's `f`, the
sequence gather) and an `Exit` (a pending sum resolved, an output gathered) from moves.py,
and the vocab-parallel lookup `VocabRows`. Here their layouts come from the axis given;
there, from a recipe.

A colwise output keeps the last dim split, so attention heads and MLP hidden units stay
local until the rowwise projection sums them: two all_reduces per transformer block in
forward and two in backward, as Megatron-style tensor parallelism.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..core.errors import MeshAxisError, MeshMismatchError, ShapeError, StyleError
from ..core.layout import Layout
from ..core.mesh import AxisName, Mesh
from ..core.names import positional_names
from ..interop.placements import to_placements
from ..interop.runtime import is_dtensor, local_of, wrap
from ..runtime.bind import BoundMesh, require_bound
from .drift import watch
from .hf_plan import FUSED_OWNERS, Fused, LocalSizes, fused_parts, tp_plan_of, unknown_fused
from .moves import Entry, Exit
from .sequence import install_sequence_hooks, sequence_hooks
from .tensor_parallel import VocabRows


@dataclass(frozen=True)
class Style:
    """A tensor-parallel style: the module type, which weight dim it splits (None: weights
    stay as they are), what the input is and what the output becomes; `on(axis, mesh)` gives
    its layouts.

    split: the weight dim split over the axis, in `nn.Linear` / `nn.Embedding` order (0: the
    output rows or vocabulary, 1: the input columns; a transformers `Conv1D` is transposed).
    inputs: "replicated" (its gradient is all_reduced over the axis), "local" (replicated,
    its gradient left partial: an enclosing `sp_input` sums it), "split" (last dim split),
    "tokens" (ids, replicated), "sequence" (dim 1 split: all_gather it, reduce_scatter the
    gradient), "as is". outputs: "split" (last dim), "gather" (all_gather the last dim),
    "sum" (`| sum(axis)` -> all_reduce), "sequence" (`| sum(axis)` -> reduce_scatter over
    dim 1), "as is". `grad_sum`: the module's own parameters get their gradients all_reduced
    over the axis (replicated parameters used on sequence-split activations, e.g. norms).
    `fused`: the output rows are parts stacked along the output dim (q, k, v; gate, up),
    each split over the axis: the weight stays whole and every forward multiplies by this
    rank's rows of every part (`FusedRows`), so the output is `[q_r | k_r | v_r]`.
    """

    kind: type
    split: int | None
    inputs: str
    outputs: str
    grad_sum: bool = False
    fused: bool = False

    def on(self, axis: AxisName, mesh: Mesh) -> StyleLayouts:
        """This style's parameter layouts when it splits over `axis` of `mesh`.

        >>> STYLES["colwise"].on("mp", Mesh("dp=2 mp=2")).weight
        Layout('(mp d0) d1')
        """
        if self.split is None:
            return StyleLayouts(self, axis, mesh, None, None)
        return StyleLayouts(self, axis, mesh, _split_at(2, self.split, axis, mesh),
                            self.other(axis, mesh, 1))

    def other(self, axis: AxisName, mesh: Mesh, ndim: int) -> Layout:
        """The layout of a parameter other than the weight (the bias): split like the
        output rows under a split or gathered output, else whole."""
        if self.outputs in ("split", "gather"):
            return _split_at(ndim, 0, axis, mesh)
        return _names(ndim, mesh)


@dataclass(frozen=True)
class StyleLayouts:
    """A style applied over `axis` of `mesh`: its weight's layout (nn.Linear / nn.Embedding
    order) and its bias's, or None where it leaves them as they are."""

    style: Style
    axis: AxisName
    mesh: Mesh
    weight: Layout | None
    bias: Layout | None

    def param(self, module: nn.Module, attr: str, ndim: int) -> Layout | None:
        """The layout of `module`'s parameter `attr` (None: it stays a plain tensor); a
        transformers `Conv1D`'s weight is a Linear's transposed, so its other dim splits."""
        if self.weight is None or self.style.split is None:
            return None
        if attr == "weight":
            if _is_conv1d(module):
                return _split_at(ndim, 1 - self.style.split, self.axis, self.mesh)
            return self.weight
        return self.bias if ndim == 1 else self.style.other(self.axis, self.mesh, ndim)


STYLES = {
    "colwise": Style(nn.Linear, 0, "replicated", "split"),
    "colwise_gather": Style(nn.Linear, 0, "replicated", "gather"),
    "rowwise": Style(nn.Linear, 1, "split", "sum"),
    "embedding": Style(nn.Embedding, 0, "tokens", "sum"),
    # sequence parallelism: activations between blocks split over the sequence (dim 1)
    "colwise_sp": Style(nn.Linear, 0, "local", "split"),
    "rowwise_sp": Style(nn.Linear, 1, "split", "sequence"),
    "embedding_sp": Style(nn.Embedding, 0, "tokens", "sequence"),
    "colwise_gather_sp": Style(nn.Linear, 0, "sequence", "gather"),
    "sp_input": Style(nn.Module, None, "sequence", "as is"),
    "sp_params": Style(nn.Module, None, "as is", "as is", grad_sum=True),
    # a fused projection (q|k|v, gate|up): every part split over the axis, weight whole
    "colwise_fused": Style(nn.Linear, None, "replicated", "split", grad_sum=True, fused=True),
    "colwise_fused_sp": Style(nn.Linear, None, "local", "split", grad_sum=True, fused=True),
    # parameters replicated over the axis but used on split activations (per-head norms)
    "replicated_grad_sum": Style(nn.Module, None, "as is", "as is", grad_sum=True),
}
TP_ATTR = "_meshcomm_tp"
LOCAL_ATTR = "_meshcomm_local_sizes"   # an owner of fused projections: its LocalSizes
AUTO = "auto"           # parallelize(model, bound, "auto"): the model's own plan (tp_plan_of)


@dataclass(frozen=True)
class FusedRows:
    """The parts of a fused projection's output rows (sizes, in order: q, k, v or gate, up),
    each split over an axis of `n` ranks: rank `i` of the axis holds rows
    `[start + i * size // n, start + (i + 1) * size // n)` of every part, in part order.

    >>> FusedRows((8, 4, 4), 2).rows(1)
    ((4, 8), (10, 12), (14, 16))
    >>> str(FusedRows((8, 4, 4), 2))
    'colwise_fused(8,4,4)'
    """

    parts: tuple[int, ...]
    n: int

    def __str__(self) -> str:
        return f"colwise_fused({','.join(map(str, self.parts))})"

    def rows(self, index: int) -> tuple[tuple[int, int], ...]:
        """(start, stop) of the rows of every part that rank `index` of the axis holds."""
        out, start = [], 0
        for size in self.parts:
            share = size // self.n
            out.append((start + index * share, start + (index + 1) * share))
            start += size
        return tuple(out)

    def take(self, t: Tensor, dim: int, index: int) -> Tensor:
        """Rank `index`'s rows of every part of `t` along `dim`, concatenated in part order
        (autograd gives the rest of `t` a zero gradient)."""
        return take_rows(t, dim, self.rows(index))


def take_rows(t: Tensor, dim: int, rows: tuple[tuple[int, int], ...]) -> Tensor:
    """The (start, stop) ranges `rows` of `t` along `dim`, concatenated in order."""
    return torch.cat([t.narrow(dim, a, b - a) for a, b in rows], dim=dim)


def parse_style(text: str, pattern: str | None = None) -> tuple[str, tuple[int, ...]]:
    """A plan entry's style name and its numbers: "colwise_fused(3)" (three equal parts) ->
    ("colwise_fused", (3,)); "colwise_fused(64, 16, 16)" (the sizes of the parts) ->
    ("colwise_fused", (64, 16, 16)); "colwise" -> ("colwise", ()).

    >>> parse_style("colwise_fused(64, 16, 16)")
    ('colwise_fused', (64, 16, 16))
    """
    name, paren, rest = text.partition("(")
    name = name.strip()
    where = "" if pattern is None else f" for {pattern!r}"
    if name not in STYLES:
        raise StyleError(f"parallelize: style {text!r}{where} is not one of {sorted(STYLES)}"
                         " (or 'colwise_fused(N)' / 'colwise_fused(size, size, ...)')")
    if not paren:
        return name, ()
    body = rest.rstrip()
    items = body[:-1].split(",") if body.endswith(")") else []
    if not STYLES[name].fused or not items or not all(i.strip().isdigit() for i in items):
        raise StyleError(
            f"parallelize: cannot read style {text!r}{where}: only 'colwise_fused' takes numbers,"
            " written 'colwise_fused(N)' (N equal parts) or 'colwise_fused(64, 16, 16)' (the"
            " output size of each part, in order)")
    return name, tuple(int(i) for i in items)


def _names(ndim: int, mesh: Mesh) -> Layout:
    """An activation's dims by position, named apart from the axes of `mesh`, whole."""
    return Layout.of_names(positional_names(ndim, mesh.axis_names))


def _split_at(ndim: int, dim: int, axis: str, mesh: Mesh) -> Layout:
    """The layout of `ndim` dims with dim `dim` (negative counts from the end) split over
    `axis`: "d0 (tp d1)"."""
    return _names(ndim, mesh).split(dim, axis)


@functools.lru_cache(maxsize=4096)
def _entry(inputs: str, axis: AxisName, mesh: Mesh, ndim: int) -> Entry | None:
    """The region entry of an input of `ndim` dims (None: it enters as is): "replicated" is
    Megatron's `f`, "sequence" the sequence-parallel gather."""
    names = _names(ndim, mesh)
    if inputs == "replicated":
        return Entry(names, names, names.pending("sum", [axis]))
    if inputs == "sequence":
        return Entry(_split_at(ndim, 1, axis, mesh), names, names.pending("sum", [axis]))
    return None


@functools.lru_cache(maxsize=4096)
def _exit(outputs: str, axis: AxisName, mesh: Mesh, ndim: int) -> Exit | None:
    """What becomes of a local result of `ndim` dims (None: returned as is)."""
    names = _names(ndim, mesh)
    if outputs == "gather":
        return Exit(_split_at(ndim, -1, axis, mesh), names)
    if outputs == "sum":
        return Exit(names.pending("sum", [axis]), names)
    if outputs == "sequence":
        return Exit(names.pending("sum", [axis]), _split_at(ndim, 1, axis, mesh))
    return None


def _is_conv1d(module: nn.Module) -> bool:
    """A transformers `Conv1D` (GPT-2's attention and MLP projections): `x @ weight + bias`
    with weight (in `nx`, out `nf`), told by its name and fields (transformers is not
    imported)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _kind_fits(module: nn.Module, kind: type) -> bool:
    return isinstance(module, kind) or (kind is nn.Linear and _is_conv1d(module))


def _out_features(module: nn.Module) -> int:
    """A Linear's or Conv1D's output width (0 for other modules)."""
    return int(getattr(module, "nf") if _is_conv1d(module) else getattr(module, "out_features", 0))


class _TP:
    """A module's tensor-parallel style: its mesh, axis, layouts and the forward wrapping."""

    def __init__(self, module: nn.Module, name: str, style: str, bound: BoundMesh,
                 axis: str, rows: FusedRows | None = None) -> None:
        self.module, self.name, self.axis = module, name, axis
        self.style = style if rows is None else f"{style}({','.join(map(str, rows.parts))})"
        self.index = bound.mesh.coords(bound.rank)[axis]
        # a fused style's rows of every part that this rank takes (None for the others)
        self.rows = None if rows is None else rows.rows(self.index)
        # Activations and their gradients differ across the other axes (each dp rank has
        # its batch): their plans run on the tp slice, which knows no other axis.
        self.bound = bound.sub(axis)
        self.mesh = bound.mesh             # names activation dims apart from every axis
        self.spec = STYLES[style]
        assert (rows is not None) == self.spec.fused, f"{style}: parts {rows}"
        self.layouts = self.spec.on(axis, bound.mesh)
        self.swapped: dict[str, Any] = {}
        self.bias: Any = None
        self.held: Tensor | None = None
        self.padding_idx: int | None = None
        self.conv1d = _is_conv1d(module)
        self.out_features = _out_features(module)
        self.zero_bias: Tensor | None = None  # a Conv1D's addmm needs a bias: zeros
        if self.spec.inputs == "tokens":     # the rows of the vocabulary this rank holds
            table = self.layouts.weight
            assert table is not None, f"{style} splits {name}.weight"
            shape = tuple(getattr(module, "weight").shape)
            self.vocab = VocabRows(table, bound.mesh, shape, bound.rank)
            pad = getattr(module, "padding_idx")    # a global row: this shard's own, or none
            self.local_padding = self.vocab.local_row(pad)

    def grad_sum(self, x: Tensor) -> Tensor:
        """`x` as is; backward: its gradient summed over the axis (an all_reduce): every
        rank's part of the gradient of an input a colwise layer used (Megatron's `f`)."""
        entry = _entry("replicated", self.axis, self.mesh, x.dim())
        assert entry is not None, "a replicated input has an entry"
        return entry(x, self.bound, shape=tuple(x.shape))

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        spec, grad = self.spec, torch.is_grad_enabled()
        params: dict[str, Any] = module._parameters   # holds shards and moved tensors here
        for attr, p in list(params.items()):
            if p is not None and is_dtensor(p):     # not gathered by fully_shard: use the shard
                self.swapped[attr] = p
                params[attr] = local_of(p)
        if spec.grad_sum and grad:
            for attr, p in list(params.items()):
                if p is not None:
                    self.swapped.setdefault(attr, p)
                    params[attr] = self.grad_sum(p)
        if self.rows is not None:          # this rank's rows of every part (whole weight)
            for attr, p in list(params.items()):
                if p is not None:
                    self.swapped.setdefault(attr, p)
                    dim = 1 if self.conv1d and attr == "weight" else 0
                    params[attr] = take_rows(p, dim, self.rows)
        if self.conv1d:    # its forward shapes the output by `nf`: this rank's columns
            setattr(module, "nf", params["weight"].shape[1])
        # the input: the first positional argument, or the first tensor passed by keyword
        # (Hugging Face calls its attention and MLP blocks as block(hidden_states=...))
        key = None if args else next(
            (k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
        if not args and key is None:
            raise ShapeError(f"parallelize: {self.name} ({self.style}) was called without a"
                             " tensor argument; its style acts on the first tensor it gets")
        x = args[0] if args else kwargs[cast(str, key)]
        entry = _entry(spec.inputs, self.axis, self.mesh, x.dim())
        if entry is not None and (grad or entry.x != entry.use):   # f: nothing without grad
            whole = entry.x == entry.use         # the local shape is the global one
            x = entry(x, self.bound, shape=tuple(x.shape) if whole else None)
        elif spec.inputs == "tokens":
            x, self.held = self.vocab.index(x)
            self.padding_idx = getattr(module, "padding_idx")
            setattr(module, "padding_idx", self.local_padding)
        if spec.outputs in ("sum", "sequence") and spec.split is not None:
            self.bias = params.get("bias")   # added once, after the sum
            if self.bias is not None:
                self.swapped.setdefault("bias", self.bias)
                params["bias"] = self._no_bias(self.bias)
                if spec.outputs == "sequence" and grad:   # used on this rank's rows only
                    self.bias = self.grad_sum(self.bias)
        if key is not None:
            return args, {**kwargs, key: x}
        return (x, *args[1:]), kwargs

    def _no_bias(self, bias: Tensor) -> Tensor | None:
        """What stands for the bias while the partial sums are computed: none, or for a
        Conv1D (whose forward adds it with addmm) zeros, made once."""
        if not self.conv1d:
            return None
        z = self.zero_bias
        if z is None or z.dtype != bias.dtype or z.device != bias.device:
            z = self.zero_bias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device)
        return z

    def post(self, module: nn.Module, args: tuple[Any, ...], out: Tensor | None
             ) -> Tensor | None:
        params: dict[str, Any] = module._parameters
        for attr, p in self.swapped.items():
            params[attr] = p
        self.swapped = {}
        if self.conv1d:
            setattr(module, "nf", self.out_features)
        if self.held is not None:
            setattr(module, "padding_idx", self.padding_idx)
        held, self.held = self.held, None
        bias, self.bias = self.bias, None
        if out is None:     # the forward raised (or a recomputation stopped early): restored
            return None
        if held is not None:
            out = VocabRows.masked(out, held)
        if self.spec.outputs == "as is":    # any output: an HF attention's (output, weights)
            return out
        leave = _exit(self.spec.outputs, self.axis, self.mesh, out.dim())
        if leave is None:
            return out
        shape = (*out.shape[:-1], self.out_features) if self.spec.outputs == "gather" else None
        return leave(out, self.bound, shape=shape, bias=bias)


def parallelize(module: nn.Module, mesh: BoundMesh, plan: Mapping[str, str] | str, *,
                axis: str = "tp", drift_rtol: float = 0.0, drift_atol: float = 0.0
                ) -> nn.Module:
    """Split the weights of the modules `plan` names over `axis` and wrap their forward
    (tensor parallelism); returns `module`, changed in place.

    >>> mc.nn.parallelize(model, bound, {"layers.*.attention.wq": "colwise",   # doctest: +SKIP
    ...                                  "layers.*.attention.wo": "rowwise"})

    `plan` maps module names (`fnmatch` patterns over `named_modules()`) to a style of
    `STYLES` (`colwise_fused` also as `colwise_fused(N)` or `colwise_fused(64, 16, 16)`,
    see `parse_style`), or is "auto": the model's own plan, `tp_plan_of(module)`. Every
    pattern must match a module of the right type; a `colwise` on a projection the model
    declares fused (`fused_parts`) is refused. Apply it before
    `fully_shard`, which then shards the split weights over its own axis. In check mode
    (`init_mesh(..., check=True)`) the gradients of the parameters left replicated over
    `axis` are compared across it after every backward (`drift.py`), bit for bit unless
    `drift_rtol` / `drift_atol` allow copies to differ by `atol + rtol * |gradient|` per
    element (for nondeterministic kernels; see docs/errors.md § Check mode).
    """
    mesh = require_bound(mesh, "parallelize")
    if not mesh.in_mesh:
        raise MeshMismatchError(
            f"parallelize: rank {mesh.rank} is not in {mesh.mesh!r}, so it holds no shard;"
            " fix: build and parallelize the model on the mesh's ranks only")
    if axis not in mesh.mesh.axis_names:
        raise MeshAxisError(f"parallelize(axis={axis!r}): not an axis of {mesh.mesh!r}; fix:"
                            f" one of {list(mesh.mesh.axis_names)}")
    for name, tol in (("drift_rtol", drift_rtol), ("drift_atol", drift_atol)):
        if not (isinstance(tol, (int, float)) and 0 <= tol < float("inf")):
            raise StyleError(f"parallelize({name}={tol!r}): a tolerance is a finite number"
                             " >= 0 (0, the default: gradients compared bit for bit)")
    if isinstance(plan, str):
        if plan != AUTO:
            raise StyleError(f"parallelize: plan {plan!r} is neither a mapping of module"
                             f" names to styles nor {AUTO!r} (the model's own plan)")
        plan = tp_plan_of(module)
    modules = dict(module.named_modules())
    size = mesh.mesh.axis_size(axis)
    targets, fused, owners = _read_plan(module, modules, plan, size, axis)
    tied = _check_ties(module, targets, axis, mesh.mesh)
    positions = sequence_hooks(module, targets, axis)   # HF models under embedding_sp
    split: dict[int, nn.Parameter | None] = dict.fromkeys(tied)  # tied: split once
    for name, style in targets.items():
        _split(modules[name], name, style, mesh, axis, split, fused.get(name))
    for owner, attrs in owners.items():
        _localize(modules[owner], attrs, size)
    install_sequence_hooks(positions)
    if mesh.check:     # check mode: replicated parameters' gradients compared (drift.py)
        sums = [k for k, s in STYLES.items() if s.grad_sum and s.kind is nn.Module]
        watch(module, mesh, axis, sorted(sums, key=lambda k: "sp" in k.split("_")),
              float(drift_rtol), float(drift_atol))
    return module


def _param_layout(style: str | None, module: nn.Module, attr: str, ndim: int, axis: str,
                  mesh: Mesh) -> Layout | None:
    """The layout `style` gives `module`'s parameter `attr` (None for a module outside the
    plan: the parameter stays a plain tensor)."""
    return None if style is None else STYLES[style].on(axis, mesh).param(module, attr, ndim)


def _check_ties(module: nn.Module, targets: Mapping[str, str], axis: str, mesh: Mesh
                ) -> set[int]:
    """The ids of tensors held in several places (tied weights), which must be split alike
    in all of them: each place's style gives it one layout, or the tie would silently come
    apart. (The tensors stay alive in their places while `parallelize` runs.)"""
    places: dict[int, list[tuple[str, Tensor]]] = {}
    for qual, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append((qual, p))
    for held in places.values():
        if len(held) < 2:
            continue
        layouts = []
        for qual, t in held:
            owner, _, attr = qual.rpartition(".")
            layouts.append(_param_layout(targets.get(owner), module.get_submodule(owner), attr,
                                         t.dim(), axis, mesh))
        if len(set(layouts)) > 1:
            where = ", ".join(f'{q} ("{lay}")' if lay is not None else f"{q} (not split)"
                              for (q, _), lay in zip(held, layouts))
            raise ShapeError(
                f"parallelize: {held[0][0]} is one tensor held in several places (tied"
                f" weights) that the plan would split differently: {where}. fix: give every"
                " module that holds it a style that splits it alike (an output layer tied to"
                " an `embedding` takes `colwise` or `colwise_gather`), or untie them first")
    return {key for key, held in places.items() if len(held) > 1}


def _read_plan(module: nn.Module, modules: Mapping[str, nn.Module], plan: Mapping[str, str],
               size: int, axis: str) -> tuple[dict[str, str], dict[str, FusedRows],
                                              dict[str, tuple[tuple[str, int], ...]]]:
    """Every module `plan` names, checked whole before any change: module name -> style,
    fused module name -> its parts over `size` ranks, owner name -> its sizes made local."""
    targets: dict[str, str] = {}
    fused: dict[str, FusedRows] = {}
    owners: dict[str, tuple[tuple[str, int], ...]] = {}
    for pattern, text in plan.items():
        style, numbers = parse_style(text, pattern)
        kind = STYLES[style].kind
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise StyleError(f"parallelize: {pattern!r} matches no module; names look like"
                             f" {[n for n in modules if n][:4]}")
        for name in names:
            m = modules[name]
            if not _kind_fits(m, kind):
                raise StyleError(f"parallelize: {name} is an nn.{type(m).__name__}; style"
                                 f" {style!r} needs an nn.{kind.__name__}")
            if hasattr(m, TP_ATTR) or name in targets:
                raise StyleError(f"parallelize: {name} matches two patterns of the plan")
            declared = fused_parts(module, name, m) if _kind_fits(m, nn.Linear) else None
            unknown = unknown_fused(module, name) if declared is None else None
            if STYLES[style].fused:
                fused[name] = _fused_rows(name, m, text, numbers, declared, size, unknown)
                if declared is not None and declared.attrs:
                    owners[declared.owner] = _local_sizes(declared, name, size, axis,
                                                          modules[declared.owner])
            elif declared is not None and STYLES[style].outputs == "split":
                fix = "colwise_fused_sp" if STYLES[style].inputs == "local" else "colwise_fused"
                raise StyleError(
                    f"parallelize: {name} is a fused projection ({len(declared.parts)} parts"
                    f" of sizes {declared.parts} stacked along its output), so {style!r}"
                    " would give each rank whole parts instead of a slice of every part;"
                    f" fix: give {pattern!r} the style {fix!r}")
            elif unknown is not None and STYLES[style].outputs == "split":
                raise StyleError(
                    f"parallelize: {name} is named as transformers names a fused projection"
                    f" (parts such as q, k, v or gate, up in one weight), but its owner"
                    f" {unknown} is not one whose layout meshcomm knows"
                    f" ({_known_owners(name)}), so {style!r} might give each rank whole parts"
                    " instead of a slice of every part; nothing was split. fix: if its output"
                    " rows are its parts one after another, name their sizes, e.g."
                    f" {pattern!r}: 'colwise_fused(64, 16, 16)'; else leave it and the layer"
                    " that takes its output out of the plan (fully_shard shards them)")
            targets[name] = style
    _check_sequence_entries(modules, targets)
    return targets, fused, owners


def _check_sequence_entries(modules: Mapping[str, nn.Module], targets: Mapping[str, str]
                            ) -> None:
    """A style that sums its input's gradient over the axis ("replicated": colwise,
    colwise_fused, colwise_gather) inside an `sp_input` module, which reduce_scatters that
    gradient again, would sum it twice; a style that leaves it partial ("local": the *_sp
    ones) outside one would never sum it; an `sp_input` module with no such style inside
    gets its output's gradient whole on every rank and sums it over the axis again. All
    three train wrong without an error: refused."""
    def style_of(name: str) -> str | None:
        tp = getattr(modules[name], TP_ATTR, None)
        return targets.get(name, None if tp is None else tp.style)
    gathers = {n for n in modules if n and style_of(n) == "sp_input"}
    for name, style in targets.items():
        inputs = STYLES[style].inputs
        if inputs not in ("replicated", "local"):
            continue
        parts = name.split(".")
        outer = next((o for o in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
                      if o in gathers), None)
        if inputs == "replicated" and outer is not None:
            twin = {"colwise": "'colwise_sp'", "colwise_fused": "'colwise_fused_sp'"}.get(
                style, "a style outside the sp_input module")
            raise StyleError(
                f"parallelize: {name} ({style}) is inside {outer} (sp_input), which"
                f" reduce_scatters its input's gradient; {style!r} all_reduces that gradient"
                f" as well, so it would be summed twice. fix: use {twin} for {name}")
        if inputs == "local" and outer is None:
            raise StyleError(
                f"parallelize: {name} ({style}) leaves its input's gradient partial for an"
                " enclosing sp_input module to sum, but no module around it is sp_input."
                f" fix: give its block 'sp_input', or use {style.removesuffix('_sp')!r}")
    for outer in sorted(gathers):
        inside = [n for n in modules if n.startswith(outer + ".")
                  and (s := style_of(n)) is not None
                  and STYLES[s.split("(")[0]].inputs == "local"]
        if not inside:
            raise StyleError(
                f"parallelize: {outer} (sp_input) gathers the sequence and reduce_scatters"
                " its gradient, which only a partial gradient from a module inside it"
                " ('colwise_sp', 'colwise_fused_sp') makes right; it has none, so the"
                " gradient arriving whole on every rank would be summed over the axis again."
                " fix: give sp_input to the block whose first projections are colwise_sp,"
                " and 'colwise_gather_sp' to an output layer that needs the whole sequence")


def _known_owners(name: str) -> str:
    """The owner classes whose fused module `name`'s attribute meshcomm knows, as text."""
    return "it knows " + ", ".join(sorted(FUSED_OWNERS.get(name.rpartition(".")[2], ())))


def _fused_rows(name: str, m: nn.Module, text: str, numbers: tuple[int, ...],
                declared: Fused | None, n: int, unknown: str | None = None) -> FusedRows:
    """The parts of fused module `name` over `n` ranks: as `text` numbers them, else as its
    model declares them; checked against its output width and `n`."""
    width = _out_features(m)
    if len(numbers) == 1:
        if numbers[0] == 0 or width % numbers[0]:
            raise StyleError(f"parallelize: {name} ({text}): its {width} output rows cannot"
                             f" be {numbers[0]} equal parts; fix: give each part's size,"
                             " 'colwise_fused(64, 16, 16)'")
        parts = (width // numbers[0],) * numbers[0]
    elif numbers:
        parts = numbers
    elif declared is not None:
        parts = declared.parts
    else:
        known = (f"its owner {unknown} is not one whose layout meshcomm knows"
                 f" ({_known_owners(name)})" if unknown is not None else
                 "its model declares no parts for it (meshcomm knows those of GPT-2's c_attn"
                 " and Phi-3's qkv_proj and gate_up_proj: hf_plan.FUSED_OWNERS)")
        raise StyleError(
            f"parallelize: {name} ({text}): {known}; fix: name them, 'colwise_fused(2)' for 2"
            " equal parts or 'colwise_fused(64, 16, 16)' with the output size of each part,"
            " in order")
    if declared is not None and parts != declared.parts:
        raise StyleError(f"parallelize: {name} ({text}): parts {parts}, but its model"
                         f" declares {declared.parts}; fix: write 'colwise_fused'")
    if sum(parts) != width:
        raise ShapeError(f"parallelize: {name} ({text}): parts {parts} add up to"
                         f" {sum(parts)}, but it has {width} output rows; fix: give sizes"
                         f" that add up to {width}")
    if any(p % n for p in parts):
        raise ShapeError(f"parallelize: {name} ({text}): parts {parts} do not all divide"
                         f" over {n} ranks; fix: use an axis whose size divides every part")
    return FusedRows(parts, n)


def _local_sizes(declared: Fused, name: str, n: int, axis: str, owner: nn.Module
                 ) -> tuple[tuple[str, int], ...]:
    """The owner's attributes that `LocalSizes` makes local: each must be there (a dotted
    one, `config.num_attention_heads`, on the object its first part names) and divide."""
    for path, _ in declared.attrs:
        held: Any = owner
        for i, part in enumerate(path.split(".")):
            if not hasattr(held, part):
                what = ".".join(path.split(".")[:i + 1])
                raise StyleError(
                    f"parallelize: {name} is fused and its owner {declared.owner}"
                    f" ({type(owner).__name__}) splits its output by {path}, which"
                    f" meshcomm makes this rank's share while it runs, but it has no {what};"
                    f" nothing was split. fix: give {declared.owner} its {what} as"
                    " transformers builds it (the model's config), or leave the projection"
                    " and the layer that takes its output out of the plan")
            held = getattr(held, part)
    bad = [f"{a}={v}" for a, v in declared.attrs if v % n]
    if bad:
        raise ShapeError(f"parallelize: {name} is fused and {declared.owner} splits its"
                         f" output by {', '.join(bad)}, which {axis!r} ({n} ranks) does not"
                         " divide; fix: use an axis whose size divides the heads")
    return declared.attrs


def _localize(owner: nn.Module, attrs: tuple[tuple[str, int], ...], n: int) -> None:
    """While `owner` runs, its attributes `attrs` hold this rank's sizes (`LocalSizes`)."""
    if hasattr(owner, LOCAL_ATTR):
        return
    local = LocalSizes(owner, attrs, n)
    setattr(owner, LOCAL_ATTR, local)
    owner.register_forward_pre_hook(local.pre)
    owner.register_forward_hook(local.post, always_call=True)


def _split(m: nn.Module, name: str, style: str, bound: BoundMesh, axis: str,
           split: dict[int, nn.Parameter | None], rows: FusedRows | None = None) -> None:
    spec = STYLES[style]
    for attr, p in list(m._parameters.items()):
        if p is None or spec.split is None:
            continue
        done = split.get(id(p))
        if done is not None:               # tied: split alike elsewhere already
            m._parameters[attr] = done
            continue
        if is_dtensor(p):
            raise ShapeError(f"parallelize: {name}.{attr} is a DTensor already; fix:"
                             " parallelize before fully_shard, once")
        layout = _param_layout(style, m, attr, p.dim(), axis, bound.mesh)
        assert layout is not None, f"{style} splits {name}.{attr}"
        shape = tuple(p.shape)
        local = _block(p.detach(), layout, bound, shape)
        dt = wrap(local, bound.device_mesh, to_placements(bound.mesh, shape, layout), shape)
        m._parameters[attr] = nn.Parameter(dt, requires_grad=p.requires_grad)
        if id(p) in split:
            split[id(p)] = m._parameters[attr]
    tp = _TP(m, name, style, bound, axis, rows)
    setattr(m, TP_ATTR, tp)
    m.register_forward_pre_hook(tp.pre, with_kwargs=True)
    # always: a forward that raises, or torch.utils.checkpoint's recomputation stopping
    # early (it raises once it has what backward needs), must not leave shards in place
    m.register_forward_hook(tp.post, always_call=True)


def _block(full: Tensor, layout: Layout, bound: BoundMesh, shape: tuple[int, ...]) -> Tensor:
    """This rank's block of `full` (or an empty meta block of its shape)."""
    local_shape = layout.local_shape(bound.mesh, shape, bound.rank)
    if full.is_meta:
        return torch.empty(local_shape, dtype=full.dtype, device="meta")
    index = layout.indices(bound.mesh, shape, bound.rank)
    out = full
    for dim, ix in enumerate(index):
        ix = tuple(ix)
        start = ix[0] if ix else 0
        out = out.narrow(dim, start, len(ix))
    return out.clone()


def tp_style(module: nn.Module) -> str | None:
    """The tensor-parallel style of `module`, or None."""
    tp = getattr(module, TP_ATTR, None)
    return None if tp is None else tp.style

