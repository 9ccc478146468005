"""Plans between two meshes: pipeline hand-offs, training -> inference, re-sharded checkpoints.

This module never communicates. A plan between meshes has up to three phases:

1. on the source mesh, a pending reduction is resolved first (all_reduce or a
   reduce_scatter into some dim, whichever makes the whole plan cheapest; the
   same-mesh planner finds each candidate's steps);
2. one send_recv step from source ranks to destination ranks: every
   destination element arrives exactly once, from one holder, nothing a rank
   already holds is sent to it, and when several source ranks hold a replica
   of a block the sending is spread over them (least-loaded first);
3. a pending sum/max/min in the destination is delivered to the first rank of
   each reduction group only (the others hold the op's identity, so nothing is
   sent twice); a pending avg is delivered to all and marked locally.

Meshes may be disjoint, overlapping or nested. Byte tuples are per rank of
both meshes, ascending (`Plan.ranks`). A partial source has one more candidate:
its partials delivered straight to their owners on the destination mesh, each
destination rank taking the part of its block from one holder of each partial and
reducing them in group order (`direct.cross_direct_transfers`, one step, no
reduction on the source mesh). Every candidate is priced by the same cost model and
the cheapest wins (`_key`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core.errors import PlanError, ShapeError
from ..core.layout import Layout, Shape
from ..core.mesh import Mesh
from ..core.notation import Dim, Factor, Pattern
from . import search
from .direct import cross_direct_transfers, cross_held
from .pairs import cross_traffic, lazy_cross
from .rank_transfers import cross_blocks_of
from .states import State, from_layout, local_numels
from .transfers import assign
from .values import CostModel, Plan, Step, Transfer


def cross_plan(mesh: Mesh, dst_mesh: Mesh, shape: Shape, dtype: torch.dtype, src: Layout,
               dst: Layout, cost_model: CostModel) -> Plan:
    """The cheapest plan from `src` on `mesh` to `dst` on `dst_mesh` (see the module doc)."""
    dst.placements(dst_mesh, shape)
    src.placements(mesh, shape)
    ranks = tuple(sorted(set(mesh.ranks) | set(dst_mesh.ranks)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    # sum/max/min: only the first member of each reduction group receives the values, the
    # others hold the identity; avg: all receive, and a local step marks the reduction.
    landing = _strip(dst) if dst.reduce_op in (None, "avg") else dst
    # Each reduce-first candidate costs its steps on the source mesh plus a transfer no
    # faster than a destination rank outside the source mesh taking its whole block; the
    # direct step (one only where the source is partial) no faster than `_direct_floor`.
    # Listing transfers is what costs: a candidate whose floor exceeds the time of one
    # listed already cannot win (nor tie), so it is never listed.
    goal = from_layout(landing, dst_mesh, shape)
    idle = set(_contributors_only(dst_mesh, landing))
    outside = max((n for r, n in zip(dst_mesh.ranks, local_numels(goal, dst_mesh))
                   if r not in mesh and r not in idle), default=0)
    floor = cost_model.time(("*",), outside * itemsize) if outside else 0.0
    firsts = []
    for staged in _resolved_candidates(mesh, shape, src):
        first = search.single_plan(mesh, shape, dtype, src, staged, cost_model)
        steps = tuple(_reindex(s, mesh, ranks, mesh) for s in first.steps)
        firsts.append((staged, steps, round(sum(s.time_s for s in steps) + floor, 15)))
    direct_floor = _direct_floor(mesh, dst_mesh, shape, src, goal, idle, itemsize, cost_model)
    direct = None
    best = math.inf
    if direct_floor is not None and direct_floor[1] and direct_floor[0] <= min(
            f for _, _, f in firsts):
        # the direct step first: where it is fast, no reduce-first transfer is listed
        direct = _direct_step(mesh, dst_mesh, ranks, shape, src, landing, itemsize,
                              cost_model)
        best = _key((direct,))[0]
    candidates = []
    for staged, steps, at_least in firsts:
        if at_least > best:
            continue
        steps += (_transfer_step(mesh, dst_mesh, ranks, shape, staged, landing, itemsize,
                                 cost_model),)
        candidates.append(steps)
        best = min(best, _key(steps)[0])
    if direct_floor is not None and direct is None and (
            direct_floor[0] <= round(min(_key(c)[0] for c in candidates), 15)):
        direct = _direct_step(mesh, dst_mesh, ranks, shape, src, landing, itemsize,
                              cost_model)
    # the first of equal keys: the older plans win ties; the direct step only where less
    if direct is not None and (not candidates
                               or _key((direct,)) < _key(min(candidates, key=_key))):
        candidates = [(direct,)]
    steps = min(candidates, key=_key)
    if dst.reduce_op == "avg":  # every member holds the value: delivered to all, then marked
        steps += (_mark_step(dst_mesh, ranks, shape, landing, dst, itemsize),)
    send = tuple(sum(s.send_bytes[i] for s in steps) for i in range(len(ranks)))
    recv = tuple(sum(s.recv_bytes[i] for s in steps) for i in range(len(ranks)))
    peak = tuple(max(s.peak_bytes[i] for s in steps) for i in range(len(ranks)))
    lower = _lower_bound(mesh, dst_mesh, ranks, shape, src, landing, itemsize)
    return Plan(mesh, shape, dtype, src, dst, steps, send, recv, lower, peak,
                sum(s.time_s for s in steps), cost_model, dst_mesh)


def _key(steps: tuple[Step, ...]) -> tuple[float, int, int, int, int]:
    """What a candidate plan is chosen by: the least modelled time; at equal time the least
    busiest rank's total received bytes, then sent bytes (per-rank totals over the steps,
    not the sum of each step's busiest), then the lower peak, then fewer steps."""
    recv = [sum(column) for column in zip(*(s.recv_bytes for s in steps))]
    send = [sum(column) for column in zip(*(s.send_bytes for s in steps))]
    return (round(sum(s.time_s for s in steps), 15), max(recv), max(send),
            max(max(s.peak_bytes) for s in steps), len(steps))


