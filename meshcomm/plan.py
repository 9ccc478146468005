"""Plans: the cheapest exact sequence of collectives between two layouts.

This module never communicates. `plan()` searches the move set of
`meshcomm.moves` (Dijkstra with Pareto labels over planner states) for the
path of least modelled time under a `CostModel`; ties go to the lower peak
memory, then to fewer steps. Plans are frozen values, cached on their inputs,
and every rank computes the same one.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import bounds
from .errors import PlanError
from .layout import Layout, Shape, as_layout
from .mesh import AxisName, Mesh
from .moves import Move, expand
from .p2p import reindex_move, send_recv_move, send_recv_targets
from .rearrange import Rearrange
from .states import State, from_layout, local_numels, local_numels_tensor, to_layout

STEP_KINDS = ("local", "all_gather", "reduce_scatter", "all_reduce", "all_to_all",
              "collective_permute", "broadcast", "send_recv")


def _pairs(value: float | Mapping[str, float] | tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), float(v)) for k, v in value.items()))
    if isinstance(value, tuple):
        return tuple(sorted(value))
    return (("*", float(value)),)


@dataclass(frozen=True)
class CostModel:
    """Latency and bandwidth per mesh axis: step time = latency + max-rank bytes / bandwidth.

    A collective over several axes pays the largest latency and the smallest
    bandwidth among them. Local steps cost nothing. The default has no latency,
    so bytes decide and ties go to memory, then to fewer steps.

    `native` names the step kinds the backend runs as real collectives (NCCL and
    gloo run them all). The planner never uses a kind outside it: nothing is
    emulated behind the cost model's back.

    >>> cm = CostModel(latency_s={"dp": 20e-6, "tp": 2e-6}, bandwidth={"dp": 25e9, "tp": 450e9})
    >>> cm.time(("dp",), 25_000) > cm.time(("tp",), 25_000)
    True
    """

    latency_s: Any = 0.0
    bandwidth: Any = 100e9
    backend: str = "nccl"
    native: Any = STEP_KINDS
    _lat: tuple[tuple[str, float], ...] = field(init=False, repr=False, compare=False)
    _bw: tuple[tuple[str, float], ...] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", _pairs(self.latency_s))
        object.__setattr__(self, "bandwidth", _pairs(self.bandwidth))
        if any(v <= 0 for _, v in self.bandwidth) or any(v < 0 for _, v in self.latency_s):
            raise PlanError(f"CostModel needs bandwidth > 0 and latency >= 0, got {self}")
        unknown = set(self.native) - set(STEP_KINDS)
        if unknown:
            raise PlanError(f"CostModel(native=...) names unknown step kinds {sorted(unknown)};"
                            f" kinds are {', '.join(STEP_KINDS)}")
        object.__setattr__(self, "native", tuple(k for k in STEP_KINDS if k in set(self.native)))
        object.__setattr__(self, "_hash", hash((self.latency_s, self.bandwidth, self.backend,
                                                self.native)))
        object.__setattr__(self, "_lat", self.latency_s)
        object.__setattr__(self, "_bw", self.bandwidth)

    def __hash__(self) -> int:  # computed once: plans are cached on the cost model
        return self._hash

    def _get(self, table: tuple[tuple[str, float], ...], axis: str, default: float) -> float:
        found = dict(table)
        return found.get(axis, found.get("*", default))

    def bandwidth_of(self, axis: AxisName) -> float:
        """Bytes per second of `axis`."""
        return self._get(self._bw, axis, 100e9)

    def time(self, axes: tuple[AxisName, ...], max_bytes: int) -> float:
        """Modelled seconds of one collective over `axes` whose busiest rank moves `max_bytes`."""
        latency = max(self._get(self._lat, a, 0.0) for a in axes)
        bandwidth = min(self._get(self._bw, a, 100e9) for a in axes)
        return latency + max_bytes / bandwidth


@dataclass(frozen=True, slots=True)
class Transfer:
    """Part of a send_recv step: `src` sends `dst` the cartesian block of its local tensor at
    per-dim positions `src_index`; `dst` writes it at per-dim positions `dst_index` of its output.

    Ranks are global. A pair may have several transfers; they travel in tuple order.
    `src == dst` is a local copy and moves no bytes.
    """

    src: int
    dst: int
    src_index: tuple[tuple[int, ...], ...]
    dst_index: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return math.prod(len(ix) for ix in self.src_index)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a plan: a collective (or local move) over `axes`, from `before` to `after`.

    `pre`/`post` are the local rearranges around the collective; `dim` is the
    tensor dim of an uneven (chunk) collective; `pairs` the (source, destination)
    group positions of a permute; `transfers` the blocks of a send_recv step (run
    as one all_to_all with uneven splits over the step's flattened group, so it
    traces like any other collective; between two meshes, as batched point-to-point
    sends). Bytes are per rank, in the order of the plan's `ranks`.
    """

    kind: str
    axes: tuple[AxisName, ...]
    before: Layout
    after: Layout
    action: str = ""
    op: str | None = None
    dim: int | None = None
    pre: Rearrange | None = None
    post: Rearrange | None = None
    pairs: tuple[tuple[int, int], ...] = ()
    transfers: tuple[Transfer, ...] = ()
    send_bytes: tuple[int, ...] = ()
    recv_bytes: tuple[int, ...] = ()
    time_s: float = 0.0
    peak_bytes: tuple[int, ...] = ()
    mesh: Mesh | None = None       # mesh of `before` when it is not the plan's source mesh
    dst_mesh: Mesh | None = None   # mesh of `after` when it differs from that of `before`

    def __str__(self) -> str:
        what = self.action if self.kind == "local" else self.kind
        over = f"({', '.join(self.axes)})" if self.axes else ""
        return f"{what}{over}: {self.before} -> {self.after}"


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps from `src` to `dst` and their modelled traffic, memory and time.

    Byte tuples are per rank in the order of `ranks`: the mesh's ranks, or for a plan
    between two meshes (`dst_mesh` set) the ranks of both, ascending.
    """

    mesh: Mesh
    shape: Shape
    dtype: torch.dtype
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    send_bytes: tuple[int, ...]
    recv_bytes: tuple[int, ...]
    lower_bound_bytes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    cost: float
    cost_model: CostModel
    dst_mesh: Mesh | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks that the byte tuples describe, in order."""
        if self.dst_mesh is None:
            return self.mesh.ranks
        return tuple(sorted(set(self.mesh.ranks) | set(self.dst_mesh.ranks)))

    @property
    def collectives(self) -> tuple[Step, ...]:
        """The steps that communicate."""
        return tuple(s for s in self.steps if s.kind != "local")

    @property
    def bound_ratio(self) -> float:
        """Max-rank received bytes over the max-rank lower bound (1.0 when both are 0)."""
        got, bound = max(self.recv_bytes, default=0), max(self.lower_bound_bytes, default=0)
        return 1.0 if got == bound else (math.inf if bound == 0 else got / bound)

    def rows(self) -> tuple[dict[str, Any], ...]:
        """One plain row per step (what `explain()` and `--json` show); bytes are max over ranks."""
        out = []
        for i, step in enumerate(self.steps, 1):
            before = step.mesh or self.mesh
            after = step.dst_mesh or before
            g = (math.prod(before.axis_size(a) for a in step.axes) if step.axes
                 else len(set(before.ranks) | set(after.ranks)))
            out.append({
                "step": i, "kind": step.kind, "action": step.action, "axes": list(step.axes),
                "group_size": g, "op": step.op,
                "before": str(step.before), "after": str(step.after),
                "local_shape_before": list(_local_shape(self, before, step.before)),
                "local_shape_after": list(_local_shape(self, after, step.after)),
                "send_bytes": max(step.send_bytes), "recv_bytes": max(step.recv_bytes),
                "time_s": step.time_s, "peak_bytes": max(step.peak_bytes),
            })
        return tuple(out)

    def summary(self) -> dict[str, Any]:
        """Totals of the plan as plain data (max over ranks unless named `_sum`)."""
        return {
            "mesh": str(self.mesh), "shape": list(self.shape), "dtype": str(self.dtype),
            "src": str(self.src), "dst": str(self.dst),
            "collectives": len(self.collectives), "steps": len(self.steps),
            "send_bytes": max(self.send_bytes), "recv_bytes": max(self.recv_bytes),
            "recv_bytes_sum": sum(self.recv_bytes),
            "lower_bound_bytes": max(self.lower_bound_bytes),
            "bound_ratio": self.bound_ratio if math.isfinite(self.bound_ratio) else None,
            "peak_bytes": max(self.peak_bytes),
            "cost_s": self.cost,
        }

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data: summary plus one row per step."""
        return {**self.summary(), "plan": list(self.rows())}

    def explain(self) -> str:
        """The plan as a plain-text table: one row per step, then totals against the bound.

        `print(plan)` prints the same; `mc.show_plan(plan)` draws it with rich and adds
        the pictures of the layouts before and after.
        """
        from .explain import format_plan

        return format_plan(self)

    def __str__(self) -> str:
        return self.explain()


def _local_shape(p: Plan, mesh: Mesh, layout: Layout) -> Shape:
    """The largest local shape any rank holds under `layout` (ranks differ when uneven)."""
    shapes = [layout.local_shape(mesh, p.shape, r) for r in mesh.ranks]
    return max(shapes, key=math.prod)


def plan(mesh: Mesh, shape: Shape, src: str | Layout, dst: str | Layout, *,
         dtype: torch.dtype = torch.float32, cost_model: CostModel | None = None,
         dst_mesh: Mesh | None = None) -> Plan:
    """Cheapest exact sequence of collectives that turns layout `src` into `dst`.

    With `dst_mesh`, `dst` lives on that other mesh (disjoint, overlapping or nested):
    see `meshcomm.crossmesh`.

    >>> p = plan(Mesh("dp=2 tp=4"), (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)")
    >>> [step.kind for step in p.steps]
    ['all_to_all']
    """
    if type(shape) is not tuple:
        shape = _as_shape(shape)
    return _plan_args(mesh, shape, src, dst, dtype, cost_model or _DEFAULT_COST, dst_mesh)


def _as_shape(shape: object) -> Shape:
    try:
        return tuple(shape)  # type: ignore[arg-type, call-overload, no-any-return, unused-ignore]
    except TypeError:
        raise PlanError(f"shape must be a sequence of ints such as (8, 16), got {shape!r}") from None


@functools.lru_cache(maxsize=4096)
def _plan_args(mesh: Mesh, shape: Shape, src: str | Layout, dst: str | Layout,
               dtype: torch.dtype, cost_model: CostModel, dst_mesh: Mesh | None) -> Plan:
    """`plan` keyed on the arguments as given, so a repeated call is one dict lookup."""
    for name, value in (("mesh", mesh), ("dst_mesh", dst_mesh)):
        if value is not None and not isinstance(value, Mesh):
            raise PlanError(f"{name} must be a meshcomm Mesh, got {type(value).__name__};"
                            ' fix: mc.Mesh("dp=2 tp=4")')
    if mesh is None:
        raise PlanError('mesh must be a meshcomm Mesh, got None; fix: mc.Mesh("dp=2 tp=4")')
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(cost_model, CostModel):
        raise PlanError(f"cost_model must be a meshcomm CostModel, got {cost_model!r};"
                        " fix: mc.CostModel(latency_s=..., bandwidth=...)")
    bad = [s for s in shape if isinstance(s, bool) or not isinstance(s, int)]
    if bad and not all(hasattr(s, "__index__") and not isinstance(s, bool) for s in bad):
        raise PlanError(f"shape must hold ints, got {tuple(shape)!r} ({bad[0]!r} is a"
                        f" {type(bad[0]).__name__}); fix: pass sizes such as (8, 16)")
    shape = tuple(int(s) for s in shape)
    src_l, dst_l = as_layout(src, "src"), as_layout(dst, "dst")
    if dst_mesh is not None and dst_mesh != mesh:
        from .crossmesh import cross_plan  # a sibling pure module built on this one

        return cross_plan(mesh, dst_mesh, shape, dtype, src_l, dst_l, cost_model)
    return _plan(mesh, shape, dtype, src_l, dst_l, cost_model)


@functools.lru_cache(maxsize=4096)
def _plan(mesh: Mesh, shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout,
          cost_model: CostModel) -> Plan:
    start, goal = from_layout(src, mesh, shape), from_layout(dst, mesh, shape)
    _check_ops(src, dst)
    itemsize = torch.empty((), dtype=dtype).element_size()
    moves = _search(start, goal, mesh, itemsize, cost_model)
    names = dst.dim_names(mesh)
    steps = []
    state, layout = start, src
    src_sizes = _times(local_numels(start, mesh), itemsize)
    for i, move in enumerate(moves):
        after = dst if move.after == goal else to_layout(move.after, names, mesh)
        steps.append(_step(move, state, layout, after, mesh, itemsize, cost_model,
                           src_sizes if i else None))
        state, layout = move.after, after
    zeros = (0,) * mesh.size
    send = tuple(map(sum, zip(zeros, *(s.send_bytes for s in steps))))
    recv = tuple(map(sum, zip(zeros, *(s.recv_bytes for s in steps))))
    peak = tuple(map(max, zip(src_sizes, *(s.peak_bytes for s in steps))))
    lower = _times(bounds.lower_bound_elements(mesh, shape, src, dst), itemsize)
    return Plan(mesh, shape, dtype, src, dst, tuple(steps), send, recv, lower, peak,
                sum(s.time_s for s in steps), cost_model)


def _times(values: tuple[int, ...], factor: int) -> tuple[int, ...]:
    """Per-rank counts times `factor` (one multiplication when every rank is alike)."""
    if values.count(values[0]) == len(values):
        return (values[0] * factor,) * len(values)
    return tuple(map(factor.__mul__, values))


def _check_ops(src: Layout, dst: Layout) -> None:
    shared = [a for a in src.partial_axes if a in dst.partial_axes]
    if shared and src.reduce_op != dst.reduce_op:
        raise PlanError(
            f'src "{src}" has a pending {src.reduce_op} over {", ".join(shared)} but dst "{dst}"'
            f" asks for a pending {dst.reduce_op} there; one axis cannot mix two reductions."
            f" fix: resolve the {src.reduce_op} first (reshard to a layout without"
            f" | {src.reduce_op}({', '.join(shared)})), then mark the new one"
        )


def _step(move: Move, state: State, before: Layout, after: Layout, mesh: Mesh, itemsize: int,
          cost_model: CostModel, held: tuple[int, ...] | None) -> Step:
    live = (local_numels_tensor(state, mesh) + local_numels_tensor(move.after, mesh)).reshape(-1)
    live = live * itemsize + (torch.tensor(held) if held else 0)
    peak = tuple(live.tolist())
    send, recv = _times(move.send, itemsize), _times(move.recv, itemsize)
    time = 0.0 if move.kind == "local" else cost_model.time(
        move.axes, max(max(send), max(recv)))
    return Step(move.kind, move.axes, before, after, move.action, move.op, move.dim, move.pre,
                move.post, move.pairs, (), send, recv, time, peak)


def _search(start: State, goal: State, mesh: Mesh, itemsize: int,
            cost_model: CostModel) -> tuple[Move, ...]:
    """Least (time, peak, steps, index-list steps) path from `start` to `goal` (Pareto labels).

    On meshes of up to `_UNGUIDED_RANKS` ranks, Dijkstra first; a search that pops more
    than `_UNGUIDED_POPS` states (and any search on a larger mesh) runs as A* on the time:
    the queue then orders paths by time so far plus a lower bound of the time still
    needed (the lower bound on bytes from the state to the goal over the fastest link). The bound holds for every correct plan, so the first path to reach the
    goal is the least one in all four criteria either way (peak, steps and index-list
    steps only grow along a path); A* expands far fewer states on large searches, and
    small ones skip the cost of bounding every state.
    """
    if mesh.size <= _UNGUIDED_RANKS:
        try:
            return _search_from(start, goal, mesh, itemsize, cost_model, guided=False)
        except _TooLong:
            pass
    return _search_from(start, goal, mesh, itemsize, cost_model, guided=True)


# Bounding a state costs about as much as expanding it; on small meshes most searches pop
# a handful of states, so they go unguided; large meshes and long searches use A*.
_UNGUIDED_RANKS = 64
_UNGUIDED_POPS = 12


class _TooLong(Exception):
    """An unguided search popped more than `_UNGUIDED_POPS` states."""


def _search_from(start: State, goal: State, mesh: Mesh, itemsize: int,
                 cost_model: CostModel, guided: bool) -> tuple[Move, ...]:
    src_numels = local_numels_tensor(start, mesh)
    first: Key = (0.0, int(src_numels.max()) * itemsize, 0, 0)
    counter = itertools.count()
    per_byte = 1.0 / max(cost_model.bandwidth_of(a) for a in mesh.axis_names)
    pops = 0

    def ahead(key: Key, state: State) -> Key:
        if not guided:
            return key
        rest = max(bounds.state_bound(state, goal, mesh)) * itemsize * per_byte
        return (round(key[0] + rest, 15),) + key[1:]

    heap: list[tuple[Key, int, Key, State, tuple[Move, ...], Key | None]] = [
        (ahead(first, start), next(counter), first, start, (), None)]
    labels: dict[State, list[Key]] = {start: [first]}

    def relax(key: Key, state: State, move: Move, path: tuple[Move, ...]) -> None:
        nkey = _extend(key, move, state, mesh, itemsize, cost_model, src_numels, bool(path))
        if move.estimate:   # a lower bound of its key: price it when it is popped
            heapq.heappush(heap, (ahead(nkey, move.after), next(counter), nkey, move.after,
                                  path + (move,), key))
            return
        if any(_dominates(k, nkey) for k in labels.get(move.after, [])):
            return
        kept = [k for k in labels.get(move.after, []) if not _dominates(nkey, k)]
        labels[move.after] = kept + [nkey]
        heapq.heappush(heap, (ahead(nkey, move.after), next(counter), nkey, move.after,
                              path + (move,), None))

    while heap:
        _, _, key, state, path, before = heapq.heappop(heap)
        if before is not None:   # an estimated send_recv: price it exactly, then queue it
            *head, last = path
            exact = send_recv_move(head[-1].after if head else start, last.after, mesh)
            assert exact is not None, f"no send_recv to {last.after}"
            relax(before, head[-1].after if head else start, exact, tuple(head))
            continue
        if state == goal:
            return path
        if key not in labels.get(state, ()):
            continue
        pops += 1
        if pops > _UNGUIDED_POPS and not guided:
            raise _TooLong
        for move in _moves(state, goal, mesh, cost_model.native):
            relax(key, state, move, path)
    raise PlanError(f"no plan found from {start} to {goal}; this is a meshcomm bug, please report it")


Key = tuple[float, int, int, int]
_DEFAULT_COST = CostModel()


def _moves(state: State, goal: State, mesh: Mesh, native: tuple[str, ...]) -> Iterator[Move]:
    for move in _all_moves(state, goal, mesh):
        if move.kind == "local" or move.kind in native:
            yield move


def _all_moves(state: State, goal: State, mesh: Mesh) -> Iterator[Move]:
    yield from expand(state, goal, mesh)
    moves = [send_recv_move(state, t, mesh, exact=False) for t in send_recv_targets(state, goal, mesh)]
    moves.append(reindex_move(state, goal, mesh))
    yield from (m for m in moves if m is not None)


def _extend(key: Key, move: Move, state: State, mesh: Mesh, itemsize: int,
            cost_model: CostModel, src_numels: torch.Tensor, held: bool) -> Key:
    # Per-rank counts as tensors of the mesh's shape: O(ranks) in C, not in Python.
    live_t = local_numels_tensor(state, mesh) + local_numels_tensor(move.after, mesh)
    if held:
        live_t = live_t + src_numels
    live = int(live_t.max()) * itemsize
    time = 0.0
    if move.kind != "local":
        busiest = max(max(move.send), max(move.recv)) * itemsize
        time = cost_model.time(move.axes, busiest)
    # Last tie-break: fewer steps driven by index lists (send_recv, select, reindex).
    return (round(key[0] + time, 15), max(key[1], live), key[2] + 1,
            key[3] + move.indexed)


def _dominates(a: Key, b: Key) -> bool:
    return all(x <= y for x, y in zip(a, b))


# -- the plan caches: bounded, and the bound is configurable ----------------------------
DEFAULT_PLAN_CACHE_SIZE = 4096


def set_plan_cache_size(size: int) -> None:
    """Bound each of the two plan caches at `size` entries (default 4096), emptying them.

    `plan()` caches its results twice: keyed on the arguments as given (`_plan_args`) and
    on the normalized layouts (`_plan`); each drops its least recently used plan beyond
    `size`. `size=0` turns caching off (every call plans again). Process-wide: call it
    once at start-up, on every rank.

    >>> set_plan_cache_size(256); plan_cache_info()["maxsize"]
    256
    >>> set_plan_cache_size(DEFAULT_PLAN_CACHE_SIZE)
    """
    global _plan_args, _plan
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PlanError(f"plan cache size must be an int >= 0, got {size!r};"
                        f" fix: e.g. set_plan_cache_size({DEFAULT_PLAN_CACHE_SIZE})")
    _plan_args = functools.lru_cache(maxsize=size)(_plan_args.__wrapped__)
    _plan = functools.lru_cache(maxsize=size)(_plan.__wrapped__)
    # crossmesh imported `_plan` by name: point it at the new cache too.
    crossmesh = sys.modules.get(f"{__package__}.crossmesh")
    if crossmesh is not None:
        crossmesh._plan = _plan  # type: ignore[attr-defined]


def plan_cache_info() -> dict[str, int]:
    """The plan caches' bound and fill, as plain data.

    `maxsize` bounds each cache; `plans` counts distinct plans held (`_plan`), `calls` the
    distinct argument spellings (`_plan_args`); `hits` and `misses` count `plan()` calls.

    >>> sorted(plan_cache_info())
    ['calls', 'hits', 'maxsize', 'misses', 'plans']
    """
    calls, plans = _plan_args.cache_info(), _plan.cache_info()
    return {"maxsize": int(calls.maxsize or 0), "plans": plans.currsize,
            "calls": calls.currsize, "hits": calls.hits, "misses": calls.misses}
