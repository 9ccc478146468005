"""Point-to-point redistribution, planned: any layout change as balanced block transfers.

This module never communicates. `send_recv_move` plans a single step in which
every rank receives exactly the elements it needs and does not hold (so a
rank's received bytes equal the lower bound), each from one holder, spreading
the sending over the ranks that hold replicas; `assign` lists the transfers of a step
between two meshes where the planner lists them. This is the plan-time room: what a rank
does when the step runs (its own blocks, `Step.rank_transfers`) is computed by
`meshcomm.planner.rank_transfers`, whose functions the planner leaves in the step
(`blocks_of`). Executors run the step as one all_to_all with uneven splits, using
`meshcomm.executors.local.pack` and `meshcomm.executors.landing.unpacked`, so that the
simulated and the real executor move the same bytes in the same order.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..core.mesh import AxisName, Mesh
from .blocks import (
    combos,
    coords_table,
    counts_at,
    flat_index,
    in_mesh_order,
    own_and_need,
    rank_blocks,
    summed_overlap,
)
from .bounds import missing, sharding_axes, state_bound
from .moves import Move, block_indices
from .rank_transfers import resolved_axes, rotation, send_recv_axes
from .states import DimState, State, as_chunks, chunk_dim, even_dim, is_chain, local_numels
from .values import Transfer

Index = tuple[tuple[int, ...], ...]


def _atoms(sets: list[tuple[int, ...]], size: int) -> list[tuple[int, ...]]:
    """Classes of indices 0..size-1 that belong to exactly the same sets (in order of their
    first index)."""
    distinct = {tuple(sorted(s)) for s in sets}
    classes: dict[tuple[bool, ...], list[int]] = defaultdict(list)
    if all(not s or _run(s) for s in distinct):
        # every set one run: membership is constant between consecutive run ends, so the
        # classes are found per interval (cost: the sets squared, not size x sets)
        runs = [(s[0], s[-1] + 1) for s in distinct if s]
        ends = sorted({0, size} | {e for run in runs for e in run})
        for a, b in zip(ends, ends[1:]):
            classes[tuple(lo <= a < hi for lo, hi in runs)].extend(range(a, b))
        return [tuple(c) for c in classes.values()]
    members = [frozenset(s) for s in distinct]
    for i in range(size):
        classes[tuple(i in m for m in members)].append(i)
    return [tuple(c) for c in classes.values()]


def _cells_of(need: Index, atoms: list[list[tuple[int, ...]]]) -> list[tuple[tuple[int, ...], ...]]:
    per_dim = []
    for d, ix in enumerate(need):
        want = set(ix)
        per_dim.append([a for a in atoms[d] if a and a[0] in want])
    cells: list[tuple[tuple[int, ...], ...]] = [()]
    for options in per_dim:
        cells = [c + (a,) for c in cells for a in options]
    return cells


def _holds(members: tuple[range | frozenset[int], ...], cell: tuple[tuple[int, ...], ...]) -> bool:
    return all(a[0] in m for m, a in zip(members, cell))


def _members(index: Index) -> tuple[range | frozenset[int], ...]:
    """Per dim, the indices held, for O(1) membership (a range where they are one run)."""
    return tuple(range(ix[0], ix[-1] + 1) if _run(ix) else frozenset(ix) for ix in index)


def _run(ix: tuple[int, ...]) -> bool:
    """Whether `ix` is consecutive ascending integers (and not empty)."""
    return bool(ix) and ix[-1] - ix[0] == len(ix) - 1 and (len(ix) < 3 or ix[1] == ix[0] + 1)


Blocks = dict[int, Index]
Cell = tuple[tuple[int, ...], ...]


def cross_blocks(state: State, dst: State, mesh: Mesh,
            dst_mesh: Mesh | None = None) -> tuple[Blocks, Blocks, list[list[tuple[int, ...]]]]:
    """Per rank the indices held in `state` (on `mesh`) and in `dst` (on `dst_mesh`, by
    default the same mesh), and per dim the atoms of both."""
    dst_mesh = dst_mesh or mesh
    have = {r: block_indices(state, mesh, r) for r in mesh.ranks}
    need = {r: block_indices(dst, dst_mesh, r) for r in dst_mesh.ranks}
    shape = tuple(d.size for d in state.dims)
    atoms = [_atoms([h[d] for h in have.values()] + [n[d] for n in need.values()], size)
             for d, size in enumerate(shape)]
    return have, need, atoms


def assign(have: Blocks, need: Blocks, atoms: list[list[tuple[int, ...]]],
           same_group: Callable[[int, int], bool]) -> tuple[Transfer, ...] | None:
    """Transfers giving every receiver in `need` its block: what it holds itself is a local
    copy, the rest comes from the least-loaded holder `s` with `same_group(s, receiver)`.
    Whole blocks first; if a sender then does more than an even share, replicated blocks
    are split over their holders.

    Returns None when some block has no such holder.
    """
    whole = _assign(have, need, atoms, same_group, split=False)
    if whole is None:
        return None
    transfers, load = whole
    total = sum(load.values())
    if max(load.values(), default=0) * len(have) > total:
        # Some sender does more than its share: split replicated blocks over their holders.
        split = _assign(have, need, atoms, same_group, split=True)
        assert split is not None, "splitting cannot lose a holder"
        if max(split[1].values()) < max(load.values()):
            transfers = split[0]
    return tuple(transfers)


def _assign(have: Blocks, need: Blocks, atoms: list[list[tuple[int, ...]]],
            same_group: Callable[[int, int], bool],
            split: bool) -> tuple[list[Transfer], dict[int, int]] | None:
    load = dict.fromkeys(have, 0)
    members = {s: _members(ix) for s, ix in have.items()}
    order = {s: i for i, s in enumerate(have)}
    by_atom: list[dict[int, frozenset[int]]] = [{} for _ in atoms]

    def holding(d: int, atom: tuple[int, ...]) -> frozenset[int]:
        """The ranks whose dim-d block holds `atom` (once per atom, not per receiver)."""
        found = by_atom[d].get(atom[0])
        if found is None:
            found = by_atom[d][atom[0]] = frozenset(
                s for s in have if atom[0] in members[s][d])
        return found

    transfers = []
    for r in need:
        for cell in _cells_of(need[r], atoms):
            if r in have and _holds(members[r], cell):
                transfers.append(_transfer(r, r, cell, have, need))
                continue
            sets = sorted((holding(d, atom) for d, atom in enumerate(cell)), key=len)
            common = sets[0].intersection(*sets[1:]) if sets else frozenset(have)
            holders = [s for s in sorted(common, key=order.__getitem__) if same_group(s, r)]
            if not holders:
                return None
            for piece in _split(cell, len(holders)) if split else [cell]:
                src = min(holders, key=lambda s: load[s])   # least loaded, then mesh order
                transfers.append(_transfer(src, r, piece, have, need))
                load[src] += transfers[-1].numel
    return transfers, load


def _split(cell: Cell, parts: int) -> list[Cell]:
    """`cell` cut into up to `parts` pieces along its longest atom (one piece if it is 1 long)."""
    if parts == 1 or not cell:
        return [cell]
    d = max(range(len(cell)), key=lambda i: len(cell[i]))
    atom = cell[d]
    step = -(-len(atom) // parts)
    return [cell[:d] + (atom[i:i + step],) + cell[d + 1:] for i in range(0, len(atom), step)]


@functools.lru_cache(maxsize=4096)
def _where(index: Index) -> tuple[dict[int, int], ...]:
    """Per dim, global index -> local position."""
    return tuple({g: k for k, g in enumerate(ix)} for ix in index)


def _transfer(src: int, dst: int, cell: Cell, have: Blocks, need: Blocks) -> Transfer:
    """The Transfer of `cell` from `src`'s local positions to `dst`'s."""
    def positions(index: Index) -> tuple[Sequence[int], ...]:
        out: list[Sequence[int]] = []
        for d, (ix, atom) in enumerate(zip(index, cell)):
            if _run(ix) and _run(atom):      # both one run: the positions are one run too
                out.append(range(atom[0] - ix[0], atom[-1] - ix[0] + 1))
            else:
                where = _where(index)[d]
                out.append(tuple(where[g] for g in atom))
        return tuple(out)

    return Transfer(src, dst, positions(have[src]), positions(need[dst]))


# -- send_recv and reindex on one mesh: planned from block counts -------------------------
def pair_traffic(state: State, dst: State, mesh: Mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, the elements it sends and receives when every rank r gets each element it
    needs and lacks from its twin: the holder that agrees with r on every axis that does
    not shard `state` (so a step runs over the axes sharding `state` only).

    Holders that differ on an axis sharding `state` hold disjoint blocks, so the twins of r
    cover the tensor exactly once and r receives exactly what it lacks (the lower bound).
    A sender s sends each twin r of its group what r needs of s's block: a sum over the
    group of products of per-dim intersection tables, counted for all ranks at once.
    """
    own, need = own_and_need(state, dst, mesh)
    return pair_sent(state, dst, mesh), tuple((need - own).tolist())


