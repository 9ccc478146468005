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
"""

from __future__ import annotations

import functools

import torch

from ..core.mesh import Mesh
from .blocks import own_and_need, summed_overlap
from .moves import Move
from .rank_transfers import direct_axes, resolved_axes
from .states import State


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