def _strip(layout: Layout) -> Layout:
    """`layout` without its pending reduction (what the transfer delivers)."""
    p = layout.pattern
    return Layout._from_pattern(Pattern(p.dims, None, ())) if p.reduce_op else layout


def _resolved_candidates(mesh: Mesh, shape: Shape, src: Layout) -> list[Layout]:
    """Layouts on the source mesh without a pending reduction that `src` can reach."""
    if src.reduce_op is None:
        return [src]
    partial = tuple(a for a in mesh.axis_names if a in src.partial_axes)
    spare = tuple(a for a in src.replicated_axes(mesh))
    out = [_strip(src)]
    # Scatter the reduction (and, to share the work, the replicated axes) into one dim.
    for axes in dict.fromkeys((partial, partial + spare)):   # in order: not by hash
        for d, dim in enumerate(src.dims):
            factors = tuple(Factor(a) for a in axes) + dim.factors
            dims = src.dims[:d] + (Dim(factors),) + src.dims[d + 1:]
            candidate = Layout._from_pattern(Pattern(dims, None, ()))
            try:
                candidate.placements(mesh, shape)
            except ShapeError:
                continue
            out.append(candidate)
    return out


def _reindex(step: Step, mesh: Mesh, ranks: tuple[int, ...], before_mesh: Mesh) -> Step:
    """`step` (bytes in `mesh` order) with bytes in the order of `ranks` (0 elsewhere)."""
    where = {r: i for i, r in enumerate(mesh.ranks)}

    def spread(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values[where[r]] if r in where else 0 for r in ranks)

    return dataclasses.replace(step, send_bytes=spread(step.send_bytes),
                               recv_bytes=spread(step.recv_bytes),
                               peak_bytes=spread(step.peak_bytes), mesh=before_mesh)


