"""One rank's blocks of a step, when it runs: the run-time room of point-to-point steps.

This module never communicates. The planner leaves in a send_recv, select or reindex
step the function that lists one rank's blocks (`blocks_of`, `cross_blocks_of`); the step
calls it for the rank that runs it (`Step.rank_transfers`), computed from the step's
layouts for that rank only and cached, so a plan's size follows its blocks, never ranks x
ranks. `receiver_blocks` gives one loading rank its blocks of a checkpoint saved on
another mesh. The plan-time room is `meshcomm.planner.transfers`; both use the group a
send_recv talks over (`send_recv_axes`, `rotation`), defined here, below both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..core.layout import Layout
from ..core.mesh import AxisName, Mesh
from .blocks import block, in_mesh_order
from .bounds import sharding_axes
from .pairs import lazy_cross, positions, receiver_pairs, replicating_axes, sender_pairs
from .states import State, from_layout
from .values import Transfer


# -- the group a send_recv talks over (planned in transfers.py, run here) ----------------
def resolved_axes(state: State, dst: State) -> tuple[AxisName, ...] | None:
    """The pending axes of `state` that a reducing send_recv to `dst` resolves (empty for a
    plain one), or None when no send_recv goes from `state` to `dst`: `dst` may only keep
    some of `state`'s pending axes, with the same op."""
    if any(a not in state.partial for a in dst.partial):
        return None
    if dst.partial and dst.op != state.op:
        return None
    return tuple(a for a in state.partial if a not in dst.partial)


def send_recv_axes(state: State, dst: State, mesh: Mesh) -> tuple[AxisName, ...]:
    """The group of a send_recv from `state` to `dst`: the axes sharding `state` (a rank's
    twins differ from it on those axes only), or for a reducing one the axes it resolves."""
    resolve = resolved_axes(state, dst)
    return in_mesh_order(mesh, set(resolve) if resolve else sharding_axes(state))


def direct_axes(state: State, dst: State, mesh: Mesh) -> tuple[AxisName, ...]:
    """The group of a direct delivery (`action == "direct"`): the axes it resolves and those
    sharding `state`, so that every rank takes each partial of its `dst` block from the
    holders of that partial (one per element, its twins on the other axes)."""
    return in_mesh_order(mesh, set(resolved_axes(state, dst) or ()) | sharding_axes(state))


def rotation(state: State, mesh: Mesh) -> tuple[tuple[AxisName, ...],
                                               tuple[AxisName, ...]] | None:
    """(S, R): the axes sharding `state` and those replicating it (not pending, size > 1),
    in mesh order; None where either is empty (nothing to rotate)."""
    shard = in_mesh_order(mesh, sharding_axes(state))
    spare = tuple(a for a in replicating_axes(state, mesh) if a not in state.partial)
    return (shard, spare) if shard and spare else None


