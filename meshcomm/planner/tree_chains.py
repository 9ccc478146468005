"""Chains of moves that balance drawn reduction trees (`trees`): the trees as they are
drawn (`Tree`), and the searches that lower the busiest receiver (`augment`, `rebalance`)
and the busiest sender (`augment_sends`) of a schedule.

This module never communicates. A chain hands a unit (a child in a tree, a delivery, a
holder's place) from the busiest rank to another that may take it, which hands one of its
own on, and so on, until a rank that stays below the busiest takes one (`_search`: a
shortest such chain, within a `Budget` of units looked at).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

FREEING = 16          # chains that may fail making room for combiners, a schedule

# where a value lives on a rank (`trees.Schedule`): its input, its output, its scratch
INPUT, OUTPUT, SCRATCH = 0, 1, 2
REGIONS = ("input", "output", "scratch")
Row = tuple[int, int, int, int, int, int]   # round, src, dst, element, src/dst region


@dataclass(slots=True)
class Tree:
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


def rebalance(rx: Receivers) -> None:
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


def _relieve(rx: Receivers, t: int, b: int, where: dict[int, list[int]]) -> bool:
    """One message fewer at node `b` of tree `t` where that lowers it (see `rebalance`)."""
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
    # first lower it far enough (`Receivers.lower`, every other rank kept below b).
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


class Receivers:
    """The receive side of the trees while they are balanced: which trees each rank has a
    spare child in (one it may hand on: `spare`), and chains of such moves that lower a
    rank (`lower`). A move hands a child on to another node of the same tree; a node with
    one child may also hand its place in the tree to another rank holding the same
    partial (`part`), which takes the child and sends in its stead. Where no chain of
    whole items lowers a rank, an item may be cut in two (`cut`: a new tree with the same
    nodes takes part of its elements), so that a chain of lighter units can; `items`
    grows with the cuts, at most as many as there were trees."""

    def __init__(self, trees: list[Tree], items: list[tuple[int, ...]], recv: list[int],
                 sent: list[int], part: list[int], budget: Budget, wide: bool) -> None:
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
        piece = Tree(tree.root, len(self.items) - 2, w, list(tree.want), tree.root_holds,
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


def augment(rx: Receivers, floor: int) -> None:
    """Lower the busiest rank along chains of moves (`Receivers.lower`): a message moves
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


class Budget:
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
          budget: Budget) -> bool:
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


def _search(b: int, top: int, load: list[int], w: int, moves: Units, budget: Budget
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


def augment_sends(rows: list[Row], owner: list[int], merged: int, trees: list[Tree],
                   part: list[int], first: int, sent: list[int], recv: list[int],
                   budget: Budget) -> None:
    """Lower the busiest sender along chains of moves, as `augment` does for receivers,
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