def _transfer_step(mesh: Mesh, dst_mesh: Mesh, ranks: tuple[int, ...], shape: Shape,
                   before: Layout, after: Layout, itemsize: int, cost_model: CostModel) -> Step:
    start, goal = from_layout(before, mesh, shape), from_layout(after, dst_mesh, shape)
    pos = {r: i for i, r in enumerate(ranks)}
    ins = dict(zip(mesh.ranks, local_numels(start, mesh)))
    outs = dict(zip(dst_mesh.ranks, local_numels(goal, dst_mesh)))
    peak = tuple((ins.get(r, 0) + outs.get(r, 0)) * itemsize for r in ranks)
    if lazy_cross(start, mesh, goal):
        # one holder per element: counted here, each rank's blocks listed when it runs
        # (`Step.rank_transfers`), so planning follows the blocks, never ranks x ranks
        sent, got = cross_traffic(start, mesh, goal, dst_mesh)
        send, recv = [0] * len(ranks), [0] * len(ranks)
        for r, n in zip(mesh.ranks, sent.tolist()):
            send[pos[r]] = n * itemsize
        for r, n in zip(dst_mesh.ranks, got.tolist()):
            recv[pos[r]] = n * itemsize
        return dataclasses.replace(
            _send_recv(mesh, dst_mesh, before, after, (), send, recv, peak, cost_model),
            blocks_of=cross_blocks_of(before, after, mesh, dst_mesh, tuple(shape)))
    have, need, atoms = cross_held(start, goal, mesh, dst_mesh)
    need = dict(need)
    for r in _contributors_only(dst_mesh, after):
        need[r] = tuple(() for _ in shape)   # holds the identity of the pending op
    found = assign(have, need, atoms, lambda s, r: True)
    if found is None:
        raise PlanError(f"cannot move {before} on {mesh!r} to {after} on {dst_mesh!r}: some"
                        " block has no holder; this is a meshcomm bug, please report it")
    return _send_recv(mesh, dst_mesh, before, after, *_listed(found, ranks, itemsize), peak,
                      cost_model)


def _listed(found: tuple[Transfer, ...], ranks: tuple[int, ...], itemsize: int
            ) -> tuple[tuple[Transfer, ...], list[int], list[int]]:
    """`found` in (sender, receiver) order of `ranks`, and per rank the bytes it sends and
    receives (what a rank keeps for itself moves nothing)."""
    pos = {r: i for i, r in enumerate(ranks)}
    transfers = tuple(sorted(found, key=lambda t: (pos[t.src], pos[t.dst])))
    send, recv = [0] * len(ranks), [0] * len(ranks)
    for t in transfers:
        if t.src != t.dst:
            send[pos[t.src]] += t.numel * itemsize
            recv[pos[t.dst]] += t.numel * itemsize
    return transfers, send, recv


def _direct_floor(mesh: Mesh, dst_mesh: Mesh, shape: Shape, src: Layout, goal: State,
                  idle: set[int], itemsize: int, cost_model: CostModel
                  ) -> tuple[float, int] | None:
    """None where `src` has nothing pending to add up (over more than one rank); else a
    time the direct step cannot beat (rounded as `_key` rounds) and the elements of its
    busiest receiver it stands on: a receiver takes its block once from each of the g
    partials, all but the one it may hold itself (known before any transfer is listed;
    listing them costs as much as the reduce-first plans)."""
    g = mesh.group_size(src.partial_axes)
    if src.reduce_op is None or g == 1:
        return None
    sizes = zip(dst_mesh.ranks, local_numels(goal, dst_mesh))
    least = max((n * (g - (r in mesh)) for r, n in sizes if r not in idle), default=0)
    # nothing to receive (an empty tensor): the step moves nothing and costs nothing
    return (round(cost_model.time(("*",), least * itemsize), 15) if least else 0.0), least


def _direct_step(mesh: Mesh, dst_mesh: Mesh, ranks: tuple[int, ...], shape: Shape, src: Layout,
                 landing: Layout, itemsize: int, cost_model: CostModel) -> Step:
    """The transfer that delivers `src`'s pending partials (over more than one rank)
    straight to the owners of `landing` (action "direct": each receiver reduces them in
    group order)."""
    g = mesh.group_size(src.partial_axes)
    start = from_layout(_strip(src), mesh, shape)
    goal = from_layout(landing, dst_mesh, shape)
    idle = set(_contributors_only(dst_mesh, landing))
    resolve = tuple(a for a in mesh.axis_names if a in src.partial_axes)
    found = cross_direct_transfers(start, goal, mesh, dst_mesh, resolve, tuple(sorted(idle)))
    ins = dict(zip(mesh.ranks, local_numels(start, mesh)))
    outs = dict(zip(dst_mesh.ranks, local_numels(goal, dst_mesh)))
    # a receiver holds its g partials of its block, then their reduction
    peak = tuple((ins.get(r, 0) + (g + 1) * outs.get(r, 0)) * itemsize for r in ranks)
    step = _send_recv(mesh, dst_mesh, src, landing, *_listed(found, ranks, itemsize), peak,
                      cost_model)
    return dataclasses.replace(step, action="direct", op=src.reduce_op)