def _rotated_partners(state: State, mesh: Mesh, rank: int) -> tuple[list[int], list[int]]:
    """`rank`'s receivers and senders in a rotated send_recv (itself left out), one per
    block position on S other than its own (the rotated twins: see `transfers.py`)."""
    turn = rotation(state, mesh)
    assert turn is not None, "a rotated send_recv needs sharding and replicating axes"
    shard, spare = turn
    turns = mesh.group_size(spare)
    group = mesh.members(rank, *shard, *spare)     # position j * turns + r: S major, then R
    own, mine = divmod(group.index(rank), turns)
    places = [j for j in range(len(group) // turns) if j != own]
    to = [group[j * turns + (mine - j) % turns] for j in places]
    fro = [group[j * turns + (mine + own) % turns] for j in places]
    return to, fro



# -- a rank's own blocks, at execution time -----------------------------------------------
LISTED_PER_RANK = frozenset({"send_recv", "select", "reindex"})   # step kinds and actions


def blocks_of(kind: str, action: str, before: Layout, after: Layout, mesh: Mesh,
              shape: tuple[int, ...]) -> Callable[[int], tuple[Transfer, ...]] | None:
    """For `Step.blocks_of`: the function giving the transfers a rank sends or receives (a
    send_recv) or keeps (a select or reindex) in a step on one mesh, computed for that rank
    only from the step's layouts (and cached); None for other steps."""
    if kind not in LISTED_PER_RANK and action not in LISTED_PER_RANK:
        return None
    return functools.partial(_rank_transfers, kind, action, before, after, mesh, shape)


def cross_blocks_of(before: Layout, after: Layout, mesh: Mesh, dst_mesh: Mesh,
                    shape: tuple[int, ...]) -> Callable[[int], tuple[Transfer, ...]]:
    """`blocks_of` for the transfer between two meshes planned by counting
    (`pairs.lazy_cross`)."""
    return functools.partial(_cross_rank_transfers, before, after, mesh, dst_mesh, shape)


@functools.lru_cache(maxsize=256)
def _rank_transfers(kind: str, action: str, before: Layout, after: Layout, mesh: Mesh,
                    shape: tuple[int, ...], rank: int) -> tuple[Transfer, ...]:
    state, dst = from_layout(before, mesh, shape), from_layout(after, mesh, shape)
    coords = mesh.coords(rank)
    if action == "reindex":
        new = [a for a in dst.partial if a not in state.partial]
        first = all(coords[a] == 0 for a in new if a not in sharding_axes(state))
        return (_cell(rank, rank, state, dst, mesh),) if first else ()
    if kind != "send_recv":   # select: every rank holds what it needs
        return (_cell(rank, rank, state, dst, mesh),)
    if action == "rotate":
        to, fro = _rotated_partners(state, mesh, rank)
        out = [_cell(rank, r, state, dst, mesh) for r in (rank, *to)]
        out += [_cell(s, rank, state, dst, mesh) for s in fro]
        return tuple(t for t in out if t.numel)
    axes = (direct_axes(state, dst, mesh) if action == "direct"
            else send_recv_axes(state, dst, mesh))
    group = mesh.members(rank, *axes)
    out = [_cell(rank, r, state, dst, mesh) for r in group]
    out += [_cell(s, rank, state, dst, mesh) for s in group if s != rank]
    return tuple(t for t in out if t.numel)


def _cell(src: int, dst_rank: int, state: State, dst: State, mesh: Mesh) -> Transfer:
    """The block `src` holds in `state` that `dst_rank` needs in `dst`, at local positions."""
    have = block(state, mesh, mesh.coords(src))
    need = block(dst, mesh, mesh.coords(dst_rank))
    pairs = [positions(h, n) for h, n in zip(have, need)]
    return Transfer(src, dst_rank, tuple(s for s, _ in pairs), tuple(d for _, d in pairs))




# -- between two meshes, per rank (planner/pairs.py) ----------------------------------------
def receiver_transfers(state: State, mesh: Mesh, dst: State, dst_mesh: Mesh,
                       rank: int) -> tuple[Transfer, ...]:
    """The blocks `rank` of `dst_mesh` receives when `state` on `mesh` moves to `dst`, for
    a `state` whose every element has exactly one holder (every axis of `mesh` that does not
    shard it has size 1, and nothing is pending): what the send_recv step of
    `plan(mesh, ..., dst_mesh=dst_mesh)` gives `rank`, computed for this rank only (a
    checkpoint loader on 1,024 ranks plans in milliseconds; see `pairs.receiver_pairs`).
    """
    spare = replicating_axes(state, mesh)
    if spare or state.partial:
        raise ValueError(f"receiver_transfers: every element needs one holder; axes {spare}"
                         f" replicate it, {list(state.partial)} hold it pending")
    return tuple(Transfer(*p) for p in receiver_pairs(state, mesh, dst, dst_mesh, rank))


@functools.lru_cache(maxsize=256)
def _cross_rank_transfers(before: Layout, after: Layout, mesh: Mesh, dst_mesh: Mesh,
                          shape: tuple[int, ...], rank: int) -> tuple[Transfer, ...]:
    """What `rank` sends, receives and keeps in a transfer between meshes planned by
    counting (`pairs.lazy_cross`); none for any other."""
    state, dst = from_layout(before, mesh, shape), from_layout(after, dst_mesh, shape)
    if not lazy_cross(state, mesh, dst):
        return ()
    got = receiver_pairs(state, mesh, dst, dst_mesh, rank) if rank in dst_mesh.ranks else []
    sent = sender_pairs(state, mesh, dst, dst_mesh, rank) if rank in mesh.ranks else []
    return tuple(Transfer(*p) for p in [*(p for p in sent if p[1] != rank), *got])


def receiver_blocks(mesh: Mesh, layout: Layout, dst_mesh: Mesh, dst_layout: Layout,
                    shape: tuple[int, ...], rank: int) -> tuple[Transfer, ...]:
    """`receiver_transfers` from layouts: the blocks `rank` of `dst_mesh` receives when a
    tensor of `shape` moves from `layout` on `mesh` (one holder per element) to
    `dst_layout` (what `mc.nn.load_checkpoint` reads, the saved ranks being its files)."""
    return receiver_transfers(from_layout(layout, mesh, shape), mesh,
                              from_layout(dst_layout, dst_mesh, shape), dst_mesh, rank)
