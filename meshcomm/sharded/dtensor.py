"""DTensor <-> Sharded (no copy, no communication) and `mc.reshard` on DTensors.

The bridge sits here, above `reshard`, because a DTensor reshard is a meshcomm reshard of
its local tensor (`interop/` below holds the pure placement mapping and the DeviceMesh
groups it uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.errors import InteropError, MeshMismatchError, ShapeError
from ..core.layout import Layout, as_layout
from ..core.mesh import Mesh
from ..interop.placements import from_placements, to_placements
from ..interop.runtime import (
    bind_device_mesh,
    flatten_groups,
    global_shape,
    is_dtensor,
    placements_of,
    slice_meshes,
    wrap,
)
from ..planner.plan import plan
from ..planner.values import CostModel
from ..runtime.bind import BoundMesh
from .local import reshard_local
from .value import Sharded


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
    """A DTensor with `sharded`'s local tensor and the placements of its layout (no copy):
    `sharded.to_dtensor(device_mesh=...)`.

    >>> dt = mc.distribute(torch.arange(8.0), bound, "(tp dp b)").to_dtensor()  # doctest: +SKIP
    >>> dt.placements                                                            # doctest: +SKIP
    (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    return sharded.to_dtensor(device_mesh=device_mesh)


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
        out = reshard_local(x, src.mesh, src.layout, layout, shape=shape,
                            cost_model=cost_model, trace=trace, check=check)
        assert out is not None, "a reshard on one mesh gives every rank of it a tensor"
        return wrap(out, dt.device_mesh, placements, shape)

    if torch.is_grad_enabled() and dt.requires_grad:
        return _DTensorReshard.apply(dt, run, backward_dtype)  # type: ignore[no-untyped-call]
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
