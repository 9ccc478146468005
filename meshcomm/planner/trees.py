"""Reduction trees: a pending reduction resolved by point-to-point messages in rounds.

This module never communicates. Where the layout steps cannot reach the counting bound
(`bounds._reduction`), trees of messages can. Elements with the same holders and needers
are interchangeable: each such class is cut into *items* of near-equal size (about
`TREE_LIMIT` / ranks items in all), and each item's g partial values combine along a tree
of ranks, one holder of each partial, rooted at a rank that needs the item (one holding a
partial where there is one: its delivery is then its own combine). The trees are drawn
greedily, item by item, so that the rank receiving the least so far takes the next
message; then chains of moves lower the busiest rank (`augment`: with the nodes fixed,
to the least possible maximum; a chain may cut an item in two where whole items cannot
move), and a *combiner* (a rank holding no partial of the item, which combines two values
in scratch and sends one) may relieve it further. A schedule left well above the bound is
drawn twice more with *helper roots* (`Helpers`: a rank not needing the item, a holder
combining in its input or a rank holding none combining in scratch, roots its tree and
delivers the finished value to every needer; weighed against the first draw's loads, then
against its loads before combiners), and small ones in a few other orders. Sends
are balanced along chains too (`augment_sends`).

A tree step runs as rounds of one all_to_all each: in a round every rank receives at most
one value per element it combines, and adds it to the value it has, so the result does not
depend on the order messages arrive in; a rank sends a value once it has all its
children's. Then rounds deliver each finished value from its root to the other ranks that
need it (a rank forwards what it received).

Finding the classes looks at every element, so trees apply to tensors of at most
`ELEMENT_LIMIT` elements x ranks; on larger ones the layout steps plan alone. Cost: the
busiest rank's received elements over all rounds (the rounds of a tree pipeline), plus one
latency per round in a CostModel with latency.

This module holds the entry points, the schedule and each rank's transfers; the trees are
drawn in `tree_draw` and balanced along chains in `tree_chains`.
"""

from __future__ import annotations

import functools
import math
import random
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..core.mesh import AxisName, Mesh
from ..core.positions import block_flat
from .blocks import coords_table, flat_index, in_mesh_order, own_and_need
from .bounds import FLOW_TRIES, element_mask, state_bound
from .moves import Move, block_indices
from .rank_transfers import resolved_axes
from .states import State
from .tree_chains import INPUT, OUTPUT, Budget, Tree
from .tree_chains import REGIONS as REGIONS
from .tree_chains import SCRATCH as SCRATCH
from .tree_draw import Helpers, Messages, balanced, items_of, messages
from .values import Transfer

TREE_LIMIT = 1 << 15   # items x ranks: elements are grouped into at most this / ranks items
ELEMENT_LIMIT = 1 << 22   # elements x ranks above which no tree is drawn (planning time)
RESTARTS = 8          # other orders (items, ties) tried where a schedule is above the bound
RESTART_LIMIT = 1 << 12   # items x ranks up to which they are tried
TREE_RANKS = 256       # meshes above which no tree is drawn: each round is an all_to_all
                       # over the step's group, whose host cost grows with its size
