"""Helpers for tests and benchmarks: random layouts drawn alike on every rank.

Processes are started by `meshcomm.runtime.launch.run_ranks`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .core.layout import Layout
from .core.mesh import Mesh
from .planner.bounds import CLASS_LIMIT, FLOW_TRIES
from .planner.unions import unions_fit


def random_layout(rng: Any, mesh: Any, ndim: int, ops: tuple[str, ...],
                  names: str = "ijkl", *, name_inside: float = 0.5, sized: float = 0.0,
                  sized_names: str = "xyzw") -> str:
    """A random layout text for tests and benchmarks: each axis of `mesh` shards a dim (either
    side of its name), is pending with one of `ops`, or stays replicated. `rng` is a
    `random.Random` (or one drawn by hypothesis, `st.randoms()`), so every rank that seeds it
    alike draws the same layouts.

    `name_inside` is the chance that a dim's name stands at a random place among its axes
    ("(dp i tp)", "(i dp)") rather than after them; 0 draws blocks only, "(axes... i)".
    `sized` is the chance that a dim also gets a sized local factor ("(x=2 dp i)", named from
    `sized_names`) at a random place; at 0 (the default) no draw is spent on it.

    >>> import random
    >>> from meshcomm import Mesh
    >>> random_layout(random.Random(0), Mesh("dp=2 tp=2"), 2, ("sum",))
    'i (dp j)'
    """
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial = []
    axes = list(mesh.axis_names)
    rng.shuffle(axes)
    for axis in axes:
        where: str | int = rng.choice(["rep", "partial", *range(ndim)])   # a dim by index
        if where == "partial":
            partial.append(axis)
        elif isinstance(where, int):
            dims[where].append(axis)
    parts = []
    for i, group in enumerate(dims):
        at = rng.randint(0, len(group)) if rng.random() < name_inside else len(group)
        factors = group[:at] + [names[i]] + group[at:]
        if sized and rng.random() < sized:
            factors.insert(rng.randint(0, len(factors)), f"{sized_names[i]}=2")
        parts.append(f"({' '.join(factors)})" if len(factors) > 1 else factors[0])
    text = " ".join(parts)
    return text + (f" | {rng.choice(ops)}({', '.join(sorted(partial))})" if partial else "")


def _mask(mesh: Mesh, shape: tuple[int, ...], layout: Layout, rank: int) -> torch.Tensor:
    """Which global elements (flat) `rank` holds (a partial of, if pending)."""
    idx = torch.arange(math.prod(shape)).reshape(shape)
    for d, sel in enumerate(layout.indices(mesh, shape, rank)):
        idx = idx.index_select(d, torch.tensor(list(sel), dtype=torch.long))
    mask = torch.zeros(math.prod(shape), dtype=torch.bool)
    mask[idx.reshape(-1)] = True
    return mask


def counting_bound(mesh: Mesh, shape: tuple[int, ...], src: str | Layout,
                   dst: str | Layout, with_classes: bool | None = None) -> int | None:
    """Elements the busiest rank must receive when `src` with a pending reduction becomes
    `dst`, counted element by element (an oracle for tests and benchmarks; the planner's
    bound, `meshcomm.planner.bounds`, counts the same from block tables). None where the
    destination has pending axes the source lacks, or nothing is resolved.

    An item (an element, with a coordinate on the pending axes `dst` keeps) with g partial
    values needs g - 1 messages to combine them, plus one delivery to each rank needing it,
    less one when a rank needing it holds a partial. The busiest rank receives at least the
    total over P ranks, and every rank at least one message per element it needs. Where
    ranks hold and need nothing (idle), each wastes its first message of an element (it
    has no value to add to), so the load rises until the ranks carry every message and
    every one of the g - 1 unions per item (see `meshcomm.planner.bounds`). With
    `with_classes`, also per class of items sharing holders and needers; by default where
    the planner's bound does (elements x ranks at most `CLASS_LIMIT`).

    >>> from meshcomm import Mesh
    >>> counting_bound(Mesh("tp=4"), (8,), "i | sum(tp)", "(tp i)")   # a reduce_scatter's 3 x 2
    6
    """
    s, d = Layout(src), Layout(dst)
    resolve = [a for a in s.partial_axes if a not in d.partial_axes]
    keep = [a for a in s.partial_axes if a in d.partial_axes]
    g = mesh.group_size(resolve)
    if g == 1 or any(a not in s.partial_axes for a in d.partial_axes):
        return None
    numel = math.prod(shape)
    needers: dict[tuple[int, ...], torch.Tensor] = {}    # per kept coordinate, per element
    combines: dict[tuple[int, ...], torch.Tensor] = {}   # a needer holds a partial there
    busiest, idle, lacking, needs, empty = 0, 0, [], [], []
    holds, wants = [], []
    for r in mesh.ranks:
        c = tuple(mesh.coords(r)[a] for a in keep)
        need, hold = _mask(mesh, shape, d, r), _mask(mesh, shape, s, r)
        holds.append(hold)
        wants.append(need)
        needers[c] = needers.get(c, torch.zeros(numel, dtype=torch.long)) + need
        combines[c] = combines.get(c, torch.zeros(numel, dtype=torch.bool)) | (need & hold)
        busiest = max(busiest, int(need.sum()))
        idle += not bool(need.any()) and not bool(hold.any())
        lacking.append(int((need & ~hold).sum()))
        needs.append(int(need.sum()))
        if not hold.any():
            empty.append(int(need.sum()))
    messages = sum(int(((g - 1 + n - h.long()) * (n > 0)).sum())
                   for n, h in zip(needers.values(), combines.values()))
    unions = sum(int((n > 0).sum()) for n in needers.values()) * (g - 1)
    rootless = sum(int(((n > 0) & ~h).sum()) for n, h in zip(needers.values(), combines.values()))
    if with_classes is None:
        with_classes = numel * mesh.size <= CLASS_LIMIT
    classes = _item_classes(mesh, keep, resolve, holds, wants) if with_classes else []
    if classes:   # a root saves a copy only where it holds nothing at all
        nothing = {i for i, hold in enumerate(holds) if not hold.any()}
        rootless = sum(c[0] for c in classes if nothing & set(c[4]))
    flow = [(c[0], c[1], c[2], c[4], c[3]) for c in classes]
    load = max(-(-messages // mesh.size), busiest)
    while not (_carries(load, messages, unions, lacking, idle, g, mesh.size, needs, empty,
                        rootless)
               and all(_class_carries(load, needs, *c) for c in classes)
               and (not flow or unions_fit(flow, [max(0, load - n) for n in needs], FLOW_TRIES))):
        load += 1
    return load


def _item_classes(mesh: Mesh, keep: list[str], resolve: list[str], holds: list[torch.Tensor],
                  wants: list[torch.Tensor]) -> list[tuple[int, int, list[list[int]], list[int],
                                                          list[int]]]:
    """Items (element, kept coordinate) grouped by who holds and who needs them: per group,
    its size, the unions each item needs beyond one message per needer, the ranks holding
    each partial, the ranks of the reduction holding none, and which of those may be a root
    without wasting a copy (the needers, where no needer holds a partial)."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int] = {}
    for e in range(holds[0].numel()):
        at: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
        for i, r in enumerate(mesh.ranks):
            c = tuple(mesh.coords(r)[a] for a in keep)
            have, want = at.setdefault(c, ([], []))
            if holds[i][e]:
                have.append(i)
            if wants[i][e]:
                want.append(i)
        for c, (held, needed) in at.items():
            if needed:
                key = (c, tuple(held), tuple(needed))
                groups[key] = groups.get(key, 0) + 1
    out = []
    for (c, h, n), count in groups.items():
        members = [i for i, r in enumerate(mesh.ranks)
                   if tuple(mesh.coords(r)[a] for a in keep) == c]
        both = any(i in n for i in h)
        by_partial: dict[tuple[int, ...], list[int]] = {}
        for i in h:
            by_partial.setdefault(tuple(mesh.coords(mesh.ranks[i])[a] for a in resolve),
                                  []).append(i)
        others = [i for i in members if i not in h]
        g = mesh.group_size(resolve)
        out.append((count, g - 1 - both, list(by_partial.values()), others,
                    [] if both else [i for i in others if i in n]))
    return out


