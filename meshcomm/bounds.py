"""Lower bounds on the bytes any correct plan must move, from index sets alone.

This module never communicates and never looks at the planner's search: the
bound depends only on which global elements each rank holds before and after.
Shards are cartesian products of per-dim index sets, so every count is a
product over dims and stays cheap for large tensors.

For rank r with `have` (elements held in the source) and `need` (elements held
in the destination):

- no reduction to resolve: r must receive every needed element it lacks,
  `|need - have|` elements.
- a pending reduction over g > 1 ranks to resolve: r must first give up all but
  a 1/g share of its partial values (the reduce-scatter bound, (g-1)/g * |have|)
  and then receive whatever it needs beyond the reduced share it can keep,
  `max(0, |need| - min(|need & have|, |have| / g))`. For a plain
  reduce_scatter this is (g-1)/g of the input, for all_reduce 2(g-1)/g.
"""

from __future__ import annotations

import math

from .layout import Layout, Shape
from .mesh import Mesh


def _count(sets: list[set[int]]) -> int:
    return math.prod(len(s) for s in sets)


def lower_bound_elements(mesh: Mesh, shape: Shape, src: Layout, dst: Layout) -> tuple[int, ...]:
    """Per rank (mesh order), elements any correct plan must receive."""
    if dst.partial_axes and not src.partial_axes:
        return _partial_destination(mesh, shape, src, dst)
    resolve = [a for a in src.partial_axes if a not in dst.partial_axes]
    g = math.prod(mesh.axis_size(a) for a in resolve)
    out = []
    for rank in mesh.ranks:
        have = [set(ix) for ix in src.indices(mesh, shape, rank)]
        need = [set(ix) for ix in dst.indices(mesh, shape, rank)]
        both = _count([h & n for h, n in zip(have, need)])
        n_have, n_need = _count(have), _count(need)
        if g == 1:
            out.append(n_need - both)
            continue
        reduce_part = (g - 1) * n_have // g
        deliver = max(0, n_need - min(both, -(-n_have // g)))
        out.append(reduce_part + deliver)
    return tuple(out)


def _partial_destination(mesh: Mesh, shape: Shape, src: Layout, dst: Layout) -> tuple[int, ...]:
    """A partial destination only needs each element somewhere in its reduction group:
    the group must receive what none of its members holds, at best spread evenly."""
    import torch

    axes = [a for a in mesh.axis_names if a in dst.partial_axes]
    g = math.prod(mesh.axis_size(a) for a in axes)
    out = {}
    for group in mesh.groups(*axes):
        covered = torch.zeros(shape, dtype=torch.bool)
        for rank in group:
            covered[_grid(src.indices(mesh, shape, rank))] = True
        for rank in group:
            need = covered[_grid(dst.indices(mesh, shape, rank))]
            out[rank] = -(-int((~need).sum()) // g)
    return tuple(out[r] for r in mesh.ranks)


def _grid(index):
    import torch

    if not index:
        return ()
    return torch.meshgrid(*[torch.tensor(ix, dtype=torch.long) for ix in index], indexing="ij")
