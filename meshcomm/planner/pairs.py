"""Blocks between two meshes, per rank: who sends which block to whom, found for one rank at
a time, and the bytes every rank moves, counted without listing them.

This module never communicates, and sits below the plan values (it returns plain tuples,
which `rank_transfers.py` turns into `Transfer`s). It applies where every element of the source
has one holder (`lazy_cross`: no axis of size > 1 replicates it, nothing is pending) and
nothing is pending in the destination: then the sender of every block is fixed, and a
rank's blocks follow from its own coordinates. A checkpoint loaded onto another mesh and
a pipeline hand-off are such moves; `crossmesh.py` plans them by counting
(`cross_traffic`) and the executors list each rank's blocks when it runs
(`Step.rank_transfers`), so a 1,024 -> 1,024-rank plan costs blocks, never ranks x ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.mesh import AxisName, Mesh
from .blocks import DimBlock, block, coords_grid, coords_table, dim_block, flat_index, in_mesh_order
from .bounds import sharding_axes
from .states import State

Positions = tuple[Sequence[int], ...]          # per dim: local positions (a range: one run)
Pair = tuple[int, int, Positions, Positions]    # (sender, receiver, sender's, receiver's)


def replicating_axes(state: State, mesh: Mesh) -> list[AxisName]:
    """The axes of size > 1 that shard no dim of `state`: each element has a holder per
    coordinate on them."""
    return [a for a in mesh.axis_names if a not in sharding_axes(state) and mesh.axis_size(a) > 1]


def lazy_cross(state: State, mesh: Mesh, dst: State) -> bool:
    """Whether moving `state` on `mesh` to `dst` (on another mesh) is planned by counting
    (see the module doc)."""
    return not replicating_axes(state, mesh) and not state.partial and not dst.partial


def positions(h: DimBlock, n: DimBlock, runs: bool = False
              ) -> tuple[Sequence[int], Sequence[int]]:
    """The local positions, in `h`'s block and in `n`'s, of the indices both hold; with
    `runs`, two one-run blocks give ranges (no index spelled out)."""
    both = h & n
    if runs and not h.digits and not n.digits:
        return (range(both.start - h.start, both.stop - h.start),
                range(both.start - n.start, both.stop - n.start))
    common = both.indices()
    return (tuple(torch.searchsorted(h.indices(), common).tolist()),
            tuple(torch.searchsorted(n.indices(), common).tolist()))


def _product(options: list[list[dict[AxisName, int]]]) -> list[tuple[dict[AxisName, int], ...]]:
    combos: list[tuple[dict[AxisName, int], ...]] = [()]
    for choices in options:
        combos = [c + (x,) for c in combos for x in choices]
    return combos


def _pair(src: int, dst: int, have: Sequence[DimBlock], need: Sequence[DimBlock]) -> Pair:
    both = [positions(h, n, runs=True) for h, n in zip(have, need)]
    return src, dst, tuple(s for s, _ in both), tuple(d for _, d in both)


def _overlapping(state: State, mesh: Mesh, blocks: Sequence[DimBlock],
                 free: tuple[AxisName, ...] = ()) -> list[dict[AxisName, int]]:
    """Every coordinate of `mesh` whose block of `state` overlaps `blocks` in every dim, the
    axes in `free` taking every value (they split no dim)."""
    zero = dict.fromkeys(mesh.axis_names, 0)
    options = [[c for c in coords_grid(mesh, in_mesh_order(mesh, dim.axes))
                if (dim_block(dim, mesh, {**zero, **c}) & b).count()]
               for dim, b in zip(state.dims, blocks)]
    options.append(list(coords_grid(mesh, free)))
    out = []
    for combo in _product(options):
        coords = dict(zero)
        for c in combo:
            coords.update(c)
        out.append(coords)
    return out


def receiver_pairs(state: State, mesh: Mesh, dst: State, dst_mesh: Mesh,
                   rank: int) -> list[Pair]:
    """The blocks `rank` of `dst_mesh` gets, one per sender whose block overlaps what it
    needs (itself included, where it is in both meshes).

    Cost: per dim, one block intersection per coordinate of the axes splitting that dim,
    then one pair per sender that overlaps; never the element count, never the other
    receivers.
    """
    need = block(dst, dst_mesh, dst_mesh.coords(rank))
    if any(n.count() == 0 for n in need):
        return []
    return [_pair(mesh.rank_at(**c), rank, block(state, mesh, c), need)
            for c in _overlapping(state, mesh, need)]


def sender_pairs(state: State, mesh: Mesh, dst: State, dst_mesh: Mesh,
                 rank: int) -> list[Pair]:
    """The blocks `rank` of `mesh` sends, one per receiver that needs part of its block
    (itself included), with the positions `receiver_pairs` gives that receiver."""
    have = block(state, mesh, mesh.coords(rank))
    if any(h.count() == 0 for h in have):
        return []
    # a destination axis that splits no dim: every coordinate on it needs the same block
    free = tuple(a for a in dst_mesh.axis_names if a not in sharding_axes(dst))
    return [_pair(rank, dst_mesh.rank_at(**c), have, block(dst, dst_mesh, c))
            for c in _overlapping(dst, dst_mesh, have, free)]


def _interval(b: DimBlock) -> tuple[int, int] | None:
    """[start, stop) of a block that is one run of indices, else None."""
    if not b.digits:
        return b.start, b.stop
    top, start, width = b.size, 0, b.size
    for lo, hi, value in b.digits:           # major first: a chain from the dim's size down
        if hi != top or lo <= 0 or hi % lo:
            return None
        start, width, top = start + value * lo, lo, lo
    lo_, hi_ = max(start, b.start), min(start + width, b.stop)
    return lo_, max(hi_, lo_)


def _dim_counts(rows: list[DimBlock], cols: list[DimBlock]) -> Tensor:
    """|rows[i] ∩ cols[j]| for every pair: one tensor expression where every block is one
    run (the common case), else block by block."""
    spans = [_interval(b) for b in (*rows, *cols)]
    if all(s is not None for s in spans):
        lo = torch.tensor([s[0] for s in spans if s is not None], dtype=torch.long)
        hi = torch.tensor([s[1] for s in spans if s is not None], dtype=torch.long)
        n = len(rows)
        return (torch.minimum(hi[:n, None], hi[None, n:])
                - torch.maximum(lo[:n, None], lo[None, n:])).clamp(min=0)
    return torch.tensor([[(h & c).count() for c in cols] for h in rows], dtype=torch.long)


@functools.lru_cache(maxsize=256)
def cross_traffic(state: State, mesh: Mesh, dst: State, dst_mesh: Mesh
                  ) -> tuple[Tensor, Tensor]:
    """Elements each rank of `mesh` sends (mesh order) and each rank of `dst_mesh` receives
    (its order); what a rank in both meshes holds and needs stays with it.

    Per dim, a table of block intersections (source block x destination block); a pair's
    overlap is the product over dims, so a sender's total over every receiver is a product
    of row sums: O(blocks per dim), never ranks x ranks. Cached: the tensors are shared,
    read only."""
    src_coords, dst_coords = coords_table(mesh), coords_table(dst_mesh)
    sent = torch.ones(mesh.size, dtype=torch.long)
    got = torch.ones(dst_mesh.size, dtype=torch.long)
    tables, src_at, dst_at = [], [], []
    used: set[AxisName] = set()
    for a, b in zip(state.dims, dst.dims):
        ax, bx = in_mesh_order(mesh, a.axes), in_mesh_order(dst_mesh, b.axes)
        used |= set(bx)
        table = _dim_counts([dim_block(a, mesh, c) for c in coords_grid(mesh, ax)],
                            [dim_block(b, dst_mesh, c) for c in coords_grid(dst_mesh, bx)])
        i, j = flat_index(src_coords, mesh, ax), flat_index(dst_coords, dst_mesh, bx)
        sent *= table.sum(1)[i]
        got *= table.sum(0)[j]
        tables.append(table)
        src_at.append(i)
        dst_at.append(j)
    sent *= dst_mesh.group_size(a for a in dst_mesh.axis_names if a not in used)
    for r in set(mesh.ranks) & set(dst_mesh.ranks):   # kept: neither sent nor received
        p, q = mesh.position(r), dst_mesh.position(r)
        keep = math.prod(int(t[i[p], j[q]]) for t, i, j in zip(tables, src_at, dst_at))
        sent[p] -= keep
        got[q] -= keep
    return sent, got
