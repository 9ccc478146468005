"""Lower bounds on the bytes any correct plan must receive, from the layouts alone.

This module never communicates and never looks at the planner's search: the
bound depends only on which global elements each rank holds before and after,
counted from the layouts' blocks (`meshcomm.planner.blocks`) without listing elements.
For P ranks, rank r holding `have_r` before and `need_r` after:

- No reduction to resolve, no pending reduction after: r must receive every
  element it needs and lacks: `LB_r = |need_r - have_r|`.
- A new pending reduction after (`| sum(tp)`): in r's group G of g ranks over
  the new pending axes (every member needs the same block), an element the
  group needs must be received by one of them unless a member both holds and
  needs it, so G receives at least that many elements and its busiest member a
  g-th of them: `LB_r = ceil(|need_G - (have_1 | ... | have_g)| / g)`. An
  average is the exception: every member must hold the value itself, so the
  first bound applies.
- A pending reduction over g > 1 ranks to resolve (the counting bound): an
  item x (an element, with a coordinate on the pending axes the destination
  keeps) needs at least g - 1 messages to combine its g partial values, plus
  one delivery to each of the n_x ranks that need it, less one when a rank
  that needs it holds a partial (h_x = 1: it can combine there), so all ranks
  together receive at least `S = sum_x (g - 1 + n_x - h_x)` elements and the
  busiest rank at least S / P; and every rank at least one message per element
  of its block: `LB_r = max(L, |need_r|)`, L the least load that carries them.
  A message either adds partials to a value the receiver has (a union; item x
  needs g - 1 of them, U in all) or gives it a value where it had none (a
  copy: a rank's first message of an element it does not hold). An idle rank
  (holding and needing nothing) copies before it combines, so of m messages it
  wastes at least ceil(m / g), and a rank lacking n_r elements it needs spends
  n_r copies on them. So with I idle ranks, L must satisfy
  `P L - I ceil(L / g) >= S` and `sum_r max(0, L - n_r) - I ceil(L / g) >= U`.
  Without idle ranks this is `ceil(S / P)`; with many (small tensors, where
  `torch.chunk` leaves ranks empty) it is higher. For a plain
  reduce_scatter this is (g - 1)/g of the input, for an all_reduce 2(g - 1)/g:
  the ring algorithms meet it. (Where the destination also has new pending
  axes, n_x counts its reduction groups needing x, and h_x = 1.)
  Two more conditions on L. Beyond one message per element a rank needs, the
  items need `F = sum_x (g - 1 - h_x)` unions; a rank holding nothing at all
  copies once per item it works on, so of the e = max(0, L - need_r) messages
  it receives beyond its needs at least ceil(e / g) add nothing to F, but as
  the root of an item no needer holds a partial of (one an item, where such a
  rank needs it): `sum_r e_r - (wasted - refunds) >= F`. And on small tensors
  (`CLASS_LIMIT`) per class of items sharing holders and needers
  (`ItemClass.fits`): an item takes one node per partial value, so a class
  cannot use more of a partial's holders than one node an item can take; and
  all classes at once (`unions_fit`, a max-flow): a rank's unions of classes
  it holds no partial of cost a copy an item.

The first bound holds for every rank. The other two are shared out evenly,
so they bound the busiest rank of the group (the max over ranks), which is
what the modelled time of a collective depends on. Axes of size 1 take no
part: a reduction over one rank is already resolved.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..core.layout import Layout, Shape
from ..core.mesh import AxisName, Mesh
from ..core.positions import block_flat
from .blocks import coords_table, flat_index, own_and_need, summed_overlap
from .moves import block_indices
from .states import State, from_layout, local_numels, local_numels_tensor


def lower_bound_elements(mesh: Mesh, shape: Shape, src: Layout, dst: Layout) -> tuple[int, ...]:
    """Per rank (mesh order), elements any correct plan must receive."""
    shape = tuple(shape)
    return state_bound(from_layout(src, mesh, shape), from_layout(dst, mesh, shape), mesh,
                       FLOW_TRIES)


def sharding_axes(state: State) -> frozenset[AxisName]:
    return frozenset(a for dim in state.dims for a in dim.axes)


@functools.lru_cache(maxsize=4096)
def busiest_bound(start: State, goal: State, mesh: Mesh) -> int:
    """The largest of `state_bound`: what the busiest rank must receive (the search's A*
    asks it of every state it queues)."""
    return max(state_bound(start, goal, mesh))


def state_bound(start: State, goal: State, mesh: Mesh, tries: int = 1) -> tuple[int, ...]:
    """`lower_bound_elements` between two planner states. `tries`: the max-flows each
    test of the classes may run (`unions_fit`): the search's A* asks the bound of every
    state it queues and takes one (a bound as valid, at most as tight); the plan's own
    bound and trees take `FLOW_TRIES`. It matters only where the bound looks at classes
    of items, so elsewhere every `tries` shares one cached answer."""
    if tries != 1 and not _looks_at_classes(start, mesh):
        tries = 1
    return _state_bound(start, goal, mesh, tries)


@functools.lru_cache(maxsize=4096)
def _state_bound(start: State, goal: State, mesh: Mesh, tries: int) -> tuple[int, ...]:
    resolve = [a for a in start.partial if a not in goal.partial]
    g = mesh.group_size(resolve)
    if g > 1:
        return _reduction(start, goal, mesh, g, tries)
    new = [a for a in goal.partial if a not in start.partial]
    if new and goal.op != "avg":   # an average needs the value on every member
        return _partial_destination(start, goal, mesh, tuple(new))
    return missing(start, goal, mesh)


def missing(start: State, goal: State, mesh: Mesh) -> tuple[int, ...]:
    """Per rank, the elements it needs in `goal` and does not hold in `start`."""
    own, need = own_and_need(start, goal, mesh)
    return tuple((need - own).tolist())


def _reduction(start: State, goal: State, mesh: Mesh, g: int, tries: int) -> tuple[int, ...]:
    total = math.prod(d.size for d in start.dims)
    if any(a not in start.partial for a in goal.partial):
        # Members of a pending group of the goal all need the same block: count it once.
        groups = mesh.group_size(goal.partial)
        needers = sum(local_numels(goal, mesh)) // groups
        return (-(-(total * (g - 2) + needers) // mesh.size),) * mesh.size
    # Items: an element and a coordinate on the pending axes the goal keeps (k of them).
    # Each needs g - 1 messages to combine, one more per rank needing it, one less when a
    # rank needing it holds a partial of it (it can combine there).
    k = mesh.group_size(goal.partial)
    own, need = own_and_need(start, goal, mesh)
    unions = k * total * (g - 1)
    held = k * _held_where_needed(start, goal, mesh, own)
    messages = unions + int(need.sum()) - held
    empty = local_numels_tensor(start, mesh).reshape(-1) == 0
    idle = int((empty & (need == 0)).sum())
    # items no needer holds a partial of: their root may be a rank holding nothing
    rootless = k * total - held
    classes = _classes(start, goal, mesh, g) if _looks_at_classes(start, mesh) else ()
    if classes:   # only a rank holding nothing saves a copy as a root
        rootless = sum(c.count for c in classes if bool(empty[c.roots].any()))
    # every rank receives at least one message per element of its block
    share = busiest_share(messages, unions, need, need - own, idle, g, mesh.size,
                          need[empty], rootless, classes, tries)
    return tuple(torch.clamp(need, min=share).tolist())


def busiest_share(messages: int, unions: int, need: torch.Tensor, lacking: torch.Tensor,
                  idle: int, g: int, ranks: int, empty_need: torch.Tensor,
                  rootless: int, classes: tuple[ItemClass, ...] = (),
                  tries: int = 1) -> int:
    """The least L such that ranks receiving at most L messages each can carry `messages`
    and `unions` (see the module doc): `need` and `lacking` are per rank, `idle` ranks hold
    and need nothing, `empty_need` is what each rank holding nothing needs, and `rootless`
    items have no needer holding a partial. (`meshcomm.testing.counting_bound` counts the
    same apart, element by element.)"""
    beyond = messages - int(need.sum())     # messages beyond one per element a rank needs
    flow: list[FlowClass] = [(c.count, c.free, [p.tolist() for p in c.partials],
                              c.roots.tolist(), c.others.tolist()) for c in classes]

    def fits(L: int) -> bool:
        wasted = idle * -(-L // g)          # an idle rank's first message per element
        # A rank holding nothing copies before it combines: of the e messages it receives
        # beyond its needs, at least ceil(e / g) (one an item it works on) add nothing the
        # count `beyond` has, but the root of a rootless item, whose copy is its delivery.
        extra = torch.clamp(L - need, min=0)
        empty = int((-(-torch.clamp(L - empty_need, min=0) // g)).sum())
        return (ranks * L - wasted >= messages
                and int(torch.clamp(L - lacking, min=0).sum()) - wasted >= unions
                and int(extra.sum()) - max(0, empty - rootless) >= beyond
                and all(c.fits(extra) for c in classes)
                and (not flow or unions_fit(flow, extra.tolist(), tries)))

    lo = max(-(-messages // ranks), int(need.max()) if need.numel() else 0)
    if fits(lo):
        return lo
    hi = 2 * lo + 1
    while not fits(hi):
        hi *= 2
    while lo + 1 < hi:                      # fits(hi), not fits(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


CLASS_LIMIT = 1 << 16   # elements x ranks up to which the bound looks at classes of items
FLOW_TRIES = 32         # max-flows a `unions_fit` call may run for a plan's own bound


def _looks_at_classes(start: State, mesh: Mesh) -> bool:
    """Whether a reduction's bound from `start` checks classes of items (`CLASS_LIMIT`)."""
    return math.prod(d.size for d in start.dims) * mesh.size <= CLASS_LIMIT


