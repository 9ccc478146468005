"""`parallelize`: tensor parallelism on unmodified modules, planned by meshcomm.

`mc.nn.parallelize(model, bound, {"layers.*.attention.wq": "colwise", ...}, axis="tp")`
splits the weights of the named `nn.Linear` / `nn.Embedding` modules over mesh axis `axis`
(DTensor parameters, replicated over the other axes, so `fully_shard` can shard them
further over "dp") and wraps each module's forward with the activation moves its style
needs. Every move is a meshcomm plan on layouts (`d0 d1 ...` are the activation's dims):

| style            | weight            | input                        | output                    |
|------------------|-------------------|------------------------------|---------------------------|
| `colwise`        | `(tp d0) d1`      | replicated; backward: all_reduce of its gradient | last dim split `(tp dk)` |
| `colwise_gather` | `(tp d0) d1`      | as colwise                   | all_gather to replicated  |
| `rowwise`        | `d0 (tp d1)`      | last dim split (a colwise output) | `... | sum(tp)` -> all_reduce; bias added after |
| `embedding`      | `(tp d0) d1` (vocab rows) | replicated token ids  | `... | sum(tp)` -> all_reduce |

A colwise output keeps the last dim split, so attention heads and MLP hidden units stay
local until the rowwise projection sums them: two all_reduces per transformer block in
forward and two in backward, as Megatron-style tensor parallelism.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import MeshAxisError, MeshMismatchError, ShapeError
from ..core.layout import Layout
from ..core.reduce_ops import chunk_sizes
from ..executors.distributed.bind import BoundMesh
from ..interop.placements import to_placements
from ..interop.runtime import is_dtensor, wrap
from ..sharded import reshard

STYLES = {
    "colwise": (nn.Linear, "(tp d0) d1"),
    "colwise_gather": (nn.Linear, "(tp d0) d1"),
    "rowwise": (nn.Linear, "d0 (tp d1)"),
    "embedding": (nn.Embedding, "(tp d0) d1"),
}
TP_ATTR = "_meshcomm_tp"


def _names(ndim: int) -> str:
    return " ".join(f"d{i}" for i in range(ndim))


def _last_split(ndim: int, axis: str) -> str:
    names = [f"d{i}" for i in range(ndim)]
    names[-1] = f"({axis} {names[-1]})"
    return " ".join(names)


class _GradSum(torch.autograd.Function):
    """Forward: `x` as is. Backward: the gradient summed over `axis` (an all_reduce plan):
    every rank's part of the input's gradient, where a colwise layer used the input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: BoundMesh, axis: str) -> Tensor:
        ctx.bound, ctx.axis = bound, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        names = _names(g.dim())
        return reshard(g, ctx.bound, f"{names} | sum({ctx.axis})", names), None, None


