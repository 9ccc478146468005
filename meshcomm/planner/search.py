"""The search: the least-cost path of moves between two planner states, and one-mesh plans.

`single_plan` (cached) turns two layouts on one mesh into a Plan: Dijkstra with Pareto
labels over planner states (A* on large meshes and long searches) for the path of least
modelled time under a CostModel; ties go to the busiest rank's least total received bytes,
then sent bytes, then to the lower peak memory, then to native reductions over reducing
send_recvs and trees, then to fewer steps. `path_key` and `exact_moves` expose the key and
the moves, so tests can compare the search's choice with the paths it considers.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import operator
from collections.abc import Callable, Iterator

import torch

from ..core.errors import PlanError
from ..core.layout import Layout, Shape
from ..core.mesh import Mesh
from . import bounds
from .direct import direct_move
from .moves import Move, chunk_gather, expand, with_rearranges
from .rank_transfers import blocks_of, resolved_axes
from .states import (
    State,
    block_numels,
    from_layout,
    lay_blocks,
    local_numels_tensor,
    most_numel,
    to_layout,
    uniform_numel,
)
from .traffic import as_tensor, on_mesh
from .transfers import reindex_move, send_recv_move, send_recv_targets
from .trees import tree_estimate, tree_move, tree_transfers
from .values import CostModel, Plan, Step, wire_of


@functools.lru_cache(maxsize=4096)
def single_plan(mesh: Mesh, shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout,
          cost_model: CostModel) -> Plan:
    start, goal = from_layout(src, mesh, shape), from_layout(dst, mesh, shape)
    _check_ops(src, dst)
    itemsize = dtype.itemsize
    busiest = _Most()
    moves = _search(start, goal, mesh, itemsize, cost_model, busiest)
    names = dst.dim_names(mesh)
    steps = []
    bytes_of = _Scaled(itemsize)
    state, layout = start, src
    src_held = _numels(start, mesh) * itemsize if len(moves) != 1 else 0
    peak: Counts | tuple[int, ...] = src_held
    for i, move in enumerate(map(with_rearranges, moves)):   # rearranges of kept moves only
        after = dst if move.after == goal else to_layout(move.after, names, mesh)
        step, live = _step(move, state, layout, after, mesh, tuple(shape), itemsize,
                           cost_model, src_held if i else 0, bytes_of, busiest)
        steps.append(step)
        # step 0 holds the source besides its output (`_live`): no rank's peak is below it
        peak = live if i == 0 else _maximum(_counts(peak, mesh), _counts(live, mesh))
        state, layout = move.after, after
    send = _per_rank_sum((s.send_bytes for s in steps), mesh.size)
    recv = _per_rank_sum((s.recv_bytes for s in steps), mesh.size)
    # per rank, the most it holds: the source, or a step's peak (one step: that step's)
    peaks = steps[0].peak_bytes if len(steps) == 1 else _per_rank(peak, mesh)
    lower = bytes_of(bounds.lower_bound_elements(mesh, shape, src, dst))
    return Plan(mesh, shape, dtype, src, dst, tuple(steps), send, recv, lower, peaks,
                sum(s.time_s for s in steps), cost_model)


# Per-rank counts: one int where every rank holds alike (no tensor op: after the garbage
# collection a cold plan starts with, each torch op costs ~15 us), else a tensor.
Counts = int | torch.Tensor


def _numels(state: State, mesh: Mesh) -> Counts:
    """Elements each rank holds in `state` (a tensor of the mesh's shape where they differ)."""
    n = uniform_numel(state)
    return local_numels_tensor(state, mesh) if n is None else n


def _counts(value: Counts | tuple[int, ...], mesh: Mesh) -> Counts:
    """Per-rank counts as `Counts` (laid-out tuples as a tensor where ranks differ)."""
    if not isinstance(value, tuple):
        return value
    return value[0] if value.count(value[0]) == len(value) else on_mesh(mesh, value)


def _maximum(a: Counts, b: Counts) -> Counts:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if isinstance(a, int):
        a, b = b, a
    assert isinstance(a, torch.Tensor)
    return a.clamp(min=b) if isinstance(b, int) else torch.maximum(a, b)


def _per_rank(value: Counts | tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return value
    return (value,) * mesh.size if isinstance(value, int) else tuple(value.reshape(-1).tolist())


def _start_most(state: State, mesh: Mesh) -> int:
    n = uniform_numel(state)
    return most_numel(state, mesh) if n is None else n


def _per_rank_sum(columns: Iterator[tuple[int, ...]], ranks: int) -> tuple[int, ...]:
    """Per-rank sums of the steps' per-rank counts (a plan of one step, the most common,
    adds nothing; one of none is all zeros)."""
    total: tuple[int, ...] | None = None
    for column in columns:
        total = column if total is None else tuple(map(operator.add, total, column))
    return (0,) * ranks if total is None else total


def _times(values: tuple[int, ...], factor: int) -> tuple[int, ...]:
    """Per-rank counts times `factor` (one multiplication when every rank is alike)."""
    if values[-1] == values[0] and values.count(values[0]) == len(values):
        return (values[0] * factor,) * len(values)
    return tuple(map(factor.__mul__, values))


class _Scaled:
    """Per-rank elements as bytes (`_times`), once per tuple: a plan's bound is often the
    very tuple a step receives (`bounds.missing` is cached), and 1,024 products cost."""

    __slots__ = ("itemsize", "done")

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
        self.done: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, values: tuple[int, ...]) -> tuple[int, ...]:
        for seen, scaled in self.done:
            if seen is values:
                return scaled
        scaled = _times(values, self.itemsize)
        self.done.append((values, scaled))
        return scaled


class _Most:
    """The largest of per-rank counts (`_most`), once per tuple: a plan asks it of the
    same tuples again (an estimate's received counts and its exact price's, both
    `bounds.missing`; a step's in the search and in the plan)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done: dict[int, tuple[tuple[int, ...], int]] = {}

    def __call__(self, values: tuple[int, ...]) -> int:
        if len(values) < _MOST_KEPT:
            return _most(values)
        hit = self.done.get(id(values))
        if hit is not None and hit[0] is values:
            return hit[1]
        most = _most(values)
        self.done[id(values)] = (values, most)   # held: its id names no other tuple
        return most


_MOST_KEPT = 64   # per-rank tuples at least this long have their largest count kept


def _check_ops(src: Layout, dst: Layout) -> None:
    shared = [a for a in src.partial_axes if a in dst.partial_axes]
    if shared and src.reduce_op != dst.reduce_op:
        raise PlanError(
            f'src "{src}" has a pending {src.reduce_op} over {", ".join(shared)} but dst "{dst}"'
            f" asks for a pending {dst.reduce_op} there; one axis cannot mix two reductions."
            f" fix: resolve the {src.reduce_op} first (reshard to a layout without"
            f" | {src.reduce_op}({', '.join(shared)})), then mark the new one"
        )


def _step(move: Move, state: State, before: Layout, after: Layout, mesh: Mesh,
          shape: tuple[int, ...], itemsize: int, cost_model: CostModel,
          held: Counts, bytes_of: _Scaled, most: Largest
          ) -> tuple[Step, Counts | tuple[int, ...]]:
    """The plan's step of `move`, and its per-rank peak bytes (`held` bytes held besides;
    a tuple where `_laid_live` laid them out)."""
    assert move.rearranges is None, "a plan's move runs with its rearranges built (with_rearranges)"
    live: Counts | tuple[int, ...] | None = _laid_live(move, state, mesh, itemsize, held)
    if isinstance(live, tuple):
        peak = live
    else:
        live = _live(move, state, mesh) * itemsize
        if not isinstance(held, int) or held:
            live = live + held
        peak = _per_rank(live, mesh)
    send, recv = bytes_of(move.send), bytes_of(move.recv)
    time = (0.0 if move.kind == "local" else
            _time(move, _busiest(move, most) * itemsize, cost_model))
    found = (functools.partial(tree_transfers, state, move.after, mesh)
             if move.action == "tree" else
             blocks_of(move.kind, move.action, before, after, mesh, shape))
    return Step(move.kind, move.axes, before, after, move.action, move.op, move.dim, move.pre,
                move.post, move.pairs, (), send, recv, time, peak,
                wire="" if move.kind == "local" else wire_of(move.kind, move.dim),
                rounds=move.rounds, merge_rounds=move.merge_rounds, blocks_of=found), live


def _most(values: tuple[int, ...]) -> int:
    """The largest of per-rank counts (where every rank is alike, a count finds it ~4x as
    fast as `max` on 1,024 ranks; the last rank tells most that differ without it)."""
    first = values[0]
    return first if values[-1] == first and values.count(first) == len(values) else max(values)


Largest = Callable[[tuple[int, ...]], int]   # `_most`, or a `_Most` that keeps its answers


def _busiest(move: Move, most: Largest = _most) -> int:
    """The most elements any rank sends or receives in `move`."""
    sent = most(move.send)
    return sent if move.recv is move.send else max(sent, most(move.recv))


def _time(move: Move, busiest: int, cost_model: CostModel) -> float:
    """Modelled seconds of a collective move whose busiest rank moves `busiest` bytes; a tree
    step pays one latency per round (its bytes pipeline over the rounds)."""
    once = cost_model.time(move.axes, busiest)
    return once if move.rounds == 1 else once + (move.rounds - 1) * cost_model.time(move.axes, 0)


def _search(start: State, goal: State, mesh: Mesh, itemsize: int,
            cost_model: CostModel, most: Largest = _most) -> tuple[Move, ...]:
    """Least ((time, busiest received, busiest sent), peak, reducing send_recvs, steps,
    index-list steps) path from `start` to `goal` (Pareto labels).

    Busiest received and sent are the largest per-rank totals over the path's steps (on
    meshes of up to `TIE_RANKS` ranks; above, the sums of each step's busiest rank): at
    equal time the plan whose busiest rank receives least wins, then sends least. They
    break ties of time in the same label component, so they add no dimension to the
    labels; a label is dropped for one of equal time only where the other's per-rank totals
    are no larger at every rank (the busiest total of every extension then follows).

    On meshes of up to `_UNGUIDED_RANKS` ranks, Dijkstra first; a search that pops more
    than `_UNGUIDED_POPS` states (and any search on a larger mesh) runs as A* on the time:
    the queue then orders paths by time so far plus a lower bound of the time still
    needed (the lower bound on bytes from the state to the goal over the fastest link). The
    bound holds for every correct plan, so the first path to reach the goal is the least
    one in every criterion either way (received and sent bytes, peak, steps and index-list
    steps only grow along a path); A* expands far fewer states on large searches, and small
    ones skip the cost of bounding every state.
    """
    if mesh.size <= _UNGUIDED_RANKS:
        try:
            return _search_from(start, goal, mesh, itemsize, cost_model, False, most)
        except _TooLong:
            pass
    return _search_from(start, goal, mesh, itemsize, cost_model, True, most)


# Bounding a state costs about as much as expanding it; on small meshes most searches pop
# a handful of states, so they go unguided; large meshes and long searches use A*.
_UNGUIDED_RANKS = 64
_UNGUIDED_POPS = 12
# Meshes up to which ties of time go to the least per-rank totals (a tuple per label);
# above, to the least sum of each step's busiest rank (no per-rank work per label).
TIE_RANKS = 256

Totals = tuple[tuple[int, ...], tuple[int, ...]] | None   # per rank: received, sent (elements)


class _TooLong(Exception):
    """An unguided search popped more than `_UNGUIDED_POPS` states."""


def _search_from(start: State, goal: State, mesh: Mesh, itemsize: int,
                 cost_model: CostModel, guided: bool, most: Largest) -> tuple[Move, ...]:
    first: Key = ((0.0, 0, 0), _start_most(start, mesh) * itemsize, 0, 0, 0)
    zeros = (0,) * mesh.size
    origin: Totals = (zeros, zeros) if mesh.size <= TIE_RANKS else None
    counter = itertools.count()
    per_byte = 1.0 / max(cost_model.bandwidth_of(a) for a in mesh.axis_names)
    pops = 0

    def ahead(key: Key, state: State) -> Key:
        rest = bounds.busiest_bound(state, goal, mesh) * itemsize   # bytes still received
        time, got, sent = key[0]
        return ((round(time + rest * per_byte, 15), max(got, rest), sent),) + key[1:]

    # A* bounds a queued state only when it reaches the top of the queue (`bounded` False
    # until then: its key alone is a lower bound too); many queued states never do.
    heap: list[tuple[Key, int, Key, State, tuple[Move, ...], Key | None, bool, Totals]] = [
        (first, next(counter), first, start, (), None, not guided, origin)]
    labels: dict[State, list[tuple[Key, Totals]]] = {start: [(first, origin)]}

    def relax(key: Key, totals: Totals, state: State, move: Move,
              path: tuple[Move, ...], n: int | None = None) -> None:
        """Queue `move` from `state` (`n`: the queue order of the estimate it prices)."""
        nkey, ntotals = _extend(key, totals, move, state, mesh, itemsize, cost_model,
                                start, bool(path), most)
        if move.estimate:   # a lower bound of its key: price it when it is popped
            heapq.heappush(heap, (nkey, next(counter), nkey, move.after, path + (move,), key,
                                  not guided or move.after == goal, totals))
            return
        held = labels.get(move.after, [])
        if any(_dominates(k, t, nkey, ntotals) for k, t in held):
            return
        labels[move.after] = [(k, t) for k, t in held if not _dominates(nkey, ntotals, k, t)]
        labels[move.after].append((nkey, ntotals))
        # a priced gather keeps its place among equal keys (as if it had been queued exact)
        order = n if n is not None and move.kind == "all_gather" else next(counter)
        heapq.heappush(heap, (nkey, order, nkey, move.after, path + (move,), None,
                              not guided or move.after == goal, ntotals))

    while heap:
        # bound it; back in the queue if others lead (alone in the queue, it needs none)
        if not heap[0][6] and len(heap) > 1:
            _, n, key, state, path, before, _, totals = heap[0]
            guess = ahead(key, state)
            if guess > min(heap[1:3])[0]:
                heapq.heapreplace(heap, (guess, n, key, state, path, before, True, totals))
                continue
            heapq.heappop(heap)
        else:
            _, n, key, state, path, before, _, totals = heapq.heappop(heap)
        if before is not None:   # an estimated step (send_recv, tree, gather): price, queue it
            *head, last = path
            prev = head[-1].after if head else start
            exact = _priced(prev, last, mesh)
            assert exact is not None, f"no exact {last.kind} to {last.after}"
            relax(before, totals, prev, exact, tuple(head), n)
            continue
        if state == goal:
            return path
        if not any(k == key and t is totals for k, t in labels.get(state, ())):
            continue
        pops += 1
        if pops > _UNGUIDED_POPS and not guided:
            raise _TooLong
        for move in _moves(state, goal, mesh, cost_model):
            if SHORTCUT and not path and _alone_at_bound(move, start, goal, mesh, cost_model,
                                                         most):
                return (move,)
            relax(key, totals, state, move, path)
    raise PlanError(f"no plan found from {start} to {goal}; this is a meshcomm bug,"
                    " please report it")


# (time, busiest received, busiest sent), peak, reducing send_recvs, steps, index-list steps
Key = tuple[tuple[float, int, int], int, int, int, int]

# Moves found first from the start skip the rest of the search where nothing can beat them.
SHORTCUT = True


def path_key(start: State, moves: tuple[Move, ...], mesh: Mesh, itemsize: int,
             cost_model: CostModel) -> Key:
    """The key the search ranks a path of `moves` from `start` by (the least wins): ((time,
    busiest rank's total received bytes, its total sent bytes), peak, reducing send_recvs,
    steps, index-list steps). Pure: tests compare the search's choice with paths it
    considers (`exact_moves`)."""
    key: Key = ((0.0, 0, 0), _start_most(start, mesh) * itemsize, 0, 0, 0)
    zeros = (0,) * mesh.size
    totals: Totals = (zeros, zeros) if mesh.size <= TIE_RANKS else None
    state = start
    for i, move in enumerate(moves):
        key, totals = _extend(key, totals, move, state, mesh, itemsize, cost_model,
                              start, bool(i))
        state = move.after
    return key


def exact_moves(state: State, goal: State, mesh: Mesh, cost_model: CostModel) -> list[Move]:
    """The moves the search considers from `state`, each priced exactly (an estimated
    send_recv, tree or uneven all_gather priced as the search prices it when it pops one)."""
    out = []
    for move in _moves(state, goal, mesh, cost_model):
        if move.estimate:
            exact = _priced(state, move, mesh)
            if exact is None:
                continue
            move = exact
        out.append(move)
    return out


def _priced(state: State, move: Move, mesh: Mesh) -> Move | None:
    """Estimated `move` from `state`, priced exactly: an uneven all_gather, a tree or a
    send_recv."""
    if move.kind == "all_gather":
        assert move.dim is not None, f"an estimated all_gather of no uneven dim: {move}"
        return chunk_gather(state, move.dim, mesh)
    if move.action == "tree":
        return tree_move(state, move.after, mesh)
    return send_recv_move(state, move.after, mesh)


def _alone_at_bound(move: Move, start: State, goal: State, mesh: Mesh,
                    cost_model: CostModel, most: Largest = _most) -> bool:
    """Whether `move`, one step from `start`, is the plan the whole search would return.

    It is where it reaches `goal` as one collective on the fastest links (the least latency
    and the most bandwidth of the mesh's axes) moving no more than the bound of what the
    busiest rank must receive: every plan takes at least that time and receives at least
    that much; every plan holds at least the source and the destination at once, which is
    this step's peak (not so for trees and reducing send_recvs, left out); and among equal
    keys the search keeps the fewest steps, then the fewest index-list steps (so none of
    those here), then the first move found, which this is.
    """
    if (move.after != goal or move.kind == "local" or move.estimate or move.indexed
            or move.action == "tree" or move.rounds != 1
            or (move.kind == "send_recv" and move.op is not None)):
        return False
    busiest = _busiest(move, most)
    if busiest == 0 or busiest != bounds.busiest_bound(start, goal, mesh):
        return False
    latency = [cost_model.time((a,), 0) for a in mesh.axis_names]
    bandwidth = [cost_model.bandwidth_of(a) for a in mesh.axis_names]
    return (cost_model.time(move.axes, 0) == min(latency)
            and min(cost_model.bandwidth_of(a) for a in move.axes) == max(bandwidth))


def _moves(state: State, goal: State, mesh: Mesh, cost_model: CostModel) -> Iterator[Move]:
    for move in _all_moves(state, goal, mesh, cost_model.trees):
        if move.kind == "local" or move.kind in cost_model.native:
            yield move


def _all_moves(state: State, goal: State, mesh: Mesh, trees: bool) -> Iterator[Move]:
    yield from expand(state, goal, mesh)
    moves = [send_recv_move(state, t, mesh, exact=False)
             for t in send_recv_targets(state, goal, mesh)]
    moves.append(reindex_move(state, goal, mesh))
    moves.append(direct_move(state, goal, mesh))
    if trees:
        moves.append(tree_estimate(state, goal, mesh))     # its rounds: trees.least_rounds
    yield from (m for m in moves if m is not None)


def _extend(key: Key, totals: Totals, move: Move, state: State, mesh: Mesh, itemsize: int,
            cost_model: CostModel, start: State, held: bool, most: Largest = _most
            ) -> tuple[Key, Totals]:
    live = _live_most(move, state, mesh, start if held else None) * itemsize
    time, (_, got, sent) = 0.0, key[0]
    if move.kind != "local":
        step_send = most(move.send) * itemsize
        step_recv = step_send if move.recv is move.send else most(move.recv) * itemsize
        time = _time(move, max(step_send, step_recv, move.least * itemsize), cost_model)
        if totals is None:     # a large mesh: the sums of each step's busiest rank
            got, sent = got + step_recv, sent + step_send
        else:
            recv, send = _added(totals[0], move.recv), _added(totals[1], move.send)
            got = _total_most(recv, totals[0], got, move.recv, step_recv, itemsize)
            sent = _total_most(send, totals[1], sent, move.send, step_send, itemsize)
            totals = (recv, send)
    # At equal time, the least busiest rank's received bytes win, then its sent bytes (a
    # step's time is the larger of its sent and received bytes); then the lower peak; then
    # native reductions (reduce_scatter, all_reduce) over a reducing send_recv or tree;
    # then fewer steps; last, fewer steps driven by index lists (send_recv, select, reindex).
    reducing = move.kind == "send_recv" and move.op is not None
    return ((round(key[0][0] + time, 15), got, sent), max(key[1], live),
            key[2] + reducing, key[3] + 1, key[4] + move.indexed), totals


def _total_most(total: tuple[int, ...], before: tuple[int, ...], before_most: int,
                step: tuple[int, ...], step_most: int, itemsize: int) -> int:
    """The largest of per-rank totals `total` (`_added` of `before` and `step`) in bytes,
    known where it is either of them (their largest given, in bytes)."""
    if total is before:
        return before_most
    return step_most if total is step else max(total) * itemsize


def _added(total: tuple[int, ...], step: tuple[int, ...]) -> tuple[int, ...]:
    """Per-rank sums (a step that moves nothing adds nothing; nothing yet, the step)."""
    if not any(step):
        return total
    return step if not any(total) else tuple(map(operator.add, total, step))


def _live_most(move: Move, state: State, mesh: Mesh, held: State | None) -> int:
    """The most elements any rank holds during `move` (`_live`), plus what it holds of
    `held`. Where every term is a state (or alike on all ranks), the first rank holds the
    most of each at once (`most_numel`): their sum there, in ints; a tree's varying
    receive adds the per-rank counts up as tensors."""
    ints = 0
    varying: list[tuple[int, State | torch.Tensor]] = []
    terms = _live_terms(move, state, mesh)
    if held is not None:
        terms.append((1, held))
    for factor, term in terms:
        if isinstance(term, State):
            n = uniform_numel(term)
            if n is None:
                varying.append((factor, term))
                continue
            term = n
        if isinstance(term, int):
            ints += factor * term
        else:
            varying.append((factor, term))
    if not varying:
        return ints
    if all(isinstance(term, State) for _, term in varying):
        return ints + sum(factor * most_numel(term, mesh)
                          for factor, term in varying if isinstance(term, State))
    total: torch.Tensor | None = None
    for factor, term in varying:
        counts = local_numels_tensor(term, mesh) if isinstance(term, State) else term
        counts = counts if factor == 1 else factor * counts
        total = counts if total is None else total + counts
    assert total is not None
    return int(total.max()) + ints


def _live_terms(move: Move, state: State, mesh: Mesh
                ) -> list[tuple[int, State | int | torch.Tensor]]:
    """`_live` as (factor, per-rank counts) terms that add up to it: a state stands for
    its local sizes."""
    if move.action == "tree":
        got = move.recv
        recv = (got[0] if got[-1] == got[0] and got.count(got[0]) == len(got)
                else as_tensor(got).reshape(mesh.shape))
        return [(2, state), (1, move.after), (1, recv)]
    if move.kind == "send_recv" and move.op is not None:
        g = mesh.group_size(resolved_axes(state, move.after) or ())
        return [(1, state), (2 * g, move.after)]
    return [(1, state), (1, move.after)]


def _laid_live(move: Move, state: State, mesh: Mesh, itemsize: int, held: Counts
               ) -> tuple[int, ...] | None:
    """`_live` in bytes plus `held` per rank, where one term varies over the ranks as a
    chunk chain laid on them by repetition (`states.block_numels`) and the rest are alike:
    worked out per block and laid out (no tensor op; a cold one costs more than the
    whole); else None."""
    if not isinstance(held, int):
        return None
    alike, varying = 0, None
    for factor, term in _live_terms(move, state, mesh):
        n = uniform_numel(term) if isinstance(term, State) else None
        if n is None and isinstance(term, int):
            n = term
        if n is not None:
            alike += factor * n
        elif varying is not None or not isinstance(term, State):
            return None
        else:
            varying = factor, term
    found = None if varying is None else block_numels(varying[1], mesh)
    if varying is None or found is None:
        return None
    factor, (blocks, dim) = varying[0], found
    table = [(factor * b + alike) * itemsize + held for b in blocks]
    return tuple(lay_blocks(table, dim, mesh))


def _live(move: Move, state: State, mesh: Mesh) -> Counts:
    """Elements a rank holds during `move`: its input and output; for a reducing send_recv
    over g ranks, 2g outputs (the buffer it receives, and the g partials it reduces); for a
    tree, its input twice (the partials it combines into) and what it receives."""
    total: Counts = 0
    for factor, term in _live_terms(move, state, mesh):
        counts = _numels(term, mesh) if isinstance(term, State) else term
        counts = counts if factor == 1 else factor * counts
        total = counts if isinstance(total, int) and total == 0 else total + counts
    return total


def _dominates(a: Key, at: Totals, b: Key, bt: Totals) -> bool:
    """Whether label `a` (per-rank totals `at`) makes `b` useless: no worse in peak, steps
    and the rest, and less time; or equal time and, per rank, no more received and sent
    (every extension of `b` then has an extension of `a` no worse in every criterion)."""
    if a[0][0] > b[0][0] or any(x > y for x, y in zip(a[1:], b[1:])):
        return False
    if a[0][0] < b[0][0]:
        return True
    if at is None or bt is None:
        return a[0] <= b[0]
    return (at is bt or (all(map(operator.le, at[0], bt[0]))
                         and all(map(operator.le, at[1], bt[1]))))



def set_cache_size(size: int) -> None:
    """Bound the cache of `single_plan` at `size` entries, emptying it."""
    global single_plan
    single_plan = functools.lru_cache(maxsize=size)(single_plan.__wrapped__)