def pair_sent(state: State, dst: State, mesh: Mesh) -> tuple[int, ...]:
    """What each rank sends in `pair_traffic` (mesh order)."""
    if all(d.is_local for d in dst.dims):   # every rank needs it all: a sender's block goes
        others = mesh.group_size(sharding_axes(state)) - 1      # to its group's others
        return tuple(others * n for n in local_numels(state, mesh))
    own, _ = own_and_need(state, dst, mesh)
    # Sender p's receivers are p with its coordinates on the axes sharding `state`
    # replaced by any values.
    return tuple((summed_overlap(state, dst, mesh, sharding_axes(state), in_need=True)
                  - own).tolist())


@functools.lru_cache(maxsize=1024)
def send_recv_move(state: State, dst: State, mesh: Mesh, exact: bool = True) -> Move | None:
    """One send_recv step from `state` straight to `dst` over the axes sharding `state`
    (each rank receives exactly what it lacks, from its twin: `pair_traffic`), or a local
    select when no rank lacks anything; None where it does not apply.

    A reducing send_recv also resolves pending axes R of `state` (g ranks) where every
    rank's `dst` block lies in its `state` block: each rank receives the partial values of
    its block from the other g - 1 members of its group over R (they hold the same block)
    and reduces the g of them in group order. Its group is R alone, so it never talks to
    more ranks than the reduction needs (a destination elsewhere is reached by a move after
    it; see `reduce_targets`).

    With `exact=False` the sent counts are only estimated (as the received ones, which
    are exact and cheap): the search prices a send_recv exactly only when it may win.
    """
    resolve = resolved_axes(state, dst)
    if resolve is None or state == dst:
        return None
    if resolve:
        return _reducing_move(state, dst, mesh, resolve, exact)
    recv = missing(state, dst, mesh)
    zeros = (0,) * mesh.size
    if not any(recv):
        return Move("local", (), dst, action="select", indexed=True, send=zeros, recv=zeros)
    axes = in_mesh_order(mesh, sharding_axes(state))
    if not exact:
        return Move("send_recv", axes, dst, indexed=True, estimate=True, send=recv, recv=recv)
    send = pair_sent(state, dst, mesh)   # each receives `recv`, above
    most = max(send)     # in Python: the tensor's max and int are two more cold torch ops
    if most > max(recv):     # twins send more than anyone receives: rotate them?
        turn = rotation(state, mesh)
        if turn is not None and mesh.size * mesh.group_size(turn[0]) <= ROTATE_LIMIT:
            spread = rotated_sends(state, dst, mesh, *turn)
            if max(spread) < most:
                return Move("send_recv", in_mesh_order(mesh, {*turn[0], *turn[1]}), dst,
                            action="rotate", indexed=True, send=spread, recv=recv)
    return Move("send_recv", axes, dst, indexed=True, send=send, recv=recv)