SEARCH_UNITS = 1 << 18   # units the chain searches of one drawn schedule may look at
SEND_LIMIT = 1 << 16     # elements x ranks up to which an estimate counts its least sends
HELPER_GAP = 16          # a schedule above its bound by more than 1 / this is drawn again
                         # with helpers (each draw costs the same planning time)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Every message of a tree step: row i sends item `elem[i]` (the global flat elements
    `items[elem[i]]`, which share their holders and needers) from mesh position `src[i]` to
    `dst[i]` in round `round[i]`. Rounds before `merges` combine
    partials; the others deliver finished values. A value lives in a rank's input (a
    holder's partial; a root holding one combines there), its output (a root needing the
    element that holds no partial combines there; delivered values land there) or its
    scratch (a combiner: a rank holding no partial of the element that combines two or
    more values, for others or as a root needing none of it), as `REGIONS` number them. A
    root needing its element that holds a partial of it copies the value from its input
    into its output; a root not needing it delivers it to every rank that does."""

    rounds: int
    merges: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    elem: tuple[int, ...]
    round: tuple[int, ...]
    src_region: tuple[int, ...]    # where the sender reads the value
    dst_region: tuple[int, ...]    # where the receiver combines (merge) or writes (delivery)
    roots: tuple[tuple[int, int, bool, bool], ...]   # (position, item, holds a partial, needs it)
    scratch: tuple[tuple[int, ...], ...]       # per position: the items it combines for
    items: tuple[tuple[int, ...], ...]         # per item: its global flat elements


def tree_axes(state: State, goal: State, mesh: Mesh) -> tuple[AxisName, ...]:
    """The group of a tree step: every axis but the pending ones the goal keeps (ranks that
    differ there combine different partial sums and never talk) and those of size 1."""
    return in_mesh_order(mesh, {a for a in mesh.axis_names
                                if a not in goal.partial and mesh.axis_size(a) > 1})


def applies(state: State, goal: State, mesh: Mesh) -> bool:
    """Whether a tree step may go from `state` to `goal`: it resolves pending axes of more
    than one rank, keeps the others, adds none, and the tensor and mesh are small enough."""
    resolve = resolved_axes(state, goal)
    if not resolve or mesh.group_size(resolve) == 1:
        return False
    if mesh.size > TREE_RANKS:
        return False
    numel = math.prod(d.size for d in state.dims)
    return 0 < numel and numel * mesh.size <= ELEMENT_LIMIT


def tree_estimate(state: State, goal: State, mesh: Mesh) -> Move | None:
    """The tree step from `state` to `goal` priced at the lower bound (`Move.estimate`): the
    search draws its schedule (`tree_move`) only when the step may be on the best path."""
    if not applies(state, goal, mesh):
        return None
    # Every rank receives at least one message per element it needs (a delivery, or as
    # a root its last combine): a lower bound of the step's time, received bytes and every
    # rank's peak. (The counting bound, `state_bound`, is tighter, but its flow over classes
    # of items cost more than drawing the few schedules it saves: on 300 random small
    # transitions the same plans came 27 % faster without it.) Sends: `least_sends`, below
    # every tree's. A figure above a rank's sends in the schedule drawn (its receives, say)
    # could rank the estimate behind a plan of equal time and receives that sends more, and
    # the search would return that plan without drawing the tree.
    _, need = own_and_need(state, goal, mesh)
    return Move("send_recv", tree_axes(state, goal, mesh), goal, action="tree", op=state.op,
                indexed=True, estimate=True, send=least_sends(state, goal, mesh),
                recv=tuple(need.tolist()), least=least_busiest(state, goal, mesh, need),
                rounds=least_rounds(state, goal, mesh))


def least_busiest(state: State, goal: State, mesh: Mesh, need: torch.Tensor) -> int:
    """A floor of the busiest rank's received elements in every tree step from `state` to
    `goal`, for its time alone (its per-rank figures stay each rank's own floor). One
    element's reduction over g partials, k ranks needing its value: the first rank to hold
    the whole value heard, directly or not, from all g holders (g - 1 messages at least,
    each carrying one value), and each of the other k - 1 needers receives one more
    message after that, so g + k - 2 messages; over every element and every kept partial
    index that is the needs' sum plus (g - 2) per pair, received by the mesh's ranks, the
    busiest at least their average. Without it a tree estimate priced at each rank's needs
    alone looked faster than one reduce_scatter, and the search drew a schedule (134 ms on
    `sp=4`, (9, 96, 128, 6)) only to throw it away."""
    g = mesh.group_size(resolved_axes(state, goal) or ())
    if g < 2:
        return 0
    pairs = math.prod(d.size for d in state.dims) * mesh.group_size(goal.partial)
    total = int(need.sum()) + (g - 2) * pairs
    return -(-total // mesh.size)


def least_sends(state: State, goal: State, mesh: Mesh) -> tuple[int, ...]:
    """Per rank, elements it sends in every tree step from `state` to `goal`: those whose
    partial value it alone holds in its reduction while another rank of the reduction needs
    them (that value reaches the other rank through a message from it, and a message
    carries one value an element). Anything else may leave through another holder of the
    same partial, or not at all (a root). Counted on tensors of at most `SEND_LIMIT`
    elements x ranks (it looks at every element, for each state a tree may leave); above,
    none (still below every tree's, only looser: a tie of time and receives then draws
    the tree)."""
    if math.prod(d.size for d in state.dims) * mesh.size > SEND_LIMIT:
        return (0,) * mesh.size
    coords = coords_table(mesh)
    part = flat_index(coords, mesh, resolved_axes(state, goal) or ())
    kept = flat_index(coords, mesh, goal.partial)
    group = kept * (int(part.max()) + 1) + part      # ranks holding the same partials
    hold, need = element_mask(state, mesh), element_mask(goal, mesh)

    def per(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per element and rank, how many ranks with the rank's id in `ids` are in `mask`."""
        width = int(ids.max()) + 1
        counts = torch.zeros(mask.shape[0], width, dtype=torch.int32)
        return counts.index_add_(1, ids, mask.to(torch.int32))[:, ids]

    alone = hold & (per(group, hold) == 1)
    wanted = per(kept, need) > need.to(torch.int32)   # another rank of the reduction needs it
    return tuple((alone & wanted).sum(0).tolist())


def least_rounds(state: State, goal: State, mesh: Mesh) -> int:
    """A lower bound of a tree step's rounds, so that a cost model with latency prices its
    estimate closer: in a round a rank adds at most one received value to what it has, so a
    value of all g partials needs ceil(log2 g) rounds of merges; where the goal replicates
    over an axis of more than one rank, each reduction has a needer besides its root, and a
    round of deliveries follows."""
    g = mesh.group_size(resolved_axes(state, goal) or ())
    merges = max(1, (g - 1).bit_length())
    used = goal.used_axes()
    return merges + any(mesh.axis_size(a) > 1 for a in mesh.axis_names if a not in used)


@functools.lru_cache(maxsize=256)
def tree_move(state: State, goal: State, mesh: Mesh) -> Move | None:
    """The tree step from `state` to `goal` (see the module doc), or None where none applies."""
    if not applies(state, goal, mesh):
        return None
    s = schedule(state, goal, mesh)
    send, recv = [0] * mesh.size, [0] * mesh.size
    for a, b, e in zip(s.src, s.dst, s.elem):
        w = len(s.items[e])
        send[a] += w
        recv[b] += w
    return Move("send_recv", tree_axes(state, goal, mesh), goal, action="tree", op=state.op,
                indexed=True, send=tuple(send), recv=tuple(recv), rounds=s.rounds,
                merge_rounds=s.merges)


@functools.lru_cache(maxsize=64)
def schedule(state: State, goal: State, mesh: Mesh) -> Schedule:
    """The messages of the tree step from `state` to `goal` (`applies` must hold)."""
    resolve = list(resolved_axes(state, goal) or ())
    g = mesh.group_size(resolve)
    coords = coords_table(mesh)
    part = flat_index(coords, mesh, tuple(resolve)).tolist()   # which partial a rank holds
    kept = flat_index(coords, mesh, goal.partial).tolist()     # which reduction it is in
    by_kept: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(kept):
        by_kept[k].append(i)
    items, holders, needers = items_of(state, goal, mesh, max(1, TREE_LIMIT // mesh.size))
    floor = max(state_bound(state, goal, mesh, FLOW_TRIES))   # no schedule receives less
    order, tie = list(range(len(items))), list(range(mesh.size))

    plain: list[Helpers] = []    # the first draw's loads before its combiners

    def drawn(helpers: Helpers | None = None
              ) -> Drawn:
        budget = Budget(SEARCH_UNITS)
        trees, got, recv, sent, loads = balanced(order, tie, items, holders, needers, kept,
                                                  by_kept, part, g, mesh.size, floor, budget,
                                                  helpers)
        if loads is not None and not plain:
            plain.append(loads)
        made = messages(trees, part, recv, sent, budget)
        # a step's time is its busiest rank's larger of sent and received
        return (max(max(recv), max(sent)), max(recv), sum(recv)), trees, got, made, sent, recv

    best = drawn()
    if _helpers_may_help(best, floor, items, holders, needers, part, kept, mesh.size):
        # needer roots left the busiest rank well above the bound: twice more with helper
        # roots (`Helpers`) where they lower it, and combiners sought more widely: helpers
        # weighed against the first draw's loads, then against its loads before combiners
        for helpers in (Helpers(*best[4:]), plain[0]):
            got = drawn(helpers)
            # the faster kept, even where it receives more (helpers add messages): keeping a
            # schedule's receives at their bound instead left a faster tree between two
            # other steps (`"i (pp j) k | sum(cp)"` (2, 1, 12) to `"(pp i) j k"` on `pp=4
            # cp=4`: 96 B received, not 56 B); but more rounds only for a gain the draw was
            # made for (each round costs a latency: a 60-element, 39-round tree became 59
            # elements, 70 rounds)
            gain = best[0][0] - got[0][0]
            if got[0] < best[0] and (_rounds(got) <= _rounds(best)
                                     or gain * HELPER_GAP > best[0][0]):
                best = got
    if best[0][0] > floor and len(items) * mesh.size <= RESTART_LIMIT:
        # greedy draws depend on the order items come in and on ties between ranks: a few
        # other orders of both, the best kept
        shuffle = random.Random(len(items)).shuffle
        for _ in range(RESTARTS):
            shuffle(order)
            shuffle(tie)
            got = drawn()
            if got[0] < best[0]:
                best = got
            if best[0][0] <= floor:
                break
    _, trees, items, (rows, first), _, _ = best
    rounds = _rounds(best)
    round_, src, dst, elem, src_region, dst_region = (
        (tuple(c) for c in zip(*rows)) if rows else ((),) * 6)
    scratch: list[set[int]] = [set() for _ in range(mesh.size)]
    for tree in trees:
        for i in tree.combiners:
            scratch[i].add(tree.elem)
    return Schedule(rounds, first, src, dst, elem, round_, src_region, dst_region,
                    tuple((t.root, t.elem, t.root_holds, t.root_needs) for t in trees),
                    tuple(tuple(sorted(x)) for x in scratch), tuple(items))


def _rounds(drawn: Drawn) -> int:
    """The rounds of a drawn schedule: its combining rounds, then its deliveries."""
    rows, first = drawn[3]
    return max(first, 1 + max(r[0] for r in rows)) if rows else first


def _helpers_may_help(best: Drawn, floor: int, items: list[tuple[int, ...]],
                      holders: list[list[int]], needers: list[list[int]], part: list[int],
                      kept: list[int], ranks: int) -> bool:
    """Whether a draw with helpers (`Helpers`) may lower schedule `best`'s time by more
    than 1 / `HELPER_GAP`: its busiest receiver is that far above the bound `floor` (wider
    combiners may lower it), or a busiest sender is that far above what it must send
    (`_least_sends`) and sends that much in deliveries (helper roots take deliveries off
    needers). Each draw costs as much planning time as the first."""
    (time, top, _), _, pieces, (rows, first), sent, _ = best
    if top > floor + floor // HELPER_GAP:
        return True
    if max(sent) <= max(top, floor + floor // HELPER_GAP):
        return False
    least = _least_sends(items, holders, needers, part, kept, ranks)
    delivered = [0] * ranks
    for t, a, _, e, *_ in rows:
        if t >= first:
            delivered[a] += len(pieces[e])    # the items, cut ones added
    gap = time // HELPER_GAP
    return any(n == time and n - least[i] > gap and delivered[i] > gap
               for i, n in enumerate(sent))


def _least_sends(items: list[tuple[int, ...]], holders: list[list[int]],
                 needers: list[list[int]], part: list[int], kept: list[int], ranks: int
                 ) -> list[int]:
    """Per rank, elements it sends in every tree schedule: those of items whose partial it
    alone holds in its reduction while another rank of the reduction needs them (as
    `least_sends`, counted by items, so on any tensor a tree applies to). Where a
    schedule's busiest rank is no busier than this (or than the receives' bound), no
    other root helps it."""
    out = [0] * ranks
    for item, hs, ns in zip(items, holders, needers):
        alone: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in hs:
            alone[(kept[i], part[i])].append(i)
        for (k, _), who in alone.items():
            if len(who) == 1 and any(kept[j] == k and j != who[0] for j in ns):
                out[who[0]] += len(item)
    return out


# a drawn schedule: (time, busiest receiver, all received), its trees, items, messages,
# and each rank's sent and received elements
Drawn = tuple[tuple[int, int, int], list["Tree"], list[tuple[int, ...]], Messages, list[int],
              list[int]]


@functools.lru_cache(maxsize=256)
def tree_transfers(state: State, goal: State, mesh: Mesh, rank: int) -> tuple[Transfer, ...]:
    """The transfers `rank` sends or receives in the tree step, one per round and peer.

    Positions are flat, in a rank's work buffer: its input tensor, its output tensor, then
    its scratch (`Schedule.scratch`). A value is read where the sender has it and combined
    (round < `Schedule.merges`) or written (a delivery) where the receiver keeps it: a
    holder's partial in its input, a root holding no partial in its output, a combiner's in
    its scratch; deliveries land in outputs and forwards read them there. A root holding a
    partial of an element it needs copies it from its input to its output (src == dst, in
    the first delivery round). Items are listed element by element, in item order. A rank
    outside `mesh` (a plan between meshes lists both meshes' ranks) moves nothing."""
    if rank not in mesh:
        return ()
    s = schedule(state, goal, mesh)
    me = mesh.ranks.index(rank)
    groups: dict[tuple[int, int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for a, b, e, t, ra, rb in zip(s.src, s.dst, s.elem, s.round, s.src_region, s.dst_region):
        if a == me or b == me:
            groups[(t, a, b)].append((e, ra, rb))
    keep = [(e, INPUT, OUTPUT) for i, e, holds, needs in s.roots if i == me and holds and needs]
    if keep:
        groups[(s.merges, me, me)] = keep
    out = []
    for (t, a, b), units in sorted(groups.items()):
        units.sort()
        src_at = _work(state, goal, mesh, mesh.ranks[a], s.scratch[a], s.items)
        dst_at = _work(state, goal, mesh, mesh.ranks[b], s.scratch[b], s.items)
        src_pos = torch.cat([src_at[ra][_elements(s.items, e)] for e, ra, _ in units])
        dst_pos = torch.cat([dst_at[rb][_elements(s.items, e)] for e, _, rb in units])
        out.append(Transfer(mesh.ranks[a], mesh.ranks[b], (tuple(src_pos.tolist()),),
                            (tuple(dst_pos.tolist()),), round=t))
    return tuple(out)


def _elements(items: tuple[tuple[int, ...], ...], e: int) -> torch.Tensor:
    return torch.tensor(items[e], dtype=torch.long)


def _work(state: State, goal: State, mesh: Mesh, rank: int, scratch: tuple[int, ...],
          items: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per region of `rank`'s work buffer, global flat element -> its position there (-1
    where it has none): its input, its output, its scratch (the elements of the items it
    combines for others, after its output)."""
    shape = tuple(d.size for d in state.dims)
    held = _local_positions(state, rank, shape, mesh)
    n_in = int((held >= 0).sum())
    made = _local_positions(goal, rank, shape, mesh, n_in)
    extra = torch.full_like(held, -1)
    if scratch:
        elems = torch.cat([_elements(items, e) for e in scratch])
        extra[elems] = n_in + int((made >= 0).sum()) + torch.arange(elems.numel())
    return held, made, extra


@functools.lru_cache(maxsize=256)
def _local_positions(state: State, rank: int, shape: tuple[int, ...], mesh: Mesh,
                     offset: int = 0) -> torch.Tensor:
    """Global flat element -> `offset` + flat position in `rank`'s local tensor of `state`
    (-1 where `rank` does not hold it)."""
    flat = block_flat(block_indices(state, mesh, rank), shape)
    out = torch.full((math.prod(shape),), -1, dtype=torch.long)
    out[flat] = offset + torch.arange(flat.numel())
    return out
