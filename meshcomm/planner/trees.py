"""Reduction trees: a pending reduction resolved by point-to-point messages in rounds.

This module never communicates. Where the layout steps cannot reach the counting bound
(`bounds._reduction`), trees of messages can. Elements with the same holders and needers
are interchangeable: each such class is cut into *items* of near-equal size (about
`TREE_LIMIT` / ranks items in all), and each item's g partial values combine along a tree
of ranks, one holder of each partial, rooted at a rank that needs the item (one holding a
partial where there is one: its delivery is then its own combine). The trees are drawn
greedily, item by item, so that the rank receiving the least so far takes the next
message; then chains of moves lower the busiest rank (`_augment`: with the nodes fixed,
to the least possible maximum; a chain may cut an item in two where whole items cannot
move), and a *combiner* (a rank holding no partial of the item, which combines two values
in scratch and sends one) may relieve it further. A schedule left well above the bound is
drawn twice more with *helper roots* (`_Helpers`: a rank not needing the item, a holder
combining in its input or a rank holding none combining in scratch, roots its tree and
delivers the finished value to every needer; weighed against the first draw's loads, then
against its loads before combiners), and small ones in a few other orders. Sends
are balanced along chains too (`_augment_sends`).

A tree step runs as rounds of one all_to_all each: in a round every rank receives at most
one value per element it combines, and adds it to the value it has, so the result does not
depend on the order messages arrive in; a rank sends a value once it has all its
children's. Then rounds deliver each finished value from its root to the other ranks that
need it (a rank forwards what it received).

Finding the classes looks at every element, so trees apply to tensors of at most
`ELEMENT_LIMIT` elements x ranks; on larger ones the layout steps plan alone. Cost: the
busiest rank's received elements over all rounds (the rounds of a tree pipeline), plus one
latency per round in a CostModel with latency.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..core.mesh import AxisName, Mesh
from ..core.positions import block_flat
from .blocks import coords_table, flat_index, in_mesh_order, own_and_need
from .bounds import FLOW_TRIES, element_mask, row_ids, state_bound
from .moves import Move, block_indices
from .rank_transfers import resolved_axes
from .states import State
from .values import Transfer

TREE_LIMIT = 1 << 15   # items x ranks: elements are grouped into at most this / ranks items
ELEMENT_LIMIT = 1 << 22   # elements x ranks above which no tree is drawn (planning time)
ITEMS_PER_CLASS = 4       # items a class a rank at most (x ranks): enough to balance it
RESTARTS = 8          # other orders (items, ties) tried where a schedule is above the bound
RESTART_LIMIT = 1 << 12   # items x ranks up to which they are tried
FREEING = 16          # chains that may fail making room for combiners, a schedule
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


INPUT, OUTPUT, SCRATCH = 0, 1, 2
REGIONS = ("input", "output", "scratch")
Row = tuple[int, int, int, int, int, int]   # round, src, dst, element, src/dst region


@dataclass(slots=True)
class _Tree:
    """One element's tree while it is drawn: its nodes' numbers of children."""

    root: int
    elem: int
    weight: int              # the item's elements
    want: list[int]          # ranks needing the element, the root aside
    root_holds: bool         # the root holds a partial (it combines in its input)
    root_needs: bool         # the root needs the item (one holding none combines in its
                             # output; one neither holding nor needing it, in scratch)
    degree: dict[int, int]
    combiners: set[int]      # ranks holding no partial that combine others' (in scratch)
    members: list[int]       # the ranks of its reduction (same coordinate on kept axes)
    taken: set[int]          # ranks holding a partial of the element (never combiners)
    peers: dict[int, list[int]]   # per partial, the ranks of `taken` holding it (in its order)

    def floor(self, i: int) -> int:
        """The fewest children node i may have: 2 for a combiner (a root holding and needing
        nothing is one), 1 for another root."""
        return 2 if i in self.combiners else int(i == self.root)

    def region(self, i: int) -> int:
        if i in self.combiners:
            return SCRATCH
        return OUTPUT if i == self.root and not self.root_holds else INPUT


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


def _items(state: State, goal: State, mesh: Mesh, budget: int
           ) -> tuple[list[tuple[int, ...]], list[list[int]], list[list[int]]]:
    """The elements grouped into items, with each item's holders (in `state`) and needers
    (in `goal`), as mesh positions. Elements with the same holders and needers are
    interchangeable: each such class is cut into items of near-equal size, about `budget`
    items in all (at least one a class), so a schedule's size follows the layouts, not the
    tensor's."""
    hold, need = element_mask(state, mesh), element_mask(goal, mesh)
    cls = row_ids(torch.cat([hold, need], 1))
    order = torch.argsort(cls, stable=True)
    numel = cls.numel()
    items: list[tuple[int, ...]] = []
    holders: list[list[int]] = []
    needers: list[list[int]] = []
    at = 0
    for c in torch.bincount(cls).tolist():
        elems = order[at:at + c]
        at += c
        first = int(elems[0])
        h = hold[first].nonzero().flatten().tolist()
        n = need[first].nonzero().flatten().tolist()
        cut = max(1, min(c, budget * c // numel, ITEMS_PER_CLASS * mesh.size))
        for chunk in torch.tensor_split(elems, cut):
            items.append(tuple(chunk.tolist()))
            holders.append(h)
            needers.append(n)
    return items, holders, needers


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
    items, holders, needers = _items(state, goal, mesh, max(1, TREE_LIMIT // mesh.size))
    floor = max(state_bound(state, goal, mesh, FLOW_TRIES))   # no schedule receives less
    order, tie = list(range(len(items))), list(range(mesh.size))

    plain: list[_Helpers] = []    # the first draw's loads before its combiners

    def drawn(helpers: _Helpers | None = None
              ) -> Drawn:
        budget = _Budget(SEARCH_UNITS)
        trees, got, recv, sent, loads = _balanced(order, tie, items, holders, needers, kept,
                                                  by_kept, part, g, mesh.size, floor, budget,
                                                  helpers)
        if loads is not None and not plain:
            plain.append(loads)
        made = _messages(trees, part, recv, sent, budget)
        # a step's time is its busiest rank's larger of sent and received
        return (max(max(recv), max(sent)), max(recv), sum(recv)), trees, got, made, sent, recv

    best = drawn()
    if _helpers_may_help(best, floor, items, holders, needers, part, kept, mesh.size):
        # needer roots left the busiest rank well above the bound: twice more with helper
        # roots (`_Helpers`) where they lower it, and combiners sought more widely: helpers
        # weighed against the first draw's loads, then against its loads before combiners
        for helpers in (_Helpers(*best[4:]), plain[0]):
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
    """Whether a draw with helpers (`_Helpers`) may lower schedule `best`'s time by more
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


Messages = tuple[list[Row], int]     # the rows, the first delivery round
# a drawn schedule: (time, busiest receiver, all received), its trees, items, messages,
# and each rank's sent and received elements
Drawn = tuple[tuple[int, int, int], list["_Tree"], list[tuple[int, ...]], Messages, list[int],
              list[int]]


def _messages(trees: list[_Tree], part: list[int], recv: list[int], sent: list[int],
              budget: _Budget) -> Messages:
    """The rows of balanced trees: each tree laid out in rounds (`_tree`), then each finished
    value's deliveries (`_deliveries`), then sends balanced along chains (`_augment_sends`).
    Updates `recv` and `sent`."""
    rows: list[Row] = []
    owner: list[int] = []    # the tree of each row
    for k, tree in enumerate(trees):
        edges = _tree(tree.root, tree.degree, tree.elem)
        rows += [(t, a, b, tree.elem, tree.region(a), tree.region(b)) for t, a, b, _ in edges]
        owner += [k] * len(edges)
    merged = len(rows)
    first = 1 + max((m[0] for m in rows), default=-1)
    for k, tree in enumerate(trees):       # each finished value reaches its needers
        made = _deliveries(tree, first, sent)
        rows += made
        owner += [k] * len(made)
    _augment_sends(rows, owner, merged, trees, part, first, sent, recv, budget)
    return rows, first


def _balanced(order: list[int], tie: list[int], items: list[tuple[int, ...]],
              holders: list[list[int]], needers: list[list[int]], kept: list[int],
              by_kept: dict[int, list[int]], part: list[int], g: int, ranks: int, floor: int,
              budget: _Budget, helpers: _Helpers | None = None
              ) -> tuple[list[_Tree], list[tuple[int, ...]], list[int], list[int],
                         _Helpers | None]:
    """Trees for every item, drawn greedily in `order` (ties between ranks to the least
    `tie`) and balanced (`_augment`, `_rebalance`): the trees, the items (cut ones added),
    the elements each rank receives and sends, and (without `helpers`) each rank's load
    before combiners (`_Helpers.before_combiners`: what a draw with helpers starts from)."""
    items = list(items)
    recv = [0] * ranks       # elements received so far: every needer one per element
    sent = [0] * ranks
    for e, ns in enumerate(needers):
        for i in ns:
            recv[i] += len(items[e])
    trees: list[_Tree] = []
    for e in order:
        wanting: dict[int, list[int]] = defaultdict(list)
        for i in needers[e]:
            wanting[kept[i]].append(i)
        for k, want in wanting.items():
            held = [i for i in holders[e] if kept[i] == k]
            trees.append(_draw(e, len(items[e]), want, held, by_kept[k], part, g, recv,
                               sent, tie, helpers))
    rx = _Receivers(trees, items, recv, sent, part, budget, helpers is not None)
    _augment(rx, floor)
    plain = None if helpers is not None else _Helpers.before_combiners(trees, sent, recv)
    _rebalance(rx)
    _augment(rx, floor)
    return trees, items, recv, sent, plain


def _draw(e: int, w: int, want: list[int], held: list[int], members: list[int],
          part: list[int], g: int, recv: list[int], sent: list[int], tie: list[int],
          helpers: _Helpers | None) -> _Tree:
    """The tree of item `e` (`w` elements) among the ranks of one reduction (`members`): the
    root (`_root`), a holder of each partial, and the children of each node, dealt out one
    at a time to the least busy node (ties to the least `tie`). Updates `recv` and `sent`
    (in elements)."""
    holding = set(held)
    root = _root(w, want, holding, members, g, recv, sent, tie, helpers)
    holds, needs = root in holding, root in want
    nodes: dict[int, int] = {part[root]: root} if holds else {}
    for i in held:    # one holder of each partial: the least busy (received, then sent)
        j = nodes.get(part[i])
        if j is None or j != root and (max(sent[i], recv[i]), recv[i], sent[i], tie[i]) < (
                max(sent[j], recv[j]), recv[j], sent[j], tie[j]):
            nodes[part[i]] = i
    assert len(nodes) == g, f"element {e} has {len(nodes)} of {g} partials"
    peers: dict[int, list[int]] = defaultdict(list)
    for i in holding:
        peers[part[i]].append(i)
    tree = _Tree(root, e, w, [i for i in want if i != root], holds, needs,
                 dict.fromkeys(nodes.values(), 0), set(), members, holding, peers)
    # A root needing the item counts its first message as its delivery (already in `recv`);
    # one that does not receives one more value, or, holding no partial, combines two in
    # scratch like a combiner.
    tree.degree[root] = 1 if holds or needs else 2
    if not holds and not needs:
        tree.combiners.add(root)
    recv[root] += w * (tree.degree[root] - needs)
    heap = [(recv[i], tie[i], i) for i in tree.degree]
    heapq.heapify(heap)
    # a tree has one message per node but the root
    for _ in range(len(tree.degree) - 1 - tree.degree[root]):
        _, _, i = heapq.heappop(heap)
        tree.degree[i] += 1
        recv[i] += w
        heapq.heappush(heap, (recv[i], tie[i], i))
    for i in tree.degree:
        sent[i] += w * (i != root)
    if tree.want:     # the root sends the first delivery (`_deliveries` takes it from here)
        sent[root] += w
    return tree


class _Helpers:
    """Where a tree may be rooted at a rank not needing its item (a *helper*: a holder that
    does not need it, or a rank of the reduction holding and needing none of it), which
    then delivers the finished value to every rank needing it. A needer root sends its
    value on through the other needers, who forward it: where the needers hold partials
    they must send too, they are the busiest senders, and helpers sending the deliveries
    lower them at the cost of more messages. `sent` and `recv`: each rank's elements in a
    schedule drawn with needer roots only (with its combiners, or, `plain`, before them),
    updated as helpers take trees over."""

    __slots__ = ("sent", "recv", "plain")

    def __init__(self, sent: Sequence[float], recv: Sequence[float], plain: bool = False
                 ) -> None:
        self.sent = [float(n) for n in sent]
        self.recv = [float(n) for n in recv]
        self.plain = plain     # loads before combiners (`before_combiners`)

    @classmethod
    def before_combiners(cls, trees: list[_Tree], sent: list[int], recv: list[int]
                         ) -> _Helpers:
        """Each rank's load in needer-rooted `trees` without combiners, whose `recv` and
        `sent` count every message but the deliveries after each root's first: those are
        spread evenly over the ranks holding the finished value (the root and its needers).
        A combiner takes receives off a busy needer at a message more in all, while a
        helper root takes both sends and receives off it: weighed against the combiners'
        loads alone, helpers saw the needers' receives already low and stopped short,
        leaving them the busiest senders (issue 39's `sp=3 pp=2 ep=2 cp=2` case: 8,128 B
        sent, not 7,768 B)."""
        out = cls(sent, recv, plain=True)
        for tree in trees:
            if len(tree.want) > 1:
                each = tree.weight * (len(tree.want) - 1) / (len(tree.want) + 1)
                for i in (tree.root, *tree.want):
                    out.sent[i] += each
        return out

    def load(self, i: int) -> float:
        return max(self.sent[i], self.recv[i])


def _root(w: int, want: list[int], holding: set[int], members: list[int], g: int,
          recv: list[int], sent: list[int], tie: list[int], helpers: _Helpers | None) -> int:
    """The root of a tree: a rank needing the item (its first message replaces its
    delivery), one holding a partial if any. With `helpers`, a helper instead where the
    needers are among the busiest ranks of the schedule drawn without helpers and a helper
    lowers the busier of them and it (with `helpers.plain`, loads before combiners: the
    tree also takes the needers' merges off them, and the helper counts half what it
    adds)."""
    both = [i for i in want if i in holding]
    root = min(both or want, key=lambda i: (sent[i], recv[i], tie[i]))
    if helpers is None:
        return root
    k = len(want)
    before = max(helpers.load(i) for i in want)
    if before + w < max(helpers.sent + helpers.recv):
        return root          # the busiest rank does not need the item: no gain there
    # A needer root's tree has the needers send k - 1 deliveries, and its partial stays
    # (a helper's has every holder send its own): k - 2 fewer sends, spread over them.
    share = w * (k - 2 + (not both)) / k
    # and of its other g - 1 merges (the root's first is its delivery), those landing on
    # needers holding partials go (a helper's needers receive their delivery alone)
    both_held = sum(i in holding for i in want) if helpers.plain else 0
    taken = w * max(0, g - 2) * both_held / (len(holding) * k) if both_held else 0.0
    after = max(max(helpers.sent[i] - share, helpers.recv[i] - taken) for i in want)

    def cost(h: int) -> tuple[float, float]:      # a helper's sends and receives after
        return (helpers.sent[h] + k * w, helpers.recv[h] + w * (1 if h in holding else 2))

    wanted = set(want)
    helper = min((h for h in members if h not in wanted), key=lambda h: (max(cost(h)), tie[h]),
                 default=None)
    if helper is None:
        return root
    # Against loads before combiners, taken while the helper, halfway through what the
    # tree adds to it, stays below the needers before: later chains spread its load, and
    # a whole tree's margin (k deliveries on one rank) stopped the draw that far short of
    # where helpers and needers meet.
    sends, receives = cost(helper)
    if helpers.plain:
        mid = max((helpers.sent[helper] + sends) / 2, (helpers.recv[helper] + receives) / 2)
    else:
        mid = max(sends, receives)
    if max(after, mid) >= before:
        return root
    for i in want:
        helpers.sent[i] -= share
        helpers.recv[i] -= taken
    helpers.sent[helper], helpers.recv[helper] = sends, receives
    return helper


def _rebalance(rx: _Receivers) -> None:
    """Lower the busiest rank while it can be: move a child of it to the least busy node of
    the same tree, or, failing that, hand one of its children and one more (its own or
    another node's) to a combiner: a rank of the reduction holding no partial of the
    element, which combines the two and sends one value on (a message more in all, one
    fewer at the busiest rank). The greedy pass placed elements one at a time, before it
    knew the later ones. Edits the trees, `recv` and `sent` in place."""
    where: dict[int, list[int]] = {i: sorted(ts) for i, ts in rx.spare.items() if ts}
    recv = rx.recv
    while where:
        busiest = max(where, key=lambda i: (recv[i], i))
        # A tree that cannot relieve the busiest rank now will not later either (its other
        # nodes only get busier): it leaves the rank's list, so each tree is tried once.
        kept, relieved = [], False
        for t in where[busiest]:
            if relieved:
                kept.append(t)
            elif _relieve(rx, t, busiest, where):
                relieved = True
                if t in rx.spare[busiest]:
                    kept.append(t)
        if not relieved:
            return
        if kept:
            where[busiest] = kept
        else:
            del where[busiest]


def _relieve(rx: _Receivers, t: int, b: int, where: dict[int, list[int]]) -> bool:
    """One message fewer at node `b` of tree `t` where that lowers it (see `_rebalance`)."""
    tree, recv = rx.trees[t], rx.recv
    if t not in rx.spare[b]:
        return False
    w = tree.weight
    j = min(tree.degree, key=lambda i: (recv[i], i))
    if recv[j] + w < recv[b]:
        had = t in rx.spare[j]
        tree.degree[b] -= 1
        tree.degree[j] += 1
        recv[b] -= w
        recv[j] += w
        rx.update(t, b)
        rx.update(t, j)
        if not had and t in rx.spare[j]:
            where.setdefault(j, []).append(t)
        return True
    # a combiner c takes two children (two of b's, or one of b's and one of another node's)
    # and is a child itself: b has one child fewer, c two (`_tree` lays the tree out again
    # from the degrees). Where the least busy candidate is too busy, chains of moves may
    # first lower it far enough (`_Receivers.lower`, every other rank kept below b).
    # The least busy candidate; with `rx.wide`, the others after it, least busy first: one
    # that no chain frees may be followed by one a chain frees (its spare child moves on),
    # while failed chains are left.
    candidates = sorted((i for i in tree.members if i not in tree.taken and i not in tree.degree),
                        key=lambda i: (recv[i], i))
    for c in candidates if rx.wide else candidates[:1]:
        if recv[c] + 2 * w < recv[b]:
            break
        if recv[c] + 2 * w - recv[b] >= 2 * w or rx.freeing <= 0:
            return False      # too far to free (chains are dear; few succeed)
        while recv[c] + 2 * w >= recv[b] and rx.lower(c, recv[b], cut=False):
            pass
        if recv[c] + 2 * w < recv[b]:
            break
        rx.freeing -= 1
    else:
        return False
    if t not in rx.spare[b]:    # a chain (this candidate's or an earlier one's) passed
        return False            # through b's place in this tree
    tree.degree[b] -= 1
    tree.degree[c] = 2
    tree.combiners.add(c)
    recv[b] -= w
    recv[c] += 2 * w
    rx.sent[c] += w
    rx.update(t, b)
    return True


class _Receivers:
    """The receive side of the trees while they are balanced: which trees each rank has a
    spare child in (one it may hand on: `spare`), and chains of such moves that lower a
    rank (`lower`). A move hands a child on to another node of the same tree; a node with
    one child may also hand its place in the tree to another rank holding the same
    partial (`part`), which takes the child and sends in its stead. Where no chain of
    whole items lowers a rank, an item may be cut in two (`cut`: a new tree with the same
    nodes takes part of its elements), so that a chain of lighter units can; `items`
    grows with the cuts, at most as many as there were trees."""

    def __init__(self, trees: list[_Tree], items: list[tuple[int, ...]], recv: list[int],
                 sent: list[int], part: list[int], budget: _Budget, wide: bool) -> None:
        self.trees, self.items, self.recv, self.sent, self.part = trees, items, recv, sent, part
        self.budget = budget
        self.spare: dict[int, set[int]] = defaultdict(set)
        for t, tree in enumerate(trees):
            for i in tree.degree:
                self.update(t, i)
        self.cuts = len(trees)      # items it may still cut in two
        self.freeing = FREEING      # failed chains left to make room for a combiner
        self.wide = wide            # whether a combiner is sought beyond the least busy

    def update(self, t: int, i: int) -> None:
        """Whether rank i has a spare child in tree t, after its degree changed."""
        tree = self.trees[t]
        if tree.degree.get(i, 0) > tree.floor(i):
            self.spare[i].add(t)
        else:
            self.spare[i].discard(t)

    def takers(self, t: int, i: int) -> Ranks:
        """The ranks that may take rank i's spare child in tree t: the tree's other nodes;
        where i has one child, the ranks holding i's partial that are no node of the tree
        too (they take i's place)."""
        tree = self.trees[t]
        out = list(tree.degree)
        if tree.degree[i] == 1 and i != tree.root and i not in tree.combiners:
            out += [c for c in tree.peers.get(self.part[i], ())
                    if c not in tree.degree and c not in tree.combiners]
        return _ranks(out)

    def moves(self, i: int, w: int, heavier: bool = False) -> Iterable[tuple[int, Takers]]:
        """Rank i's units of weight w (and, with `heavier`, of more: `move` cuts them)."""
        return ((t, functools.partial(self.takers, t, i)) for t in self.spare[i]
                if self.trees[t].weight == w or heavier and self.trees[t].weight > w)

    def weights(self, b: int) -> set[int]:
        return {self.trees[t].weight for t in self.spare[b]}

    def move(self, path: list[tuple[int, int, int]], w: int) -> None:
        for i, j, t in path:
            if self.trees[t].weight > w:
                t = self.cut(t, w)
            tree = self.trees[t]
            if j in tree.degree:
                tree.degree[i] -= 1
                tree.degree[j] += 1
            else:            # j holds i's partial too and takes i's place (and child)
                del tree.degree[i]
                tree.degree[j] = 1
                self.sent[i] -= w
                self.sent[j] += w
            self.update(t, i)
            self.update(t, j)

    def cut(self, t: int, w: int) -> int:
        """A new tree, with tree t's nodes and degrees, for `w` of its item's elements (a
        new item); tree t keeps the others (another new item: the old one may be shared
        with trees of other reductions). Returns the new tree's index."""
        tree = self.trees[t]
        elems = self.items[tree.elem]
        self.items += [elems[:w], elems[w:]]
        piece = _Tree(tree.root, len(self.items) - 2, w, list(tree.want), tree.root_holds,
                      tree.root_needs, dict(tree.degree), set(tree.combiners), tree.members,
                      tree.taken, tree.peers)
        tree.elem, tree.weight = len(self.items) - 1, tree.weight - w
        self.trees.append(piece)
        for i in piece.degree:
            self.update(len(self.trees) - 1, i)
        self.cuts -= 1
        return len(self.trees) - 1

    def lower(self, b: int, top: int, cut: bool = True) -> bool:
        """Lower rank `b` by one unit along a chain ending at a rank that stays below `top`
        (`_search`): whole items first, the heaviest first; then, while cuts are left,
        pieces of half b's heaviest item, a quarter, ... down to one element."""
        if _step(b, top, self.recv, self.weights, self.moves, self.move, self.budget):
            return True
        if not cut:
            return False
        pieces = functools.partial(self.moves, heavier=True)
        w = max(self.weights(b), default=0) // 2
        while w >= 1 and self.cuts > 0:
            if _step(b, top, self.recv, lambda _: {w}, pieces, self.move, self.budget):
                return True
            w //= 2
        return False


def _augment(rx: _Receivers, floor: int) -> None:
    """Lower the busiest rank along chains of moves (`_Receivers.lower`): a message moves
    off it to another node of one of its trees, which hands one of its own messages (in
    another tree of the same weight) on, and so on, until a rank that stays below the
    busiest takes one. Each rank on the chain but its ends keeps its load. This finds what
    one move (`_relieve`) cannot: with the trees' nodes fixed and items of one size, the
    loads it stops at have the least possible maximum (an augmenting path argument, as in
    a max-flow); cutting items lowers it below what whole items allow. It stops at
    `floor`, a lower bound. Edits the trees, `recv` and `sent` in place."""
    _lower(rx.recv, floor, rx.lower)


def _lower(load: list[int], floor: int, step: Callable[[int, int], bool]) -> None:
    """While the busiest rank's `load` is above `floor`, lower it by one chain (`step(b,
    top)`, which updates `load`). Stops where the busiest rank cannot be lowered (nor can
    the maximum)."""
    while max(load) > floor:
        top = max(load)
        if not step(load.index(top), top):
            return


Ranks = tuple[int, list[int]]    # ranks as a bit mask (bit j: rank j), and in order
Takers = Ranks | Callable[[], Ranks]   # the ranks that may take a unit (or what lists them)
Units = Callable[[int, int], Iterable[tuple[int, Takers]]]


def _ranks(order: list[int]) -> Ranks:
    mask = 0
    for j in order:
        mask |= 1 << j
    return mask, order


class _Budget:
    """Units a schedule's chain searches may still look at (`SEARCH_UNITS` at first): once
    it is spent, no chain is searched and the balancing stops where it is (every schedule
    stays exact; only its busiest rank may stay above what more searching would reach)."""

    __slots__ = ("left",)

    def __init__(self, units: int) -> None:
        self.left = units

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _step(b: int, top: int, load: list[int], weights: Callable[[int], set[int]],
          moves: Units, move: Callable[[list[tuple[int, int, int]], int], None],
          budget: _Budget) -> bool:
    """Lower rank `b` along a shortest chain (`_search`) of units of one weight
    (`weights(b)`, the heaviest tried first; `moves(i, w)`: rank i's units of weight w and
    who may take each) ending below `top`; `move` applies the chain. False where none."""
    for w in sorted(weights(b), reverse=True):
        path = _search(b, top, load, w, moves, budget)
        if path:
            move(path, w)
            load[b] -= w
            load[path[-1][1]] += w
            return True
    return False


def _search(b: int, top: int, load: list[int], w: int, moves: Units, budget: _Budget
            ) -> list[tuple[int, int, int]] | None:
    """A shortest chain from rank `b` (at load `top`): `moves(i, w)` gives, for each unit
    of weight `w` that rank i may hand on, the unit and the ranks that may take it (`Ranks`,
    or what makes them: called once a unit). The chain ends at a rank whose load stays
    below `top` once it takes w more. As (giver, taker, unit), from b; None if none (at once
    where no rank could end it), or once `budget` is spent. The masks keep a unit whose
    takers were all reached already (most, once the loads are level) to one integer
    operation; new takers are taken in the unit's order."""
    if all(n + w >= top for j, n in enumerate(load) if j != b):
        return None
    came: dict[int, tuple[int, int]] = {}
    reached = 1 << b
    seen: set[int] = set()
    frontier = [b]
    while frontier:
        nxt = []
        for i in frontier:
            for unit, takers in moves(i, w):
                if unit in seen:     # its takers do not depend on its giver: once is enough
                    continue
                if not budget.take():
                    return None
                seen.add(unit)
                mask, order = takers if isinstance(takers, tuple) else takers()
                new = mask & ~reached
                if not new:
                    continue
                reached |= new
                for j in order:
                    if not new >> j & 1:
                        continue
                    new ^= 1 << j
                    came[j] = (i, unit)
                    if load[j] + w < top:
                        out = []
                        while j != b:
                            i, unit = came[j]
                            out.append((i, j, unit))
                            j = i
                        return out[::-1]
                    nxt.append(j)
        frontier = nxt
    return None


def _augment_sends(rows: list[Row], owner: list[int], merged: int, trees: list[_Tree],
                   part: list[int], first: int, sent: list[int], recv: list[int],
                   budget: _Budget) -> None:
    """Lower the busiest sender along chains of moves, as `_augment` does for receivers,
    with what can change sender without raising the busiest receiver: a delivery may come
    from any rank holding the finished value before its round (the root from round
    `first`, a needer once it received it), and a holder's place in a tree (rows before
    `merged`: it receives its children's values, adds its partial and sends on) may go to
    another rank holding the same partial (`part`) that is no node of the tree, where its
    children's values keep that rank at or below the busiest receiver. It stops once no
    rank sends more than the busiest receiver receives (a step's time is its busiest
    rank's larger of the two), or once `budget` is spent. Edits `rows`, `sent` and `recv`
    in place.

    Who else may send a delivery never changes (no move changes a delivery's round or
    receiver, nor who has the value when), so it is listed once a delivery, when first
    asked; who may take a holder's place changes with the chains, so that is worked out
    each time it is asked."""
    floor = max(recv, default=0)
    if max(sent, default=0) <= floor:
        return       # no rank sends more than the busiest receiver receives
    ready: list[dict[int, int]] = [{tree.root: first} for tree in trees]
    nodes: list[set[int]] = [set(tree.degree) | tree.combiners for tree in trees]
    into: list[dict[int, list[int]]] = [defaultdict(list) for _ in trees]   # merge rows
    for k, (t, _src, dst, *_rest) in enumerate(rows):
        if k < merged:
            into[owner[k]][dst].append(k)
        else:
            ready[owner[k]][dst] = t + 1
    # A root holding no partial with one child only receives the finished value: that
    # child has it too (from its last merge round on) and may deliver it as well.
    relay = [ks[0] if not tree.root_holds and len(ks := into[o].get(tree.root, [])) == 1
             else -1 for o, tree in enumerate(trees)]
    by_sender: dict[int, set[int]] = defaultdict(set)
    for k, row in enumerate(rows):
        if k >= merged or row[1] not in trees[owner[k]].combiners:
            by_sender[row[1]].add(k)
    delivers: dict[int, Ranks] = {}    # who else may send each delivery, once asked

    def deliverers(k: int) -> Ranks:
        """Who else may send delivery row k (its round and receiver never change, nor does
        the relay's sender: it keeps its place)."""
        if k not in delivers:
            t, _, dst = rows[k][:3]
            o = owner[k]
            out = [c for c, at in ready[o].items() if at <= t and c != dst]
            if relay[o] >= 0 and rows[relay[o]][1] != dst:
                out.append(rows[relay[o]][1])
            delivers[k] = _ranks(out)
        return delivers[k]

    def place(k: int) -> Ranks:
        """Who may take the place in its tree of the holder sending merge row k."""
        o = owner[k]
        if k == relay[o]:
            return 0, []  # it may deliver the finished value (now, or earlier on the
                          # same chain): its place stays
        src = rows[k][1]
        tree = trees[o]
        take = len(into[o].get(src, ())) * tree.weight
        return _ranks([c for c in tree.peers.get(part[src], ()) if c not in nodes[o]
                       and recv[c] + take <= floor])

    def moves(i: int, w: int) -> Iterable[tuple[int, Takers]]:
        for k in by_sender[i]:
            if trees[owner[k]].weight == w:
                yield k, functools.partial(deliverers if k >= merged else place, k)

    def move(path: list[tuple[int, int, int]], w: int) -> None:
        for a, c, k in path:
            t, _, dst, e, region, dst_region = rows[k]
            o = owner[k]
            tree = trees[o]
            if k < merged:     # another holder of the same partial takes a's place
                nodes[o].discard(a)
                nodes[o].add(c)
                kids = into[o].pop(a, [])
                into[o][c] = kids
                for q in kids:
                    rows[q] = rows[q][:2] + (c,) + rows[q][3:]
                recv[a] -= len(kids) * w
                recv[c] += len(kids) * w
            elif c == tree.root or relay[o] >= 0 and c == rows[relay[o]][1]:
                # the root, or its one child, sends from where it merged (the child also
                # where it needs the value: its output may only get it in a later round)
                region = tree.region(c)
            else:
                region = OUTPUT
            rows[k] = (t, c, dst, e, region, dst_region)
            by_sender[a].discard(k)
            by_sender[c].add(k)

    def weights(b: int) -> set[int]:
        return {trees[owner[k]].weight for k in by_sender[b]}

    _lower(sent, floor, lambda b, top: _step(b, top, sent, weights, moves, move, budget))


def _deliveries(tree: _Tree, first: int, sent: list[int]) -> list[Row]:
    """The deliveries of `tree`'s finished value (ready at its root in round `first`) to
    the ranks in `tree.want`: each from the least busy sender among those holding the value
    already (a rank forwards what it received, from its output, in a later round). The
    least busy needers are served first, so that they forward."""
    root, w, region = tree.root, tree.weight, tree.region(tree.root)
    # senders: (sent so far, ready in round, rank); the root's first send was counted when
    # its tree was drawn (`_draw`)
    heap = [(sent[root] - w * bool(tree.want), first, root)]
    out = []
    for i in sorted(tree.want, key=lambda i: (sent[i], i)):
        n, t, src = heapq.heappop(heap)
        sent[src] = n + w
        out.append((t, src, i, tree.elem, region if src == root else OUTPUT, OUTPUT))
        heapq.heappush(heap, (n + w, t, src))
        heapq.heappush(heap, (sent[i], t + 1, i))
    return out


def _tree(root: int, degree: dict[int, int], e: int) -> list[tuple[int, int, int, int]]:
    """The messages of one element's tree with these in-degrees (summing to the node count
    less one), as (round, child, parent, element): parents are filled breadth first, nodes
    with more children nearer the root; a node receives one child per round and sends once
    it has all of them."""
    order = [root] + sorted((i for i in degree if i != root), key=lambda i: (-degree[i], i))
    children: dict[int, list[int]] = {i: [] for i in order}
    open_ = [root]
    at = 0
    for child in order[1:]:
        while len(children[open_[at]]) == degree[open_[at]]:
            at += 1
        children[open_[at]].append(child)
        if degree[child]:
            open_.append(child)
    ready: dict[int, int] = {}
    out = []
    for node in reversed(order):
        t = -1
        for c in sorted(children[node], key=lambda c: (ready[c], c)):
            t = max(ready[c], t + 1)
            out.append((t, c, node, e))
        ready[node] = t + 1
    return out


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
