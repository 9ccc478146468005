"""One parameter of a fully_shard unit: how it is sharded (at wrap time) and the numbers a
step needs about it, computed once; and the mixed-precision policy value. Never
communicates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...core.errors import MeshMismatchError, ShapeError
from ...core.layout import Layout
from ...core.names import positional_names
from ...core.reduce_ops import chunk_sizes
from ...interop.placements import from_placements, to_placements
from ...interop.runtime import (
    device_mesh_of,
    global_shape,
    is_dtensor,
    like,
    local_of,
    placements_of,
    wrap,
)
from ...planner.values import CostModel
from ...runtime.bind import BoundMesh
from ..params import ParamSpec

UNIT_ATTR = "_meshcomm_fsdp_unit"     # the attribute a fully_shard'ed module holds its unit in
# fully_shard's plans: an all_gather forward, a reduce_scatter backward, whatever the shard
# sizes (the planner alone would reduce a tiny uneven parameter by all_reduce and a slice;
# FSDP2 pads, so does the unit: one collective per unit each way). HSDP adds the all_reduce
# over the replicas (one call over all the replicate axes: one flattened group), which the
# planner puts after the reduce_scatter except for tiny uneven parameters: those run their
# own plan beside the unit's buffer. Chosen on bytes (no latency): a unit's parameters share
# one call per step, so a latency is paid once per unit, not once per parameter.
FSDP_PLANS = CostModel(trees=False, native=("all_gather", "reduce_scatter"), latency_s=0.0)
HSDP_PLANS = CostModel(trees=False, native=("all_gather", "reduce_scatter", "all_reduce"),
                       latency_s=0.0)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of FSDP's communication and compute (None: the parameter's own dtype).

    `param_dtype`: the dtype parameters are gathered and computed in (the shards stay in
    their own dtype for the optimizer). `reduce_dtype`: the dtype gradients are reduced in;
    they are stored in the parameter's dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass
class Param:
    """One parameter of a unit: where it lives and how it moves (its `ParamSpec`, the one
    per-parameter record of meshcomm.nn: stored, use and grad layouts, grad_scale).

    A parameter fully_shard sharded is a DTensor `nn.Parameter` that forward replaces by the
    gathered tensor; one of a recipe module (`ShardedModule`) stays in place, stored as its
    recipe says, and forward hands the gathered tensor to the module's `use(name)`."""

    module: nn.Module
    attr: str
    name: str
    param: Any                     # the stored parameter (a DTensor, or a recipe's local shard)
    spec: ParamSpec
    use_shape: tuple[int, ...]     # this rank's gathered tensor: what forward computes with
    aliases: tuple[tuple[nn.Module, str], ...] = ()   # other places of a tied parameter
    recipe: bool = False           # a recipe module's parameter (used through `use(name)`)

    def place(self, t: Tensor) -> None:
        """`t` where forward reads this parameter (a tied one: in each of its places)."""
        if self.recipe:
            self.module.in_use[self.attr] = t      # type: ignore[index, operator]
            return
        self.module._parameters[self.attr] = t     # type: ignore[assignment]
        for m, a in self.aliases:
            m._parameters[a] = t                   # type: ignore[assignment]

    def put_back(self) -> None:
        """The stored parameter back in its places."""
        if self.recipe:
            self.module.in_use.pop(self.attr, None)   # type: ignore[operator, union-attr]
        else:
            self.place(self.param)

    def local(self) -> Tensor:
        """This rank's stored shard (detached)."""
        held: Tensor = self.param if self.recipe else self.param.to_local()
        return held.detach()

    def set_grad(self, local: Tensor) -> None:
        """Add `local` (this rank's reduced gradient) to the parameter's `.grad`."""
        grad = local.to(self.param.dtype)
        if not self.recipe:
            grad = like(grad, self.param)
        if self.param.grad is None:
            self.param.grad = grad
        else:
            self.param.grad += grad


def recipe_param(bound: BoundMesh, module: Any, attr: str, name: str, p: nn.Parameter,
                 aliases: tuple[tuple[nn.Module, str], ...] = ()) -> Param:
    """A parameter of a recipe module (`ShardedModule`): stored as its spec says already."""
    spec = module.specs[attr]
    if spec.mesh != bound.mesh:
        raise MeshMismatchError(f"fully_shard: parameter {name} is stored on {spec.mesh!r}"
                                f" (its module's mesh), not on {bound.mesh!r}; fix: pass the"
                                " module's own bound mesh")
    p._meshcomm_fsdp = True          # type: ignore[attr-defined]
    return Param(module, attr, name, p, spec,
                 spec.use.local_shape(spec.mesh, spec.shape, bound.rank), aliases, recipe=True)


Tied = dict[int, tuple[tuple[nn.Module, str], ...]]


