"""Reduction trees: a pending reduction resolved by point-to-point messages in rounds.

This module never communicates. Where the layout steps cannot reach the counting bound
(`bounds._reduction`), one element at a time can: each element's g partial values combine
along a tree of ranks, one holder of each partial (so every message but the deliveries
removes one partial), rooted where possible at a rank that needs the element (its delivery
is then its own combine). The trees are drawn greedily, element by element, so that the
rank receiving the least so far takes the next message: the busiest rank receives close to
`max(ceil(S / P), |need_r|)`. Idle replicas and ranks that need nothing take messages too.

A tree step runs as rounds of one all_to_all each: in a round every rank receives at most
one value per element it combines, and adds it to its own partial in place, so the result
does not depend on the order messages arrive in; then one more round delivers each
finished value from its root to the other ranks that need it. A rank sends a value after
it has combined all of its children's.

Schedules are per element, so they apply to small tensors on small meshes only
(`TREE_LIMIT`); on larger ones the layout steps plan alone. Cost: the busiest rank's
received elements over all rounds (the rounds of a tree pipeline), plus one latency per
round in a CostModel with latency.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..core.mesh import AxisName, Mesh
from .blocks import in_mesh_order
from .moves import Move, block_indices
from .states import State
from .transfers import resolved_axes
from .values import Transfer

TREE_LIMIT = 1 << 16   # elements x ranks above which no tree is drawn (planning time)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Every message of a tree step: row i sends element `elem[i]` (global flat index) from
    mesh position `src[i]` to `dst[i]` in round `round[i]`. Rounds before `merges` combine
    partials; the others deliver finished values (read from the sender's output where
    `forward[i]`, else from its combined partial); `roots` (mesh position, element) copy a
    finished value they need into their own output."""

    rounds: int
    merges: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    elem: tuple[int, ...]
    round: tuple[int, ...]
    src_out: tuple[bool, ...]      # the sender reads its output (else its input)
    dst_out: tuple[bool, ...]      # the receiver writes its output (else combines in its input)
    roots: tuple[tuple[int, int, bool], ...]   # (position, element, holds a partial of it)


Row = tuple[int, int, int, int, bool, bool]   # round, src, dst, element, src_out, dst_out
# one element's tree: its root, the element, the ranks it delivers to, whether the root
# combines in its output (it holds no partial), and each node's number of children
Tree = tuple[int, int, list[int], bool, dict[int, int]]


def tree_axes(state: State, goal: State, mesh: Mesh) -> tuple[AxisName, ...]:
    """The group of a tree step: every axis but the pending ones the goal keeps (ranks that
    differ there combine different partial sums and never talk) and those of size 1."""
    return in_mesh_order(mesh, {a for a in mesh.axis_names
                                if a not in goal.partial and mesh.axis_size(a) > 1})


def applies(state: State, goal: State, mesh: Mesh) -> bool:
    """Whether a tree step may go from `state` to `goal`: it resolves pending axes of more
    than one rank, keeps the others, adds none, and the tensor is small enough."""
    resolve = resolved_axes(state, goal)
    if not resolve or math.prod(mesh.axis_size(a) for a in resolve) == 1:
        return False
    numel = math.prod(d.size for d in state.dims)
    return 0 < numel and numel * mesh.size <= TREE_LIMIT


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


