"""The public runtime API: `reshard`, `Sharded`, `distribute`, `reshard_many`, DTensors.

One module per job: `local` (reshard a local shard, on one mesh or across two, eager or
compiled), `value` (`Sharded`, `distribute`), `many` (`reshard_many`), `dtensor` (DTensor
in and out, and `mc.reshard` of a DTensor). `reshard` here takes either kind of input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import Tensor

from ..core.errors import ShapeError
from ..core.layout import Layout
from ..executors.distributed.handlers import ByteTrace
from ..interop.runtime import is_dtensor
from ..planner.values import CostModel
from ..runtime.bind import BoundMesh
from .dtensor import from_dtensor, reshard_dtensor, to_dtensor
from .local import infer_shape, reshard_local
from .many import reshard_many
from .value import Sharded, distribute, replicated

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["Sharded", "distribute", "from_dtensor", "infer_shape", "replicated", "reshard",
           "reshard_dtensor", "reshard_local", "reshard_many", "to_dtensor"]


@overload
def reshard(x_local: Tensor, mesh: BoundMesh, src: str | Layout, dst: str | Layout, *,
            shape: Sequence[int] | None = None, dtype: torch.dtype | None = None,
            cost_model: CostModel | None = None, trace: ByteTrace | None = None,
            check: bool | None = None, async_op: bool = False) -> Tensor: ...
@overload
def reshard(x_local: Tensor | None, mesh: BoundMesh, src: str | Layout, dst: str | Layout, *,
            dst_mesh: BoundMesh, shape: Sequence[int] | None = None,
            dtype: torch.dtype | None = None, cost_model: CostModel | None = None,
            trace: ByteTrace | None = None, check: bool | None = None,
            requires_grad: bool = False) -> Tensor | None: ...
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
            backward_dtype: torch.dtype | None = None, async_op: bool = False,
            requires_grad: bool = False) -> Tensor | None:
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
    None. Differentiable: where `x_local` requires grad, ranks only in `dst_mesh` pass
    `requires_grad=True` (they have no input to read it from), and ranks only in `mesh` get
    an empty tensor instead of None, whose backward (`y.sum().backward()`, or in the loss)
    receives `x_local`'s gradient while the destination's backward sends it
    (docs/crossmesh.md).

    `mc.reshard(dtensor, dst)` takes a DTensor and `dst` (a layout or placements) and
    returns a DTensor (`meshcomm.sharded.reshard_dtensor`, docs/dtensor.md); it takes
    `forward_dtype=` and `backward_dtype=` as `DTensor.redistribute` does.
    """
    if requires_grad and dst_mesh is None:
        raise ShapeError("reshard(requires_grad=True) goes with dst_mesh=, on ranks only in the"
                         " destination mesh; elsewhere the input's requires_grad decides")
    if async_op and (is_dtensor(x_local) or dst_mesh is not None):
        raise ShapeError("reshard(async_op=True) goes with a local tensor on one mesh; fix:"
                         " leave async_op out for DTensors and dst_mesh=")
    if is_dtensor(x_local):
        if (src, dst, dst_mesh, shape, dtype) != (None,) * 5:
            raise ShapeError("mc.reshard(dtensor, dst) takes the destination only (a layout or"
                             " placements): the DTensor carries its mesh, layout and shape")
        out: Tensor = reshard_dtensor(x_local, mesh, cost_model=cost_model, trace=trace,
                                      check=check, forward_dtype=forward_dtype,
                                      backward_dtype=backward_dtype)
        return out
    if forward_dtype is not None or backward_dtype is not None:
        raise ShapeError("reshard(forward_dtype=, backward_dtype=) go with a DTensor,"
                         " mc.reshard(dtensor, dst, forward_dtype=...); for a local tensor"
                         " pass x.to(dtype) (its gradient comes back in x's dtype)")
    if src is None or dst is None:
        raise ShapeError("mc.reshard(x_local, mesh, src, dst): give both layouts, src and dst")
    return reshard_local(x_local, mesh, src, dst, dst_mesh=dst_mesh, shape=shape, dtype=dtype,
                         cost_model=cost_model, trace=trace, check=check, async_op=async_op,
                         requires_grad=requires_grad)