# -- rotated twins: the sending spread over replicas --------------------------------------
# A rank's twins (`pair_traffic`) agree with it on every axis that does not shard the state,
# so where the ranks that need one block line up along an axis the state shards (a
# destination replicated over it), one replica of the block sends to all of them and the
# others idle. A rotated send_recv takes each rank's blocks from the replicas one further
# along the replicating axes R per step of its coordinates on the sharding axes S: rank q
# receives every block it lacks from the holders whose R coordinates are q's plus
# shift(q) = (q's flat index over S) mod |R|, and whose other coordinates (pending axes)
# are q's. Each of them holds that block (the state is replicated over R), so q receives
# exactly what it lacks, as from its twins; only who sends changes.
ROTATE_LIMIT = 1 << 18   # ranks x block positions counted at most (planning time: about
                         # 10 ms at the limit, more on chunked dims); beyond, the twins send


@functools.lru_cache(maxsize=1024)
def rotated_sends(state: State, dst: State, mesh: Mesh, shard: tuple[AxisName, ...],
                  spare: tuple[AxisName, ...]) -> tuple[int, ...]:
    """Per rank (mesh order), the elements it sends in a rotated send_recv: a sum over the
    g block positions j on S (its own left out) of what the rank with S coordinates j and R
    coordinates its own minus shift(j) needs of its block. O(ranks x g) counts, in torch."""
    coords = coords_table(mesh)                                     # [N, axes]
    grid = combos(mesh, shard)                                      # [g, |S|]
    g, turns = grid.shape[0], mesh.group_size(spare)
    mine = flat_index(coords, mesh, spare)[:, None]                 # [N, 1]
    theirs = (mine - torch.arange(g)[None, :] % turns) % turns      # [N, g] R index of q
    stride = {a: mesh.group_size(spare[i + 1:])
              for i, a in enumerate(spare)}

    def coord(axis: AxisName) -> Tensor:                            # q's, [N, g] or [N, 1]
        if axis in shard:
            return grid[None, :, shard.index(axis)]
        if axis in stride:
            return (theirs // stride[axis]) % mesh.axis_size(axis)
        return coords[:, mesh.axis_names.index(axis)][:, None]

    out = torch.ones(mesh.size, g, dtype=torch.long)
    for have, want in zip(state.dims, dst.dims):
        need = torch.zeros(1, 1, dtype=torch.long)
        for axis in in_mesh_order(mesh, want.axes):
            need = need * mesh.axis_size(axis) + coord(axis)
        out = out * counts_at(have, want, mesh, rank_blocks(have, mesh)[:, None], need)
    own = flat_index(coords, mesh, shard)[:, None] == torch.arange(g)[None, :]
    return tuple(out.masked_fill(own, 0).sum(1).tolist())


def _reducing_move(state: State, dst: State, mesh: Mesh, resolve: tuple[AxisName, ...],
                   exact: bool) -> Move | None:
    own, need = own_and_need(state, dst, mesh)
    if not bool(torch.equal(own, need)):
        return None
    g = mesh.group_size(resolve)
    recv = tuple((need * (g - 1)).tolist())
    axes = send_recv_axes(state, dst, mesh)
    if not exact:
        return Move("send_recv", axes, dst, op=state.op, indexed=True, estimate=True,
                    send=recv, recv=recv)
    # Sender s sends each member r of its group what r needs of s's block, itself aside.
    sent = summed_overlap(state, dst, mesh, frozenset(axes), in_need=True) - own
    return Move("send_recv", axes, dst, op=state.op, indexed=True, send=tuple(sent.tolist()),
                recv=recv)


@functools.lru_cache(maxsize=1024)
def reindex_move(state: State, dst: State, mesh: Mesh) -> Move | None:
    """A free local step straight to a pending reduction in `dst`: each rank keeps the part of
    its block that it needs, and the other elements hold the op's identity, or None.

    It applies when every element a destination reduction group needs is held by one of
    its members (the lower bound is 0); of members holding the same block, the first in
    group order keeps it, so the reduction gives every element back exactly once.
    """
    new = tuple(a for a in dst.partial if a not in state.partial)
    if not new or dst.op == "avg" or (state.partial and state.op != dst.op):
        return None
    if any(a not in dst.partial for a in state.partial) or state == dst:
        return None
    if any(state_bound(state, dst, mesh)):
        return None
    zeros = (0,) * mesh.size
    return Move("local", new, dst, action="reindex", op=dst.op, indexed=True,
                send=zeros, recv=zeros)


def send_recv_targets(state: State, goal: State, mesh: Mesh) -> list[State]:
    """Where a send_recv from `state` may go: the goal itself; the goal's dims keeping the
    current pending reduction (when the goal's extra pending axes are marked after, or,
    without the axes still to be reduced, when a reduce_scatter into them follows), also
    with the axes the goal does not use left where they are (gathered after a cheaper
    reduction); and the spreads of a goal with new pending axes (`spread_targets`)."""
    targets = [goal]
    resolve = {a for a in state.partial if a not in goal.partial}
    kept = State(tuple(_before_reduction(dim, resolve, mesh) for dim in goal.dims),
                 state.partial, state.op)
    for target in (kept, _keep_extra(state, kept, mesh)):
        if target not in targets:
            targets.append(target)
    return targets + spread_targets(state, goal, mesh) + [
        t for t in reduce_targets(state, goal, mesh) if t not in targets]


def reduce_targets(state: State, goal: State, mesh: Mesh) -> list[State]:
    """Where a reducing send_recv from `state` may go besides the goal: the goal's dims,
    with the axes the goal leaves free (neither sharding it nor pending) splitting one of
    its dims too, so that each rank reduces a share of its block and an all_gather over
    those axes (or a send_recv) completes it. The idle replicas then share the reduction:
    over g ranks and f free ranks a rank receives (g - 1 + f - 1) / f of its block, not
    g - 1 times it. Or `state`'s own dims split over the axes free in it, where each rank
    reduces a share of what it holds. A target where some rank's block is not in what it
    holds gets no reducing send_recv (`send_recv_move` gives None)."""
    resolve = resolved_axes(state, goal)
    if not resolve:
        return []
    keep = tuple(a for a in state.partial if a in goal.partial)
    op = state.op if keep else None
    base = State(goal.dims, keep, op)
    out = [] if base == goal else [base]

    def add(targets: list[State]) -> None:
        out.extend(t for t in targets if t not in out and t != goal)

    free = [a for a in mesh.axis_names if a not in base.used_axes() and mesh.axis_size(a) > 1]
    if free:
        for order in _orders(free, in_mesh_order(mesh, sharding_axes(state))):
            add(_spread(base, order, mesh) + _spread(_keep_extra(state, base, mesh), order, mesh))
    # Or each rank reduces a share of its own block, split over the axes free in `state`,
    # and a move to the goal follows.
    own = State(state.dims, keep, op)
    free = [a for a in mesh.axis_names if a not in own.used_axes() and mesh.axis_size(a) > 1]
    for order in _orders(free, in_mesh_order(mesh, sharding_axes(goal))):
        add(_spread(own, order, mesh))
    return out


def _orders(axes: list[AxisName], first: tuple[AxisName, ...]) -> list[tuple[AxisName, ...]]:
    """`axes` with those in `first` leading (in `first`'s order), and in mesh order."""
    lead = [a for a in first if a in axes]
    orders = [tuple(lead + [a for a in axes if a not in lead])]
    return orders if orders[0] == tuple(axes) else orders + [tuple(axes)]


def _spread(target: State, axes: tuple[AxisName, ...], mesh: Mesh,
            bottom: bool = False) -> list[State]:
    """`target` with those of `axes` it leaves free splitting one dim more: at the top of a
    local run of an even dim where they divide it (with `bottom`, at its bottom too), or
    after the chain of an uneven one."""
    axes = tuple(a for a in axes if a not in target.used_axes())
    if not axes:
        return [target]
    out = []
    for d, dim in enumerate(target.dims):
        grown: list[DimState] = []
        if dim.chunks or dim.size == 0:
            grown.append(chunk_dim(dim.size, dim.chunks + axes, mesh))
        else:
            grown += _run_spreads(dim, axes, mesh, bottom)
            chain = as_chunks(dim)
            if not grown and chain is not None:
                grown.append(chunk_dim(dim.size, chain + axes, mesh))
        out += [State(target.dims[:d] + (g,) + target.dims[d + 1:], target.partial, target.op)
                for g in grown]
    return out


def _before_reduction(dim: DimState, resolve: set[AxisName], mesh: Mesh) -> DimState:
    """`dim` without the axes a later reduce_scatter puts in place (and, in a chunk chain,
    without what follows them: those links come after the reduction)."""
    if dim.chunks:
        chain = list(dim.chunks)
        cut = next((i for i, a in enumerate(chain) if a in resolve), len(chain))
        return chunk_dim(dim.size, tuple(chain[:cut]), mesh)
    return even_dim(dim.size, tuple(s for s in dim.shards if s[2] not in resolve))


def _keep_extra(state: State, target: State, mesh: Mesh) -> State:
    """`target` with every even shard of `state` whose axis `target` leaves free kept in
    place where it fits (that axis is gathered later, on less data)."""
    free = {a for a in mesh.axis_names} - target.used_axes()
    dims = list(target.dims)
    for d, (have, want) in enumerate(zip(state.dims, dims)):
        if have.chunks or want.chunks:
            continue
        for shard in have.shards:
            grown = even_dim(want.size, want.shards + (shard,))
            if shard[2] in free and _fits_shard(want, shard) and is_chain(grown.bounds()):
                want = grown
        dims[d] = want
    return State(tuple(dims), target.partial, target.op)


def _fits_shard(dim: DimState, shard: tuple[int, int, AxisName]) -> bool:
    lo, hi, _ = shard
    return all(hi <= s[0] or lo >= s[1] for s in dim.shards)


def spread_targets(state: State, goal: State, mesh: Mesh) -> list[State]:
    """States from which a free `reindex` reaches a `goal` with new pending axes: the
    goal's dims with those axes splitting one dim more (`_spread`: sharding the top or the
    bottom of a local run of an even dim they divide, where the bottom may match what
    each member holds, or chunking after the chain of an uneven one), so that each
    member of a reduction group holds a g-th of what the group needs (a send_recv there
    receives about the lower bound, where gathering whole blocks first would receive up to
    g times more). The state's own pending axes stay pending there: where the goal
    resolves some, a reduction over them follows on the g-th (an all_reduce of a 16th, not
    of the whole block), then the reindex."""
    new = tuple(a for a in goal.partial if a not in state.partial)
    if not new or goal.op == "avg" or (state.partial and state.op != goal.op):
        return []
    # pending axes of `state` the goal resolves stay pending in the spread (a reduction
    # over them follows), so none of them may shard the goal's dims
    if sharding_axes(goal) & set(state.partial):
        return []
    base = State(goal.dims, state.partial, state.op)
    return [t for t in _spread(base, new, mesh, bottom=True) if t != base]


def _run_spreads(dim: DimState, axes: tuple[AxisName, ...], mesh: Mesh,
                 bottom: bool = False) -> list[DimState]:
    """Even `dim` with `axes` (major first) sharding the top of one of its local runs (and,
    with `bottom`, its bottom too), for each run they divide and where the result is a
    valid factorization."""
    n = mesh.group_size(axes)
    out = []
    for lo, hi in dim.local_runs():
        if (hi // lo) % n:
            continue
        for top in (hi, lo * n) if bottom else (hi,):      # `out` drops a repeat
            shards = []
            for a in axes:
                shards.append((top // mesh.axis_size(a), top, a))
                top //= mesh.axis_size(a)
            spread = even_dim(dim.size, dim.shards + tuple(shards))
            if is_chain(spread.bounds()) and spread not in out:
                out.append(spread)
    return out