@dataclass(frozen=True)
class ItemClass:
    """Items (elements, at one coordinate on the kept pending axes) that share their holders
    and needers: `count` of them, each needing `free` unions beyond one message per rank
    needing it (g - 1, less one where a needer holds a partial: its last union is its
    delivery). `partials` lists, per partial value, the ranks holding it; `others` the
    ranks of the reduction holding none (`roots` of them may be the root of an item without
    a copy to waste: the needers, where no needer holds a partial)."""

    count: int
    free: int
    partials: tuple[torch.Tensor, ...]
    others: torch.Tensor
    roots: torch.Tensor

    def fits(self, extra: torch.Tensor) -> bool:
        """Whether ranks with `extra` messages each beyond their needs can make the class's
        unions. Each item takes one node per partial value, which makes at most all of the
        item's `free` unions: a partial's holders make at most `count` x the most one of
        them can, and at most all they can together. A rank holding none copies first: of
        e messages it makes at most e - ceil(e / (free + 1)) unions (one copy an item, at
        most `free` unions after it; all e as the root of an item no needer holds)."""
        if self.free <= 0:
            return True
        made = 0
        for holders in self.partials:
            e = extra[holders]
            made += min(int(e.sum()), self.count * min(self.free, int(e.max())))
        e = extra[self.others]
        made += int(e.sum()) - int((-(-e // (self.free + 1))).sum())
        made += int((-(-extra[self.roots] // (self.free + 1))).sum())
        return made >= self.count * self.free


FlowClass = tuple[int, int, list[list[int]], list[int], list[int]]


def unions_fit(classes: list[FlowClass], extra: list[int], tries: int) -> bool:
    """Whether ranks with `extra` messages each beyond their needs can make every class's
    unions at once: per class (items, unions an item, the ranks holding each partial
    value, ranks that take unions without a copy as roots, ranks that copy first). Each
    item has one node per partial value, which makes at most `free` of the item's unions,
    and no more than its rank's extra: a partial's holders make at most items x min(free,
    the most extra one of them has). A rank takes at most its extra in all, less the
    copies it makes: u unions of classes it holds no partial of take at least ceil(u / f)
    copies (one an item it combines, f the most unions an item).

    A max-flow (Dinic) over classes, their partials and ranks, first with no copies
    counted (a rank's unions for others capped at e - ceil(e / (f + 1))). Where a rank's
    flow for others needs more copies than counted, two cases are tried apart: it makes
    at most f x its counted copies of them, or it makes one copy more (its capacity one
    less). Every plan fits one of them, so the answer stays a lower bound's condition;
    after `tries` flows the weaker answer (fits) stands. Two shortcuts give the same
    answer sooner: a flow whose ranks each have room for the copies it needs (ceil(u / f))
    is a plan's, so no case of the search fails them all and it would answer fits; and
    once more cases wait than tries are left, some stay untried (fits)."""
    demand = sum(count * free for count, free, *_ in classes)
    if demand == 0:
        return True
    f = max(free for _, free, *_ in classes)
    ranks = len(extra)
    graph = _UnionGraph(classes, extra)
    # Without copies (holders and copy-free roots alone) the flow makes `alone` unions; the
    # rest each cost a copy per at most min(f, e - 1) unions at a rank with extra e.
    alone = graph.flow([0] * ranks, [0] * ranks, demand)[0]
    if alone >= demand:
        return True
    most = max((min(f, extra[r] - 1) for r in graph.copying), default=0)
    if most <= 0 or sum(extra) - -(-(demand - alone) // most) < demand:
        return False
    pending = [([0] * ranks, [e - -(-e // (f + 1)) for e in extra])]
    for left in range(tries, 0, -1):
        if not pending:
            return False
        if len(pending) > left:   # a try takes one case at most: some stay untried
            return True
        copies, other = pending.pop()
        made, got, taken = graph.flow(copies, other, demand)
        if made < demand:
            continue
        if all(t + -(-u // f) <= e for u, t, e in zip(got, taken, extra)):
            return True   # copies enough for this flow fit: so does some plan (see above)
        bad = next((r for r, u in enumerate(got) if u > f * copies[r]), None)
        if bad is None:
            return True
        fewer = list(other)
        fewer[bad] = f * copies[bad]
        more = list(copies)
        more[bad] += 1
        pending += [(more, other), (copies, fewer)]
    return bool(pending)     # cases left untried: the weaker answer


class _UnionGraph:
    """The network of `unions_fit`, built once: source -> class -> (partial -> holder |
    root | others-node of a rank) -> rank -> sink. Edges are numbered in pairs (an edge,
    then its reverse); `flow` sets the two capacities per rank that change between
    tries."""

    def __init__(self, classes: list[FlowClass], extra: list[int]) -> None:
        n, ranks = len(classes), len(extra)
        self.ranks, self.extra = ranks, extra
        self.rank_node = [2 + n + r for r in range(ranks)]
        self.other_node = [2 + n + ranks + r for r in range(ranks)]
        self.size = 2 + n + 2 * ranks + sum(len(c[2]) for c in classes)
        self.copying: set[int] = set()     # ranks with an edge for others' unions
        self.out: list[list[int]] = [[] for _ in range(self.size)]
        self.to: list[int] = []
        self.cap: list[int] = []
        node = 2 + n + 2 * ranks
        for k, (count, free, partials, roots, others) in enumerate(classes):
            self._edge(0, 2 + k, count * free)
            for holders in partials:
                self._edge(2 + k, node, count * min(free, max(extra[r] for r in holders)))
                for r in holders:
                    self._edge(node, self.rank_node[r], count * min(free, extra[r]))
                node += 1
            for r in roots:
                self._edge(2 + k, self.rank_node[r], count * free)
            for r in others:
                if extra[r] > 1:
                    self._edge(2 + k, self.other_node[r], count * free)
                    self.copying.add(r)
        self.sink_edge = [self._edge(self.rank_node[r], 1, extra[r], keep=True)
                          for r in range(ranks)]
        self.other_edge = [self._edge(self.other_node[r], self.rank_node[r], 0, keep=True)
                           for r in range(ranks)]

    def _edge(self, a: int, b: int, cap: int, keep: bool = False) -> int:
        if cap <= 0 and not keep:
            return -1
        e = len(self.to)
        self.out[a].append(e)
        self.out[b].append(e + 1)
        self.to += [b, a]
        self.cap += [cap, 0]
        return e

    def flow(self, copies: list[int], other: list[int], demand: int
             ) -> tuple[int, list[int], list[int]]:
        """A max-flow (up to `demand`) with rank r taking at most extra[r] - copies[r]
        unions in all and other[r] of classes it holds no partial of: the unions made, what
        each rank takes for those classes, and what each rank takes in all."""
        cap = list(self.cap)
        for r in range(self.ranks):
            room = self.extra[r] - copies[r]
            cap[self.sink_edge[r]] = room
            cap[self.other_edge[r]] = max(0, min(other[r], room))
        to, out, sink = self.to, self.out, 1
        total = 0
        while total < demand:
            level = _levels(out, to, cap, self.size, sink)
            if level is None:
                break
            total += _blocking_flow(out, to, cap, level, sink, demand - total)
        # what went through a rank's node for others: its edge's reverse capacity
        return (total, [cap[e ^ 1] for e in self.other_edge],
                [cap[e ^ 1] for e in self.sink_edge])


def _levels(out: list[list[int]], to: list[int], cap: list[int], size: int,
            sink: int) -> list[int] | None:
    """Breadth-first levels from node 0 over edges with capacity left, up to the sink's
    (nodes beyond it lie on no shortest path); None where the sink is out of reach."""
    level = [-1] * size
    level[0] = 0
    queue = [0]
    for a in queue:
        up = level[a] + 1
        for e in out[a]:
            b = to[e]
            if cap[e] > 0 and level[b] < 0:
                level[b] = up
                if b == sink:
                    return level
                queue.append(b)
    return None


def _blocking_flow(out: list[list[int]], to: list[int], cap: list[int], level: list[int],
                   sink: int, limit: int) -> int:
    """Dinic's blocking flow over `level` from node 0 (at most `limit`), `cap` updated: a
    depth-first search that keeps each node's current edge and sends down it as much as it
    takes before moving on. It sends the same paths in the same order as augmenting one
    path at a time from node 0, so the flow is the same (`unions_fit` reads which ranks it
    went through), with far fewer calls."""
    at = [0] * len(level)

    def push(a: int, limit: int) -> int:
        if a == sink:
            return limit
        edges = out[a]
        up = level[a] + 1
        sent = 0
        i = at[a]
        n = len(edges)
        while i < n:
            e = edges[i]
            c = cap[e]
            if c > 0 and level[to[e]] == up:
                got = push(to[e], min(limit - sent, c))
                if got:
                    cap[e] = c - got
                    cap[e ^ 1] += got
                    sent += got
                    if sent == limit:
                        at[a] = i
                        return sent
                    continue      # the same edge again: full, or its end has no more room
            i += 1
        at[a] = i
        return sent

    return push(0, limit)


def _classes(start: State, goal: State, mesh: Mesh, g: int) -> tuple[ItemClass, ...]:
    """The classes of items of a reduction (see `ItemClass`), element by element: only for
    small tensors (`CLASS_LIMIT`), where few items share a class and the class's own
    capacity binds before the ranks' total does."""
    resolve = tuple(a for a in start.partial if a not in goal.partial)
    coords = coords_table(mesh)
    part = flat_index(coords, mesh, resolve)
    kept = flat_index(coords, mesh, goal.partial)
    hold, need = element_mask(start, mesh), element_mask(goal, mesh)
    out = []
    for k in torch.unique(kept).tolist():
        group = kept == k
        h, n = hold & group, need & group
        both_masks = torch.cat([h, n], 1)
        ids = row_ids(both_masks)
        first, counts = _firsts(ids)
        for row, c in zip(both_masks[first], counts.tolist()):
            holders, needers = row[:mesh.size], row[mesh.size:]
            if not needers.any():
                continue
            both = bool((holders & needers).any())
            others = group & ~holders
            out.append(ItemClass(
                c, g - 1 - both,
                tuple(holders.logical_and(part == j).nonzero().flatten()
                      for j in torch.unique(part[holders]).tolist()),
                others.nonzero().flatten(),
                (others & needers).nonzero().flatten() if not both
                else torch.zeros(0, dtype=torch.long)))
    return tuple(out)


def row_ids(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a bool matrix, a number shared exactly by the rows equal to it, in the
    rows' lexicographic order: the rows' bits packed into 63-bit words, each word numbered
    by `torch.unique`, and the numbers of the words so far combined with the next word's
    (one 1-D `unique` a word: `unique(dim=0)` is many times slower)."""
    cols = mask.shape[1]
    words = -(-cols // 63)

    def packed(k: int) -> torch.Tensor:     # word k of every row (no padding: a tall mask)
        part = mask[:, 63 * k:63 * (k + 1)]
        return (part.long() << torch.arange(part.shape[1])).sum(-1)

    _, ids = torch.unique(packed(0), return_inverse=True)
    for k in range(1, words):
        kinds, word = torch.unique(packed(k), return_inverse=True)
        _, ids = torch.unique(ids * kinds.numel() + word, return_inverse=True)
    out: torch.Tensor = ids
    return out


def _firsts(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per id (0, 1, ...): the first row with it and how many rows have it."""
    counts = torch.bincount(ids)
    first = torch.full((counts.numel(),), ids.numel(), dtype=torch.long)
    first.scatter_reduce_(0, ids, torch.arange(ids.numel()), "amin")
    return first, counts


@functools.lru_cache(maxsize=16)
def element_mask(state: State, mesh: Mesh) -> torch.Tensor:
    """Elements (global flat) x mesh positions: which positions hold which elements in
    `state`. Ranks that agree on the axes sharding `state` hold the same block: each block
    is listed once. Cached: callers must not modify it."""
    shape = tuple(d.size for d in state.dims)
    mask = torch.zeros(math.prod(shape), mesh.size, dtype=torch.bool)
    sharding = [a for d in state.dims for a in d.axes]
    blocks: dict[tuple[int, ...], torch.Tensor] = {}
    for i, r in enumerate(mesh.ranks):
        c = mesh.coords(r)
        key = tuple(c[a] for a in sharding)
        if key not in blocks:
            blocks[key] = block_flat(block_indices(state, mesh, r), shape)
        mask[blocks[key], i] = True
    return mask


def _held_where_needed(start: State, goal: State, mesh: Mesh, own: torch.Tensor) -> int:
    """How many elements some rank both holds in `start` and needs in `goal`: the union of
    every rank's overlap. A rank's blocks on both sides depend only on its coordinates on the
    axes sharding either state; ranks that agree there share one overlap, and overlaps of
    ranks that differ there are disjoint. So: the overlaps of the ranks at coordinate 0 on
    every other axis, summed."""
    sharding = sharding_axes(start) | sharding_axes(goal)
    index = tuple(slice(None) if a in sharding else 0 for a in mesh.axis_names)
    return int(own.reshape(mesh.shape)[index].sum())


def _partial_destination(start: State, goal: State, mesh: Mesh,
                         new: tuple[AxisName, ...]) -> tuple[int, ...]:
    g = mesh.group_size(new)
    # Members differ only on the new axes and need the same block; those that differ on
    # an axis sharding `start` hold disjoint blocks, the others the same one, so the group
    # keeps the sum over those axes of what one member keeps.
    kept = summed_overlap(start, goal, mesh, frozenset(new) & sharding_axes(start),
                          in_need=False)
    _, need = own_and_need(start, goal, mesh)
    return tuple(((need - kept + g - 1) // g).tolist())