class _TP:
    """A module's tensor-parallel style: its mesh, axis and the forward wrapping."""

    def __init__(self, module: nn.Module, name: str, style: str, bound: BoundMesh,
                 axis: str) -> None:
        self.module, self.name, self.style, self.bound, self.axis = (
            module, name, style, bound, axis)
        self.n = bound.mesh.axis_size(axis)
        self.pos = bound.mesh.coords(bound.rank)[axis]
        self.swapped: dict[str, Any] = {}
        self.bias: Any = None
        self.mask: Tensor | None = None

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        for attr, p in list(module._parameters.items()):
            if p is not None and is_dtensor(p):     # not gathered by fully_shard: use the shard
                self.swapped[attr] = p
                module._parameters[attr] = p.to_local()   # type: ignore[assignment]
        x = args[0]
        if self.style in ("colwise", "colwise_gather") and torch.is_grad_enabled():
            x = _GradSum.apply(x, self.bound, self.axis)
        elif self.style == "rowwise":
            self.bias = module._parameters.get("bias")
            if self.bias is not None:
                self.swapped.setdefault("bias", self.bias)
                module._parameters["bias"] = None
        elif self.style == "embedding":
            rows = chunk_sizes(module.num_embeddings, self.n)
            start = sum(rows[:self.pos])
            local = x - start
            self.mask = (local >= 0) & (local < rows[self.pos])
            x = local.clamp(0, max(rows[self.pos] - 1, 0))
        return (x, *args[1:])

    def post(self, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        for attr, p in self.swapped.items():
            module._parameters[attr] = p
        self.swapped = {}
        names = _names(out.dim())
        if self.style == "colwise_gather":
            out = reshard(out, self.bound, _last_split(out.dim(), self.axis), names,
                          shape=(*out.shape[:-1], module.out_features))
        elif self.style == "rowwise":
            out = reshard(out, self.bound, f"{names} | sum({self.axis})", names)
            if self.bias is not None:
                out = out + self.bias
            self.bias = None
        elif self.style == "embedding":
            if module.num_embeddings and self.mask is not None:
                out = out * self.mask.unsqueeze(-1).to(out.dtype)
            out = reshard(out, self.bound, f"{names} | sum({self.axis})", names)
            self.mask = None
        return out


def parallelize(module: nn.Module, mesh: BoundMesh, plan: Mapping[str, str], *,
                axis: str = "tp") -> nn.Module:
    """Split the weights of the modules `plan` names over `axis` and wrap their forward
    (tensor parallelism); returns `module`, changed in place.

    >>> mc.nn.parallelize(model, bound, {"layers.*.attention.wq": "colwise",   # doctest: +SKIP
    ...                                  "layers.*.attention.wo": "rowwise"})

    `plan` maps module names (`fnmatch` patterns over `named_modules()`) to a style of
    `STYLES`. Every pattern must match a module of the right type. Apply it before
    `fully_shard`, which then shards the split weights over its own axis.
    """
    if not isinstance(mesh, BoundMesh):
        raise MeshAxisError(f"parallelize needs a BoundMesh (mc.init_mesh), got"
                            f" {type(mesh).__name__}")
    if not mesh.in_mesh:
        raise MeshMismatchError(
            f"parallelize: rank {mesh.rank} is not in {mesh.mesh!r}, so it holds no shard;"
            " fix: build and parallelize the model on the mesh's ranks only")
    if axis not in mesh.mesh.axis_names:
        raise MeshAxisError(f"parallelize(axis={axis!r}): not an axis of {mesh.mesh!r}; fix:"
                            f" one of {list(mesh.mesh.axis_names)}")
    modules = dict(module.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ShapeError(f"parallelize: style {style!r} for {pattern!r} is not one of"
                             f" {sorted(STYLES)}")
        kind = STYLES[style][0]
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ShapeError(f"parallelize: {pattern!r} matches no module; names look like"
                             f" {[n for n in modules if n][:4]}")
        for name in names:
            m = modules[name]
            if not isinstance(m, kind):
                raise ShapeError(f"parallelize: {name} is an nn.{type(m).__name__}; style"
                                 f" {style!r} needs an nn.{kind.__name__}")
            if hasattr(m, TP_ATTR):
                raise ShapeError(f"parallelize: {name} matches two patterns of the plan")
            _split(m, name, style, mesh, axis)
    return module


def _split(m: nn.Module, name: str, style: str, bound: BoundMesh, axis: str) -> None:
    weight_layout = STYLES[style][1].replace("tp", axis)
    for attr, p in list(m._parameters.items()):
        if p is None:
            continue
        if is_dtensor(p):
            raise ShapeError(f"parallelize: {name}.{attr} is a DTensor already; fix:"
                             " parallelize before fully_shard, once")
        if attr == "weight":
            layout = Layout(weight_layout)
        elif style in ("colwise", "colwise_gather"):
            layout = Layout(f"({axis} d0)")            # the bias follows the output rows
        else:
            layout = Layout(_names(p.dim()))           # replicated
        shape = tuple(p.shape)
        local = _block(p.detach(), layout, bound, shape)
        dt = wrap(local, bound.device_mesh, to_placements(bound.mesh, shape, layout), shape)
        m._parameters[attr] = nn.Parameter(dt, requires_grad=p.requires_grad)
    tp = _TP(m, name, style, bound, axis)
    setattr(m, TP_ATTR, tp)
    m.register_forward_pre_hook(tp.pre)
    m.register_forward_hook(tp.post)


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

