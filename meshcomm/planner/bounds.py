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
  (`CLASS_LIMIT`) per class of items sharing holders and needers (found cell by
  cell: a cell holds the elements sharing their block of every dim on both sides)
  (`ClassCaps`): an item takes one node per partial value, so a class
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
import sys
from dataclasses import dataclass

import torch

from ..core.layout import Layout, Shape
from ..core.mesh import AxisName, Mesh
from ..core.positions import block_flat
from .blocks import (
    coords_table,
    flat_index,
    own_and_need,
    own_and_need_counts,
    pair_counts,
    rank_blocks,
    summed_overlap,
)
from .moves import block_indices
from .states import DimState, State, from_layout, local_numels, local_numels_tensor
from .unions import FlowClass, Unions


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


@functools.lru_cache(maxsize=1024)
def missing(start: State, goal: State, mesh: Mesh) -> tuple[int, ...]:
    """Per rank, the elements it needs in `goal` and does not hold in `start` (cached: the
    bound, a send_recv's estimate and its exact price share one tuple)."""
    if all(d.is_local for d in goal.dims):     # every rank needs it all: what it lacks is
        total = math.prod(d.size for d in goal.dims)     # the rest (no tensor op)
        return tuple(total - n for n in local_numels(start, mesh))
    own, need = own_and_need_counts(start, goal, mesh)
    lacking = need - own
    return (lacking,) * mesh.size if isinstance(lacking, int) else tuple(lacking.tolist())


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
    apart = ClassCaps(classes)
    together = Unions(flow, ranks) if flow else None

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
                and apart.fits(extra)
                and (together is None or together.fit(extra.tolist(), tries)))

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
    """Whether a reduction's bound from `start` checks classes of items
    (`CLASS_LIMIT`). The classes come from the layouts' cells (`cells`), whatever the
    tensor's size; the limit is on elements because the test of the classes together
    (`Unions`, a max-flow) grows with them: on few cells of a large tensor it can cost a
    plan 100 ms for a bound a few percent tighter."""
    return math.prod(d.size for d in start.dims) * mesh.size <= CLASS_LIMIT


