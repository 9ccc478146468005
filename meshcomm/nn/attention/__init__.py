"""Attention whose sequence is split over mesh axes (context parallelism), declared as a
layout: `mc.nn.attention(q, k, v, bound, "(dp b) (tp h) (cp s) d", causal=True)`.

Building-block layer. The call is resolved once from the arguments (`call.py`), the
strategy picked by its modelled time (`strategies.costs`, `timing.py`), and run with
meshcomm plans and the block math of `blocks.py` (backward: autograd through the plans), or
as a ring of point-to-point steps that overlap with the blocks' math (`ring.py`, its own
backward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.errors import ShapeError
from ...core.layout import Layout
from ...core.units import format_bytes, format_us
from ...planner.values import CostModel
from ...runtime.bind import BoundMesh, require_bound
from ...runtime.compiler import when_dynamo_loads
from ...sharded.local import concrete, cost_model_of, plain_bound, plain_cost_model, rebind
from .blocks import Mask, reference
from .call import Call, resolve
from .strategies import Cost, allgather, costs, hybrid, ulysses
from .strategies import ring as ring_strategy  # `ring` names the module (ring.py)
from .timing import DEFAULT_COST_MODEL, DEFAULT_FLOPS

STRATEGIES: dict[str, Callable[[Call, Tensor, Tensor, Tensor, Tensor | None], Tensor]] = {
    "allgather": allgather,
    "ulysses": ulysses,
    "ring": ring_strategy,
    "hybrid": hybrid,
}

__all__ = ["AttentionExplain", "Cost", "Mask", "STRATEGIES", "attention", "attention_costs",
           "attention_explain", "attention_reference", "reference"]


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
              memory_budget: int | None = None, cost_model: CostModel | None = None,
              flops: float | None = None) -> Tensor:
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
    `strategy`: "allgather", "ulysses", "ring" or "auto" (the least modelled time,
    `attention_explain`; with `memory_budget`, bytes, only among those whose extra memory
    fits it). The time model: `cost_model` (`mc.CostModel`, the links; default 10 us
    latency and 50 GB/s) and `flops` (FLOP/s of one rank's attention math; default 100e12).
    `shape` / `kv_shape`: the global shapes, needed when a split is uneven.
    """
    bound = require_bound(bound, "attention")
    if torch.compiler.is_compiling():
        static = (plain_bound(bound), str(layout),
                  _plain(None if kv_layout is None else str(kv_layout)), causal,
                  _plain(window), _plain(scale), strategy, dims,
                  _plain(None if shape is None else tuple(int(s) for s in shape)),
                  _plain(None if kv_shape is None else tuple(int(s) for s in kv_shape)),
                  _plain(memory_budget), plain_cost_model(cost_model), _plain(flops))
        return _attention_traced(q, k, v, _plain(document_ids), static)
    return _attention(q, k, v, bound, layout, kv_layout, causal, window, document_ids, scale,
                      strategy, dims, shape, kv_shape, memory_budget, cost_model, flops)


def _attention(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout,
               kv_layout: str | Layout | None, causal: bool, window: int | None,
               document_ids: Tensor | None, scale: float | None, strategy: str, dims: str,
               shape: Sequence[int] | None, kv_shape: Sequence[int] | None,
               memory_budget: int | None, cost_model: CostModel | None,
               flops: float | None) -> Tensor:
    call = resolve(q, k, v, bound, layout, kv_layout, dims, shape, kv_shape,
                   Mask(causal, window), scale)
    if document_ids is not None and call.q_shape[call.seq_dim] != call.kv_shape[call.seq_dim]:
        raise ShapeError("attention(document_ids=...): documents need one sequence for queries"
                         " and keys (self-attention); fix: pass equal lengths")
    name = (pick(call, q.dtype, memory_budget, cost_model or DEFAULT_COST_MODEL,
                 DEFAULT_FLOPS if flops is None else float(flops))
            if strategy == "auto" else strategy)
    if name not in STRATEGIES:
        raise ShapeError(f"attention(strategy={strategy!r}): expected 'auto' or one of"
                         f" {sorted(STRATEGIES)}")
    return STRATEGIES[name](call, q, k, v, document_ids)


