"""The planner's move set: every single step from one state, with its exact traffic.

This module never communicates. A move is one collective (or one local
operation) that turns a state into another. Each carries what an executor
needs to run it (local rearranges before and after, the collective's group
axes and arguments) and the bytes every rank sends and receives, from the
algorithm each collective is modelled with:

- all_gather: every block reaches every other group member once (ring):
  rank i sends (g-1)*L_i and receives the sum of the other blocks.
- reduce_scatter: ring; rank i sends its input less its own output chunk and
  receives (g-1) times its output chunk.
- all_reduce: ring reduce_scatter then ring all_gather of the flattened tensor
  in `torch.chunk` chunks c_i: rank i sends and receives (T - c_i) + (g-1)*c_i.
- all_to_all: pairwise; a rank sends every chunk but its own and receives one
  chunk from every other member.
- collective_permute: direct; a rank sends its block to one partner and
  receives one (nothing when it is its own partner).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..core.mesh import AxisName, Mesh
from ..core.names import positional_names
from .blocks import (
    block_of,
    block_sizes,
    combos,
    coords_table,
    digit_rows,
    flat_index,
    group_positions,
    in_mesh_order,
    index_slices,
    rank_blocks,
)
from .rearrange import Rearrange
from .states import (
    DimState,
    Shard,
    State,
    as_chunks,
    chunk_dim,
    even_dim,
    is_chain,
    local_numels,
    local_numels_tensor,
    most_numel,
    to_layout,
    uniform_numel,
)
from .traffic import (
    all_reduce_traffic,
    all_to_all_traffic,
    gather_traffic,
    off_diagonal,
    scatter_traffic,
)


@dataclass(frozen=True, slots=True)
class Move:
    """One step between states: what runs, and the per-rank traffic in elements."""

    kind: str                      # a Step kind: "local", "all_gather", ...
    axes: tuple[AxisName, ...]     # group axes, major first
    after: State
    action: str = ""               # for "local": "slice", "mark_partial", "reindex"
    op: str | None = None          # reduce op of reduce_scatter / all_reduce / mark_partial
    dim: int | None = None         # tensor dim of an uneven (chunk) collective, else None
    pre: Rearrange | None = None   # local rearrange before the collective
    post: Rearrange | None = None  # local rearrange after it
    pairs: tuple[tuple[int, int], ...] = ()
    indexed: bool = False          # driven by per-rank index blocks (send_recv, select, reindex)
    estimate: bool = False         # `send` is a stand-in (the search prices it exactly if needed)
    send: tuple[int, ...] = ()     # elements sent per rank (mesh order)
    recv: tuple[int, ...] = ()
    rounds: int = 1                # all_to_alls of a tree step (`trees.tree_move`)
    merge_rounds: int = 0          # of those, the ones that combine partials
    least: int = 0                 # an estimate's floor of its busiest rank's elements (time only)
    # `pre` and `post` not built yet: a generator defers them, as most moves are only priced
    # (`with_rearranges` builds them for the moves a plan keeps).
    rearranges: Callable[[], tuple[Rearrange | None, Rearrange | None]] | None = (
        dataclasses.field(default=None, compare=False, repr=False))


def with_rearranges(move: Move) -> Move:
    """`move` with its local rearranges (`pre`, `post`) built."""
    if move.rearranges is None:
        return move
    pre, post = move.rearranges()
    return dataclasses.replace(move, pre=pre, post=post, rearranges=None)


# -- rearranges ---------------------------------------------------------------------
Piece = tuple[int, int, int]   # (dim, lo, hi)


def _refine(runs: list[tuple[int, int]], cuts: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        points = sorted({p for p in cuts if lo < p < hi} | {lo, hi}, reverse=True)
        out.extend((b, a) for a, b in zip(points, points[1:]))
    return out


def _rearrange(before: State, after: State, lead_in: tuple[Shard, ...],
               lead_out: tuple[Shard, ...], lead_dims: dict[AxisName, int]) -> Rearrange | None:
    """Rearrange from `before`'s local tensor (plus leading `lead_in` blocks) to `after`'s."""
    flat_in: list[Piece] = []
    flat_out: list[Piece] = []
    split: list[tuple[int, ...] | None] = []
    merge: list[int] = []
    per_dim_in: list[list[Piece] | None] = []
    per_dim_out: list[list[Piece] | None] = []
    for d, (b, a) in enumerate(zip(before.dims, after.dims)):
        if b.chunks or a.chunks or b.size == 0:  # runtime size: uneven or empty
            per_dim_in.append(None)
            per_dim_out.append(None)
            continue
        cuts = set(b.bounds()) | set(a.bounds())
        per_dim_in.append([(d, lo, hi) for lo, hi in _refine(list(b.local_runs()), cuts)])
        per_dim_out.append([(d, lo, hi) for lo, hi in _refine(list(a.local_runs()), cuts)])

    def lead(shards: tuple[Shard, ...], per_dim: list[list[Piece] | None]) -> list[Piece]:
        pieces: list[Piece] = []
        for lo, hi, axis in shards:
            d = lead_dims[axis]
            cuts = set(before.dims[d].bounds()) | set(after.dims[d].bounds())
            pieces += [(d, plo, phi) for plo, phi in _refine([(lo, hi)], cuts)]
        return pieces

    if lead_in:
        pieces = lead(lead_in, per_dim_in)
        flat_in += pieces
        split.append(tuple(p[2] // p[1] for p in pieces))
    for d, dim_pieces in enumerate(per_dim_in):
        if dim_pieces is None:
            flat_in.append((d, -1, -1))
            split.append(None)
        else:
            flat_in += dim_pieces
            split.append(tuple(p[2] // p[1] for p in dim_pieces))
    if lead_out:
        pieces = lead(lead_out, per_dim_out)
        flat_out += pieces
        merge.append(len(pieces))
    for d, dim_pieces in enumerate(per_dim_out):
        chosen = [(d, -1, -1)] if dim_pieces is None else dim_pieces
        flat_out += chosen
        merge.append(len(chosen))
    perm = tuple(flat_in.index(p) for p in flat_out)
    r = Rearrange(tuple(split), perm, tuple(merge))
    return None if r.is_identity else r


RearrangeArgs = tuple[State, State, tuple[Shard, ...], tuple[Shard, ...], dict[AxisName, int]]


def _later(pre: RearrangeArgs | None = None, post: RearrangeArgs | None = None
           ) -> Callable[[], tuple[Rearrange | None, Rearrange | None]]:
    """The `rearranges` of a move: `_rearrange` of `pre`'s and `post`'s arguments, when called."""
    return functools.partial(_build, pre, post)


def _build(pre: RearrangeArgs | None, post: RearrangeArgs | None
           ) -> tuple[Rearrange | None, Rearrange | None]:
    return (None if pre is None else _rearrange(*pre),
            None if post is None else _rearrange(*post))


# -- helpers -------------------------------------------------------------------------
def _set_dim(state: State, d: int, dim: DimState, **changes: object) -> State:
    dims = state.dims[:d] + (dim,) + state.dims[d + 1:]
    fields = {"dims": dims, "partial": state.partial, "op": state.op}
    fields.update(changes)  # type: ignore[arg-type]
    return State(**fields)  # type: ignore[arg-type]


def _without(dim: DimState, axis: AxisName, mesh: Mesh) -> DimState:
    if dim.chunks:
        return chunk_dim(dim.size, tuple(a for a in dim.chunks if a != axis), mesh)
    return even_dim(dim.size, tuple(s for s in dim.shards if s[2] != axis))


def _shard_of(dim: DimState, axis: AxisName) -> Shard:
    return next(s for s in dim.shards if s[2] == axis)


def _fits(dim: DimState, shard: Shard) -> bool:
    """True if `shard`'s interval is local in even `dim` and keeps a valid factorization."""
    if dim.chunks:
        return False
    lo, hi, _ = shard
    if any(not (hi <= s[0] or lo >= s[1]) for s in dim.shards):
        return False
    return is_chain(tuple(sorted(set(dim.bounds()) | {lo, hi})))