def _send_recv(mesh: Mesh, dst_mesh: Mesh, before: Layout, after: Layout,
               transfers: tuple[Transfer, ...], send: list[int], recv: list[int],
               peak: tuple[int, ...], cost_model: CostModel) -> Step:
    time = cost_model.time(("*",), max(max(send), max(recv))) if any(send) else 0.0
    return Step("send_recv", (), before, after, op=after.reduce_op, transfers=transfers,
                wire="send/recv", send_bytes=tuple(send), recv_bytes=tuple(recv), time_s=time,
                peak_bytes=peak, mesh=mesh, dst_mesh=dst_mesh)


def _contributors_only(mesh: Mesh, layout: Layout) -> list[int]:
    """Ranks past the first of each pending-reduction group of `layout` (none without one)."""
    axes = tuple(a for a in mesh.axis_names if a in layout.partial_axes)
    if not axes:
        return []
    return [r for group in mesh.groups(*axes) for r in group[1:]]


def _mark_step(dst_mesh: Mesh, ranks: tuple[int, ...], shape: Shape, before: Layout,
               after: Layout, itemsize: int) -> Step:
    axes = tuple(a for a in dst_mesh.axis_names if a in after.partial_axes)
    sizes = dict(zip(dst_mesh.ranks, local_numels(from_layout(before, dst_mesh, shape), dst_mesh)))
    zeros = (0,) * len(ranks)
    peak = tuple(2 * sizes.get(r, 0) * itemsize for r in ranks)
    return Step("local", axes, before, after, action="mark_partial", op=after.reduce_op,
                send_bytes=zeros, recv_bytes=zeros, peak_bytes=peak, mesh=dst_mesh)


def _lower_bound(mesh: Mesh, dst_mesh: Mesh, ranks: tuple[int, ...], shape: Shape, src: Layout,
                 landing: Layout, itemsize: int) -> tuple[int, ...]:
    """Per rank, a receive no correct plan's busiest rank can beat: the larger of the
    destination elements the rank needs and does not hold complete (a pending reduction
    holds none: a contributor still needs the others' sum), and an even share, over every
    rank of the two meshes, of resolving a pending reduction over g ranks (each element's g
    parts combined somewhere: (g - 1) * numel receives in all). The two overlap (what a
    rank receives to combine may be what it needs), so the larger, not the sum."""
    start, goal = from_layout(src, mesh, shape), from_layout(landing, dst_mesh, shape)
    if lazy_cross(start, mesh, goal):   # one holder each: a receiver lacks what it gets
        _, got = cross_traffic(start, mesh, goal, dst_mesh)
        lacking = dict(zip(dst_mesh.ranks, got.tolist()))
        return tuple(lacking.get(r, 0) * itemsize for r in ranks)
    g = mesh.group_size(src.partial_axes)
    complete = src.reduce_op is None or g == 1   # a reduction over one rank is its result
    reduce_share = -(-math.prod(shape) * (g - 1) // len(ranks)) if not complete else 0
    idle = set(_contributors_only(dst_mesh, landing))
    out = []
    for r in ranks:
        need_count = 0
        if r in dst_mesh.ranks and r not in idle:
            need = [set(ix) for ix in landing.indices(dst_mesh, shape, r)]
            have = ([set(ix) for ix in src.indices(mesh, shape, r)]
                    if complete and r in mesh.ranks else [set() for _ in shape])
            both = math.prod(len(h & n) for h, n in zip(have, need))
            need_count = math.prod(len(n) for n in need) - both
        out.append(max(need_count, reduce_share) * itemsize)
    return tuple(out)
