"""`Sharded` (a rank's shard with its global layout and shape) and `distribute`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import display
from ..core.errors import MeshMismatchError, ShapeError
from ..core.layout import Layout, Shape, as_layout
from ..core.mesh import Mesh
from ..executors.sim.shards import shard_of
from ..interop.placements import to_placements
from ..interop.runtime import wrap
from ..planner.values import CostModel
from ..runtime.bind import BoundMesh, require_bound
from .local import reshard_local

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def replicated(layout: Layout, mesh: Mesh) -> Layout:
    """The fully replicated layout with the dims (and names, where unique) of `layout`."""
    return Layout.of_names(layout.dim_names(mesh))


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
        out = reshard_local(self.local, self.mesh, self.layout, dst, shape=self.shape,
                            cost_model=cost_model, check=check)
        assert out is not None, "a reshard on one mesh gives every rank of it a tensor"
        return Sharded(out, self.mesh, as_layout(dst, "dst"), self.shape)

    def full(self) -> Tensor:
        """The global tensor, on every rank of the mesh (a reshard to the replicated
        layout); on a rank outside it, its empty local tensor (as DTensor's `full_tensor`)."""
        return self.reshard(replicated(self.layout, self.mesh.mesh)).local

    def to_dtensor(self, *, device_mesh: Any = None) -> DTensor:
        """A DTensor with this local tensor (no copy) and the placements of this layout;
        raises InteropError, before anything else, for a layout DTensor cannot express
        (docs/dtensor.md). `device_mesh` defaults to `self.mesh.device_mesh`; another must
        be over the same mesh."""
        placements = to_placements(self.mesh.mesh, self.shape, self.layout)
        dm = self.mesh.device_mesh if device_mesh is None else device_mesh
        if device_mesh is not None and Mesh.from_device_mesh(dm) != self.mesh.mesh:
            raise MeshMismatchError(f"to_dtensor(device_mesh=...) is over"
                                    f" {Mesh.from_device_mesh(dm)!r}, the Sharded over"
                                    f" {self.mesh.mesh!r}; fix: leave device_mesh= out")
        return wrap(self.local, dm, placements, self.shape)  # type: ignore[no-any-return]

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
    local = shard_of(global_tensor, mesh.mesh, layout, mesh.rank)    # this rank's alone
    return Sharded(local, mesh, layout, tuple(global_tensor.shape))
