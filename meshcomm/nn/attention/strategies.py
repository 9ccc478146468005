"""The strategies of context parallelism, each made of meshcomm plans and `blocks.py`:

- `allgather`: keys and values gathered along the sequence (`"(cp s)" -> "s"`, one plan
  each); each rank attends its own queries to every key. Backward: the plans' reverse, a
  reduce_scatter of dK and dV. Extra memory: the whole K and V.
- `ulysses`: queries, keys and values moved from a split sequence to split heads
  (`"(tp h) (cp s)" -> "(tp cp h) s"`, an all_to_all each) and the output back; each rank
  attends whole sequences of its heads. Heads that do not divide by the group are uneven
  layouts (some ranks hold fewer heads), exact. Key/value heads are repeated to the
  query heads first (GQA), so the heads of a rank always meet their keys.
- `ring`: queries stay; key/value blocks pass around the sequence's group point to point,
  the next one posted before the current one is computed (`ring.py`). Backward: the blocks
  go round again and dK/dV travel with their block back to its owner. Extra memory: two
  blocks of K, V and of dK, dV.

A strategy takes the call (`call.py`) and the user's local tensors, returns the output in
the query layout; autograd runs backward through the plans (the engine's `Reshard`), or
the ring's own function. Every byte figure comes from the plans, or the ring's schedule
(`costs`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.errors import ShapeError
from ...core.layout import Layout
from ...executors.distributed.autograd import reshard_autograd
from ...planner.plan import plan_untraced
from ...planner.values import CostModel, Plan
from ...sharded import reshard
from .blocks import chunked, compute_dtype
from .call import Call
from .ring import Ring, ring_attention, traffic
from .timing import (
    DEFAULT_COST_MODEL,
    DEFAULT_FLOPS,
    check_rate,
    chunked_seconds,
    key_tile,
    pairs,
    per_pair,
    plan_time,
    ring_time,
    serial,
)


def whole_seq(call: Call, layout: Layout) -> Layout:
    """`layout` with its sequence dim whole (no axis splits it)."""
    return layout.with_dim(call.seq_dim, layout.dim_names(call.mesh)[call.seq_dim])


def heads_layout(call: Call, layout: Layout, axes: tuple[str, ...] | None = None) -> Layout:
    """`layout` with the sequence's axes (or those of `axes`) moved onto the heads, as their
    most minor splits."""
    moved = call.seq_axes if axes is None else axes
    out = layout.without_axes(call.seq_dim, moved)
    for axis in moved:
        out = out.split(call.order[1], axis)
    return out


def doc_layout(call: Call, layout: Layout) -> Layout:
    """The layout of per-token document ids: `layout`'s batch and sequence dims."""
    b, _, s, _ = call.order
    dims = [d for d in (b, s) if d >= 0]
    return Layout.of_dims([[f.name if f.size is None else f"{f.name}={f.size}"
                            for f in layout.dims[d].factors] for d in dims])


def _doc_shape(call: Call, shape: tuple[int, ...]) -> tuple[int, ...]:
    b, _, s, _ = call.order
    return tuple(shape[d] for d in (b, s) if d >= 0)


def _docs(doc: Tensor | None) -> Tensor | None:
    """Document ids as (b, s) (a missing batch dim: one row)."""
    return None if doc is None else (doc if doc.dim() == 2 else doc.unsqueeze(0))


def gathered(call: Call, x: Tensor, layout: Layout, shape: tuple[int, ...]) -> Tensor:
    """`x` with its sequence gathered whole; backward: each rank's gradient is its part of a
    sum over the sequence's axes (its queries saw every key), so the reverse plan is a
    reduce_scatter of `"... s ... | sum(cp)"`, not the slice of a replicated gradient."""
    full = whole_seq(call, layout)
    forward = plan_untraced(call.mesh, shape, layout, full, dtype=x.dtype)

    def reverse(_: Plan, dtype: torch.dtype) -> Plan:
        return plan_untraced(call.mesh, shape, full.pending("sum", call.seq_axes), layout,
                             dtype=dtype)
    return reshard_autograd(x, call.bound, forward, reverse=reverse)