def _class_carries(load: int, needs: list[int], count: int, free: int,
                   partials: list[list[int]], others: list[int], roots: list[int]) -> bool:
    """Whether one class of items can make its unions with ranks receiving at most `load`:
    one node per partial value an item, taking at most the item's `free` unions; a rank
    holding no partial copies once an item it works on (but as the root of an item no
    needer holds)."""
    if free <= 0:
        return True
    spare = [max(0, load - n) for n in needs]
    made = sum(min(sum(spare[i] for i in p), count * min(free, max(spare[i] for i in p)))
               for p in partials)
    made += sum(spare[i] - -(-spare[i] // (free + 1)) for i in others)
    made += sum(-(-spare[i] // (free + 1)) for i in roots)
    return made >= count * free


def _carries(load: int, messages: int, unions: int, lacking: list[int], idle: int, g: int,
             ranks: int, needs: list[int], empty: list[int], rootless: int) -> bool:
    """Whether ranks receiving at most `load` messages each can receive `messages`, `unions`
    of them adding to a value the receiver has (an idle rank copies its first message of an
    element; a rank lacking an element it needs copies it); and the messages beyond one per
    element each rank needs, where a rank holding nothing (what it needs: `empty`) spends
    one of every g it receives beyond its needs on a copy, except as the root of an item
    that no needer holds a partial of (`rootless` of them)."""
    wasted = idle * -(-load // g)
    copies = sum(-(-max(0, load - n) // g) for n in empty)
    return (ranks * load - wasted >= messages
            and sum(max(0, load - n) for n in lacking) - wasted >= unions
            and sum(max(0, load - n) for n in needs) - max(0, copies - rootless)
            >= messages - sum(needs))


PARTIAL_MESHES = ("dp=4 tp=2", "dp=2 tp=2 pp=2", "a=2 b=3 c=2", "dp=4 pp=2 ep=4", "sp=4 dp=4 pp=2",
                  "pp=2 sp=4 dp=4", "pp=4 cp=4", "ep=2 dp=4 tp=2 sp=2", "dp=8 tp=8",
                  "x=2 y=2 z=2 w=2", "dp=4 tp=4", "dp=2 tp=3", "a=2 b=2 c=2 d=2 e=2 f=2",
                  "dp=16 tp=4", "dp=8")


def partial_transition(rng: Any, even: bool,
                       meshes: tuple[str, ...] = PARTIAL_MESHES) -> tuple[Mesh, tuple[int, ...],
                                                                         str, str]:
    """A random transition from a pending reduction that resolves some of it (what
    `counting_bound` measures), on one of `meshes` (up to 64 ranks): one or two dims of 64,
    128 or 192 (`even`, divisible by most meshes) or up to three small dims (1 to 16, which
    `torch.chunk` splits unevenly and leaves ranks empty)."""
    from .core.errors import ShapeError

    ops = ("sum", "avg", "max", "min")
    while True:
        mesh = Mesh(rng.choice(meshes))
        ndim = rng.randint(1, 2 if even else 3)
        sizes = [64, 128, 192] if even else [1, 2, 3, 4, 5, 6, 8, 12, 13, 16]
        shape = tuple(rng.choice(sizes) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, ops, name_inside=0.3)
        op = Layout(src).reduce_op
        if op is None:
            continue
        dst = random_layout(rng, mesh, ndim, (op,), name_inside=0.3)
        try:
            Layout(src).placements(mesh, shape)
            Layout(dst).placements(mesh, shape)
        except ShapeError:
            continue
        if counting_bound(mesh, shape, src, dst) is not None:
            return mesh, shape, src, dst
