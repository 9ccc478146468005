"""Direct delivery: every partial of a rank's destination block sent straight to that rank.

This module never communicates. A pending reduction over axes R (g ranks) can be resolved
in one step to any destination: each rank receives, from one holder of each of the g
partials, the part of its destination block that holder has, and reduces the g values
in group order (the reducing send_recv of `transfers.send_recv_move` is the case where
every rank's destination block lies in its own block, so it talks over R alone). Here the
group is R and the axes sharding the source (`rank_transfers.direct_axes`): for each
partial, the holders that differ from a rank only on the sharding axes hold disjoint
blocks that cover the tensor, so each element arrives once per partial. A rank receives
g times its block, less what it holds of it itself; it sends each member of its group
what that member needs of its block. One round, one latency: where a reduction tree
receives less but takes several rounds, a cost model with latency weighs the two.

Between two meshes (`cross_direct_transfers`) the same delivery is listed as transfers:
for each partial, its holders on the source mesh give every destination rank its block
(one holder per element, the least loaded first), and the destination rank reduces the
g partials in group order. The transfer between meshes cannot add up what it receives,
so without it a partial source is reduced on the source mesh first.
"""

from __future__ import annotations

import functools

import torch

from ..core.errors import PlanError
from ..core.mesh import AxisName, Mesh
from .blocks import own_and_need, summed_overlap
from .moves import Move
from .rank_transfers import direct_axes, resolved_axes
from .states import State
from .transfers import Blocks, assign, cross_blocks
from .values import Transfer


@functools.lru_cache(maxsize=1024)
def direct_move(state: State, goal: State, mesh: Mesh) -> Move | None:
    """The direct delivery from `state` (with a pending reduction) to `goal`, or None where
    it does not apply (nothing to resolve, new pending axes, or a destination every rank
    holds already: the reducing send_recv over R alone is that case)."""
    resolve = resolved_axes(state, goal)
    if not resolve or state == goal:
        return None
    own, need = own_and_need(state, goal, mesh)
    if bool(torch.equal(own, need)):
        return None
    axes = direct_axes(state, goal, mesh)
    recv = need * mesh.group_size(resolve) - own
    sent = summed_overlap(state, goal, mesh, frozenset(axes), in_need=True) - own
    return Move("send_recv", axes, goal, action="direct", op=state.op, indexed=True,
                send=tuple(sent.tolist()), recv=tuple(recv.tolist()))


@functools.lru_cache(maxsize=64)
def cross_held(start: State, goal: State, mesh: Mesh, dst_mesh: Mesh
               ) -> tuple[Blocks, Blocks, list[list[tuple[int, ...]]]]:
    """`transfers.cross_blocks` of a move between two meshes, found once: a partial source's
    plain transfer (from the source without its reduction) and its direct delivery read the
    same blocks. Read-only: a caller that changes `need` copies it first."""
    return cross_blocks(start, goal, mesh, dst_mesh)


def cross_direct_transfers(start: State, goal: State, mesh: Mesh, dst_mesh: Mesh,
                           resolve: tuple[AxisName, ...], idle: tuple[int, ...]
                           ) -> tuple[Transfer, ...]:
    """The transfers that give every rank of `dst_mesh` (but those in `idle`, which hold the
    identity of a pending reduction of `goal`) its `goal` block once from each of the g
    partials pending over `resolve` on `mesh`; `start` is the source without its pending
    reduction (the blocks the holders hold). A rank in both meshes keeps what it holds of
    its own block (a transfer to itself, no bytes)."""
    have, need, atoms = cross_held(start, goal, mesh, dst_mesh)
    need = {r: tuple(() for _ in start.dims) if r in idle else ix for r, ix in need.items()}
    by_partial: dict[tuple[int, ...], Blocks] = {}
    for r in mesh.ranks:
        coords = mesh.coords(r)
        by_partial.setdefault(tuple(coords[a] for a in resolve), {})[r] = have[r]
    out: list[Transfer] = []
    for holders in by_partial.values():
        found = assign(holders, need, atoms, lambda s, r: True)
        if found is None:
            raise PlanError(f"cannot deliver the partials of {start} on {mesh!r} to {goal} on"
                            f" {dst_mesh!r}: some block has no holder; this is a meshcomm bug,"
                            " please report it")
        out += found
    return tuple(out)
