"""`reshard` of a local shard: the plan from `mc.plan`, run by the executor.

Thin: the arguments normalized, the cached plan made (outside any fake-tensor mode), then
run on this rank by the engine (`executors.distributed.execute`), differentiably on one mesh
or across two (`executors.distributed.autograd`), or under torch.compile as one opaque
call. Nothing here communicates except through a plan, and nothing communicates to learn a
shape.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ..core.errors import MeshcommError, MeshMismatchError, PlanError, ShapeError
from ..core.layout import Layout, Shape, as_layout
from ..core.mesh import Mesh
from ..executors.distributed.autograd import placeholder, reshard_autograd
from ..executors.distributed.execute import prepare
from ..executors.distributed.handlers import ByteTrace
from ..planner.plan import backward_plan, plan_untraced
from ..planner.values import CostModel, Plan
from ..runtime.bind import BoundMesh, require_bound
from ..runtime.checks import agree_reshard, checking, raise_together
from ..runtime.compiler import when_dynamo_loads


def reshard_local(x_local: Tensor | None, mesh: Any, src: str | Layout, dst: str | Layout, *,
                  dst_mesh: BoundMesh | None = None, shape: Sequence[int] | None = None,
                  dtype: torch.dtype | None = None, cost_model: CostModel | None = None,
                  trace: ByteTrace | None = None, check: bool | None = None,
                  async_op: bool = False, requires_grad: bool = False) -> Tensor | None:
    """`mc.reshard` of a local tensor `x_local` (see `meshcomm.sharded.reshard`)."""
    if dst_mesh is not None and not (isinstance(mesh, BoundMesh) and
                                     isinstance(dst_mesh, BoundMesh) and
                                     dst_mesh.mesh == mesh.mesh):
        return _reshard_cross(x_local, mesh, src, dst, dst_mesh, shape, dtype, cost_model, trace,
                              requires_grad)
    x = cast(Tensor, x_local)   # on one mesh: `_plan_for` refuses anything but a tensor
    if torch.compiler.is_compiling():
        if trace is not None:
            raise ShapeError("reshard(trace=...) records eager calls only; under torch.compile"
                             " leave it out (the plan's send_bytes/recv_bytes are the same)")
        return _reshard_traced(x, _static_args(mesh, src, dst, shape, dtype, cost_model))
    if async_op and torch.is_grad_enabled() and getattr(x, "requires_grad", False):
        raise ShapeError("reshard(async_op=True) returns before its collectives finish and"
                         " records no gradient; fix: pass x.detach(), or leave async_op out")
    if not checking(mesh, check):
        p = _plan_for(x, mesh, src, dst, shape, dtype, cost_model)
    else:
        try:   # check mode: the ranks agree on the call first, a rank that fails here too
            p = _plan_for(x, mesh, src, dst, shape, dtype, cost_model)
        except MeshcommError as err:
            raise_together(mesh, err, "reshard")
        agree_reshard(x, mesh, p)
    if async_op:
        return prepare([p], mesh).issue([x], trace=trace).unwaited()[0]
    return reshard_autograd(x, mesh, p, trace, reverse=backward_plan)


def _reshard_cross(x: Tensor | None, bound: BoundMesh, src: str | Layout, dst: str | Layout,
                   dst_bound: BoundMesh, shape: Sequence[int] | None, dtype: torch.dtype | None,
                   cost_model: CostModel | None, trace: ByteTrace | None,
                   requires_grad: bool) -> Tensor | None:
    """`reshard` onto another mesh, differentiable when the gradient flows (see
    `meshcomm.executors.distributed.autograd`)."""
    for name, b in (("mesh", bound), ("dst_mesh", dst_bound)):
        require_bound(b, "reshard(..., dst_mesh=...)", name)
    if not bound.in_mesh and not dst_bound.in_mesh:
        return None
    if torch.compiler.is_compiling():
        if trace is not None or requires_grad or (x is not None and x.requires_grad
                                                   and torch.is_grad_enabled()):
            raise ShapeError(
                "reshard(..., dst_mesh=...) under torch.compile runs forward only: it takes no"
                " trace=, requires_grad= or input that requires grad. fix: pass x.detach(),"
                " or call it outside the compiled function")
        static = (plain_bound(bound), plain_bound(dst_bound), str(src), str(dst),
                  () if shape is None else (tuple(int(s) for s in shape),),
                  () if dtype is None else (dtype,), plain_cost_model(cost_model))
        y = _reshard_cross_traced(() if x is None else (x,), static)
        return y if dst_bound.in_mesh else None
    return _cross(x, bound, src, dst, dst_bound, shape, dtype, cost_model, trace, requires_grad)


def _cross(x: Tensor | None, bound: BoundMesh, src: str | Layout, dst: str | Layout,
           dst_bound: BoundMesh, shape: Sequence[int] | None, dtype: torch.dtype | None,
           cost_model: CostModel | None, trace: ByteTrace | None,
           requires_grad: bool) -> Tensor | None:
    """`_reshard_cross` on this rank, planned and run (eager, or inside the traced call)."""
    rank = bound.rank
    if bound.in_mesh:
        p = _plan_for(x, bound, src, dst, shape, dtype, cost_model, dst_bound.mesh)
    elif shape is None or dtype is None:
        raise ShapeError(
            f"rank {rank} is only in the destination mesh {dst_bound.mesh!r}: it has no shard"
            " to read the global shape and dtype from. fix: pass shape=(...) and dtype=..."
            " (those of the source) on every rank")
    else:
        p = plan_untraced(bound.mesh, tuple(shape), as_layout(src, "src"), as_layout(dst, "dst"),
                          dtype=dtype, cost_model=cost_model, dst_mesh=dst_bound.mesh)
    grads = bool(x.requires_grad) if x is not None else requires_grad
    if x is not None and requires_grad and not x.requires_grad:
        raise PlanError(
            f"reshard(..., dst_mesh=..., requires_grad=True) on rank {rank}, whose input does"
            " not require grad: requires_grad= is for ranks only in the destination mesh (no"
            " input), and must say what the source ranks' inputs do. fix: leave it out here,"
            " or x.requires_grad_()")
    if not (grads and torch.is_grad_enabled()):
        return prepare([p], bound, dst=dst_bound).issue([x], trace=trace).wait()[0]
    held = x if x is not None else placeholder(p, dst_bound, True)
    return reshard_autograd(held, bound, p, trace, reverse=backward_plan, dst=dst_bound)


# Under torch.compile, Dynamo never traces the planner: `_static_args` only reads plain values
# (strings, ints, tuples) off the bound mesh, and `_reshard_traced` is one opaque call for
# Dynamo that AOTAutograd traces down to the functional collectives it makes, planning with
# real Python on the way (outside the fake-tensor mode; see `plan_untraced`).
# `mc.nn.attention` does the same with `plain_bound`, `plain_cost_model` and `concrete`.
def plain_bound(bound: BoundMesh) -> tuple[Any, ...]:
    """The fields of `bound` as plain values (strings, ints, tuples), which a function marked
    `torch._dynamo.nonstrict_trace` takes where it refuses a BoundMesh; `rebind` reverses."""
    mesh = bound.mesh
    names = tuple((axes, bound.group_name(axes)) for k in range(1, len(mesh.axis_names) + 1)
                  for axes in itertools.combinations(mesh.axis_names, k)) \
        if bound.in_mesh else ()                 # a rank outside the mesh has no groups
    return (mesh.axis_names, mesh.shape, mesh.ranks, bound.backend, str(bound.device),
            bound.rank, names)


def rebind(plain: tuple[Any, ...]) -> BoundMesh:
    """The BoundMesh whose `plain_bound` is `plain` (bound to the same process groups)."""
    axes, sizes, ranks, backend, device, rank, names = plain
    return BoundMesh(Mesh(dict(zip(axes, sizes)), ranks=list(ranks)), backend,
                     torch.device(device), rank, dict(names))


def plain_cost_model(cost_model: CostModel | None) -> tuple[Any, ...]:
    """`cost_model`'s fields as (name, value) pairs, () for None (None is no graph input);
    `cost_model_of` reverses."""
    return () if cost_model is None else tuple(
        (f.name, getattr(cost_model, f.name)) for f in dataclasses.fields(cost_model) if f.init)


def cost_model_of(plain: tuple[Any, ...]) -> CostModel | None:
    """The CostModel whose `plain_cost_model` is `plain`."""
    return CostModel(**dict(plain)) if plain else None


def _static_args(bound: BoundMesh, src: str | Layout, dst: str | Layout,
                 shape: Sequence[int] | None, dtype: torch.dtype | None,
                 cost_model: CostModel | None) -> tuple[Any, ...]:
    """Everything `_reshard_traced` needs besides the tensor, as plain values."""
    if not isinstance(bound, BoundMesh):
        _plan_for(torch.empty(0), bound, src, dst, shape, dtype, cost_model)  # raises
    # None is no graph input: an absent shape, dtype or cost model is an empty tuple.
    return (plain_bound(bound), str(src), str(dst),
            () if shape is None else (tuple(int(s) for s in shape),),
            () if dtype is None else (dtype,), plain_cost_model(cost_model))


def concrete(value: Any) -> Any:
    """`value` with every SymInt made an int (a guard on its value). After a recompile
    Dynamo makes the ints a call passes dynamic; a plan is made for one shape."""
    if isinstance(value, (tuple, list)):
        return type(value)(concrete(v) for v in value)
    return int(value) if isinstance(value, torch.SymInt) else value


def _reshard_opaque(x: Tensor, static: tuple[Any, ...]) -> Tensor:
    fields, src, dst, shape, dtype, cost = concrete(static)
    bound = rebind(fields)
    p = _plan_for(x, bound, src, dst, shape[0] if shape else None, dtype[0] if dtype else None,
                  cost_model_of(cost))
    return reshard_autograd(x, bound, p, reverse=backward_plan)


def _reshard_cross_opaque(xs: tuple[Tensor, ...], static: tuple[Any, ...]) -> Tensor:
    """A reshard between meshes (forward only); `xs`: the input, or () outside the source
    mesh. An empty tensor outside the destination mesh (a result must be a tensor)."""
    fields, dst_fields, src, dst, shape, dtype, cost = concrete(static)
    dst_bound = rebind(dst_fields)
    y = _cross(xs[0] if xs else None, rebind(fields), src, dst, dst_bound,
               shape[0] if shape else None, dtype[0] if dtype else None, cost_model_of(cost),
               None, False)
    return y if y is not None else xs[0].new_empty(0)


# What `reshard` calls under torch.compile: `_reshard_opaque` and `_reshard_cross_opaque`
# marked nonstrict_trace, marked when torch._dynamo loads (importing it here would double
# `import meshcomm`'s time).
_reshard_traced = _reshard_opaque
_reshard_cross_traced = _reshard_cross_opaque


def _mark_for_dynamo() -> None:
    global _reshard_traced, _reshard_cross_traced
    _reshard_traced = torch._dynamo.nonstrict_trace(_reshard_opaque)
    _reshard_cross_traced = torch._dynamo.nonstrict_trace(_reshard_cross_opaque)


when_dynamo_loads(_mark_for_dynamo)


def _plan_for(x: Tensor | None, bound: BoundMesh, src: str | Layout, dst: str | Layout,
              shape: Sequence[int] | None, dtype: torch.dtype | None,
              cost_model: CostModel | None, dst_mesh: Mesh | None = None) -> Plan:
    require_bound(bound, "reshard")
    if not bound.in_mesh:
        raise MeshMismatchError(
            f"reshard: rank {bound.rank} is not in {bound.mesh!r} (its ranks are"
            f" {list(bound.mesh.ranks)}), so it holds no shard of a tensor on it."
            " fix: call reshard on the mesh's ranks only (if mesh.in_mesh: ...)")
    if not isinstance(x, Tensor):
        sharded = hasattr(x, "local") and hasattr(x, "layout")     # a Sharded
        hint = "; fix: s.reshard(dst) for a Sharded s" if sharded else ""
        raise ShapeError(f"reshard needs a local torch.Tensor, got {type(x).__name__}{hint}")
    if shape is None:
        shape = infer_shape(bound.mesh, as_layout(src, "src"), tuple(x.shape), bound.rank)
    # the layouts as given: a repeated call is a hit in the mesh's memo of plans, and a
    # miss parses and checks them there (naming src or dst)
    return plan_untraced(bound.mesh, tuple(shape), src, dst,
                         dtype=x.dtype if dtype is None else dtype, cost_model=cost_model,
                         dst_mesh=dst_mesh)


def infer_shape(mesh: Mesh, layout: Layout, local_shape: Shape, rank: int) -> Shape:
    """The global shape of even shards: each local size times the sizes of its dim's axes.

    Local only (never communicates). Raises where this rank's shard shows the layout is
    uneven (an empty shard of a sharded dim), asking for `shape=`.

    >>> infer_shape(Mesh("dp=2 tp=2"), Layout("(dp b) s | sum(tp)"), (4, 6), 0)
    (8, 6)
    """
    if len(local_shape) != layout.ndim:
        raise ShapeError(f'local tensor on rank {rank} has {len(local_shape)} dims but layout'
                         f' "{layout}" has {layout.ndim}; fix: pass a tensor with one dim per'
                         " layout dim")
    axes = set(mesh.axis_names)
    shape = []
    for i, (dim, n) in enumerate(zip(layout.dims, local_shape)):
        sizes = [mesh.axis_size(f.name) for f in dim.factors if f.name in axes]
        if sizes and n == 0:
            raise ShapeError(
                f'cannot infer the global shape of layout "{layout}" on {mesh!r}: rank {rank}'
                f" holds 0 elements of dim {i}, so its shards are uneven."
                f" fix: pass shape=(...) (the global shape) on every rank")
        shape.append(n * math.prod(sizes))
    layout.check_local(mesh, tuple(shape), rank, local_shape, "local tensor")
    return tuple(shape)