def _dim_cells(a: DimState, b: DimState, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """The non-empty intersections of a block of `a` and a block of `b` of one dim: the
    block of each (x, y) and its size."""
    table = pair_counts(a, b, mesh)
    x, y = table.nonzero(as_tuple=True)
    return x, y, table[x, y]


@functools.lru_cache(maxsize=64)
def cells(start: State, goal: State, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """Cells x mesh positions: which positions hold each cell in `start` and which need it
    in `goal`, and each cell's element count. A cell is the set of elements lying in one
    block of every dim on both sides: per dim an intersection of a block of `start` with a
    block of `goal`, and the cell their product. A rank holds an element when it holds its
    block of every dim, so the elements of a cell share their holders and needers: they
    stand for the tensor in the bound's classes, at a cost that follows the layouts and
    the mesh, never the element count. Cached: callers must not modify them."""
    hold = torch.ones(1, mesh.size, dtype=torch.bool)
    need = torch.ones(1, mesh.size, dtype=torch.bool)
    count = torch.ones(1, dtype=torch.long)
    for a, b in zip(start.dims, goal.dims):
        x, y, size = _dim_cells(a, b, mesh)
        h = rank_blocks(a, mesh)[None, :] == x[:, None]
        n = rank_blocks(b, mesh)[None, :] == y[:, None]
        hold = (hold[:, None, :] & h[None, :, :]).reshape(-1, mesh.size)
        need = (need[:, None, :] & n[None, :, :]).reshape(-1, mesh.size)
        count = (count[:, None] * size[None, :]).reshape(-1)
    return hold, need, count


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


class ClassCaps:
    """Whether ranks with `extra` messages each beyond their needs can make each class's
    unions, every class apart (`fits`). Each item takes one node per partial value, which
    makes at most all of the item's `free` unions: a partial's holders make at most
    `count` x the most one of them can, and at most all they can together. A rank holding
    none copies first: of e messages it makes at most e - ceil(e / (free + 1)) unions (one
    copy an item, at most `free` unions after it; all e as the root of an item no needer
    holds). The classes' ranks are laid out once, as flat index tensors, so that a test
    of every class is a few tensor operations."""

    def __init__(self, classes: tuple[ItemClass, ...]) -> None:
        live = [c for c in classes if c.free > 0]
        self.count = torch.tensor([c.count for c in live], dtype=torch.long)
        self.free = torch.tensor([c.free for c in live], dtype=torch.long)
        parts = [(k, p) for k, c in enumerate(live) for p in c.partials]
        self.holders = _flat([p for _, p in parts])
        self.part = torch.repeat_interleave(torch.arange(len(parts)),
                                            _sizes([p for _, p in parts]))
        self.part_class = torch.tensor([k for k, _ in parts], dtype=torch.long)
        self.others = _flat([c.others for c in live])
        self.other_class = torch.repeat_interleave(torch.arange(len(live)),
                                                   _sizes([c.others for c in live]))
        self.roots = _flat([c.roots for c in live])
        self.root_class = torch.repeat_interleave(torch.arange(len(live)),
                                                  _sizes([c.roots for c in live]))

    def fits(self, extra: torch.Tensor) -> bool:
        if not self.count.numel():
            return True
        e = extra[self.holders]
        parts = self.part_class.numel()
        total = torch.zeros(parts, dtype=torch.long).index_add_(0, self.part, e)
        most = torch.zeros(parts, dtype=torch.long).scatter_reduce_(0, self.part, e, "amax")
        c = self.part_class
        made = torch.zeros_like(self.count).index_add_(
            0, c, torch.minimum(total, self.count[c] * torch.minimum(self.free[c], most)))
        e = extra[self.others]
        made.index_add_(0, self.other_class, e + (-e // (self.free[self.other_class] + 1)))
        e = extra[self.roots]
        made.index_add_(0, self.root_class, -(-e // (self.free[self.root_class] + 1)))
        return bool((made >= self.count * self.free).all())


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _sizes(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([p.numel() for p in parts], dtype=torch.long)


def _classes(start: State, goal: State, mesh: Mesh, g: int) -> tuple[ItemClass, ...]:
    """The classes of items of a reduction (see `ItemClass`), cell by cell (`cells`): only
    for small tensors (`CLASS_LIMIT`), where few items share a class and the class's own
    capacity binds before the ranks' total does."""
    resolve = tuple(a for a in start.partial if a not in goal.partial)
    coords = coords_table(mesh)
    part = flat_index(coords, mesh, resolve)
    kept = flat_index(coords, mesh, goal.partial)
    hold, need, size = cells(start, goal, mesh)
    out = []
    for k in torch.unique(kept).tolist():
        group = kept == k
        h, n = hold & group, need & group
        both_masks = torch.cat([h, n], 1)
        ids = row_ids(both_masks)
        first, _ = _firsts(ids)
        counts = torch.zeros(len(first), dtype=torch.long).index_add_(0, ids, size)
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


_BIT_VALUES = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def row_ids(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a bool matrix, a number shared exactly by the rows equal to it, in the
    rows' lexicographic order: the rows' bits packed into 63-bit words, each word numbered
    by `torch.unique`, and the numbers of the words so far combined with the next word's
    (one 1-D `unique` a word: `unique(dim=0)` is many times slower)."""
    cols = mask.shape[1]
    words = -(-cols // 63)

    def packed(k: int) -> torch.Tensor:     # word k of every row (no padding: a tall mask)
        part = mask[:, 63 * k:63 * (k + 1)]
        if sys.byteorder != "little":
            return (part.long() << torch.arange(part.shape[1])).sum(-1)
        # bytes of 8 bits each, then 8 bytes read as one little-endian int64 (bit 63 zero)
        rows = part.shape[0]
        bits = torch.zeros(rows, 64, dtype=torch.uint8)
        bits[:, :part.shape[1]] = part
        octets = (bits.view(rows, 8, 8) * _BIT_VALUES).sum(-1, dtype=torch.uint8)
        return octets.view(torch.int64).reshape(rows)

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