def _global_flat(index: tuple[tuple[int, ...], ...], shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.zeros((), dtype=torch.long)
    for ix, size in zip(index, shape):
        flat = flat.unsqueeze(-1) * size + torch.tensor(ix, dtype=torch.long)
    return flat.reshape(-1)


def _members(state: State, mesh: Mesh) -> list[list[int]]:
    """Per element (global flat), the mesh positions holding it in `state`, ascending."""
    shape = tuple(d.size for d in state.dims)
    mask = torch.zeros(math.prod(shape), mesh.size, dtype=torch.bool)
    for i, r in enumerate(mesh.ranks):
        mask[_global_flat(block_indices(state, mesh, r), shape), i] = True
    out: list[list[int]] = [[] for _ in range(mask.shape[0])]
    for e, i in mask.nonzero().tolist():
        out[e].append(i)
    return out


def _coordinate(mesh: Mesh, axes: list[AxisName]) -> list[int]:
    """Per mesh position, its coordinate on `axes` as one number."""
    out = []
    for r in mesh.ranks:
        c = mesh.coords(r)
        v = 0
        for a in axes:
            v = v * mesh.axis_size(a) + c[a]
        out.append(v)
    return out


@functools.lru_cache(maxsize=64)
def schedule(state: State, goal: State, mesh: Mesh) -> Schedule:
    """The messages of the tree step from `state` to `goal` (`applies` must hold)."""
    resolve = list(resolved_axes(state, goal) or ())
    g = math.prod(mesh.axis_size(a) for a in resolve)
    part = _coordinate(mesh, resolve)                 # which partial a position holds
    kept = _coordinate(mesh, list(goal.partial))      # which reduction it takes part in
    holders, needers = _members(state, mesh), _members(goal, mesh)
    recv = [0] * mesh.size       # elements received so far: every needer one per element
    sent = [0] * mesh.size
    for ns in needers:
        for i in ns:
            recv[i] += 1
    merges: list[Row] = []
    trees: list[Tree] = []
    roots: list[tuple[int, int, bool]] = []
    for e, ns in enumerate(needers):
        by_kept: dict[int, list[int]] = defaultdict(list)
        for i in ns:
            by_kept[kept[i]].append(i)
        for k, want in by_kept.items():
            held = [i for i in holders[e] if kept[i] == k]
            both = [i for i in want if i in set(held)]
            # the root: a rank needing the element (its first message replaces its delivery),
            # one holding a partial if any; one that holds none combines in its output
            root = min(both or want, key=lambda i: (recv[i], i))
            nodes: dict[int, int] = {part[root]: root} if both else {}
            for i in held:    # one holder of each partial: the least busy
                j = nodes.get(part[i])
                if j is None or j != root and (max(sent[i], recv[i]), recv[i]) < (
                        max(sent[j], recv[j]), recv[j]):
                    nodes[part[i]] = i
            assert len(nodes) == g, f"element {e} has {len(nodes)} of {g} partials"
            degree = dict.fromkeys(nodes.values(), 0)
            degree[root] = 1
            heap = [(recv[i], i) for i in degree]
            heapq.heapify(heap)
            for _ in range(len(degree) - 2):   # a tree has one message per node but the root
                _, i = heapq.heappop(heap)
                degree[i] += 1
                recv[i] += 1
                heapq.heappush(heap, (recv[i], i))
            roots.append((root, e, bool(both)))
            for i in degree:
                sent[i] += i != root
            trees.append((root, e, [i for i in want if i != root], not both, degree))
    _rebalance(trees, recv)
    for root, e, _, at_out, degree in trees:
        merges += [(t, a, b, e, False, b == root and at_out)
                   for t, a, b, e in _tree(root, degree, e)]
    first = 1 + max((m[0] for m in merges), default=-1)
    rows = list(merges)
    for root, e, want, at_out, _ in trees:       # each finished value reaches its needers
        rows += _deliveries(root, want, e, first, sent, at_out)
    rounds = max(first, 1 + max(r[0] for r in rows))
    round_, src, dst, elem, src_out, dst_out = (tuple(c) for c in zip(*rows)) if rows else (
        (),) * 6
    return Schedule(rounds, first, src, dst, elem, round_, src_out, dst_out, tuple(roots))


def _rebalance(trees: list[Tree], recv: list[int]) -> None:
    """Move children from the busiest rank to the least busy node of the same tree while that
    lowers the busiest rank's count (the greedy pass placed elements one at a time, before
    it knew the later ones). Edits the trees' degrees and `recv` in place."""
    where: dict[int, list[int]] = defaultdict(list)      # rank -> trees it has children in
    for t, (root, _, _, _, degree) in enumerate(trees):
        for i, d in degree.items():
            if d > (i == root):
                where[i].append(t)
    while where:
        busiest = max(where, key=lambda i: (recv[i], i))
        moved = False
        for t in where[busiest]:
            root, _, _, _, degree = trees[t]
            if degree[busiest] <= (busiest == root):
                continue
            j = min(degree, key=lambda i: (recv[i], i))
            if recv[j] + 2 <= recv[busiest]:
                degree[busiest] -= 1
                degree[j] += 1
                recv[busiest] -= 1
                recv[j] += 1
                if degree[j] == 1 + (j == root):
                    where[j].append(t)
                moved = True
                break
        if not moved:
            return
        where[busiest] = [t for t in where[busiest]
                          if trees[t][4][busiest] > (busiest == trees[t][0])]
        if not where[busiest]:
            del where[busiest]


def _deliveries(root: int, want: list[int], e: int, first: int, sent: list[int],
                at_out: bool) -> list[Row]:
    """One element's deliveries from `root` (ready in round `first`, its value in its output
    where `at_out`) to the ranks in `want`: each from the least busy sender among those
    holding the value already (a rank forwards what it received in a later round)."""
    ready = {root: first}
    out = []
    for i in want:
        src = min(ready, key=lambda j: (sent[j], ready[j], j))
        sent[src] += 1
        out.append((ready[src], src, i, e, src != root or at_out, True))
        ready[i] = ready[src] + 1
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

    Positions are flat, in a rank's work buffer: its input tensor (where partials combine),
    then its output tensor (where finished values land). A combine (round < the step's
    first delivery round) reads the sender's input and adds into the receiver's; a delivery
    reads the sender's input (its root) or output (a forward) and writes the receiver's
    output. A root that needs its element copies it (src == dst, in the first delivery
    round)."""
    s = schedule(state, goal, mesh)
    me = mesh.ranks.index(rank)
    groups: dict[tuple[int, int, int], list[tuple[int, bool, bool]]] = defaultdict(list)
    for a, b, e, t, a_out, b_out in zip(s.src, s.dst, s.elem, s.round, s.src_out, s.dst_out):
        if a == me or b == me:
            groups[(t, a, b)].append((e, a_out, b_out))
    keep = [(e, False, True) for i, e, holds in s.roots if i == me and holds]
    if keep:
        groups[(s.merges, me, me)] = keep
    out = []
    for (t, a, b), elems in sorted(groups.items()):
        elems.sort()
        src_in, src_out = _work(state, goal, mesh, mesh.ranks[a])
        dst_in, dst_out = _work(state, goal, mesh, mesh.ranks[b])
        out.append(Transfer(mesh.ranks[a], mesh.ranks[b],
                            (tuple((src_out if a_out else src_in)[e] for e, a_out, _ in elems),),
                            (tuple((dst_out if b_out else dst_in)[e] for e, _, b_out in elems),),
                            round=t))
    return tuple(out)


def _work(state: State, goal: State, mesh: Mesh, rank: int) -> tuple[dict[int, int],
                                                                        dict[int, int]]:
    """Global flat element -> position in `rank`'s work buffer: in its input, in its output."""
    shape = tuple(d.size for d in state.dims)
    held = _local_positions(state, rank, shape, mesh)
    return held, _local_positions(goal, rank, shape, mesh, len(held))


@functools.lru_cache(maxsize=1024)
def _local_positions(state: State, rank: int, shape: tuple[int, ...], mesh: Mesh,
                     offset: int = 0) -> dict[int, int]:
    """Global flat element -> `offset` + flat position in `rank`'s local tensor of `state`."""
    flat = _global_flat(block_indices(state, mesh, rank), shape)
    return {e: offset + i for i, e in enumerate(flat.tolist())}
