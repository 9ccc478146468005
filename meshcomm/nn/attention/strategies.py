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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.layout import Layout
from ...executors.distributed.autograd import reshard_autograd
from ...planner.plan import plan
from ...planner.values import Plan
from ...sharded import reshard
from .blocks import chunked
from .call import Call
from .ring import ring_attention, traffic


def whole_seq(call: Call, layout: Layout) -> Layout:
    """`layout` with its sequence dim whole (no axis splits it)."""
    return layout.with_dim(call.seq_dim, layout.dim_names(call.mesh)[call.seq_dim])


def heads_layout(call: Call, layout: Layout) -> Layout:
    """`layout` with the sequence's axes moved onto the heads (as their most minor splits)."""
    out = whole_seq(call, layout)
    for axis in call.seq_axes:
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
    forward = plan(call.mesh, shape, layout, full, dtype=x.dtype)

    def reverse(_: Plan, dtype: torch.dtype) -> Plan:
        return plan(call.mesh, shape, full.pending("sum", call.seq_axes), layout, dtype=dtype)
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


def ulysses(call: Call, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
    bound = call.bound
    h = call.order[1]
    group = call.q_shape[h] // call.kv_shape[h]
    if group > 1:         # GQA: each query head's key/value head, repeated to its place
        k, v = k.repeat_interleave(group, dim=h), v.repeat_interleave(group, dim=h)
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


@dataclass(frozen=True)
class Cost:
    """One strategy's figures on this rank for a forward and backward: bytes sent (from
    the plans; the ring's from its schedule), extra peak memory (bytes of the largest
    buffers it adds), collective calls (the ring's: point-to-point batches)."""

    strategy: str
    sent_bytes: int
    extra_bytes: int
    calls: int


def _sent(call: Call, shape: tuple[int, ...], src: Layout, dst: Layout,
          dtype: torch.dtype) -> tuple[int, int]:
    """(bytes this rank sends, collectives) of one plan, forward and backward together (the
    backward plan moves as many bytes: a reduce_scatter for an all_gather, the inverse
    all_to_all)."""
    p = plan(call.mesh, shape, src, dst, dtype=dtype)
    at = p.mesh.position(call.bound.rank)
    return 2 * p.send_bytes[at], 2 * len(p.collectives)


def costs(call: Call, dtype: torch.dtype) -> list[Cost]:
    """Every strategy's `Cost` for this call."""
    item = torch.empty((), dtype=dtype).element_size()
    rank, mesh = call.bound.rank, call.mesh
    full = whole_seq(call, call.kv_layout)
    kv_full = math.prod(full.local_shape(mesh, call.kv_shape, rank))
    sent, calls = _sent(call, call.kv_shape, call.kv_layout, full, dtype)
    out = [Cost("allgather", 2 * sent, 2 * kv_full * item, 2 * calls)]
    kv_shape = repeated_kv_shape(call)
    q_heads = heads_layout(call, call.q_layout)
    kv_heads = heads_layout(call, call.kv_layout)
    sq, cq = _sent(call, call.q_shape, call.q_layout, q_heads, dtype)
    sk, ck = _sent(call, kv_shape, call.kv_layout, kv_heads, dtype)
    q_local = math.prod(q_heads.local_shape(mesh, call.q_shape, rank))
    k_local = math.prod(kv_heads.local_shape(mesh, kv_shape, rank))
    out.append(Cost("ulysses", 2 * sq + 2 * sk, (2 * q_local + 2 * k_local) * item,
                    2 * cq + 2 * ck))
    out.append(Cost("ring", *traffic(call, dtype)))
    return out
