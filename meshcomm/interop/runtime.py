"""DTensor interop at run time: a DeviceMesh's process groups as a BoundMesh, a DTensor's
parts (local tensor, placements, shape) and a DTensor from parts. Reads process groups,
never communicates, never copies. The layout mapping itself is `interop.placements`.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ..core.errors import InteropError
from ..core.layout import Shape
from ..core.mesh import Mesh, device_axis_names
from ..runtime.bind import BoundMesh, check_default, create_groups
from .placements import Placements


def global_shape(dt: Any) -> Shape:
    """A DTensor's global shape as its spec says (what every rank agrees on), not the
    wrapper's `.shape` (tensors built by hand can disagree with their spec)."""
    spec = getattr(dt, "_spec", None)
    meta = getattr(spec, "tensor_meta", None)
    return tuple(int(n) for n in (meta.shape if meta is not None else dt.shape))


def local_of(dt: Any) -> Tensor:
    """A DTensor's local tensor (`dt.to_local()`)."""
    return cast(Tensor, dt.to_local())


def device_mesh_of(dt: Any) -> Any:
    """A DTensor's DeviceMesh (`dt.device_mesh`)."""
    return dt.device_mesh


def is_dtensor(x: object) -> bool:
    """True for a torch DTensor (imports nothing: no DTensor exists before its module loads)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def bind_device_mesh(device_mesh: Any, *, check: bool | None = None,
                     flatten: bool = False) -> BoundMesh:
    """A BoundMesh over a DeviceMesh's process groups (sends nothing unless `flatten`).

    >>> bound = mc.dtensor.bind_device_mesh(  # doctest: +SKIP
    ...     init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))

    Each axis uses the DeviceMesh's own group. A group over several axes (which plans
    use for some collectives) is, first, one meshcomm made for this mesh (`mc.reshard`
    of a DTensor makes those its plan needs; `flatten=True` makes them all), else the
    world group when it has exactly those ranks in mesh order, else any existing group
    with those ranks (`DeviceMesh._flatten()`'s). A plan that needs one that does not
    exist raises before it communicates (every rank sees the same groups).
    `flatten=True` creates every flattened group of the mesh, once per mesh: a
    collective over the whole world, so call it on every rank, ranks outside the mesh
    too, in the same order. On a rank outside the mesh the BoundMesh has `in_mesh` False
    and no groups (as `mc.init_mesh` gives there). `check` is the mesh's check mode, as
    `mc.init_mesh(check=...)`.
    """
    import torch.distributed as dist

    mesh = Mesh.from_device_mesh(device_mesh)
    if flatten:
        flatten_groups(slice_meshes(device_mesh),
                       [axes for k in range(2, len(mesh.axis_names) + 1)
                        for axes in itertools.combinations(mesh.axis_names, k)])
    rank = dist.get_rank()
    if rank not in mesh.ranks:    # as init_mesh: a rank outside gets a mesh it is not in
        outside = BoundMesh(mesh, dist.get_backend(), torch.device(device_mesh.device_type),
                            rank, {}, check_default(check))
        vars(outside)["device_mesh"] = device_mesh   # DTensors on it are still made there
        return outside
    names: dict[tuple[str, ...], str] = {(axis,): device_mesh.get_group(i).group_name
                                         for i, axis in enumerate(mesh.axis_names)}
    existing = _groups_by_ranks()
    made = _MADE.get(mesh, {})
    for k in range(2, len(mesh.axis_names) + 1):
        for axes in itertools.combinations(mesh.axis_names, k):
            ranks = next(g for g in mesh.groups(*axes) if rank in g)
            if axes in made:
                names[axes] = made[axes]
            elif ranks in existing:
                names[axes] = existing[ranks]
    group = device_mesh.get_group(0)
    device = (torch.device("cpu") if device_mesh.device_type == "cpu" else
              torch.device(device_mesh.device_type, torch.get_device_module(
                  device_mesh.device_type).current_device()))
    bound = BoundMesh(mesh, dist.get_backend(group), device, rank, names, check_default(check))
    vars(bound)["device_mesh"] = device_mesh   # BoundMesh.device_mesh is this mesh itself
    return bound


@functools.lru_cache(maxsize=256)
def slice_meshes(device_mesh: Any) -> tuple[Mesh, ...]:
    """The Mesh of every slice that `device_mesh` is one of, in one order on every rank.

    >>> dm = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))  # doctest: +SKIP
    >>> slice_meshes(dm["b", "c"])                                               # doctest: +SKIP
    (Mesh(b=2, c=2), Mesh(b=2, c=2, ranks=[4, 5, 6, 7]))

    A slice such as `dm["b", "c"]` is a different mesh on different ranks (ranks 0-3 see
    [[0, 1], [2, 3]], ranks 4-7 [[4, 5], [6, 7]]), but groups must be created by every rank
    of the world alike: this is the list every rank agrees on. A mesh that is no slice is
    its own only entry. Reads the DeviceMesh's layout over its root's ranks (torch >= 2.9);
    on older torch, the root mesh's grid with the slice's dims last. Cached per DeviceMesh
    (its hash is computed once): `mc.reshard` of a DTensor asks on every call.
    """
    names = device_axis_names(getattr(device_mesh, "mesh_dim_names", None),
                              len(device_mesh.mesh.shape))
    layout, rank_map = getattr(device_mesh, "_layout", None), getattr(device_mesh, "_rank_map",
                                                                      None)
    if layout is not None and rank_map is not None:
        grids = layout.remap_to_tensor(rank_map)
    else:
        grids = _root_grids(device_mesh)
    grids = grids.reshape(-1, *device_mesh.mesh.shape)
    return tuple(Mesh(dict(zip(names, grids.shape[1:])), ranks=g.tolist()) for g in grids)


def _root_grids(device_mesh: Any) -> Tensor:
    """Every slice's rank grid from the root mesh (torch before DeviceMesh layouts)."""
    root_of = getattr(device_mesh, "_get_root_mesh", None)
    root = root_of() if root_of is not None else device_mesh
    own = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    root_names = tuple(getattr(root, "mesh_dim_names", None) or ())
    if root is device_mesh or not own or not set(own) <= set(root_names):
        return cast(Tensor, device_mesh.mesh.unsqueeze(0))
    dims = [root_names.index(n) for n in own]
    rest = [i for i in range(len(root_names)) if i not in dims]
    return cast(Tensor, root.mesh.permute(*rest, *dims))


