"""The plan values: CostModel, Transfer, Step and Plan (frozen, pure, below every planner module).

Nothing here searches or communicates, and nothing here imports the planner's search:
the only planner modules below these values are `rearrange` (a step's local moves) and
`explain`, through which `Plan.explain()` and `print(plan)` format (it reads a plan's
fields only). Executors import this module and nothing else of the planner.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import PlanError
from ..core.layout import Layout, Shape
from ..core.mesh import AxisName, Mesh
from .explain import format_plan
from .rearrange import Rearrange as Rearrange  # re-exported: executors import values only

STEP_KINDS = ("local", "all_gather", "reduce_scatter", "all_reduce", "all_to_all",
              "collective_permute", "send_recv")
# How each step kind is carried out: the collective its steps hand their buffers to
# (`Step.wire`). The planner decides it (`wire_of`) and `explain()` shows it; executors
# only follow it. "send/recv" is a batch of point-to-point messages (between meshes).
WIRES: dict[str, tuple[str, ...]] = {
    "local": ("",),
    "all_gather": ("all_gather", "all_to_all"),
    "reduce_scatter": ("reduce_scatter", "all_to_all"),
    "all_reduce": ("all_reduce",),
    "all_to_all": ("all_to_all",),
    "collective_permute": ("all_to_all",),
    "send_recv": ("all_to_all", "send/recv"),
}


def wire_of(kind: str, dim: int | None = None, between_meshes: bool = False) -> str:
    """The collective a step of `kind` runs as: an uneven (chunk) all_gather or
    reduce_scatter, a permute and a send_recv as one all_to_all with uneven splits (every
    backend has one), a send_recv between meshes as point-to-point messages.

    >>> wire_of("all_gather"), wire_of("all_gather", dim=0), wire_of("collective_permute")
    ('all_gather', 'all_to_all', 'all_to_all')
    """
    if kind == "send_recv":
        return "send/recv" if between_meshes else "all_to_all"
    if kind in ("all_gather", "reduce_scatter") and dim is not None:
        return "all_to_all"
    return WIRES[kind][0]


def _pairs(value: float | Mapping[str, float] | tuple[tuple[str, float], ...]
           ) -> tuple[tuple[str, float], ...]:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), float(v)) for k, v in value.items()))
    if isinstance(value, tuple):
        return tuple(sorted(value))
    return (("*", float(value)),)


# Per backend, the (latency_s, bandwidth) a CostModel takes where none is given: one latency
# per collective call (a tree step pays one per round), and bytes of the busiest rank per
# second. gloo: fitted on this project's 2-core test machine (loopback TCP, 4 and 8
# processes, 8 B to 4 MiB: `python benchmarks/calibrate_gloo.py`, results in
# benchmarks/results/calibrate_gloo.json). nccl: NCCL's own tuning model
# (src/graph/tuning.cc: a ring collective's base latency is 6.6 us (LL) to 8.4 us
# (Simple), plus 0.6 to 3.4 us per NVLink hop), about 10 us a call inside a node, and
# 100 GB/s, below NVLink's and about an NDR InfiniBand link's (50 GB/s each way).
BACKEND_FIGURES: dict[str, tuple[float, float]] = {
    "nccl": (10e-6, 100e9),
    "gloo": (1.0e-3, 1.0e9),
}
# The collectives a `CostModel(wires=...)` may time apart: every step's wire and "p2p", a
# batch of point-to-point messages every member of a group posts together (a ring's shift).
WIRE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send/recv", "p2p")


def _wires(value: Any) -> tuple[tuple[str, float, float], ...]:
    """`wires` canonical: (wire, latency_s, bandwidth) triples sorted by wire, from a mapping
    {wire: (latency_s, bandwidth)} or such triples."""
    if isinstance(value, Mapping):
        value = tuple((w, *figures) for w, figures in value.items())
    return tuple(sorted((str(w), float(lat), float(bw)) for w, lat, bw in value))


@dataclass(frozen=True)
class CostModel:
    """Latency and bandwidth per mesh axis: step time = latency + max-rank bytes / bandwidth.

    A collective over several axes pays the largest latency and the smallest
    bandwidth among them; a tree step (several rounds) pays one latency per round. Local
    steps cost nothing. Where `latency_s` or `bandwidth` is not given, the `backend`'s
    figures stand in (`BACKEND_FIGURES`: gloo measured on a CPU machine, nccl from NCCL's
    tuning model), so a plan of k rounds wins only where its bytes pay for the k - 1
    extra latencies. Those defaults are a guide, not a prediction of your network: a plan
    made without given figures prints no time (`models_time` is False); pass a CostModel
    with your network's numbers to see modelled times.

    `native` names the step kinds the backend runs as real collectives (NCCL and
    gloo run them all). The planner never uses a kind outside it: nothing is
    emulated behind the cost model's back. `trees=False` leaves out tree steps (a
    send_recv in several rounds, `meshcomm.planner.trees`), so that every step is one
    collective call: the training blocks plan so, since their plans run every step and a
    tree's rounds share no bucket.

    >>> cm = CostModel(latency_s={"dp": 20e-6, "tp": 2e-6}, bandwidth={"dp": 25e9, "tp": 450e9})
    >>> cm.time(("dp",), 25_000) > cm.time(("tp",), 25_000)
    True
    >>> CostModel(backend="gloo").time(("dp",), 0) > CostModel().time(("dp",), 0) > 0
    True
    """

    latency_s: Any = None
    bandwidth: Any = None
    backend: str = "nccl"
    native: Any = STEP_KINDS
    trees: bool = True
    wires: Any = ()
    _lat: tuple[tuple[str, float], ...] = field(init=False, repr=False, compare=False)
    _bw: tuple[tuple[str, float], ...] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)
    _lat_of: dict[str, float] = field(init=False, repr=False, compare=False)
    _bw_of: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_FIGURES:
            raise PlanError(f"CostModel(backend={self.backend!r}) is not a backend with figures;"
                            f" backends are {', '.join(BACKEND_FIGURES)}. fix: name one, or"
                            " give latency_s= and bandwidth= yourself")
        latency, bandwidth = BACKEND_FIGURES[self.backend]
        object.__setattr__(self, "latency_s",
                           _pairs(latency if self.latency_s is None else self.latency_s))
        object.__setattr__(self, "bandwidth",
                           _pairs(bandwidth if self.bandwidth is None else self.bandwidth))
        if any(v <= 0 for _, v in self.bandwidth) or any(v < 0 for _, v in self.latency_s):
            raise PlanError(f"CostModel needs bandwidth > 0 and latency >= 0, got {self}")
        unknown = set(self.native) - set(STEP_KINDS)
        if unknown:
            raise PlanError(f"CostModel(native=...) names unknown step kinds {sorted(unknown)};"
                            f" kinds are {', '.join(STEP_KINDS)}")
        object.__setattr__(self, "native", tuple(k for k in STEP_KINDS if k in set(self.native)))
        object.__setattr__(self, "wires", _wires(self.wires))
        unknown = {w for w, _, _ in self.wires} - set(WIRE_NAMES)
        if unknown:
            raise PlanError(f"CostModel(wires=...) names unknown wires {sorted(unknown)};"
                            f" wires are {', '.join(WIRE_NAMES)}")
        if any(bw <= 0 or lat < 0 for _, lat, bw in self.wires):
            raise PlanError(f"CostModel(wires=...) needs bandwidth > 0 and latency >= 0 for"
                            f" every wire, got {self.wires}")
        object.__setattr__(self, "_hash", hash((self.latency_s, self.bandwidth, self.backend,
                                                self.native, self.trees, self.wires)))
        object.__setattr__(self, "_lat", self.latency_s)
        object.__setattr__(self, "_bw", self.bandwidth)
        # per-axis figures as dicts, built once (a plan asks them many times)
        object.__setattr__(self, "_lat_of", dict(self.latency_s))
        object.__setattr__(self, "_bw_of", dict(self.bandwidth))

    def __hash__(self) -> int:  # computed once: plans are cached on the cost model
        return self._hash

    @staticmethod
    def _get(found: dict[str, float], axis: str, default: float) -> float:
        return found.get(axis, found.get("*", default))

    @property
    def models_time(self) -> bool:
        """False for the backend's default figures (they plan, but are no prediction of your
        network), so printed plans leave times out. True once other figures are given.

        >>> CostModel().models_time, CostModel(latency_s=5e-6).models_time
        (False, True)
        """
        latency, bandwidth = BACKEND_FIGURES[self.backend]
        return ((self._lat, self._bw) != (_pairs(latency), _pairs(bandwidth))
                or bool(self.wires))

    def latency_of(self, axis: AxisName) -> float:
        """Seconds of one call over `axis` that moves nothing."""
        return self._get(self._lat_of, axis, BACKEND_FIGURES[self.backend][0])

    def bandwidth_of(self, axis: AxisName) -> float:
        """Bytes per second of `axis`."""
        return self._get(self._bw_of, axis, BACKEND_FIGURES[self.backend][1])

    def time(self, axes: tuple[AxisName, ...], max_bytes: int, wire: str | None = None
             ) -> float:
        """Modelled seconds of one collective over `axes` whose busiest rank moves
        `max_bytes`: `wire`'s own figures where `wires` names it, else the axes'.

        >>> cm = CostModel(latency_s=1e-3, bandwidth=1e9, wires={"p2p": (1e-4, 1e9)})
        >>> round(cm.time(("cp",), 0) * 1e6), round(cm.time(("cp",), 0, wire="p2p") * 1e6)
        (1000, 100)
        """
        for name, lat, bw in self.wires:
            if name == wire:
                return float(lat + max_bytes / bw)
        if len(axes) == 1:
            return self.latency_of(axes[0]) + max_bytes / self.bandwidth_of(axes[0])
        latency = max(self.latency_of(a) for a in axes)
        bandwidth = min(self.bandwidth_of(a) for a in axes)
        return latency + max_bytes / bandwidth


@dataclass(frozen=True, slots=True, repr=False)
class Transfer:
    """Part of a send_recv step: `src` sends `dst` the cartesian block of its local tensor at
    per-dim positions `src_index`; `dst` writes it at per-dim positions `dst_index` of its output.
    Positions are a tuple of ints per dim, or a `range` where they are one run (so a plan's
    size follows its blocks, not their lengths: compare with `tuple(ix)`).

    Ranks are global. A pair may have several transfers; they travel in tuple order.
    `src == dst` is a local copy and moves no bytes. `mc.sim.send_recv` takes these too
    (it reads `src_index` only).
    """

    src: int
    dst: int
    src_index: tuple[Sequence[int], ...]
    dst_index: tuple[Sequence[int], ...] = ()
    round: int = 0     # a tree step's round (`Step.rounds`); 0 for every other step

    @property
    def numel(self) -> int:
        return math.prod(len(ix) for ix in self.src_index)

    def __repr__(self) -> str:
        at = f", round={self.round}" if self.round else ""
        return (f"Transfer(src={self.src}, dst={self.dst}, src_index={self.src_index!r},"
                f" dst_index={self.dst_index!r}{at})")


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a plan: a collective (or local move) over `axes`, from `before` to `after`.

    `pre`/`post` are the local rearranges around the collective; `dim` is the
    tensor dim of an uneven (chunk) collective; `pairs` the (source, destination)
    group positions of a permute; `transfers` the blocks of a send_recv step between
    meshes where the planner lists them; otherwise `rank_transfers(rank)` gives one rank's
    blocks when it runs (the planner leaves that function in `blocks_of`, so an executor
    needs nothing of the planner but this value). `wire` is the
    collective the step runs as (`wire_of`: e.g. an uneven all_gather as an
    all_to_all), "" for a local step. `action`: what a local step does; for a send_recv,
    "tree" (rounds of messages), "rotate" (senders rotated over the source's replicas,
    `planner.transfers.rotated_sends`) or "". Bytes are per rank, in the order of the
    plan's `ranks`.
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
    wire: str = ""
    rounds: int = 1                # all_to_alls a tree step runs in (action "tree"), else 1
    merge_rounds: int = 0          # of those, the first ones, that combine partials
    blocks_of: Callable[[int], tuple[Transfer, ...]] | None = field(
        default=None, compare=False, repr=False)

    def rank_transfers(self, rank: int) -> tuple[Transfer, ...]:
        """The blocks `rank` sends, receives or keeps in this step (a send_recv, select or
        reindex): the listed `transfers`, else this rank's own, computed (and cached) when
        it runs."""
        if self.transfers or self.blocks_of is None:
            return self.transfers
        return self.blocks_of(rank)

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
        return _union(self.mesh, self.dst_mesh)

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
            g = (before.group_size(step.axes) if step.axes
                 else len(set(before.ranks) | set(after.ranks)))
            out.append({
                "step": i, "kind": step.kind, "action": step.action, "axes": list(step.axes),
                "group_size": g, "op": step.op, "wire": step.wire,
                "before": str(step.before), "after": str(step.after),
                "local_shape_before": list(_local_shape(self, before, step.before)),
                "local_shape_after": list(_local_shape(self, after, step.after)),
                "send_bytes": max(step.send_bytes), "recv_bytes": max(step.recv_bytes),
                "time_s": step.time_s, "peak_bytes": max(step.peak_bytes),
                "rounds": step.rounds,
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
        return format_plan(self)

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        """One line (a REPL shows it): the move, the shape, the mesh and the steps;
        `print(plan)` gives the table.

        >>> mc.plan(mc.Mesh("dp=2"), (8, 6), "(dp b) h", "b h")
        Plan("(dp b) h" -> "b h", shape=(8, 6), float32, Mesh(dp=2), steps=[all_gather(dp)])
        """
        steps = ", ".join(s.action if s.kind == "local" else
                          f"{s.kind}({', '.join(s.axes)})" if s.axes else s.kind
                          for s in self.steps)
        to = f", dst_mesh={self.dst_mesh!r}" if self.dst_mesh is not None else ""
        return (f'Plan("{self.src}" -> "{self.dst}", shape={self.shape},'
                f" {str(self.dtype).removeprefix('torch.')}, {self.mesh!r}{to}, steps=[{steps}])")


def _local_shape(p: Plan, mesh: Mesh, layout: Layout) -> Shape:
    """The largest local shape any rank holds under `layout` (ranks differ when uneven)."""
    shapes = [layout.local_shape(mesh, p.shape, r) for r in mesh.ranks]
    return max(shapes, key=math.prod)



def grad_scale(plan: Plan) -> float:
    """The factor a reshard's backward applies to the resharded gradient: (1/g of an avg
    source) / (1/g of an avg destination), g the size of the avg's group."""
    def share(layout: Layout, mesh: Mesh) -> int:
        if layout.reduce_op != "avg":
            return 1
        return mesh.group_size(layout.partial_axes)
    return share(plan.dst, plan.dst_mesh or plan.mesh) / share(plan.src, plan.mesh)


@functools.lru_cache(maxsize=256)
def _union(a: Mesh, b: Mesh) -> tuple[int, ...]:
    """Both meshes' ranks, ascending (a plan between meshes reads it on every call)."""
    return tuple(sorted(set(a.ranks) | set(b.ranks)))
