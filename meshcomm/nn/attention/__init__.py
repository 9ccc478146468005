"""Attention whose sequence is split over mesh axes (context parallelism), declared as a
layout: `mc.nn.attention(q, k, v, bound, "(dp b) (tp h) (cp s) d", causal=True)`.

Building-block layer. The call is resolved once from the arguments (`call.py`), the
strategy picked from what each one moves (`strategies.costs`), and run with meshcomm plans
and the block math of `blocks.py` (backward: autograd through the plans), or as a ring of
point-to-point steps that overlap with the blocks' math (`ring.py`, its own backward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...core.errors import ShapeError
from ...core.layout import Layout
from ...runtime.bind import BoundMesh, require_bound
from .blocks import Mask, reference
from .call import Call, resolve
from .strategies import Cost, allgather, costs, ulysses
from .strategies import ring as ring_strategy  # `ring` names the module (ring.py)

STRATEGIES: dict[str, Callable[[Call, Tensor, Tensor, Tensor, Tensor | None], Tensor]] = {
    "allgather": allgather,
    "ulysses": ulysses,
    "ring": ring_strategy,
}

__all__ = ["Cost", "Mask", "STRATEGIES", "attention", "attention_costs",
           "attention_reference", "reference"]


def attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                        window: int | None = None, document_ids: Tensor | None = None,
                        scale: float | None = None) -> Tensor:
    """One process's attention of whole `b h s d` tensors, with the masks of `attention`:
    what every strategy equals (the tests compare with it)."""
    return reference(q, k, v, Mask(causal, window), scale, document_ids)


def attention(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout, *,
              kv_layout: str | Layout | None = None, causal: bool = False,
              window: int | None = None, document_ids: Tensor | None = None,
              scale: float | None = None, strategy: str = "auto", dims: str = "b h s d",
              shape: Sequence[int] | None = None,
              kv_shape: Sequence[int] | None = None,
              memory_budget: int | None = None) -> Tensor:
    """Scaled dot-product attention of this rank's `q`, `k`, `v` (local tensors under
    `layout`, keys and values under `kv_layout`, default the same), its output in `q`'s
    layout; differentiable, exact (every strategy equals one process's attention).

    >>> y = mc.nn.attention(q, k, v, bound, "(dp b) (tp h) (cp s) d", causal=True)  # doctest: +SKIP

    `dims` names the batch (optional), heads, sequence and head-dim dims of the layouts; the
    sequence may be split over any axes, in any order ("(cp s)" contiguous, "(s cp)"
    striped): each rank's queries and keys are located by their global positions, so the
    masks hold whatever the split. `causal`, `window` (keys fewer than `window` positions
    away) and `document_ids` (per token, in `layout`'s batch and sequence dims: a query
    sees keys of its own document only) combine. Keys and values may have fewer heads
    (GQA: a whole number of query heads per key head) and another sequence length.
    `strategy`: "allgather", "ulysses", "ring" or "auto" (the one sending the fewest bytes,
    `attention_costs`; with `memory_budget`, bytes, only among those whose extra memory
    fits it). `shape` / `kv_shape`: the global shapes, needed when a split is uneven.
    """
    bound = require_bound(bound, "attention")
    call = resolve(q, k, v, bound, layout, kv_layout, dims, shape, kv_shape,
                   Mask(causal, window), scale)
    if document_ids is not None and call.q_shape[call.seq_dim] != call.kv_shape[call.seq_dim]:
        raise ShapeError("attention(document_ids=...): documents need one sequence for queries"
                         " and keys (self-attention); fix: pass equal lengths")
    name = pick(call, q.dtype, memory_budget) if strategy == "auto" else strategy
    if name not in STRATEGIES:
        raise ShapeError(f"attention(strategy={strategy!r}): expected 'auto' or one of"
                         f" {sorted(STRATEGIES)}")
    return STRATEGIES[name](call, q, k, v, document_ids)


@functools.lru_cache(maxsize=1024)
def pick(call: Call, dtype: torch.dtype, memory_budget: int | None = None) -> str:
    """The strategy `auto` runs: the fewest bytes sent, then the least extra memory, among
    those whose extra memory fits `memory_budget` (bytes; None: any). Computed once per call
    signature (the ring's figures visit every block of the group)."""
    runnable = [c for c in costs(call, dtype) if c.strategy in STRATEGIES]
    fits = [c for c in runnable if memory_budget is None or c.extra_bytes <= memory_budget]
    if not fits:
        need = ", ".join(f"{c.strategy} {c.extra_bytes:,} B" for c in runnable)
        raise ShapeError(f"attention(memory_budget={memory_budget:,}): no strategy fits; their"
                         f" extra memory on rank {call.bound.rank}: {need}. fix: raise the"
                         " budget, or split the sequence over more ranks")
    return min(fits, key=lambda c: (c.sent_bytes, c.extra_bytes)).strategy


def attention_costs(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout, *,
                    kv_layout: str | Layout | None = None, dims: str = "b h s d",
                    shape: Sequence[int] | None = None,
                    kv_shape: Sequence[int] | None = None) -> list[Cost]:
    """Every strategy's bytes, extra memory and calls on this rank for these arguments
    (nothing runs), as `attention(..., strategy="auto")` compares them."""
    call = resolve(q, k, v, require_bound(bound, "attention_costs"), layout, kv_layout, dims,
                   shape, kv_shape, Mask(), None)
    return costs(call, q.dtype)