# -- move generators --------------------------------------------------------------
def gathers(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """all_gather of one axis, or of several even axes at once (one flattened group)."""
    n = uniform_numel(state)   # where ranks differ, their sizes stay a tensor
    sizes = None if n is None else (n,) * mesh.size
    even: list[AxisName] = []
    for d, dim in enumerate(state.dims):
        for axis in dim.axes:
            if dst.dims[d].axes and _same_place(state, dst, d, axis):
                continue
            if dim.chunks:
                if axis == dim.chunks[-1]:
                    yield chunk_gather(state, d, mesh, exact=False, goal=dst)
                continue
            even.append(axis)
    order = [a for a in mesh.axis_names if a in even]
    for k in range(1, len(order) + 1):
        for group in itertools.combinations(order, k):
            yield _even_gather(state, group, mesh, sizes)


def chunk_gather(state: State, d: int, mesh: Mesh, exact: bool = True,
                 goal: State | None = None) -> Move:
    """all_gather of the last axis of uneven dim `d`'s chain.

    With `exact=False`, where ranks hold different amounts and the step does not reach
    `goal`, it is priced at a floor (`Move.estimate`): its busiest rank's elements
    (`least`: the first rank's, which holds the most, `most_numel`) and no per-rank
    traffic. Per-rank counts of an uneven state cost tensor ops, and the search prices the
    step exactly (this function) only when it pops it: most such gathers never are.
    """
    dim = state.dims[d]
    axis = dim.chunks[-1]
    after = _set_dim(state, d, _without(dim, axis, mesh))
    n = uniform_numel(state)   # where ranks differ, their sizes stay a tensor
    if n is None and not exact and after != goal:
        zeros = (0,) * mesh.size
        most = most_numel(state, mesh)
        least = max((mesh.axis_size(axis) - 1) * most, most_numel(after, mesh) - most)
        return Move("all_gather", (axis,), after, dim=d, estimate=True, send=zeros,
                    recv=zeros, least=least)
    sizes = None if n is None else (n,) * mesh.size
    send, recv = gather_traffic(mesh, (axis,), sizes,
                                None if sizes else local_numels_tensor(state, mesh))
    return Move("all_gather", (axis,), after, dim=d, send=send, recv=recv)


def _same_place(state: State, dst: State, d: int, axis: AxisName) -> bool:
    a, b = state.dims[d], dst.dims[d]
    if a.chunks or b.chunks:
        ca, cb = as_chunks(a), as_chunks(b)
        return (ca is not None and cb is not None and axis in ca
                and ca[:ca.index(axis) + 1] == cb[:ca.index(axis) + 1])
    return any(s[2] == axis for s in b.shards) and _shard_of(a, axis) == _shard_of(b, axis)


def _even_gather(state: State, group: tuple[AxisName, ...], mesh: Mesh,
                 sizes: tuple[int, ...] | None) -> Move:
    after = state
    shards: list[Shard] = []
    dims: dict[AxisName, int] = {}
    for axis in group:
        d = after.axis_dim(axis)
        assert d is not None, f"{axis} shards no dim of {state}"
        shards.append(_shard_of(after.dims[d], axis))
        dims[axis] = d
        after = _set_dim(after, d, _without(after.dims[d], axis, mesh))
    send, recv = gather_traffic(mesh, group, sizes,
                                None if sizes else local_numels_tensor(state, mesh))
    return Move("all_gather", group, after, send=send, recv=recv,
                rearranges=_later(post=(state, after, tuple(shards), (), dims)))


def _even_target(dst: State, axis: AxisName) -> tuple[int, Shard] | None:
    d = dst.axis_dim(axis)
    if d is None or dst.dims[d].chunks:
        return None
    return d, _shard_of(dst.dims[d], axis)


def _chunk_next(state: State, dst: State, axis: AxisName) -> int | None:
    """The dim where appending `axis` to the chunk chain moves toward uneven `dst`."""
    d = dst.axis_dim(axis)
    if d is None or not dst.dims[d].chunks:
        return None
    have = as_chunks(state.dims[d])
    want = dst.dims[d].chunks
    if have is None or want[:len(have)] != have or len(want) <= len(have):
        return None
    return d if want[len(have)] == axis else None


def slices(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """Free local moves: replicated axes take their destination factors (one or all at once)."""
    zeros = (0,) * mesh.size
    together: list[tuple[AxisName, int, Shard]] = []
    after_all = state
    for axis in mesh.axis_names:
        if axis in state.used_axes():
            continue
        target = _even_target(dst, axis)
        if target and _fits(state.dims[target[0]], target[1]):
            d, shard = target
            after = _set_dim(state, d, even_dim(state.dims[d].size,
                                                state.dims[d].shards + (shard,)))
            yield Move("local", (axis,), after, action="slice", send=zeros, recv=zeros,
                       rearranges=_later(pre=(state, after, (), (shard,), {axis: d})))
            if _fits(after_all.dims[d], shard):
                after_all = _set_dim(after_all, d, even_dim(
                    after_all.dims[d].size, after_all.dims[d].shards + (shard,)))
                together.append((axis, d, shard))
        chunk_d = _chunk_next(state, dst, axis)
        if chunk_d is not None:
            chain = (as_chunks(state.dims[chunk_d]) or ()) + (axis,)
            after = _set_dim(state, chunk_d, chunk_dim(state.dims[chunk_d].size, chain, mesh))
            yield Move("local", (axis,), after, action="slice", dim=chunk_d, send=zeros, recv=zeros)
    if len(together) > 1:
        axes = tuple(a for a, _, _ in together)
        pre = (state, after_all, (), tuple(s for _, _, s in together),
               {a: d for a, d, _ in together})
        yield Move("local", axes, after_all, action="slice", send=zeros, recv=zeros,
                   rearranges=_later(pre=pre))


def replica_slices(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """Free local moves while a reduction is pending: an axis that replicates both layouts
    takes a factor of a local run, so that the coming reduce_scatter or all_reduce works on
    1/n of the data on each of the n replicas (an all_gather over the axis follows).

    This is how a plan meets the reduce-scatter bound when the destination is replicated:
    the combining work is shared by every rank that will need the result. An axis the
    destination holds pending (not avg) may split the work too: a free `reindex` turns its
    factor into the destination's pending reduction afterwards.
    """
    if not [a for a in state.partial if a not in dst.partial]:
        return
    zeros = (0,) * mesh.size
    later_pending = set(dst.partial) if dst.op != "avg" else set()
    used = state.used_axes() | (dst.used_axes() - later_pending)
    for axis in mesh.axis_names:
        n = mesh.axis_size(axis)
        if axis in used or n == 1:
            continue
        # One place per axis (the first that fits): where the factor sits changes no byte.
        place = next(((d, shard) for d, dim in enumerate(state.dims) if not dim.chunks
                      for lo, hi in _refine(list(dim.local_runs()), set(dst.dims[d].bounds()))
                      if (hi // lo) % n == 0
                      for shard in ((hi // n, hi, axis), (lo, lo * n, axis))
                      if _fits(dim, shard) and _fits(dst.dims[d], shard)), None)
        if place is None:
            continue
        d, shard = place
        after = _set_dim(state, d, even_dim(state.dims[d].size, state.dims[d].shards + (shard,)))
        yield Move("local", (axis,), after, action="slice", send=zeros, recv=zeros,
                   rearranges=_later(pre=(state, after, (), (shard,), {axis: d})))


def all_to_alls(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """all_to_all moving one even axis from its factor to its destination factor."""
    for d1, dim in enumerate(state.dims):
        for lo, hi, axis in dim.shards:
            target = _even_target(dst, axis)
            if target is None or target == (d1, (lo, hi, axis)):
                continue
            d2, shard2 = target
            if not _fits(state.dims[d2], shard2):
                continue
            tag = "\0" + axis
            mid = _set_dim(state, d2, even_dim(
                state.dims[d2].size, state.dims[d2].shards + ((shard2[0], shard2[1], tag),)))
            removed = _set_dim(state, d1, _without(state.dims[d1], axis, mesh))
            after = _set_dim(removed, d2, even_dim(removed.dims[d2].size,
                                                   removed.dims[d2].shards + (shard2,)))
            if not is_chain(after.dims[d2].bounds()):
                continue
            pre = (state, mid, (), ((shard2[0], shard2[1], tag),), {tag: d2})
            post = (mid, after, ((lo, hi, axis),), (), {axis: d1})
            traffic = all_to_all_traffic(mesh, (axis,), local_numels(state, mesh))
            yield Move("all_to_all", (axis,), after, send=traffic, recv=traffic,
                       rearranges=_later(pre, post))


def permutes(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """collective_permute swapping the factors of two equal axes (or handing one to a replicated
    axis)."""
    placed = [(d, s) for d, dim in enumerate(state.dims) for s in dim.shards]
    free = [a for a in mesh.axis_names if a not in state.used_axes() and mesh.axis_size(a) > 1]
    # Partners: each placed shard's (dim, axis), then each free axis with no dim.
    partners: list[tuple[int | None, AxisName]] = [(d, s[2]) for d, s in placed]
    partners += [(None, a) for a in free]
    for (d1, s1), (d2, b) in itertools.product(placed, partners):
        a = s1[2]
        if (d2 is not None and a >= b) or a == b or mesh.axis_size(a) != mesh.axis_size(b):
            continue
        swap = {a: b, b: a}
        after = state
        for d in {d1} | ({d2} if d2 is not None else set()):
            dim = after.dims[d]
            after = _set_dim(after, d, even_dim(dim.size, tuple(
                (lo, hi, swap.get(x, x)) for lo, hi, x in dim.shards)))
        if not any(_even_target(dst, x) == (dx, _shard_of(after.dims[dx], x))
                   for x in (a, b) if (dx := after.axis_dim(x)) is not None):
            continue
        pairs = _transpose_pairs(mesh.axis_size(a))
        moving = off_diagonal(mesh, local_numels(state, mesh), a, b)
        axes = tuple(x for x in mesh.axis_names if x in (a, b))  # symmetric pairs: any order
        yield Move("collective_permute", axes, after, pairs=pairs, send=moving, recv=moving)


@functools.lru_cache(maxsize=64)
def _transpose_pairs(g: int) -> tuple[tuple[int, int], ...]:
    """(source, destination) of each position of a g x g grid in its transpose: position
    k = i g + j receives from j g + i (the tuples built in C, by `zip` over ranges)."""
    sources = itertools.chain.from_iterable(range(i, g * g, g) for i in range(g))
    return tuple(zip(sources, range(g * g)))


def _drop_partial(state: State,
                  axes: tuple[AxisName, ...]) -> tuple[tuple[AxisName, ...], str | None]:
    left = tuple(a for a in state.partial if a not in axes)
    return left, state.op if left else None


def reductions(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """reduce_scatter of pending axes into their destination factors, and all_reduce."""
    pending = [a for a in state.partial if a not in dst.partial]
    if not pending:
        return
    sizes = local_numels(state, mesh)
    for k in range(1, len(pending) + 1):
        for group in itertools.combinations(pending, k):
            left, op = _drop_partial(state, group)
            after = State(state.dims, left, op)
            send, recv = all_reduce_traffic(mesh, group, sizes)
            yield Move("all_reduce", group, after, op=state.op, send=send, recv=recv)
            yield from _reduce_scatters(state, dst, mesh, group, sizes)


def _reduce_scatters(state: State, dst: State, mesh: Mesh, group: tuple[AxisName, ...],
                     sizes: tuple[int, ...]) -> Iterator[Move]:
    left, op = _drop_partial(state, group)
    if len(group) == 1:
        yield from _reduce_where_it_fits(state, dst, mesh, group[0], sizes)
        d = _chunk_next(state, dst, group[0])
        if d is not None:
            chain = (as_chunks(state.dims[d]) or ()) + group
            after = State(state.dims, left, op)
            after = _set_dim(after, d, chunk_dim(state.dims[d].size, chain, mesh))
            send, recv = scatter_traffic(mesh, group, sizes, local_numels(after, mesh))
            yield Move("reduce_scatter", group, after, op=state.op, dim=d, send=send, recv=recv)
    after = State(state.dims, left, op)
    shards, dims = [], {}
    for axis in group:
        target = _even_target(dst, axis)
        if target is None or not _fits(after.dims[target[0]], target[1]):
            return
        d, shard = target
        after = _set_dim(after, d, even_dim(after.dims[d].size, after.dims[d].shards + (shard,)))
        shards.append(shard)
        dims[axis] = d
    send, recv = scatter_traffic(mesh, group, sizes, local_numels(after, mesh))
    yield Move("reduce_scatter", group, after, op=state.op, send=send, recv=recv,
               rearranges=_later(pre=(state, after, (), tuple(shards), dims)))


def _reduce_where_it_fits(state: State, dst: State, mesh: Mesh, axis: AxisName,
                          sizes: tuple[int, ...]) -> Iterator[Move]:
    """reduce_scatter over `axis` into the dim the destination splits over it, at a place
    the data has now (the top or the bottom of one of the dim's local runs), where that is
    not the destination's own place: reduce first, then move the smaller shards, rather
    than gather the dim to make room for the destination's place."""
    target = _even_target(dst, axis)
    d = dst.axis_dim(axis)
    if d is None or state.dims[d].chunks:
        return
    n = mesh.axis_size(axis)
    dim = state.dims[d]
    left, op = _drop_partial(state, (axis,))
    places = []
    for lo, hi in dim.local_runs():
        if (hi // lo) % n == 0:
            places += [(hi // n, hi, axis), (lo, lo * n, axis)]
    for shard in dict.fromkeys(places):
        if target is not None and shard == target[1] or not _fits(dim, shard):
            continue
        after = _set_dim(State(state.dims, left, op), d,
                         even_dim(dim.size, dim.shards + (shard,)))
        send, recv = scatter_traffic(mesh, (axis,), sizes, local_numels(after, mesh))
        yield Move("reduce_scatter", (axis,), after, op=state.op, send=send, recv=recv,
                   rearranges=_later(pre=(state, after, (), (shard,), {axis: d})))


def partial_marks(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """Free local moves: a replicated axis becomes a pending reduction the destination asks for
    (one rank of each group keeps the values for "sum", every rank for the other ops)."""
    if not dst.partial or (state.partial and state.op != dst.op):
        return
    zeros = (0,) * mesh.size
    used = state.used_axes()
    for axis in dst.partial:
        if axis in state.partial:
            continue
        partial = tuple(a for a in mesh.axis_names if a in state.partial or a == axis)
        if axis not in used:
            after = State(state.dims, partial, dst.op)
            yield Move("local", (axis,), after, action="mark_partial", op=dst.op,
                       send=zeros, recv=zeros)


def block_permutes(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """One collective_permute straight to `dst` when every rank's destination block is
    exactly the current block of the rank that agrees with it on every axis not sharding
    `state` (e.g. shard orders of unequal axes). Pending partial values thus stay at
    their reduction coordinates."""
    if state.partial != dst.partial or state == dst or not _same_block_shape(state, dst, mesh):
        return
    source = _block_sources(state, dst, mesh)
    if source is None:
        return
    coords = coords_table(mesh)
    moved = (coords[source] != coords).any(0).tolist()
    axes = tuple(a for a, m in zip(mesh.axis_names, moved) if m)
    zeros = (0,) * mesh.size
    if not axes:  # every rank already holds its block: only the description changes
        yield Move("local", (), dst, action="relabel", send=zeros, recv=zeros)
        return
    pos = group_positions(mesh, axes).reshape(-1)
    g = mesh.group_size(axes)
    rest = [k for k, a in enumerate(mesh.axis_names) if a not in axes]
    dims = rest + [mesh.axis_names.index(a) for a in axes]
    # Source position of each destination position, one row per group (group order).
    by_group = pos[source].reshape(mesh.shape).permute(dims).reshape(-1, g)
    if not bool((by_group == by_group[0]).all()):
        return
    pairs = tuple(sorted(zip(by_group[0].tolist(), range(g))))
    sizes = local_numels(state, mesh)
    kept = (source == torch.arange(mesh.size)).tolist()
    recv = tuple(0 if k else sizes[s] for k, s in zip(kept, source.tolist()))
    send = tuple(0 if k else n for k, n in zip(kept, sizes))   # a permutation: senders = receivers
    yield Move("collective_permute", axes, dst, pairs=pairs, send=send, recv=recv)


def _same_block_shape(state: State, dst: State, mesh: Mesh) -> bool:
    """Cheap necessary condition for a block permute: each dim is cut into as many blocks."""
    for a, b in zip(state.dims, dst.dims):
        if bool(a.chunks) != bool(b.chunks) or a.size == 0:
            return False
        if mesh.group_size(a.axes) != mesh.group_size(b.axes):
            return False
    return True


def _block_sources(state: State, dst: State, mesh: Mesh) -> torch.Tensor | None:
    """For each rank (mesh position), the position of the rank holding in `state` exactly
    the block it needs in `dst` and agreeing with it on every axis not sharding `state`;
    None unless that is a permutation of the ranks."""
    coords = coords_table(mesh)
    source = coords.clone()
    for a, b in zip(state.dims, dst.dims):
        match = _equal_blocks(a, b, mesh)
        if match is None:
            return None
        h = match[rank_blocks(b, mesh)]
        for axis in reversed(in_mesh_order(mesh, a.axes)):
            k, n = mesh.axis_names.index(axis), mesh.axis_size(axis)
            source[:, k] = h % n
            h = h // n
    flat = flat_index(source, mesh, mesh.axis_names)
    if len(set(flat.tolist())) != mesh.size:
        return None
    return flat


def _equal_blocks(a: DimState, b: DimState, mesh: Mesh) -> torch.Tensor | None:
    """For each block of `b`, the block of `a` holding the same (non-empty) indices, or
    None if some block of `b` has no equal."""
    a_at = {(lo, hi): axis for lo, hi, axis in a.shards}
    b_at = {(lo, hi): axis for lo, hi, axis in b.shards}
    if not a.chunks and not b.chunks and a_at.keys() == b_at.keys():
        # The same stride intervals: a block of `b` is the block of `a` whose axis on each
        # interval takes the value that `b`'s axis there has.
        b_axes = in_mesh_order(mesh, b.axes)
        grid = combos(mesh, b_axes)
        match = torch.zeros(len(grid), dtype=torch.long)
        for lo, hi, axis in sorted(a.shards, key=lambda s: mesh.axis_names.index(s[2])):
            match = match * mesh.axis_size(axis) + grid[:, b_axes.index(b_at[lo, hi])]
        return match
    rows = digit_rows(a, b, mesh)
    if rows is not None:   # equal blocks have equal digit rows: match rows by value
        where = {tuple(r): i for i, r in enumerate(rows[0].tolist())}
        found = [where.get(tuple(r)) for r in rows[1].tolist()]
        if any(f is None for f in found) or not int(block_sizes(b, mesh).min()):
            return None
        return torch.tensor(found, dtype=torch.long)
    # Label every index with its block of `a` and of `b`: block y of `b` equals block x of
    # `a` when every index of y lies in x and the two are as large (O(dim size) work, a
    # slice of the dim at a time).
    sizes_b = block_sizes(b, mesh)
    if not int(sizes_b.min()):         # an empty block equals no block of `a` here
        return None
    match = torch.full((len(sizes_b),), -1, dtype=torch.long)
    for index in index_slices(a.size):
        la, lb = block_of(a, mesh, index), block_of(b, mesh, index)
        new = match[lb] < 0
        match[lb[new]] = la[new]                       # the first index's block of `a`, per y
        if not bool((match[lb] == la).all()):
            return None
    return match if bool((block_sizes(a, mesh)[match] == sizes_b).all()) else None


def block_indices(state: State, mesh: Mesh, rank: int) -> tuple[tuple[int, ...], ...]:
    """Per dim, the global indices `rank` holds in `state`, in local order (cross-mesh)."""
    layout = to_layout(state, positional_names(len(state.dims), mesh.axis_names), mesh)
    shape = tuple(d.size for d in state.dims)
    return layout.indices(mesh, shape, rank)


GENERATORS = (gathers, slices, replica_slices, all_to_alls, permutes, reductions, partial_marks,
              block_permutes)


def expand(state: State, dst: State, mesh: Mesh) -> Iterator[Move]:
    """Every move of the move set from `state` toward `dst`."""
    for generate in GENERATORS:
        yield from generate(state, dst, mesh)
