"""The public runtime API: reshard a local shard, Sharded values, distribute, reshard_many.

Thin: each function normalizes its arguments, gets the cached plan from `mc.plan`
and hands it to the executor (`meshcomm.executors.distributed`). Nothing here communicates except
through a plan, and nothing communicates to learn a shape.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union, overload

import torch
from torch import Tensor

from . import display
from .core.errors import (
    InteropError,
    MeshcommError,
    MeshMismatchError,
    PlanError,
    ShapeError,
)
from .core.layout import Layout, Shape, as_layout, positional_names
from .core.mesh import Mesh
from .executors.distributed.autograd import reshard_autograd
from .planner.plan import backward_plan, plan_untraced
from .runtime.bind import BoundMesh, require_bound
from .runtime.checks import (
    agree_many,
    agree_reshard,
    checking,
    raise_together,
)
from .runtime.compiler import when_dynamo_loads
from .executors.distributed.cross import execute_cross
from .executors.distributed.execute import ByteTrace, execute, execute_many
from .executors.local import take
from .executors.sim.shards import scatter
from .interop.placements import from_placements, to_placements
from .interop.runtime import (
    bind_device_mesh,
    flatten_groups,
    global_shape,
    is_dtensor,
    placements_of,
    slice_meshes,
    wrap,
)
from .planner.plan import plan
from .planner.values import CostModel, Plan

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


@overload
def reshard(x_local: Tensor, mesh: BoundMesh, src: str | Layout, dst: str | Layout, *,
            shape: Sequence[int] | None = None, dtype: torch.dtype | None = None,
            cost_model: CostModel | None = None, trace: ByteTrace | None = None,
            check: bool | None = None, async_op: bool = False) -> Tensor: ...
@overload
def reshard(x_local: Tensor | None, mesh: BoundMesh, src: str | Layout, dst: str | Layout, *,
            dst_mesh: BoundMesh, shape: Sequence[int] | None = None,
            dtype: torch.dtype | None = None, cost_model: CostModel | None = None,
            trace: ByteTrace | None = None, check: bool | None = None) -> Tensor | None: ...
@overload
def reshard(x_local: DTensor, dst: str | Layout | Sequence[Placement], /, *,
            cost_model: CostModel | None = None, trace: ByteTrace | None = None,
            check: bool | None = None, forward_dtype: torch.dtype | None = None,
            backward_dtype: torch.dtype | None = None) -> DTensor: ...
def reshard(x_local: Tensor | None, mesh: Any, src: str | Layout | None = None,
            dst: str | Layout | None = None, *,
            dst_mesh: BoundMesh | None = None, shape: Sequence[int] | None = None,
            dtype: torch.dtype | None = None, cost_model: CostModel | None = None,
            trace: ByteTrace | None = None, check: bool | None = None,
            forward_dtype: torch.dtype | None = None,
            backward_dtype: torch.dtype | None = None, async_op: bool = False) -> Tensor | None:
    """This rank's shard under layout `dst` of the global tensor whose shard under `src` is
    `x_local` (call it on every rank of `mesh`). Differentiable and traceable.

    >>> bound = mc.init_mesh("dp=2 tp=2")                         # doctest: +SKIP
    >>> y = mc.reshard(x, bound, "(dp b) s (tp h)", "b (dp s) (tp h)")  # doctest: +SKIP

    `shape` is the global shape; without it every shard is assumed even (global size =
    local size times the sizes of the dim's mesh axes), so pass it for uneven layouts.
    `dtype` defaults to `x_local.dtype`. `trace` records the bytes of each collective call
    (eager only). `check` turns check mode on or off for this call (default: the mesh's,
    `init_mesh(check=...)`; docs/errors.md). `async_op=True` returns at once, the last
    collective still running: the result is waited on at its first use, so the caller can
    compute meanwhile (not differentiable; errors surface at that use).

    `dst_mesh` (another BoundMesh) puts `dst` on that mesh: call it on every rank of the
    world. Ranks only in `mesh` return None; ranks only in `dst_mesh` pass None as
    `x_local` and must pass `shape=` and `dtype=`; ranks in neither do nothing and return
    None. Not differentiable: send gradients back with a second reshard (docs/crossmesh.md).

    `mc.reshard(dtensor, dst)` takes a DTensor and `dst` (a layout or placements) and
    returns a DTensor (`meshcomm.sharded.reshard_dtensor`, docs/dtensor.md); it takes
    `forward_dtype=` and `backward_dtype=` as `DTensor.redistribute` does.
    """
    if async_op and (is_dtensor(x_local) or dst_mesh is not None):
        raise ShapeError("reshard(async_op=True) goes with a local tensor on one mesh; fix:"
                         " leave async_op out for DTensors and dst_mesh=")
    if is_dtensor(x_local):
        if (src, dst, dst_mesh, shape, dtype) != (None,) * 5:
            raise ShapeError("mc.reshard(dtensor, dst) takes the destination only (a layout or"
                             " placements): the DTensor carries its mesh, layout and shape")
        return reshard_dtensor(x_local, mesh, cost_model=cost_model, trace=trace, check=check,
                               forward_dtype=forward_dtype, backward_dtype=backward_dtype)
    if forward_dtype is not None or backward_dtype is not None:
        raise ShapeError("reshard(forward_dtype=, backward_dtype=) go with a DTensor,"
                         " mc.reshard(dtensor, dst, forward_dtype=...); for a local tensor"
                         " pass x.to(dtype) (its gradient comes back in x's dtype)")
    if src is None or dst is None:
        raise ShapeError("mc.reshard(x_local, mesh, src, dst): give both layouts, src and dst")
    if dst_mesh is not None and not (isinstance(mesh, BoundMesh) and
                                     isinstance(dst_mesh, BoundMesh) and dst_mesh.mesh == mesh.mesh):
        return _reshard_cross(x_local, mesh, src, dst, dst_mesh, shape, dtype, cost_model, trace)
    if torch.compiler.is_compiling():
        if trace is not None:
            raise ShapeError("reshard(trace=...) records eager calls only; under torch.compile"
                             " leave it out (the plan's send_bytes/recv_bytes are the same)")
        return _reshard_traced(x_local, _static_args(mesh, src, dst, shape, dtype, cost_model))
    if async_op and torch.is_grad_enabled() and getattr(x_local, "requires_grad", False):
        raise ShapeError("reshard(async_op=True) returns before its collectives finish and"
                         " records no gradient; fix: pass x.detach(), or leave async_op out")
    if not checking(mesh, check):
        p = _plan_for(x_local, mesh, src, dst, shape, dtype, cost_model)
    else:
        try:   # check mode: the ranks agree on the call first, a rank that fails here too
            p = _plan_for(x_local, mesh, src, dst, shape, dtype, cost_model)
        except MeshcommError as err:
            raise_together(mesh, err, "reshard")
        agree_reshard(x_local, mesh, p)
    if async_op:
        return execute(p, x_local, mesh, trace=trace, wait=False)
    return reshard_autograd(x_local, mesh, p, trace, reverse=backward_plan)


def _reshard_cross(x: Tensor | None, bound: BoundMesh, src: str | Layout, dst: str | Layout,
                   dst_bound: BoundMesh, shape: Sequence[int] | None, dtype: torch.dtype | None,
                   cost_model: CostModel | None, trace: ByteTrace | None) -> Tensor | None:
    """`reshard` onto another mesh (see `meshcomm.executors.distributed.cross`)."""
    for name, b in (("mesh", bound), ("dst_mesh", dst_bound)):
        require_bound(b, "reshard(..., dst_mesh=...)", name)
    rank = bound.rank
    if not bound.in_mesh and not dst_bound.in_mesh:
        return None
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
    if x is not None and torch.is_grad_enabled() and x.requires_grad:
        raise PlanError(
            "reshard(..., dst_mesh=...) is not differentiable: ranks outside the destination"
            " mesh get no output to call backward on. fix: pass x.detach(), and send the"
            " gradient back with mc.reshard(grad, dst_mesh, dst, src, dst_mesh=mesh)")
    return execute_cross(p, x, bound, dst_bound, trace=trace)


# Under torch.compile, Dynamo never traces the planner: `_static_args` only reads plain values
# (strings, ints, tuples) off the bound mesh, and `_reshard_traced` is one opaque call for
# Dynamo that AOTAutograd traces down to the functional collectives it makes, planning with
# real Python on the way (outside the fake-tensor mode; see `plan_untraced`).
def _static_args(bound: BoundMesh, src: str | Layout, dst: str | Layout,
                 shape: Sequence[int] | None, dtype: torch.dtype | None,
                 cost_model: CostModel | None) -> tuple[Any, ...]:
    """Everything `_reshard_traced` needs besides the tensor, as plain values."""
    if not isinstance(bound, BoundMesh):
        _plan_for(torch.empty(0), bound, src, dst, shape, dtype, cost_model)  # raises
    mesh = bound.mesh
    names = tuple((axes, bound.group_name(axes)) for k in range(1, len(mesh.axis_names) + 1)
                  for axes in itertools.combinations(mesh.axis_names, k))
    # None is no graph input: an absent shape, dtype or cost model is an empty tuple.
    cost = () if cost_model is None else tuple(
        (f.name, getattr(cost_model, f.name)) for f in dataclasses.fields(cost_model) if f.init)
    return (mesh.axis_names, mesh.shape, mesh.ranks, bound.backend, str(bound.device), bound.rank,
            names, str(src), str(dst), () if shape is None else (tuple(int(s) for s in shape),),
            () if dtype is None else (dtype,), cost)


def _concrete(value: Any) -> Any:
    """`value` with every SymInt made an int (a guard on its value). After a recompile
    Dynamo makes the ints a call passes dynamic; a plan is made for one shape."""
    if isinstance(value, (tuple, list)):
        return type(value)(_concrete(v) for v in value)
    return int(value) if isinstance(value, torch.SymInt) else value


def _reshard_opaque(x: Tensor, static: tuple[Any, ...]) -> Tensor:
    static = _concrete(static)
    axes, sizes, ranks, backend, device, rank, names, src, dst, shape, dtype, cost = static
    bound = BoundMesh(Mesh(dict(zip(axes, sizes)), ranks=list(ranks)), backend,
                      torch.device(device), rank, dict(names))
    cost_model = CostModel(**dict(cost)) if cost else None
    p = _plan_for(x, bound, src, dst, shape[0] if shape else None, dtype[0] if dtype else None,
                  cost_model)
    return reshard_autograd(x, bound, p, reverse=backward_plan)


# What `reshard` calls under torch.compile: `_reshard_opaque` marked nonstrict_trace, marked
# when torch._dynamo loads (importing it here would double `import meshcomm`'s time).
_reshard_traced = _reshard_opaque


def _mark_for_dynamo() -> None:
    global _reshard_traced
    _reshard_traced = torch._dynamo.nonstrict_trace(_reshard_opaque)


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
        hint = "; fix: s.reshard(dst) for a Sharded s" if isinstance(x, Sharded) else ""
        raise ShapeError(f"reshard needs a local torch.Tensor, got {type(x).__name__}{hint}")
    src_layout = as_layout(src, "src")
    if shape is None:
        shape = infer_shape(bound.mesh, src_layout, tuple(x.shape), bound.rank)
    return plan_untraced(bound.mesh, tuple(shape), src_layout, as_layout(dst, "dst"),
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


def replicated(layout: Layout, mesh: Mesh) -> Layout:
    """The fully replicated layout with the dims (and names, where unique) of `layout`."""
    names = layout.dim_names(mesh)
    if len(set(names)) != len(names):
        names = positional_names(len(names), mesh)
    return Layout.of_names(names)


@dataclass(frozen=True, eq=False)
class Sharded:
    """This rank's shard `local` of a global tensor of `shape` under `layout` on `mesh`.

    >>> s = mc.distribute(torch.arange(8.0), bound, "(tp b)")    # doctest: +SKIP
    >>> s.reshard("b").local.tolist()                            # doctest: +SKIP
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """

    local: Tensor
    mesh: BoundMesh
    layout: Layout
    shape: Shape

    def __post_init__(self) -> None:
        require_bound(self.mesh, "Sharded")
        object.__setattr__(self, "layout", as_layout(self.layout))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.mesh.in_mesh:
            self.layout.check_local(self.mesh.mesh, self.shape, self.mesh.rank,
                                    tuple(self.local.shape), "Sharded.local")
        elif self.local.numel():
            raise ShapeError(
                f"Sharded.local on rank {self.mesh.rank} has shape {tuple(self.local.shape)},"
                f" but the rank is not in {self.mesh.mesh!r}, so it holds no shard."
                " fix: pass an empty tensor there (what DTensor gives ranks outside its mesh)")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def reshard(self, dst: str | Layout, *, cost_model: CostModel | None = None,
                check: bool | None = None) -> Sharded:
        """The same global tensor under layout `dst` (call it on every rank of the mesh; a
        rank outside it holds nothing and does nothing, as DTensor's `redistribute`)."""
        if not self.mesh.in_mesh:
            dst = as_layout(dst, "dst")
            dst.local_shape(self.mesh.mesh, self.shape, self.mesh.mesh.ranks[0])  # dst fits
            return Sharded(self.local, self.mesh, dst, self.shape)
        out = reshard(self.local, self.mesh, self.layout, dst, shape=self.shape,
                      cost_model=cost_model, check=check)
        return Sharded(out, self.mesh, as_layout(dst, "dst"), self.shape)

    def full(self) -> Tensor:
        """The global tensor, on every rank of the mesh (a reshard to the replicated
        layout); on a rank outside it, its empty local tensor (as DTensor's `full_tensor`)."""
        return self.reshard(replicated(self.layout, self.mesh.mesh)).local

    def to_dtensor(self, *, device_mesh: Any = None) -> DTensor:
        """A DTensor with this local tensor (no copy) and the placements of this layout;
        raises InteropError for a layout DTensor cannot express (docs/dtensor.md)."""
        return to_dtensor(self, device_mesh=device_mesh)

    def show(self, **kwargs: Any) -> None:
        """Print which rank holds which part (`mc.show` of the layout)."""
        display.show(self.mesh.mesh, self.shape, self.layout, **kwargs)

    def __repr__(self) -> str:
        return (f"Sharded(layout={str(self.layout)!r}, shape={self.shape}, mesh={self.mesh.mesh!r},"
                f" rank={self.mesh.rank}, local={tuple(self.local.shape)} {self.dtype})")


def distribute(global_tensor: Tensor, mesh: BoundMesh, layout: str | Layout) -> Sharded:
    """This rank's shard of `global_tensor` under `layout`, sliced locally (no communication).

    Every rank must pass the same global tensor. For a partial layout each element is
    held by one rank of its reduction group, the others hold the op's identity (as
    `mc.sim.scatter`).

    >>> s = mc.distribute(torch.arange(8.0), bound, "(tp b)")    # doctest: +SKIP
    """
    require_bound(mesh, "distribute")
    layout = as_layout(layout)
    m, shape = mesh.mesh, tuple(global_tensor.shape)
    if layout.reduce_op is None:
        local = take(global_tensor, layout.indices(m, shape, mesh.rank))
    else:
        local = scatter(global_tensor, m, layout)[m.position(mesh.rank)]
    return Sharded(local, mesh, layout, shape)


Item = Union[tuple[Sharded, Union[str, Layout]],
             tuple[Tensor, BoundMesh, Union[str, Layout], Union[str, Layout], Sequence[int]]]


def reshard_many(items: Sequence[Item], *, bucket_bytes: int = 25 * 2**20,
                 cost_model: CostModel | None = None,
                 trace: ByteTrace | None = None, check: bool | None = None) -> list[Any]:
    """Each item resharded, with one collective per step for each bucket of items whose
    plans share a collective shape (FSDP-style flat buffers of up to `bucket_bytes`).

    Items are `(sharded, dst)` (gives a Sharded) or `(x_local, mesh, src, dst, shape)`
    (gives a Tensor). Call it on every rank with the same items in the same order.
    Outputs equal `reshard` item by item. When a gradient is needed, items run one by
    one through `reshard`.

    >>> ws = mc.reshard_many([(w, "b h") for w in shards])       # doctest: +SKIP
    """
    try:
        jobs = _many_jobs(items, cost_model)
    except MeshcommError as err:
        first = items[0][0].mesh if items and isinstance(items[0][0], Sharded) else (
            items[0][1] if items and len(items[0]) == 5 else None)
        if first is not None and checking(first, check):
            raise_together(first, err, "reshard_many")   # the others agree, then raise too
        raise
    if jobs and checking(jobs[0][1], check):
        agree_many(jobs)
    if torch.is_grad_enabled() and any(x.requires_grad for x, _, _ in jobs):
        outs = [reshard_autograd(x, bound, p, trace, reverse=backward_plan)
                for x, bound, p in jobs]
    else:
        outs = execute_many(jobs, bucket_bytes=bucket_bytes, trace=trace)
    return [Sharded(out, bound, p.dst, p.shape) if isinstance(item[0], Sharded) else out
            for item, out, (_, bound, p) in zip(items, outs, jobs)]


def _many_jobs(items: Sequence[Item], cost_model: CostModel | None
               ) -> list[tuple[Tensor, BoundMesh, Plan]]:
    """reshard_many's (local, mesh, plan) per item; raises on the first bad item."""
    jobs: list[tuple[Tensor, BoundMesh, Plan]] = []
    for k, item in enumerate(items):
        if len(item) == 2 and isinstance(item[0], Sharded):
            s, dst = item
            jobs.append((s.local, s.mesh, _plan_for(s.local, s.mesh, s.layout, dst, s.shape,
                                                    None, cost_model)))
        elif len(item) == 5:
            x, bound, src, dst, shape = item
            jobs.append((x, bound, _plan_for(x, bound, src, dst, shape, None, cost_model)))
        else:
            raise ShapeError(f"reshard_many: items[{k}] is neither (Sharded, dst) nor"
                             " (x_local, mesh, src, dst, shape)")
    return jobs


# -- DTensor <-> Sharded (no copy, no communication) and mc.reshard on DTensors ------
def from_dtensor(dt: Any, *, mesh: BoundMesh | None = None,
                 names: str | Sequence[str] | None = None) -> Sharded:
    """The Sharded with `dt`'s local tensor (the same tensor: no copy, no communication).

    >>> s = mc.dtensor.from_dtensor(dt, names="b h")                       # doctest: +SKIP
    >>> s.layout, s.shape                                            # doctest: +SKIP
    (Layout('(dp b) (tp h)'), (8, 6))

    `mesh` is the BoundMesh to run later reshards on (e.g. from `mc.init_mesh`); it must
    be the DeviceMesh's mesh (names, sizes, ranks). Without it, the Sharded is bound to
    the DeviceMesh's own groups (`bind_device_mesh`). `names` names the dims.
    """
    if not is_dtensor(dt):
        raise InteropError(f"from_dtensor needs a torch DTensor, got {type(dt).__name__};"
                           " fix: for a local shard use mc.Sharded(local, bound, layout, shape)")
    dm = dt.device_mesh
    if mesh is None:
        mesh = bind_device_mesh(dm)
    elif Mesh.from_device_mesh(dm) != mesh.mesh:
        raise MeshMismatchError(
            f"from_dtensor(mesh=...) got a BoundMesh of {mesh.mesh!r} but the DTensor lives on"
            f" {Mesh.from_device_mesh(dm)!r}; fix: leave mesh= out, or bind"
            " mc.init_mesh(mc.Mesh.from_device_mesh(dt.device_mesh))")
    shape = global_shape(dt)
    layout = from_placements(mesh.mesh, shape, placements_of(dt), names=names)
    return Sharded(dt.to_local(), mesh, layout, shape)


def to_dtensor(sharded: Sharded, *, device_mesh: Any = None) -> Any:
    """A DTensor with `sharded`'s local tensor and the placements of its layout (no copy).

    >>> dt = mc.distribute(torch.arange(8.0), bound, "(tp dp b)").to_dtensor()  # doctest: +SKIP
    >>> dt.placements                                                            # doctest: +SKIP
    (_StridedShard(dim=0, sf=2), Shard(dim=0))

    Raises `InteropError`, before anything else, for a layout DTensor cannot express.
    `device_mesh` defaults to `sharded.mesh.device_mesh`; another must be over the same mesh.
    """
    placements = to_placements(sharded.mesh.mesh, sharded.shape, sharded.layout)
    dm = sharded.mesh.device_mesh if device_mesh is None else device_mesh
    if device_mesh is not None and Mesh.from_device_mesh(dm) != sharded.mesh.mesh:
        raise MeshMismatchError(f"to_dtensor(device_mesh=...) is over"
                                f" {Mesh.from_device_mesh(dm)!r}, the Sharded over"
                                f" {sharded.mesh.mesh!r}; fix: leave device_mesh= out")
    return wrap(sharded.local, dm, placements, sharded.shape)


def reshard_dtensor(dt: Any, dst: str | Layout | Sequence[Any], *,
                    cost_model: CostModel | None = None, trace: Any = None,
                    check: bool | None = None, forward_dtype: torch.dtype | None = None,
                    backward_dtype: torch.dtype | None = None) -> Any:
    """`dt` resharded by a meshcomm plan to `dst` (a layout or DTensor placements): a DTensor.

    >>> y = mc.reshard(dt, "(dp b) (tp h)")                       # doctest: +SKIP
    >>> y = mc.reshard(dt, [Shard(0), Shard(1)])                  # doctest: +SKIP

    Equals `dt.redistribute(dt.device_mesh, placements)` where DTensor gets that right;
    differentiable. A `dst` DTensor cannot express raises `InteropError` before any
    communication. A rank outside the DTensor's mesh does nothing (returns a DTensor with
    its empty local tensor and the new placements), as `redistribute`. As
    `DTensor.redistribute`: `forward_dtype` casts the local tensor first
    (the result is in that dtype); `backward_dtype` is the dtype the gradient's collectives
    run at (default: the input's), and the gradient comes back in the input's dtype.
    """
    for name, value in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if value is not None and not isinstance(value, torch.dtype):
            raise ShapeError(f"reshard({name}=...) must be a torch.dtype, got {value!r}")
    # Every rank plans (pure), ranks outside the DTensor's mesh too: a flattened group the
    # plan needs is made on every rank of the world before anything is sent.
    mesh, shape = Mesh.from_device_mesh(dt.device_mesh), global_shape(dt)
    src_layout = from_placements(mesh, shape, placements_of(dt))
    if isinstance(dst, (str, Layout)):
        layout = as_layout(dst, "dst")
        placements = to_placements(mesh, shape, layout)
    else:
        placements = tuple(dst)
        layout = from_placements(mesh, shape, placements, names=src_layout.dim_names(mesh))
    p = plan(mesh, shape, src_layout, layout, dtype=forward_dtype or dt.dtype,
             cost_model=cost_model)
    flatten_groups(slice_meshes(dt.device_mesh),
                   [step.axes for step in p.steps if step.kind != "local"])
    if dt.device_mesh.get_coordinate() is None:   # as DTensor: ranks outside its mesh do nothing
        return wrap(dt.to_local(), dt.device_mesh, placements, shape)
    src = from_dtensor(dt)
    for step in p.steps:    # every group first: a missing one raises before any communication
        if step.kind != "local":
            src.mesh.group_name(step.axes)    # each step runs over its axes' group

    def run(local: Tensor) -> Any:
        x = local if forward_dtype is None else local.to(forward_dtype)
        out = reshard(x, src.mesh, src.layout, layout, shape=shape, cost_model=cost_model,
                      trace=trace, check=check)
        return wrap(out, dt.device_mesh, placements, shape)

    if torch.is_grad_enabled() and dt.requires_grad:
        return _DTensorReshard.apply(dt, run, backward_dtype)
    return run(src.local)


class _DTensorReshard(torch.autograd.Function):
    """`mc.reshard` of a DTensor as one autograd node, with DTensor.redistribute's backward:
    the output's gradient, whatever its placements, is resharded (by a meshcomm plan) to
    the input's placements, where a Partial input placement stays Partial when the gradient
    is Partial there and becomes Replicate otherwise. The gradient's collectives run at
    `backward_dtype` (default: the input's dtype); it comes back in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, dt: Any, run: Any, backward_dtype: torch.dtype | None) -> Any:
        ctx.placements, ctx.dtype = tuple(dt.placements), dt.dtype
        ctx.backward_dtype = backward_dtype
        out = run(dt.to_local())
        ctx.out_placements, ctx.device_mesh, ctx.shape = out.placements, out.device_mesh, \
            global_shape(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        if not is_dtensor(grad):      # a plain tensor: the local gradient of the output
            grad = wrap(grad, ctx.device_mesh, ctx.out_placements, ctx.shape)
        target = tuple(
            _replicate() if p.is_partial() and not g.is_partial() else p
            for p, g in zip(ctx.placements, grad.placements))
        g = grad.to(ctx.backward_dtype or ctx.dtype)
        out = reshard_dtensor(g, target)
        return (out if out.dtype == ctx.dtype else out.to(ctx.dtype)), None, None


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()

