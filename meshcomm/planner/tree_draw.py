"""Drawing reduction trees (`trees`): the elements cut into items (`items_of`), each item's
tree drawn greedily, rooted at a needer or a helper (`balanced`, `Helpers`), and the
trees laid out as messages in rounds (`messages`).

This module never communicates.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

import torch

from ..core.mesh import Mesh
from .bounds import element_mask, row_ids
from .states import State
from .tree_chains import OUTPUT, Budget, Receivers, Row, Tree, augment, augment_sends, rebalance

ITEMS_PER_CLASS = 4       # items a class a rank at most (x ranks): enough to balance it


def items_of(state: State, goal: State, mesh: Mesh, budget: int
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


Messages = tuple[list[Row], int]     # the rows, the first delivery round


def messages(trees: list[Tree], part: list[int], recv: list[int], sent: list[int],
              budget: Budget) -> Messages:
    """The rows of balanced trees: each tree laid out in rounds (`_tree`), then each finished
    value's deliveries (`_deliveries`), then sends balanced along chains (`augment_sends`).
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
    augment_sends(rows, owner, merged, trees, part, first, sent, recv, budget)
    return rows, first


def balanced(order: list[int], tie: list[int], items: list[tuple[int, ...]],
              holders: list[list[int]], needers: list[list[int]], kept: list[int],
              by_kept: dict[int, list[int]], part: list[int], g: int, ranks: int, floor: int,
              budget: Budget, helpers: Helpers | None = None
              ) -> tuple[list[Tree], list[tuple[int, ...]], list[int], list[int],
                         Helpers | None]:
    """Trees for every item, drawn greedily in `order` (ties between ranks to the least
    `tie`) and balanced (`augment`, `rebalance`): the trees, the items (cut ones added),
    the elements each rank receives and sends, and (without `helpers`) each rank's load
    before combiners (`Helpers.before_combiners`: what a draw with helpers starts from)."""
    items = list(items)
    recv = [0] * ranks       # elements received so far: every needer one per element
    sent = [0] * ranks
    for e, ns in enumerate(needers):
        for i in ns:
            recv[i] += len(items[e])
    trees: list[Tree] = []
    for e in order:
        wanting: dict[int, list[int]] = defaultdict(list)
        for i in needers[e]:
            wanting[kept[i]].append(i)
        for k, want in wanting.items():
            held = [i for i in holders[e] if kept[i] == k]
            trees.append(_draw(e, len(items[e]), want, held, by_kept[k], part, g, recv,
                               sent, tie, helpers))
    rx = Receivers(trees, items, recv, sent, part, budget, helpers is not None)
    augment(rx, floor)
    plain = None if helpers is not None else Helpers.before_combiners(trees, sent, recv)
    rebalance(rx)
    augment(rx, floor)
    return trees, items, recv, sent, plain


def _draw(e: int, w: int, want: list[int], held: list[int], members: list[int],
          part: list[int], g: int, recv: list[int], sent: list[int], tie: list[int],
          helpers: Helpers | None) -> Tree:
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
    tree = Tree(root, e, w, [i for i in want if i != root], holds, needs,
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


class Helpers:
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
    def before_combiners(cls, trees: list[Tree], sent: list[int], recv: list[int]
                         ) -> Helpers:
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
          recv: list[int], sent: list[int], tie: list[int], helpers: Helpers | None) -> int:
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


def _deliveries(tree: Tree, first: int, sent: list[int]) -> list[Row]:
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
