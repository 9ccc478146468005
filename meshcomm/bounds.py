"""Lower bounds on the bytes any correct plan must receive, from index sets alone.

This module never communicates and never looks at the planner's search: the
bound depends only on which global elements each rank holds before and after.
For P ranks, rank r holding `have_r` before and `need_r` after:

- No reduction to resolve, no pending reduction after: r must receive every
  element it needs and lacks: `LB_r = |need_r - have_r|`.
- A new pending reduction after (`| sum(tp)`): in r's group G of g ranks over
  the new pending axes, an element some member needs must
  be received by one of them unless a member both holds and needs it, so G
  receives at least that many elements and its busiest member a g-th of them:
  `LB_r = ceil(|{e needed in G, kept by no member}| / g)`.
- A pending reduction over g > 1 ranks to resolve (the reduce-scatter bound):
  every element e needs at least g - 1 messages to combine its g partial
  values, plus one delivery to each of the n_e places that need it but did not
  do the combining, so all ranks together receive at least
  `S = sum_e (g - 2 + n_e)` elements and the busiest rank at least S / P:
  `LB_r = ceil(S / P)` for every r. For a plain reduce_scatter this is
  (g - 1)/g of the input, for an all_reduce 2(g - 1)/g: the ring algorithms
  meet it. Here n_e counts the ranks needing e (or, when a reduction stays
  pending in the destination, the destination's reduction groups needing e).

The first bound holds for every rank. The other two are shared out evenly,
so they bound the busiest rank of the group (the max over ranks), which is
what the modelled time of a collective depends on.
"""

from __future__ import annotations

import math

import torch

from .layout import Layout, Shape
from .mesh import Mesh


def _count(sets: list[set[int]]) -> int:
    return math.prod(len(s) for s in sets)


def _grid(index: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    if not index:
        return ()
    return torch.meshgrid(*[torch.tensor(ix, dtype=torch.long) for ix in index], indexing="ij")


def lower_bound_elements(mesh: Mesh, shape: Shape, src: Layout, dst: Layout) -> tuple[int, ...]:
    """Per rank (mesh order), elements any correct plan must receive."""
    resolve = [a for a in src.partial_axes if a not in dst.partial_axes]
    g = math.prod(mesh.axis_size(a) for a in resolve)
    if g > 1:
        return _reduction(mesh, shape, dst, g)
    new = [a for a in mesh.axis_names if a in dst.partial_axes and a not in src.partial_axes]
    if new:
        return _partial_destination(mesh, shape, src, dst, new)
    out = []
    for rank in mesh.ranks:
        have = [set(ix) for ix in src.indices(mesh, shape, rank)]
        need = [set(ix) for ix in dst.indices(mesh, shape, rank)]
        out.append(_count(need) - _count([h & n for h, n in zip(have, need)]))
    return tuple(out)


def _dst_groups(mesh: Mesh, dst: Layout) -> tuple[tuple[int, ...], ...]:
    axes = [a for a in mesh.axis_names if a in dst.partial_axes]
    return mesh.groups(*axes) if axes else tuple((r,) for r in mesh.ranks)


def _reduction(mesh: Mesh, shape: Shape, dst: Layout, g: int) -> tuple[int, ...]:
    numel = math.prod(shape)
    groups = _dst_groups(mesh, dst)
    if all(len(group) == 1 for group in groups):
        needers = sum(_count([set(ix) for ix in dst.indices(mesh, shape, r)]) for r in mesh.ranks)
    else:
        counts = torch.zeros(shape, dtype=torch.long)
        for group in groups:
            covered = torch.zeros(shape, dtype=torch.bool)
            for rank in group:
                covered[_grid(dst.indices(mesh, shape, rank))] = True
            counts += covered.long()
        needers = int(counts.sum())
    total = numel * (g - 2) + needers
    return (-(-total // mesh.size),) * mesh.size


def _partial_destination(mesh: Mesh, shape: Shape, src: Layout, dst: Layout,
                         new: list[str]) -> tuple[int, ...]:
    out = {}
    for group in mesh.groups(*new):
        needed = torch.zeros(shape, dtype=torch.bool)
        kept = torch.zeros(shape, dtype=torch.bool)
        for rank in group:
            need = torch.zeros(shape, dtype=torch.bool)
            need[_grid(dst.indices(mesh, shape, rank))] = True
            have = torch.zeros(shape, dtype=torch.bool)
            have[_grid(src.indices(mesh, shape, rank))] = True
            needed |= need
            kept |= need & have
        lacking = int((needed & ~kept).sum())
        for rank in group:
            out[rank] = -(-lacking // len(group))
    return tuple(out[r] for r in mesh.ranks)