# Flattened groups meshcomm made for DeviceMeshes. _DONE: per set of slice meshes (the
# same on every rank: every rank makes them), the sets of axes made. _MADE: per mesh (axes,
# sizes, ranks: Mesh equality), this rank's group name per set of axes (where a member).
_DONE: dict[tuple[Mesh, ...], set[tuple[str, ...]]] = {}
_MADE: dict[Mesh, dict[tuple[str, ...], str]] = {}


def flatten_groups(meshes: Sequence[Mesh], subsets: Any) -> None:
    """Create the flattened groups over each set of axes in `subsets`, on every mesh of
    `meshes` (`slice_meshes` of a DeviceMesh), that meshcomm has not made for them yet (the
    whole world's group is reused, not made). A collective over the whole world: every
    rank calls it with the same arguments in the same order and creates every slice's
    groups, in one order (set of axes, then slice, then group); what to make depends on
    those arguments only, never on which slice this rank is in.
    """
    meshes = tuple(meshes)
    first = meshes[0]
    assert all(m.axes == first.axes for m in meshes), f"slices differ in axes: {meshes}"
    done = _DONE.setdefault(meshes, set())
    todo = sorted({tuple(a) for a in subsets if len(a) > 1} - done,
                  key=lambda axes: (len(axes), [first.axis_names.index(a) for a in axes]))
    for axes in todo:
        for mesh in meshes:
            _MADE.setdefault(mesh, {}).update(create_groups(mesh, [axes]))
        done.add(axes)


def _groups_by_ranks() -> dict[tuple[int, ...], str]:
    """Every process group this rank belongs to, by its global ranks in group order."""
    from torch.distributed import distributed_c10d as c10d

    out: dict[tuple[int, ...], str] = {}
    for pg, ranks in c10d._world.pg_group_ranks.items():
        if isinstance(pg, c10d.ProcessGroup):    # non-members hold a placeholder
            order = tuple(sorted(ranks, key=ranks.__getitem__))
            out.setdefault(order, pg.group_name)
    return out


def placements_of(dt: Any) -> Placements:
    """`dt.placements`, with an explicit non-default `shard_order` of its spec written as the
    _StridedShards that encode it (DTensor's own conversion)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = dt._spec
    order = getattr(spec, "shard_order", None)
    if order and not spec.use_strided_shard_as_shard_order \
            and not DTensorSpec.is_default_device_order(order):
        try:
            return tuple(DTensorSpec._convert_shard_order_to_StridedShard(
                order, tuple(spec.placements), dt.device_mesh))
        except ValueError as exc:
            raise InteropError(f"DTensor placements {list(spec.placements)} with shard order"
                               f" {order} have no layout: {exc}") from None
    return tuple(dt.placements)


def like(local: Tensor, dt: Any) -> Any:
    """A DTensor holding `local` with `dt`'s mesh, placements, global shape, stride and dtype,
    outside autograd (a gradient): the direct constructor, which checks nothing (FSDP2 makes
    its gradients so too); `from_local` costs tens of microseconds a call."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, dt._spec, requires_grad=False)  # type: ignore[no-untyped-call]


def wrap(local: Tensor, dm: Any, placements: Placements, shape: Shape) -> Any:
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, dm, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)