# Under torch.compile, Dynamo traces neither the call's resolution nor the planner (a cached
# call with a generator argument stops it): `attention` hands the tensors and plain values
# (str, int, float, tuples; an absent value is (), since None is no graph input) to one
# function marked nonstrict_trace, which AOTAutograd traces down to the collectives and the
# block math, as `mc.reshard` does (meshcomm/sharded/local.py).
def _plain(value: Any) -> tuple[Any, ...]:
    return () if value is None else (value,)


def _given(plain: tuple[Any, ...]) -> Any:
    return plain[0] if plain else None


def _attention_opaque(q: Tensor, k: Tensor, v: Tensor, document_ids: tuple[Tensor, ...],
                      static: tuple[Any, ...]) -> Tensor:
    (bound, layout, kv_layout, causal, window, scale, strategy, dims, shape, kv_shape, budget,
     cost, flops) = concrete(static)
    return _attention(q, k, v, rebind(bound), layout, _given(kv_layout), causal,
                      _given(window), _given(document_ids), _given(scale), strategy, dims,
                      _given(shape), _given(kv_shape), _given(budget), cost_model_of(cost),
                      _given(flops))


# What `attention` calls under torch.compile: `_attention_opaque` marked nonstrict_trace when
# torch._dynamo loads (importing it here would double `import meshcomm`'s time).
_attention_traced = _attention_opaque


def _mark_for_dynamo() -> None:
    global _attention_traced
    _attention_traced = torch._dynamo.nonstrict_trace(_attention_opaque)


when_dynamo_loads(_mark_for_dynamo)


@functools.lru_cache(maxsize=1024)
def pick(call: Call, dtype: torch.dtype, memory_budget: int | None = None,
         cost_model: CostModel = DEFAULT_COST_MODEL, flops: float = DEFAULT_FLOPS) -> str:
    """The strategy `auto` runs: the least modelled time (then the fewest bytes, then the
    least extra memory) among those whose extra memory fits `memory_budget` (bytes; None:
    any). Computed once per call signature (the figures visit every block of the group)."""
    return _pick(_runnable(call, dtype, cost_model, flops), call, memory_budget)


def _runnable(call: Call, dtype: torch.dtype, cost_model: CostModel, flops: float
              ) -> list[Cost]:
    return [c for c in costs(call, dtype, cost_model, flops) if c.strategy in STRATEGIES]


def _pick(runnable: list[Cost], call: Call, memory_budget: int | None) -> str:
    fits = [c for c in runnable if memory_budget is None or c.extra_bytes <= memory_budget]
    if not fits:
        need = ", ".join(f"{c.strategy} {c.extra_bytes:,} B" for c in runnable)
        raise ShapeError(f"attention(memory_budget={memory_budget:,}): no strategy fits; their"
                         f" extra memory on rank {call.bound.rank}: {need}. fix: raise the"
                         " budget, or split the sequence over more ranks")
    return min(fits, key=lambda c: (c.time_s, c.sent_bytes, c.extra_bytes)).strategy


def _costs_call(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout,
                kv_layout: str | Layout | None, dims: str, shape: Sequence[int] | None,
                kv_shape: Sequence[int] | None, causal: bool, window: int | None,
                what: str) -> Call:
    return resolve(q, k, v, require_bound(bound, what), layout, kv_layout, dims, shape,
                   kv_shape, Mask(causal, window), None)


def attention_costs(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout, *,
                    kv_layout: str | Layout | None = None, dims: str = "b h s d",
                    shape: Sequence[int] | None = None,
                    kv_shape: Sequence[int] | None = None, causal: bool = False,
                    window: int | None = None, cost_model: CostModel | None = None,
                    flops: float | None = None) -> list[Cost]:
    """Every strategy's bytes, extra memory, calls and modelled time on this rank for these
    arguments (nothing runs), as `attention(..., strategy="auto")` compares them.

    `causal` and `window` set which blocks are computed (the time's compute part);
    `cost_model` and `flops` as in `attention`."""
    call = _costs_call(q, k, v, bound, layout, kv_layout, dims, shape, kv_shape, causal,
                       window, "attention_costs")
    return costs(call, q.dtype, cost_model or DEFAULT_COST_MODEL,
                 DEFAULT_FLOPS if flops is None else float(flops))