def allgather(call: Call, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
    bound, rank = call.bound, call.bound.rank
    full = whole_seq(call, call.kv_twin)       # a zigzag sequence: gathered as its twin
    k_all = gathered(call, k, call.kv_twin, call.kv_shape)
    v_all = gathered(call, v, call.kv_twin, call.kv_shape)
    qpos = call.positions(call.q_layout, call.q_shape, rank)
    kpos = call.seq_order(call.kv_layout, call.kv_shape)
    kdoc = None
    if doc is not None:
        src = doc_layout(call, call.q_twin)
        kdoc = reshard(doc, bound, src, doc_layout(call, full),
                       shape=_doc_shape(call, call.q_shape))
    out = chunked(call.canonical(q), call.canonical(k_all), call.canonical(v_all), call.mask,
                  call.scale, qpos, kpos, _docs(doc), _docs(kdoc))
    return call.user(out.to(q.dtype))


def repeated_kv_shape(call: Call) -> tuple[int, ...]:
    """The global shape of k and v with their heads repeated to the query heads (GQA, as
    ulysses moves them)."""
    h = call.order[1]
    return tuple(call.q_shape[h] if i == h else n for i, n in enumerate(call.kv_shape))


def repeated_kv(call: Call, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's k and v with each key/value head repeated to the places of its query
    heads (GQA), so that heads split over axes always meet their keys."""
    h = call.order[1]
    group = call.q_shape[h] // call.kv_shape[h]
    if group > 1:
        return k.repeat_interleave(group, dim=h), v.repeat_interleave(group, dim=h)
    return k, v


def ulysses(call: Call, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
    bound = call.bound
    k, v = repeated_kv(call, k, v)
    kv_shape = repeated_kv_shape(call)
    q_twin, kv_layout = call.q_twin, call.kv_twin     # a zigzag sequence: moved as its twin
    q_heads, kv_heads = heads_layout(call, q_twin), heads_layout(call, kv_layout)
    q_h = reshard(q, bound, q_twin, q_heads, shape=call.q_shape)
    k_h = reshard(k, bound, kv_layout, kv_heads, shape=kv_shape)
    v_h = reshard(v, bound, kv_layout, kv_heads, shape=kv_shape)
    qpos = call.seq_order(call.q_layout, call.q_shape)
    kpos = call.seq_order(call.kv_layout, call.kv_shape)
    full_doc = None
    if doc is not None:
        src = doc_layout(call, q_twin)
        full_doc = reshard(doc, bound, src, doc_layout(call, whole_seq(call, q_twin)),
                           shape=_doc_shape(call, call.q_shape))
    out = chunked(call.canonical(q_h), call.canonical(k_h), call.canonical(v_h), call.mask,
                  call.scale, qpos, kpos, _docs(full_doc), _docs(full_doc))
    return reshard(call.user(out.to(q.dtype)), bound, q_heads, q_twin, shape=call.q_shape)


def ring(call: Call, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
    kdoc = doc
    src, dst = doc_layout(call, call.q_layout), doc_layout(call, call.kv_layout)
    if doc is not None and src != dst:       # the keys' ids where the keys are
        kdoc = reshard(doc, call.bound, src, dst, shape=_doc_shape(call, call.q_shape))
    return ring_attention(call, q, k, v, _docs(doc), _docs(kdoc))


def hybrid_axes(call: Call) -> tuple[tuple[str, ...], str]:
    """The hybrid's split of the sequence's axes: (moved to the heads by all_to_all, kept
    for the ring): every axis but the last (mesh order), and the last."""
    axes = tuple(a for a in call.mesh.axis_names if a in call.seq_axes)
    if len(axes) < 2:
        raise ShapeError(f"attention(strategy='hybrid'): the sequence is split over"
                         f" {list(axes)}; the hybrid needs two or more axes (all_to_all on"
                         " one, the ring on another). fix: split the sequence over two mesh"
                         ' axes ("(a r s)"), or pick another strategy')
    return axes[:-1], axes[-1]


def hybrid_call(call: Call) -> Call:
    """The call the hybrid's ring runs: the sequence's axes but the last moved onto the heads
    of q and k, v (whose heads are repeated to the query heads), the ring over the last; a
    zigzag split as its twin, positions relabelled (`Call.unfolded`)."""
    moved, _ = hybrid_axes(call)
    zigzag = bool(call.q_layout.zigzag_dims)
    return dataclasses.replace(
        call, q_layout=heads_layout(call, call.q_twin, moved),
        kv_layout=heads_layout(call, call.kv_twin, moved), kv_shape=repeated_kv_shape(call),
        seq_axes=tuple(a for a in call.seq_axes if a not in moved),
        unfolded=(call.q_layout, call.q_shape) if zigzag else None)


def hybrid(call: Call, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
    """Ulysses over the sequence's axes but the last, then the ring over the last (USP):
    q, k, v move their sequence's first axes onto the heads (an all_to_all each, key/value
    heads repeated to the query heads first), the ring runs over the axis left
    (`hybrid_call`), and the output moves back."""
    sub, bound = hybrid_call(call), call.bound
    k, v = repeated_kv(call, k, v)
    q_h = reshard(q, bound, call.q_twin, sub.q_layout, shape=call.q_shape)
    k_h = reshard(k, bound, call.kv_twin, sub.kv_layout, shape=sub.kv_shape)
    v_h = reshard(v, bound, call.kv_twin, sub.kv_layout, shape=sub.kv_shape)
    qdoc = kdoc = None
    if doc is not None:
        src, dst = doc_layout(call, call.q_twin), doc_layout(call, sub.q_layout)
        qdoc = reshard(doc, bound, src, dst, shape=_doc_shape(call, call.q_shape))
        kdst = doc_layout(call, sub.kv_layout)
        kdoc = qdoc if kdst == dst else reshard(doc, bound, src, kdst,
                                                shape=_doc_shape(call, call.q_shape))
    out = ring_attention(sub, q_h, k_h, v_h, _docs(qdoc), _docs(kdoc))
    return reshard(out, bound, sub.q_layout, call.q_twin, shape=call.q_shape)


@dataclass(frozen=True)
class Cost:
    """One strategy's figures on this rank for a forward and backward: bytes sent (from
    the plans; the ring's from its schedule), extra peak memory (bytes of the largest
    buffers it adds), collective calls (the ring's: point-to-point batches), and modelled
    seconds (`timing.py`): `time_s` in all, `comm_s` of its messages alone and `compute_s`
    of its blocks alone (the group's slowest member's; the ring overlaps the two)."""

    strategy: str
    sent_bytes: int
    extra_bytes: int
    calls: int
    time_s: float
    comm_s: float
    compute_s: float


def _sent(call: Call, shape: tuple[int, ...], src: Layout, dst: Layout,
          dtype: torch.dtype, cost_model: CostModel,
          back: Layout | None = None) -> tuple[int, int, float]:
    """(bytes this rank sends, collectives, modelled seconds) of a plan and its backward,
    the plan from `back` (default `dst`) to `src` (the allgather's: a reduce_scatter of a
    pending sum). Uneven splits send other amounts each way."""
    fwd = plan_untraced(call.mesh, shape, src, dst, dtype=dtype)
    bwd = plan_untraced(call.mesh, shape, dst if back is None else back, src, dtype=dtype)
    at = fwd.mesh.position(call.bound.rank)
    return (fwd.send_bytes[at] + bwd.send_bytes[at], len(fwd.collectives) + len(bwd.collectives),
            plan_time(fwd, cost_model) + plan_time(bwd, cost_model))


def costs(call: Call, dtype: torch.dtype, cost_model: CostModel = DEFAULT_COST_MODEL,
          flops: float = DEFAULT_FLOPS) -> list[Cost]:
    """Every strategy's `Cost` for this call, times under `cost_model` (the links) and
    `flops` (FLOP/s of a rank's attention blocks)."""
    check_rate(flops)
    item = torch.empty((), dtype=dtype).element_size()
    rank, mesh = call.bound.rank, call.mesh
    q_layout, kv_layout = call.q_twin, call.kv_twin
    group = Ring.of(call).ranks              # this rank's sequence group
    d = call.q_shape[call.order[3]]
    kpos = call.seq_order(call.kv_layout, call.kv_shape)   # the gathered keys' order
    full = whole_seq(call, kv_layout)
    kv_full = math.prod(full.local_shape(mesh, call.kv_shape, rank))
    tile = key_tile(call.bound.device)
    sent, calls, comm = _sent(call, call.kv_shape, kv_layout, full, dtype, cost_model,
                              full.pending("sum", call.seq_axes))
    compute = max(chunked_seconds(call.mask, call.positions(call.q_layout, call.q_shape, r),
                                  kpos, per_pair(q_layout.local_shape(mesh, call.q_shape, r),
                                                 call.order, d), flops, tile) for r in group)
    out = [Cost("allgather", 2 * sent, 2 * kv_full * item, 2 * calls,
                *serial(2 * comm, compute))]
    kv_shape = repeated_kv_shape(call)
    q_heads = heads_layout(call, q_layout)
    kv_heads = heads_layout(call, kv_layout)
    sq, cq, tq = _sent(call, call.q_shape, q_layout, q_heads, dtype, cost_model)
    sk, ck, tk = _sent(call, kv_shape, kv_layout, kv_heads, dtype, cost_model)
    q_local = math.prod(q_heads.local_shape(mesh, call.q_shape, rank))
    k_local = math.prod(kv_heads.local_shape(mesh, kv_shape, rank))
    widest = max(per_pair(q_heads.local_shape(mesh, call.q_shape, r), call.order, d)
                 for r in group)
    compute = chunked_seconds(call.mask, call.seq_order(call.q_layout, call.q_shape), kpos,
                              widest, flops, tile)
    out.append(Cost("ulysses", 2 * sq + 2 * sk, (2 * q_local + 2 * k_local) * item,
                    2 * cq + 2 * ck, *serial(2 * tq + 2 * tk, compute)))
    out.append(Cost("ring", *traffic(call, dtype), *_ring_time(call, dtype, cost_model, flops)))
    if len(call.seq_axes) > 1:
        out.append(_hybrid_cost(call, dtype, cost_model, flops))
    return out


def _hybrid_cost(call: Call, dtype: torch.dtype, cost_model: CostModel, flops: float) -> Cost:
    """The hybrid's figures: its all_to_alls (q, k, v and the output, each way) as Ulysses'
    over the moved axes, then the ring's over the axis left (they do not overlap)."""
    sub, item, mesh, rank = hybrid_call(call), torch.empty((), dtype=dtype).element_size(), \
        call.mesh, call.bound.rank
    sq, cq, tq = _sent(call, call.q_shape, call.q_twin, sub.q_layout, dtype, cost_model)
    sk, ck, tk = _sent(call, sub.kv_shape, call.kv_twin, sub.kv_layout, dtype, cost_model)
    moved = (2 * math.prod(sub.q_layout.local_shape(mesh, call.q_shape, rank))
             + 2 * math.prod(sub.kv_layout.local_shape(mesh, sub.kv_shape, rank))) * item
    sent, extra, calls = traffic(sub, dtype)
    time, comm, compute = _ring_time(sub, dtype, cost_model, flops)
    a2a = 2 * tq + 2 * tk
    return Cost("hybrid", 2 * sq + 2 * sk + sent, moved + extra, 2 * cq + 2 * ck + calls,
                a2a + time, a2a + comm, compute)


def _ring_time(call: Call, dtype: torch.dtype, cost_model: CostModel,
               flops: float) -> tuple[float, float, float]:
    """The ring's (time, comm, compute): at step t member j computes its queries against
    the block of member j - t; the hops carry the largest block (every block is on the
    move at every step), each a point-to-point batch (the "p2p" wire)."""
    ring, mesh, d = Ring.of(call), call.mesh, call.q_shape[call.order[3]]
    tile = key_tile(call.bound.device)
    qpos = [call.positions(call.q_layout, call.q_shape, r) for r in ring.ranks]
    kpos = [call.positions(call.kv_layout, call.kv_shape, r) for r in ring.ranks]
    width = [per_pair(call.q_twin.local_shape(mesh, call.q_shape, r), call.order, d)
             for r in ring.ranks]
    work = []
    for t in range(ring.size):
        held = [kpos[(j - t) % ring.size] for j in range(ring.size)]
        work.append(max(pairs(call.mask, qpos[j], held[j], len(held[j]), tile) * width[j]
                        for j in range(ring.size)))
    block = max(math.prod(call.kv_twin.local_shape(mesh, call.kv_shape, r)) for r in ring.ranks)
    item = torch.empty((), dtype=dtype).element_size()
    grad_item = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    kv_s = cost_model.time(ring.axes, 2 * block * item, "p2p") if ring.axes else 0.0
    dkv_s = cost_model.time(ring.axes, 2 * block * grad_item, "p2p") if ring.axes else 0.0
    latency = cost_model.time(ring.axes, 0, "p2p") if ring.axes else 0.0
    return ring_time(work, kv_s, dkv_s, latency, flops)
