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
from collections.abc import Sequence

import torch

from ..core.errors import PlanError
from ..core.mesh import AxisName, Mesh
from .blocks import own_and_need, summed_overlap
from .bounds import sharding_axes
from .moves import Move, block_indices
from .rank_transfers import direct_axes, resolved_axes
from .states import State
from .transfers import (
    Blocks,
    Cell,
    Index,
    _atoms,
    _cells_of,
    _holds,
    _members,
    _split,
    _transfer,
    assign,
)
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
    same blocks. Ranks that agree on every axis sharding a state hold the same block: it is
    worked out once and shared (the atoms read each distinct block once). Read-only: a
    caller that changes `need` copies it first."""
    have, have_once = _blocks(start, mesh)
    need, need_once = _blocks(goal, dst_mesh)
    atoms = [_atoms([h[d] for h in have_once] + [n[d] for n in need_once], dim.size)
             for d, dim in enumerate(start.dims)]
    return have, need, atoms


def _blocks(state: State, mesh: Mesh) -> tuple[Blocks, list[Index]]:
    """Per rank of `mesh` its block of `state` (`moves.block_indices`), and the distinct
    blocks: one per coordinates on the axes sharding `state`."""
    axes = [a for a in mesh.axis_names if a in sharding_axes(state)]
    once: dict[tuple[int, ...], Index] = {}
    out: Blocks = {}
    for r in mesh.ranks:
        coords = mesh.coords(r)
        key = tuple(coords[a] for a in axes)
        block = once.get(key)
        if block is None:
            block = once[key] = block_indices(state, mesh, r)
        out[r] = block
    return out, list(once.values())


def cross_direct_transfers(start: State, goal: State, mesh: Mesh, dst_mesh: Mesh,
                           resolve: tuple[AxisName, ...], idle: tuple[int, ...]
                           ) -> tuple[Transfer, ...]:
    """The transfers that give every rank of `dst_mesh` (but those in `idle`, which hold the
    identity of a pending reduction of `goal`) its `goal` block once from each of the g
    partials pending over `resolve` on `mesh`; `start` is the source without its pending
    reduction (the blocks the holders hold). A rank in both meshes keeps what it holds of
    its own block (a transfer to itself, no bytes).

    Each partial's transfers are `transfers.assign`'s over its holders. The holders of
    partial j differ from those of partial 0 only on the coordinates of `resolve`, which
    shard nothing: the k-th holder of each (in mesh order) holds the same block. So the
    receivers' cells, each cell's holders and the positions of every transfer are found
    once, for partial 0, and each partial only replays the choice of the least loaded
    holder (and keeps a receiver's own cells where it is one of that partial's holders)."""
    have, need, atoms = cross_held(start, goal, mesh, dst_mesh)
    need = {r: tuple(() for _ in start.dims) if r in idle else ix for r, ix in need.items()}
    by_partial: dict[tuple[int, ...], list[int]] = {}
    for r in mesh.ranks:
        coords = mesh.coords(r)
        by_partial.setdefault(tuple(coords[a] for a in resolve), []).append(r)
    partials = list(by_partial.values())
    listing = _Listing(have, partials[0], need, atoms)
    out: list[Transfer] = []
    for holders in partials:
        if len(holders) != len(partials[0]) or any(
                have[a] != have[b] for a, b in zip(partials[0], holders)):
            found = assign({r: have[r] for r in holders}, need, atoms, lambda s, r: True)
        else:
            found = listing.assign(tuple(holders))
        if found is None:
            raise PlanError(f"cannot deliver the partials of {start} on {mesh!r} to {goal} on"
                            f" {dst_mesh!r}: some block has no holder; this is a meshcomm bug,"
                            " please report it")
        out += found
    return tuple(out)


_Move = tuple[tuple[Sequence[int], ...], tuple[Sequence[int], ...], int]


class _Listing:
    """`transfers.assign` for holder sets that hold, k-th by k-th, the blocks `first` holds:
    the same transfers, with what does not depend on which set worked out once."""

    def __init__(self, have: Blocks, first: list[int], need: Blocks,
                 atoms: list[list[tuple[int, ...]]]) -> None:
        self.have, self.first, self.need, self.atoms = have, first, need, atoms
        members = {s: _members(have[s]) for s in first}
        self.members = members
        # per receiver (in `need` order) its cells, and whether it holds each itself
        self.rows = []
        for r in need:
            cells = _cells_of(need[r], atoms)
            own = _members(have[r]) if r in have else None
            self.rows.append((r, cells, [own is not None and _holds(own, c) for c in cells]))
        self._at_atom: list[dict[int, frozenset[int]]] = [{} for _ in atoms]
        self._holders: dict[tuple[int, int], list[int]] = {}
        self._moves: dict[tuple[int, int, int, int], _Move] = {}

    def holders(self, row: int, k: int) -> list[int]:
        """The positions in `first` of the holders of cell k of receiver row `row`."""
        found = self._holders.get((row, k))
        if found is None:
            cell = self.rows[row][1][k]
            sets = sorted((self._holding(d, atom) for d, atom in enumerate(cell)), key=len)
            common = (sets[0].intersection(*sets[1:]) if sets
                      else frozenset(range(len(self.first))))
            found = self._holders[(row, k)] = sorted(common)
        return found

    def _holding(self, d: int, atom: tuple[int, ...]) -> frozenset[int]:
        found = self._at_atom[d].get(atom[0])
        if found is None:
            found = self._at_atom[d][atom[0]] = frozenset(
                i for i, s in enumerate(self.first) if atom[0] in self.members[s][d])
        return found

    def _move(self, i: int, row: int, k: int, p: int, piece: Cell
              ) -> _Move:
        """Positions (in the sender's and the receiver's block) and numel of piece p of
        cell k of row `row` sent by holder i (-1: kept by the receiver); p counts from 1
        for the pieces of a split cell, 0 for a whole one."""
        key = (i, row, k, p)
        found = self._moves.get(key)
        if found is None:
            r = self.rows[row][0]
            t = _transfer(r if i < 0 else self.first[i], r, piece, self.have, self.need)
            found = self._moves[key] = (t.src_index, t.dst_index, t.numel)
        return found

    def _assign(self, holders: tuple[int, ...], split: bool
                ) -> tuple[list[Transfer], list[int]] | None:
        held = frozenset(holders)
        load = [0] * len(holders)
        transfers = []
        for row, (r, cells, own) in enumerate(self.rows):
            for k, cell in enumerate(cells):
                if own[k] and r in held:
                    src_index, dst_index, _ = self._move(-1, row, k, 0, cell)
                    transfers.append(Transfer(r, r, src_index, dst_index))
                    continue
                at = self.holders(row, k)
                if not at:
                    return None
                for p, piece in enumerate(_split(cell, len(at)) if split else [cell], split):
                    i = min(at, key=load.__getitem__)   # least loaded, then mesh order
                    src_index, dst_index, numel = self._move(i, row, k, p, piece)
                    transfers.append(Transfer(holders[i], r, src_index, dst_index))
                    load[i] += numel
        return transfers, load

    def assign(self, holders: tuple[int, ...]) -> tuple[Transfer, ...] | None:
        """`transfers.assign({s: have[s] for s in holders}, need, atoms, always)`."""
        whole = self._assign(holders, split=False)
        if whole is None:
            return None
        transfers, load = whole
        if max(load, default=0) * len(holders) > sum(load):
            split = self._assign(holders, split=True)
            assert split is not None, "splitting cannot lose a holder"
            if max(split[1]) < max(load):
                transfers = split[0]
        return tuple(transfers)
