"""Whether ranks can make every class's unions at once: the max-flow test of the counting
bound (`meshcomm.planner.bounds`, `unions_fit`).

This module never communicates. Its answer is a search's over cases of a max-flow, and
the search's flows are Dinic's on one network, edge by edge (`_UnionGraph`): which ranks a
flow goes through picks the next case, so a bound depends on them. Most of the work goes
to a second network with the same flow values (`_Network`): smaller, and kept from one
flow to the next. It answers what does not depend on which flow is found: a flow's value,
and whether some plan fits (a flow whose ranks have room for its copies), after which the
search answers fits whatever it draws. Dinic's flow on the first network is run only for
a case whose flow reaches the demand and is no plan's.
"""

from __future__ import annotations

FlowClass = tuple[int, int, list[list[int]], list[int], list[int]]
Cases = list[tuple[list[int], list[int]]]   # per case: copies and caps on others' unions
REPAIRS = 8    # flows `_some_plan_fits` may run after the first case's


def unions_fit(classes: list[FlowClass], extra: list[int], tries: int) -> bool:
    """Whether ranks with `extra` messages each beyond their needs can make every class's
    unions at once (`Unions.fit`, for one `extra`)."""
    return Unions(classes, len(extra)).fit(extra, tries)


class Unions:
    """The classes of a reduction's items, for `fit` to test against what ranks have to
    spare, at one load after another (the bound's search over loads, `bounds.busiest_share`):
    the network is built once."""

    def __init__(self, classes: list[FlowClass], ranks: int) -> None:
        self.classes = classes
        self.demand = sum(count * free for count, free, *_ in classes)
        self.f = max((free for _, free, *_ in classes), default=0)
        self.net = _Network(classes, ranks)

    def fit(self, extra: list[int], tries: int) -> bool:
        """Whether ranks with `extra` messages each beyond their needs can make every
        class's unions at once: per class (items, unions an item, the ranks holding each
        partial value, ranks that take unions without a copy as roots, ranks that copy
        first). Each item has one node per partial value, which makes at most `free` of the
        item's unions, and no more than its rank's extra: a partial's holders make at most
        items x min(free, the most extra one of them has). A rank takes at most its extra
        in all, less the copies it makes: u unions of classes it holds no partial of take
        at least ceil(u / f) copies (one an item it combines, f the most unions an item).

        A max-flow (Dinic) over classes, their partials and ranks, first with no copies
        counted (a rank's unions for others capped at e - ceil(e / (f + 1))). Where a
        rank's flow for others needs more copies than counted, two cases are tried apart:
        it makes at most f x its counted copies of them, or it makes one copy more (its
        capacity one less). Every plan fits one of them, so the answer stays a lower
        bound's condition; after `tries` flows the weaker answer (fits) stands (`_search`).

        Where some plan fits, that search answers fits however it goes: the case that plan
        fits in never fails, and a case that does not fail is split in two, one of which
        the plan fits in again, so cases never run out. So a flow whose ranks each have
        room for its copies (ceil(u / f)), found any way, answers fits at once
        (`_some_plan_fits`)."""
        demand, f, net = self.demand, self.f, self.net
        if demand == 0:
            return True
        net.load(extra)
        zeros = [0] * len(extra)
        # Without copies (holders and copy-free roots alone) the flow makes `alone` unions;
        # the rest each cost a copy per at most min(f, e - 1) unions at a rank with extra e.
        alone = net.flow(zeros, zeros, demand)
        if alone >= demand:
            return True
        most = max((min(f, extra[r] - 1) for r in net.others if extra[r] > 1), default=0)
        if most <= 0 or sum(extra) - -(-(demand - alone) // most) < demand:
            return False
        first = (zeros, [e - -(-e // (f + 1)) for e in extra])
        if _some_plan_fits(net, first, f, demand):
            return True
        return _search(self.classes, extra, f, demand, tries, net, first)


def _search(classes: list[FlowClass], extra: list[int], f: int, demand: int, tries: int,
            net: _Network, first: tuple[list[int], list[int]]) -> bool:
    """The search over cases of `Unions.fit`, at most `tries` flows. A case whose flow is
    Dinic's on `_UnionGraph` and fails some rank's copies is split at the first such rank:
    it makes at most f x its counted copies of others' unions, or one copy more. Once more
    cases wait than tries are left, some stay untried: fits. A case `net` finds failing
    (the value is any max-flow's) or a plan's flow in (fits) needs no flow of its own."""
    graph: _UnionGraph | None = None
    pending: Cases = [first]
    for left in range(tries, 0, -1):
        if not pending:
            return False
        if len(pending) > left:   # a try takes one case at most: some stay untried
            return True
        copies, other = pending.pop()
        if net.flow(copies, other, demand) < demand:
            continue
        if not net.short(f):
            return True      # a plan fits: the search would answer fits (`Unions.fit`)
        graph = graph or _UnionGraph(classes, extra)
        made, got, taken = graph.flow(copies, other, demand)
        assert made >= demand, f"flow values differ: {made} < {demand} (case {copies}, {other})"
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


def _some_plan_fits(net: _Network, case: tuple[list[int], list[int]], f: int,
                    demand: int) -> bool:
    """Whether a flow whose ranks each have room for its copies turns up within `REPAIRS`
    flows from `case`: each rank short of room is given the copies its flow for others
    needs (ceil(u / f)), and at most f x as many unions for others, and the flow is found
    again from the last one. False says nothing."""
    copies, other = list(case[0]), list(case[1])
    for _ in range(REPAIRS + 1):
        if net.flow(copies, other, demand) < demand:
            return False
        short = net.short(f)
        if not short:
            return True
        for r in short:
            copies[r] = -(-net.got(r) // f)
            other[r] = f * copies[r]
    return False


class _Residual:
    """A residual graph in adjacency lists: `out[v]` the edges leaving node v, an edge e
    from a to `to[e]` with residual capacity `cap[e]`, numbered in pairs (an edge, then its
    reverse, `e ^ 1`)."""

    out: list[list[int]]
    to: list[int]
    cap: list[int]

    def _edge(self, a: int, b: int, cap: int) -> int:
        e = len(self.to)
        self.out[a].append(e)
        self.out[b].append(e + 1)
        self.to += [b, a]
        self.cap += [cap, 0]
        return e


class _Network(_Residual):
    """`Unions.fit`'s network with the same max-flow values, smaller and kept between flows.
    A class's edges to the ranks it may combine for (others) go through one node per such
    set of ranks (their caps never bind: a class sends no more than it gets), and the flow
    found last stays: new caps (`load`, `flow`) push back what no longer fits and the rest
    is augmented (Dinic). Any flow does here: only values and whether a flow is a plan's
    are read (`Unions.fit`)."""

    def __init__(self, classes: list[FlowClass], ranks: int) -> None:
        self.out: list[list[int]] = [[], []]       # node 0 the source, node 1 the sink
        self.to: list[int] = []
        self.cap: list[int] = []                   # residual capacities
        self.extra = [0] * ranks
        rank_node = [self._node() for _ in range(ranks)]
        other_node = [self._node() for _ in range(ranks)]
        # edges whose caps follow the ranks' extra: (edge, items, unions an item, ranks)
        self.partial_edges: list[tuple[int, int, int, list[int]]] = []
        self.holder_edges: list[tuple[int, int, int, int]] = []
        self.set_edges: list[tuple[int, int]] = []     # (edge, rank)
        sets: dict[tuple[int, ...], int] = {}
        for count, free, partials, roots, others in classes:
            node = self._node()
            self._edge(0, node, count * free)
            for holders in partials:
                p = self._node()
                self.partial_edges.append((self._edge(node, p, 0), count, free, holders))
                for r in holders:
                    self.holder_edges.append((self._edge(p, rank_node[r], 0), count, free, r))
            for r in roots:
                self._edge(node, rank_node[r], count * free)
            key = tuple(others)
            if key:
                if key not in sets:
                    sets[key] = self._node()
                    self.set_edges += [(self._edge(sets[key], other_node[r], 0), r)
                                       for r in key]
                self._edge(node, sets[key], count * free)
        self.others = sorted({r for _, r in self.set_edges})
        self.most = sum(count * free for count, free, *_ in classes)   # caps that never bind
        self.sink_edge = [self._edge(rank_node[r], 1, 0) for r in range(ranks)]
        self.other_edge = [self._edge(other_node[r], rank_node[r], 0) for r in range(ranks)]
        self.made = 0

    def _node(self) -> int:
        self.out.append([])
        return len(self.out) - 1

    def load(self, extra: list[int]) -> None:
        """The caps that follow the ranks' `extra`: a partial's holders make at most items x
        min(free, the most extra one of them has), a holder at most items x min(free, its
        extra), and a rank with extra 1 or less combines for no other (a copy and a union
        need 2)."""
        self.extra = extra
        for e, count, free, holders in self.partial_edges:
            self._set(e, count * min(free, max(extra[r] for r in holders)))
        for e, count, free, r in self.holder_edges:
            self._set(e, count * min(free, extra[r]))
        for e, r in self.set_edges:
            self._set(e, self.most if extra[r] > 1 else 0)

    def flow(self, copies: list[int], other: list[int], demand: int) -> int:
        """A max-flow up to `demand` (its value), rank r taking at most extra[r] -
        copies[r] unions in all and other[r] of classes it holds no partial of."""
        for r, e in enumerate(self.extra):
            room = e - copies[r]
            self._set(self.other_edge[r], max(0, min(other[r], room)))
            self._set(self.sink_edge[r], max(0, room))
        while self.made < demand:
            level = _levels(self.out, self.to, self.cap, len(self.out), 1)
            if level is None:
                break
            self.made += _blocking_flow(self.out, self.to, self.cap, level, 1,
                                        demand - self.made)
        return self.made

    def _set(self, e: int, new: int) -> None:
        """Edge e's capacity becomes `new`; the flow beyond it is taken off the paths it was
        on, back to the source and on to the sink."""
        cap, to = self.cap, self.to
        carried = cap[e ^ 1]
        if carried > new:
            cut = carried - new
            cap[e ^ 1] = new
            if to[e ^ 1] != 0:
                self._drain(to[e ^ 1], cut, 1)
            if to[e] != 1:
                self._drain(to[e], cut, 0)
            self.made -= cut
            carried = new
        cap[e] = new - carried

    def _drain(self, v: int, amount: int, back: int) -> None:
        """Take `amount` of the flow through node v off the edges that carry it into v
        (`back` 1, and on to the source) or out of it (`back` 0, on to the sink). A flow
        here runs in no cycle: the network has none."""
        cap, to = self.cap, self.to
        end = 1 - back        # the source (node 0) going back, the sink (node 1) ahead
        for q in self.out[v]:
            if q & 1 != back:
                continue
            e = q ^ back       # the edge as built (even); its reverse holds its flow
            carried = cap[e ^ 1]
            if carried > 0:
                d = min(amount, carried)
                cap[e ^ 1] -= d
                cap[e] += d
                if to[q] != end:
                    self._drain(to[q], d, back)
                amount -= d
                if amount == 0:
                    return
        assert amount == 0, f"no flow left to take off at node {v}: {amount}"

    def got(self, r: int) -> int:
        """What rank r takes for classes it holds no partial of, in the last flow."""
        return self.cap[self.other_edge[r] ^ 1]

    def short(self, f: int) -> list[int]:
        """The ranks without room for the copies the last flow needs of them."""
        cap = self.cap
        return [r for r, e in enumerate(self.extra)
                if cap[self.sink_edge[r] ^ 1] + -(-cap[self.other_edge[r] ^ 1] // f) > e]


class _UnionGraph(_Residual):
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
        """An edge where it has capacity (or `keep`: its capacity is set later), else -1."""
        return super()._edge(a, b, cap) if cap > 0 or keep else -1

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