@dataclass(frozen=True)
class AttentionExplain:
    """`attention_explain`'s answer: every strategy's `Cost`, the one `auto` picks (None
    when none fits the budget) and what the times assume; `print` it for the table."""

    costs: tuple[Cost, ...]
    pick: str | None
    rank: int
    memory_budget: int | None
    cost_model: CostModel
    flops: float

    def rows(self) -> tuple[dict[str, Any], ...]:
        """One plain row per strategy (what the table shows)."""
        return tuple({"strategy": c.strategy, "picked": c.strategy == self.pick,
                      "sent_bytes": c.sent_bytes, "extra_bytes": c.extra_bytes,
                      "fits": self.memory_budget is None or c.extra_bytes <= self.memory_budget,
                      "calls": c.calls, "time_s": c.time_s, "comm_s": c.comm_s,
                      "compute_s": c.compute_s} for c in self.costs)

    def __str__(self) -> str:
        budget = "" if self.memory_budget is None else \
            f", memory budget {format_bytes(self.memory_budget)}"
        cm = self.cost_model
        axes = sorted({a for a, _ in cm.latency_s} | {a for a, _ in cm.bandwidth})
        links = ", ".join(f"{'links' if a == '*' else a} {cm.time((a,), 0) * 1e6:g} µs +"
                          f" bytes / {cm.bandwidth_of(a) / 1e9:g} GB/s" for a in axes)
        lines = [f"attention on rank {self.rank}, forward + backward ({links};"
                 f" {self.flops:.3g} FLOP/s{budget}); * marks auto's pick"]
        head = ("", "strategy", "sent/rank", "extra memory", "calls", "time (µs)",
                "comm (µs)", "compute (µs)")
        cells = [head] + [("*" if r["picked"] else "", r["strategy"],
                           format_bytes(r["sent_bytes"]),
                           format_bytes(r["extra_bytes"]) + ("" if r["fits"] else " (over)"),
                           str(r["calls"]), format_us(r["time_s"]), format_us(r["comm_s"]),
                           format_us(r["compute_s"])) for r in self.rows()]
        width = [max(len(row[i]) for row in cells) for i in range(len(head))]
        for row in cells:
            lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w)
                                   for i, (x, w) in enumerate(zip(row, width))).rstrip())
        if self.pick is None:
            lines.append("no strategy fits the memory budget")
        return "\n".join(lines)


def attention_explain(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh,
                      layout: str | Layout, *, kv_layout: str | Layout | None = None,
                      dims: str = "b h s d", shape: Sequence[int] | None = None,
                      kv_shape: Sequence[int] | None = None, causal: bool = False,
                      window: int | None = None, cost_model: CostModel | None = None,
                      flops: float | None = None,
                      memory_budget: int | None = None) -> AttentionExplain:
    """Per strategy, this rank's bytes sent, extra peak memory, calls and modelled time,
    with `auto`'s pick marked: `print(mc.nn.attention_explain(q, k, v, bound, layout,
    causal=True))`. Arguments as `attention_costs`, and `memory_budget` as `attention`."""
    call = _costs_call(q, k, v, bound, layout, kv_layout, dims, shape, kv_shape, causal,
                       window, "attention_explain")
    cm = cost_model or DEFAULT_COST_MODEL
    rate = DEFAULT_FLOPS if flops is None else float(flops)
    runnable = _runnable(call, q.dtype, cm, rate)
    try:
        chosen: str | None = _pick(runnable, call, memory_budget)
    except ShapeError:
        chosen = None
    return AttentionExplain(tuple(runnable), chosen, call.bound.rank, memory_budget, cm, rate)
