"""Reduction trees: a pending reduction resolved by point-to-point messages in rounds.

This module never communicates. Where the layout steps cannot reach the counting bound
(`bounds._reduction`), one element at a time can: each element's g partial values combine
along a tree of ranks, one holder of each partial, rooted at a rank that needs the element
(one holding a partial where there is one: its delivery is then its own combine). The
trees are drawn greedily, element by element, so that the rank receiving the least so far
takes the next message; a second pass moves messages off the busiest rank, to the least
busy node of the same tree or to a *combiner* (a rank holding no partial of the element,
which combines two values in scratch and sends one), while that lowers it.

A tree step runs as rounds of one all_to_all each: in a round every rank receives at most
one value per element it combines, and adds it to the value it has, so the result does not
depend on the order messages arrive in; a rank sends a value once it has all its
children's. Then rounds deliver each finished value from its root to the other ranks that
need it (a rank forwards what it received).

Schedules are per element, so they apply to small tensors only (`TREE_LIMIT`); on larger
ones the layout steps plan alone. Cost: the busiest rank's received elements over all
rounds (the rounds of a tree pipeline), plus one latency per round in a CostModel with
latency.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..core.mesh import AxisName, Mesh
from ..core.positions import block_flat
from .blocks import coords_table, flat_index, in_mesh_order, own_and_need
from .bounds import state_bound
from .moves import Move, block_indices
from .states import State
from .transfers import resolved_axes
from .values import Transfer

TREE_LIMIT = 1 << 16   # elements x ranks above which no tree is drawn (planning time)
TREE_RANKS = 256       # meshes above which no tree is drawn: each round is an all_to_all
                       # over the step's group, whose host cost grows with its size


@dataclass(frozen=True, slots=True)
class Schedule:
    """Every message of a tree step: row i sends element `elem[i]` (global flat index) from
    mesh position `src[i]` to `dst[i]` in round `round[i]`. Rounds before `merges` combine
    partials; the others deliver finished values. A value lives in a rank's input (a
    holder's partial), its output (a root that holds no partial combines there; delivered
    values land there) or its scratch (a combiner: a rank holding no partial of the
    element that combines two or more values for others), as `REGIONS`
    number them. A root needing its element that holds a partial of it copies the value
    from its input into its output."""

    rounds: int
    merges: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    elem: tuple[int, ...]
    round: tuple[int, ...]
    src_region: tuple[int, ...]    # where the sender reads the value
    dst_region: tuple[int, ...]    # where the receiver combines (merge) or writes (delivery)
    roots: tuple[tuple[int, int, bool], ...]   # (position, element, holds a partial of it)
    scratch: tuple[tuple[int, ...], ...]       # per position: the elements it combines for


INPUT, OUTPUT, SCRATCH = 0, 1, 2
REGIONS = ("input", "output", "scratch")
Row = tuple[int, int, int, int, int, int]   # round, src, dst, element, src/dst region


@dataclass(slots=True)
class _Tree:
    """One element's tree while it is drawn: its nodes' numbers of children."""

    root: int
    elem: int
    want: list[int]          # ranks needing the element, the root aside
    root_holds: bool         # the root holds a partial (else it combines in its output)
    degree: dict[int, int]
    combiners: set[int]      # ranks holding no partial that combine others' (in scratch)
    members: list[int]       # the ranks of its reduction (same coordinate on kept axes)
    taken: set[int]          # ranks holding a partial of the element (never combiners)

    def floor(self, i: int) -> int:
        """The fewest children node i may have: 2 for a combiner, 1 for the root."""
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
    if not resolve or math.prod(mesh.axis_size(a) for a in resolve) == 1:
        return False
    if mesh.size > TREE_RANKS:
        return False
    numel = math.prod(d.size for d in state.dims)
    return 0 < numel and numel * mesh.size <= TREE_LIMIT


def tree_estimate(state: State, goal: State, mesh: Mesh) -> Move | None:
    """The tree step from `state` to `goal` priced at the lower bound (`Move.estimate`): the
    search draws its schedule (`tree_move`) only when the step may be on the best path."""
    if not applies(state, goal, mesh):
        return None
    # every rank receives at least one message per element it needs (a delivery, or as
    # a root its last combine), and the busiest at least the bound: a lower bound of the
    # step's time, received bytes and every rank's peak
    _, need = own_and_need(state, goal, mesh)
    return Move("send_recv", tree_axes(state, goal, mesh), goal, action="tree", op=state.op,
                indexed=True, estimate=True, send=state_bound(state, goal, mesh),
                recv=tuple(need.tolist()))


@functools.lru_cache(maxsize=256)
def tree_move(state: State, goal: State, mesh: Mesh) -> Move | None:
    """The tree step from `state` to `goal` (see the module doc), or None where none applies."""
    if not applies(state, goal, mesh):
        return None
    s = schedule(state, goal, mesh)
    send, recv = [0] * mesh.size, [0] * mesh.size
    for a, b in zip(s.src, s.dst):
        send[a] += 1
        recv[b] += 1
    return Move("send_recv", tree_axes(state, goal, mesh), goal, action="tree", op=state.op,
                indexed=True, send=tuple(send), recv=tuple(recv), rounds=s.rounds,
                merge_rounds=s.merges)


def _members(state: State, mesh: Mesh) -> list[list[int]]:
    """Per element (global flat), the mesh positions holding it in `state`, ascending. Ranks
    that agree on the axes sharding `state` hold the same block: each block is listed once."""
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
    cols = mask.nonzero()[:, 1].tolist()
    out, at = [], 0
    for n in mask.sum(1).tolist():
        out.append(cols[at:at + n])
        at += n
    return out


@functools.lru_cache(maxsize=64)
def schedule(state: State, goal: State, mesh: Mesh) -> Schedule:
    """The messages of the tree step from `state` to `goal` (`applies` must hold)."""
    resolve = list(resolved_axes(state, goal) or ())
    g = math.prod(mesh.axis_size(a) for a in resolve)
    coords = coords_table(mesh)
    part = flat_index(coords, mesh, tuple(resolve)).tolist()   # which partial a rank holds
    kept = flat_index(coords, mesh, goal.partial).tolist()     # which reduction it is in
    by_kept: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(kept):
        by_kept[k].append(i)
    holders, needers = _members(state, mesh), _members(goal, mesh)
    recv = [0] * mesh.size       # elements received so far: every needer one per element
    sent = [0] * mesh.size
    for ns in needers:
        for i in ns:
            recv[i] += 1
    trees: list[_Tree] = []
    for e, ns in enumerate(needers):
        wanting: dict[int, list[int]] = defaultdict(list)
        for i in ns:
            wanting[kept[i]].append(i)
        for k, want in wanting.items():
            held = [i for i in holders[e] if kept[i] == k]
            trees.append(_draw(e, want, held, by_kept[k], part, g, recv, sent))
    _augment(trees, recv)
    _rebalance(trees, recv, sent)
    _augment(trees, recv)
    rows: list[Row] = []
    owner: list[int] = []    # the tree of each row
    for k, tree in enumerate(trees):
        edges = _tree(tree.root, tree.degree, tree.elem)
        rows += [(t, a, b, tree.elem, tree.region(a), tree.region(b)) for t, a, b, _ in edges]
        owner += [k] * len(edges)
    merged = len(rows)
    first = 1 + max((m[0] for m in rows), default=-1)
    for k, tree in enumerate(trees):       # each finished value reaches its needers
        made = _deliveries(tree.root, tree.want, tree.elem, first, sent,
                           tree.region(tree.root))
        rows += made
        owner += [k] * len(made)
    _augment_sends(rows, owner, merged, trees, part, first, sent)
    rounds = max(first, 1 + max(r[0] for r in rows))
    round_, src, dst, elem, src_region, dst_region = (
        (tuple(c) for c in zip(*rows)) if rows else ((),) * 6)
    scratch: list[set[int]] = [set() for _ in range(mesh.size)]
    for tree in trees:
        for i in tree.combiners:
            scratch[i].add(tree.elem)
    return Schedule(rounds, first, src, dst, elem, round_, src_region, dst_region,
                    tuple((t.root, t.elem, t.root_holds) for t in trees),
                    tuple(tuple(sorted(x)) for x in scratch))


def _draw(e: int, want: list[int], held: list[int], members: list[int], part: list[int],
          g: int, recv: list[int], sent: list[int]) -> _Tree:
    """One element's tree among the ranks of one reduction (`members`): the root, a holder
    of each partial, and the children of each node, dealt out one at a time to the least
    busy node. Updates `recv` and `sent`."""
    holding = set(held)
    both = [i for i in want if i in holding]
    # the root: a rank needing the element (its first message replaces its delivery), one
    # holding a partial if any; one that holds none combines in its output
    root = min(both or want, key=lambda i: (sent[i], recv[i], i))
    nodes: dict[int, int] = {part[root]: root} if both else {}
    for i in held:    # one holder of each partial: the least busy (received, then sent)
        j = nodes.get(part[i])
        if j is None or j != root and (max(sent[i], recv[i]), recv[i], sent[i]) < (
                max(sent[j], recv[j]), recv[j], sent[j]):
            nodes[part[i]] = i
    assert len(nodes) == g, f"element {e} has {len(nodes)} of {g} partials"
    tree = _Tree(root, e, [i for i in want if i != root], bool(both),
                 dict.fromkeys(nodes.values(), 0), set(), members, holding)
    tree.degree[root] = 1
    heap = [(recv[i], i) for i in tree.degree]
    heapq.heapify(heap)
    for _ in range(len(tree.degree) - 2):   # a tree has one message per node but the root
        _, i = heapq.heappop(heap)
        tree.degree[i] += 1
        recv[i] += 1
        heapq.heappush(heap, (recv[i], i))
    for i in tree.degree:
        sent[i] += i != root
    if tree.want:     # the root sends the first delivery (`_deliveries` takes it from here)
        sent[root] += 1
    return tree


def _rebalance(trees: list[_Tree], recv: list[int], sent: list[int]) -> None:
    """Lower the busiest rank while it can be: move a child of it to the least busy node of
    the same tree, or, failing that, hand one of its children and one more (its own or
    another node's) to a combiner: a rank of the reduction holding no partial of the
    element, which combines the two and sends one value on (a message more in all, one
    fewer at the busiest rank). The greedy pass placed elements one at a time, before it
    knew the later ones. Edits the trees, `recv` and `sent` in place."""
    where: dict[int, list[int]] = defaultdict(list)   # rank -> trees it has spare children in
    for t, tree in enumerate(trees):
        for i, d in tree.degree.items():
            if d > tree.floor(i):
                where[i].append(t)
    while where:
        busiest = max(where, key=lambda i: (recv[i], i))
        # A tree that cannot relieve the busiest rank now will not later either (its other
        # nodes only get busier): it leaves the rank's list, so each tree is tried once.
        kept, relieved = [], False
        for t in where[busiest]:
            if relieved:
                kept.append(t)
            elif _relieve(trees[t], busiest, recv, sent, where, t):
                relieved = True
                if trees[t].degree[busiest] > trees[t].floor(busiest):
                    kept.append(t)
        if not relieved:
            return
        if kept:
            where[busiest] = kept
        else:
            del where[busiest]


def _relieve(tree: _Tree, b: int, recv: list[int], sent: list[int],
             where: dict[int, list[int]], t: int) -> bool:
    """One message fewer at node `b` of `tree` where that lowers it (see `_rebalance`)."""
    if tree.degree[b] <= tree.floor(b):
        return False
    j = min(tree.degree, key=lambda i: (recv[i], i))
    if recv[j] + 2 <= recv[b]:
        tree.degree[b] -= 1
        tree.degree[j] += 1
        recv[b] -= 1
        recv[j] += 1
        if tree.degree[j] == tree.floor(j) + 1:
            where[j].append(t)
        return True
    # a combiner c takes two children (two of b's, or one of b's and one of another node's)
    # and is a child itself: b has one child fewer, c two (`_tree` lays the tree out again
    # from the degrees)
    c = min((i for i in tree.members if i not in tree.taken and i not in tree.degree),
            key=lambda i: (recv[i], i), default=None)
    if c is None or recv[c] + 3 > recv[b]:
        return False
    tree.degree[b] -= 1
    tree.degree[c] = 2
    tree.combiners.add(c)
    recv[b] -= 1
    recv[c] += 2
    sent[c] += 1
    return True


def _augment(trees: list[_Tree], recv: list[int]) -> None:
    """Lower the busiest rank along chains of moves: a message moves off it to another node
    of one of its trees, which hands one of its own messages (in another tree) on, and so
    on, until a rank at least two below the busiest takes one. Each rank on the chain but
    its ends keeps its load. This finds what one move (`_relieve`) cannot: with the trees'
    nodes fixed, the loads it stops at have the least possible maximum (an augmenting path
    argument, as in a max-flow). Edits the trees and `recv` in place."""
    spare: dict[int, set[int]] = defaultdict(set)   # rank -> trees it has a spare child in
    for t, tree in enumerate(trees):
        for i, d in tree.degree.items():
            if d > tree.floor(i):
                spare[i].add(t)
    stuck: set[int] = set()
    while True:
        top = max(recv)
        busiest = [i for i, r in enumerate(recv) if r == top and i not in stuck]
        if not busiest:
            return
        b = busiest[0]
        came: dict[int, tuple[int, int]] = {}
        seen_trees: set[int] = set()
        frontier, end = [b], -1
        while frontier and end < 0:
            nxt = []
            for i in frontier:
                for t in spare[i]:
                    if t in seen_trees:
                        continue
                    seen_trees.add(t)
                    for j in trees[t].degree:
                        if j == b or j in came:
                            continue
                        came[j] = (i, t)
                        if recv[j] + 2 <= top:
                            end = j
                            break
                        nxt.append(j)
                    if end >= 0:
                        break
                if end >= 0:
                    break
            frontier = nxt
        if end < 0:
            return          # the busiest rank cannot be lowered: neither can the maximum
        j = end
        while j != b:
            i, t = came[j]
            tree = trees[t]
            tree.degree[i] -= 1
            tree.degree[j] += 1
            if tree.degree[i] <= tree.floor(i):
                spare[i].discard(t)
            if tree.degree[j] > tree.floor(j):
                spare[j].add(t)
            j = i
        recv[b] -= 1
        recv[end] += 1


def _augment_sends(rows: list[Row], owner: list[int], merged: int, trees: list[_Tree],
                   part: list[int], first: int, sent: list[int]) -> None:
    """Lower the busiest sender along chains of moves, as `_augment` does for receivers,
    with what can change sender without changing who receives what when: a delivery may
    come from any rank holding the finished value before its round (the root from round
    `first`, a needer once it received it), and a leaf of a tree (rows before `merged`:
    a node with no children, which sends its partial on) may be another rank holding the
    same partial (`part`). Edits `rows` and `sent` in place."""
    ready: list[dict[int, int]] = [{tree.root: first} for tree in trees]
    nodes: list[set[int]] = [set(tree.degree) | tree.combiners for tree in trees]
    parents: list[set[int]] = [set() for _ in trees]
    for k, (t, _src, dst, *_rest) in enumerate(rows):
        if k < merged:
            parents[owner[k]].add(dst)
        else:
            ready[owner[k]][dst] = t + 1
    by_sender: dict[int, set[int]] = defaultdict(set)
    for k, row in enumerate(rows):
        if k >= merged or (row[1] not in parents[owner[k]]
                           and row[1] not in trees[owner[k]].combiners):
            by_sender[row[1]].add(k)

    def others(k: int) -> list[int]:
        t, src, dst = rows[k][:3]
        tree = trees[owner[k]]
        if k < merged:
            return [c for c in tree.taken if part[c] == part[src] and c not in nodes[owner[k]]]
        return [c for c, at in ready[owner[k]].items() if at <= t and c != dst]

    while by_sender:
        top = max(sent)
        b = sent.index(top)
        came: dict[int, tuple[int, int]] = {}     # rank -> (rank it relieves, row)
        seen: set[int] = set()
        frontier, end = [b], -1
        while frontier and end < 0:
            nxt = []
            for a in frontier:
                for k in by_sender[a]:
                    if k in seen:
                        continue
                    seen.add(k)
                    for c in others(k):
                        if c == b or c in came:
                            continue
                        came[c] = (a, k)
                        if sent[c] + 2 <= top:
                            end = c
                            break
                        nxt.append(c)
                    if end >= 0:
                        break
                if end >= 0:
                    break
            frontier = nxt
        if end < 0:
            return
        c = end
        while c != b:
            a, k = came[c]
            t, _, dst, e, region, dst_region = rows[k]
            tree = trees[owner[k]]
            if k < merged:     # another holder of the same partial sends it, from its input
                nodes[owner[k]].discard(a)
                nodes[owner[k]].add(c)
            else:
                region = tree.region(c) if c == tree.root else OUTPUT
            rows[k] = (t, c, dst, e, region, dst_region)
            by_sender[a].discard(k)
            by_sender[c].add(k)
            c = a
        sent[b] -= 1
        sent[end] += 1


def _deliveries(root: int, want: list[int], e: int, first: int, sent: list[int],
                region: int) -> list[Row]:
    """One element's deliveries from `root` (ready in round `first`, its value in `region`)
    to the ranks in `want`: each from the least busy sender among those holding the value
    already (a rank forwards what it received, from its output, in a later round)."""
    # senders: (sent so far, ready in round, rank); the root's first send was counted when
    # its tree was drawn (`_draw`)
    heap = [(sent[root] - bool(want), first, root)]
    out = []
    for i in sorted(want, key=lambda i: (sent[i], i)):   # the least busy first: they forward
        n, t, src = heapq.heappop(heap)
        sent[src] = n + 1
        out.append((t, src, i, e, region if src == root else OUTPUT, OUTPUT))
        heapq.heappush(heap, (n + 1, t, src))
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
    the first delivery round)."""
    s = schedule(state, goal, mesh)
    me = mesh.ranks.index(rank)
    groups: dict[tuple[int, int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for a, b, e, t, ra, rb in zip(s.src, s.dst, s.elem, s.round, s.src_region, s.dst_region):
        if a == me or b == me:
            groups[(t, a, b)].append((e, ra, rb))
    keep = [(e, INPUT, OUTPUT) for i, e, holds in s.roots if i == me and holds]
    if keep:
        groups[(s.merges, me, me)] = keep
    out = []
    for (t, a, b), elems in sorted(groups.items()):
        elems.sort()
        src_at = _work(state, goal, mesh, mesh.ranks[a], s.scratch[a])
        dst_at = _work(state, goal, mesh, mesh.ranks[b], s.scratch[b])
        out.append(Transfer(mesh.ranks[a], mesh.ranks[b],
                            (tuple(src_at[ra][e] for e, ra, _ in elems),),
                            (tuple(dst_at[rb][e] for e, _, rb in elems),), round=t))
    return tuple(out)


def _work(state: State, goal: State, mesh: Mesh, rank: int,
          scratch: tuple[int, ...]) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Global flat element -> position in `rank`'s work buffer: in its input, its output,
    its scratch (the elements it combines for others, after its output)."""
    shape = tuple(d.size for d in state.dims)
    held = _local_positions(state, rank, shape, mesh)
    made = _local_positions(goal, rank, shape, mesh, len(held))
    at = len(held) + len(made)
    return held, made, {e: at + j for j, e in enumerate(scratch)}


@functools.lru_cache(maxsize=1024)
def _local_positions(state: State, rank: int, shape: tuple[int, ...], mesh: Mesh,
                     offset: int = 0) -> dict[int, int]:
    """Global flat element -> `offset` + flat position in `rank`'s local tensor of `state`."""
    flat = block_flat(block_indices(state, mesh, rank), shape)
    return {e: offset + i for i, e in enumerate(flat.tolist())}