def owned_params(module: nn.Module) -> tuple[list[tuple[nn.Module, str, str, nn.Parameter]],
                                              Tied]:
    """(module, attribute, qualified name, parameter) of every parameter `module` owns, not
    those under a submodule that is a unit already; and, per parameter, the other
    (module, attribute) places that hold the same tensor (tied weights: one unit shards it
    once and puts it in every place). A tensor tied to one another unit manages is refused,
    as FSDP2 refuses it."""
    out: list[tuple[nn.Module, str, str, nn.Parameter]] = []
    seen: dict[int, str] = {}            # id(parameter) -> where it was met first
    tied: Tied = {}
    units: dict[int, str] = {}          # id(module of a unit below) -> its qualified name

    def elsewhere(p: Any) -> str | None:
        """Where another unit holds `p` (a tensor it replaced by its shard), or None."""
        holder = getattr(p, "_meshcomm_sharded_as", None)
        if holder is None:
            return None
        owner, name = holder
        return f"{units[owner]}.{name}" if owner in units else f"{name} of another unit"

    def walk(prefix: str, m: nn.Module) -> None:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            name = f"{prefix}{attr}"
            taken = seen.get(id(p)) or elsewhere(p)
            if taken is not None and (taken.endswith("(unit)") or id(p) not in seen):
                raise ShapeError(
                    f"fully_shard: parameter {name} is the same tensor as {taken}, which"
                    " another fully_shard unit manages already (tied weights across units);"
                    " fix: put every module that holds it in one unit (fully_shard their"
                    " common parent, not each of them)")
            if getattr(p, "_meshcomm_fsdp", False):
                raise ShapeError(
                    f"fully_shard: parameter {name} is sharded by another unit already: a"
                    " module around this one was fully_shard'ed first. fix: fully_shard the"
                    " inner modules first, then the root (as FSDP2: for block in"
                    " model.layers: fully_shard(block); fully_shard(model))")
            if taken is not None:            # tied inside this unit: sharded once
                tied[id(p)] = (*tied.get(id(p), ()), (m, attr))
                continue
            seen[id(p)] = name
            out.append((m, attr, name, p))
        for child_name, child in m._modules.items():
            if child is not None and not hasattr(child, UNIT_ATTR):
                walk(f"{prefix}{child_name}.", child)
            elif child is not None:
                units[id(child)] = f"{prefix}{child_name}"
                for q in child.parameters():
                    seen.setdefault(id(q), f"{prefix}{child_name}.(unit)")

    walk("", module)
    return out, tied


def shard_param(bound: BoundMesh, axis: str, module: nn.Module, attr: str, name: str,
                 p: nn.Parameter, replicate: tuple[str, ...] = (),
                 aliases: tuple[tuple[nn.Module, str], ...] = (),
                 unit_module: nn.Module | None = None) -> Param:
    """`p` as a DTensor parameter sharded along dim 0 over `axis` (on top of the tensor
    parallel split a DTensor `p` already has), replicated over the axes `replicate` (HSDP)."""
    mesh = bound.mesh
    if p.dim() == 0:
        raise ShapeError(f"fully_shard: parameter {name} is a scalar; FSDP shards dim 0."
                         " fix: make it shape (1,) or keep it outside the unit")
    names = positional_names(p.dim(), mesh.axis_names)
    if is_dtensor(p):
        if bound.mesh != type(mesh).from_device_mesh(device_mesh_of(p)):
            raise MeshMismatchError(f"fully_shard: parameter {name} is a DTensor on"
                                    f" {type(mesh).from_device_mesh(device_mesh_of(p))!r}, not on"
                                    f" {mesh!r}; fix: parallelize on the same mesh")
        shape = global_shape(p)
        use = from_placements(mesh, shape, placements_of(p), names=" ".join(names))
        for taken in (axis, *replicate):
            if taken in use.sharded_axes(mesh) or use.partial_axes:
                raise ShapeError(f"fully_shard: parameter {name} is already split over"
                                 f' {taken!r} ("{use}"); fix: shard it over another axis')
        full = local_of(p)
    else:
        shape, use, full = tuple(p.shape), Layout.of_names(names), p.detach()
    use_shape = tuple(full.shape)
    stored = use.split(0, axis)
    n = mesh.axis_size(axis)
    rows = chunk_sizes(use_shape[0], n)
    mine = stored.local_shape(mesh, shape, bound.rank) if bound.in_mesh else None
    me = mesh.coords(bound.rank)[axis]
    if mine is None or mine[0] != rows[me] or tuple(mine[1:]) != use_shape[1:]:
        raise ShapeError(
            f"fully_shard: parameter {name} of shape {shape} (\"{use}\") cannot be split"
            f" evenly enough over {axis!r}: its shards would not be consecutive rows."
            f" fix: make dim 0 ({shape[0]}) divisible by the sizes of the axes that split it")
    start = sum(rows[:me])
    if full.is_meta:
        local = torch.empty((rows[me], *use_shape[1:]), dtype=full.dtype, device="meta")
    else:
        local = full[start:start + rows[me]].detach().clone()
    dm = device_mesh_of(p) if is_dtensor(p) else bound.device_mesh
    dt = wrap(local, dm, to_placements(mesh, shape, stored), shape)
    param = nn.Parameter(dt, requires_grad=p.requires_grad)
    param._meshcomm_fsdp = True      # type: ignore[attr-defined]
    # the tensor replaced here: a later unit that meets it (a tie across units) refuses it
    p._meshcomm_sharded_as = (id(unit_module), name)   # type: ignore[attr-defined]
    module._parameters[attr] = param
    for m, a in aliases:             # tied: every place holds the one sharded parameter
        m._parameters[a] = param
    grad = use.pending("avg", [axis, *replicate])
    spec = ParamSpec(" ".join(names), mesh, shape, p.dtype, stored, use, grad,
                     cost_model=HSDP_PLANS if replicate else FSDP_PLANS)
    return Param(module, attr, name, param, spec, use_shape, aliases)
