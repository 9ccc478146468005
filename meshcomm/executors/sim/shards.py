"""Split a global tensor into per-rank shards and rebuild it, on simulated ranks.

Lists of per-rank tensors are in mesh order: entry i belongs to `mesh.ranks[i]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...core.errors import ShapeError
from ...core.layout import Layout, Shape, as_layout
from ...core.mesh import Mesh
from ...core.reduce_ops import identity_like, op_reduce
from ..local import grid, take


def _partial_owner(mesh: Mesh, layout: Layout, rank: int, numel: int,
                   device: torch.device) -> Tensor:
    """Per element, True where this rank holds the value of a partial layout."""
    axes = layout.partial_axes
    coords = mesh.coords(rank)
    pos = 0
    for a in axes:
        pos = pos * mesh.axis_size(a) + coords[a]
    return torch.arange(numel, device=device) % mesh.group_size(axes) == pos


def scatter(global_tensor: Tensor, mesh: Mesh, layout: str | Layout) -> list[Tensor]:
    """Each rank's local tensor of `global_tensor` under `layout`, in mesh order.

    For a partial layout every element is owned by one rank of its reduction
    group (round robin), which holds the value; the others hold the identity of
    the op (0 for sum, -inf for max, ...), so reducing gives the global tensor
    back exactly. For "avg" the owner holds value * group size.

    >>> xs = scatter(torch.arange(4.0), Mesh("tp=2"), "(tp b)")
    >>> [x.tolist() for x in xs]
    [[0.0, 1.0], [2.0, 3.0]]
    """
    layout = as_layout(layout)
    return [shard_of(global_tensor, mesh, layout, rank) for rank in mesh.ranks]


def shard_of(global_tensor: Tensor, mesh: Mesh, layout: str | Layout, rank: int) -> Tensor:
    """The local tensor of `rank` alone (`scatter`'s entry for it; the work of one rank,
    whatever the mesh's size)."""
    layout = as_layout(layout)
    local = take(global_tensor, layout.indices(mesh, tuple(global_tensor.shape), rank))
    op = layout.reduce_op
    if op is None:
        return local
    owner = _partial_owner(mesh, layout, rank, local.numel(), local.device).reshape(local.shape)
    value = local * _group_size(mesh, layout) if op == "avg" else local
    return torch.where(owner, value, identity_like(local, op))


def _group_size(mesh: Mesh, layout: Layout) -> int:
    return mesh.group_size(layout.partial_axes)


def gather(locals_: Sequence[Tensor], mesh: Mesh, layout: str | Layout, shape: Shape) -> Tensor:
    """The global tensor rebuilt from per-rank `locals_` (mesh order).

    Partial results are reduced over their axes first (in mesh order of the
    group); replicas of one element must agree exactly, or ShapeError says where.
    """

    layout = as_layout(layout)
    shape = tuple(shape)
    if len(locals_) != mesh.size:
        raise ShapeError(f"gather got {len(locals_)} local tensors for {mesh!r} of {mesh.size}"
                         " ranks")
    for rank, local in zip(mesh.ranks, locals_):
        layout.check_local(mesh, shape, rank, tuple(local.shape), "locals_")
    values = list(locals_)
    if layout.reduce_op is not None:
        values = _reduce_partials(values, mesh, layout)
    device = values[0].device if values else None
    result = (torch.zeros(shape, dtype=values[0].dtype, device=device) if values
              else torch.zeros(shape))
    written = torch.zeros(shape, dtype=torch.bool, device=device)
    for rank, local in zip(mesh.ranks, values):
        where = grid(layout.indices(mesh, shape, rank), device)
        if not where:
            result = local.clone()
            continue
        seen = written[where]
        clash = seen & (result[where] != local) & ~(result[where].isnan() & local.isnan())
        if bool(clash.any()):
            raise ShapeError(
                f'gather: rank {rank} disagrees with another replica of layout "{layout}" at'
                f" {int(clash.sum())} element(s); replicas must hold equal values"
            )
        result[where] = local
        written[where] = True
    return result


def _reduce_partials(values: list[Tensor], mesh: Mesh, layout: Layout) -> list[Tensor]:
    op = layout.reduce_op
    assert op is not None, f'"{layout}" has a pending reduction to reduce'
    axes = [a for a in mesh.axis_names if a in layout.partial_axes]
    out = list(values)
    for group in mesh.groups(*axes):
        members = [mesh.position(r) for r in group]
        reduced = op_reduce([values[i] for i in members], op)
        for i in members:
            out[i] = reduced
    return out
