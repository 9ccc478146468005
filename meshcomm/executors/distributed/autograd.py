"""Autograd for reshard: the backward pass runs the planned reverse transition.

Executor layer. Gradients follow the global tensor, not the local map: the gradient
of a shard is the same shard of the global gradient G. Each side's gradient layout is
its layout with the pending reduction dropped (those axes become replicated):

- a pending `sum` becomes replication: every contributor's gradient is the full G;
- a pending `avg` over a group of g ranks likewise, scaled by 1/g (each contributor
  holds 1/g of the value, so its gradient is G / g);
- replicated stays replicated (every replica gets G), sharded stays sharded;
- a pending `max` or `min` in the source has no gradient here: backward raises.

So backward takes the output gradient in `dst'`, undoes the avg scale of `dst`,
reshards it to `src'` with `mc.plan`, and applies the avg scale of `src`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from ...core.errors import PlanError
from ...core.layout import Layout
from ...planner.plan import plan
from ...planner.values import Plan
from .bind import BoundMesh
from .execute import ByteTrace, execute


def without_reduction(layout: Layout) -> Layout:
    """`layout` with its pending reduction dropped (its axes become replicated).

    >>> without_reduction(Layout("(dp b) s | sum(tp)"))
    Layout('(dp b) s')
    """
    if layout.reduce_op is None:
        return layout
    return Layout(" ".join(str(d) for d in layout.dims))


def grad_scale(plan: Plan) -> float:
    """The factor backward applies: (1/g of an avg source) / (1/g of an avg destination)."""
    def share(layout: Layout) -> int:
        if layout.reduce_op != "avg":
            return 1
        return math.prod(plan.mesh.axis_size(a) for a in layout.partial_axes)
    return share(plan.dst) / share(plan.src)


def plan_untraced(*args: Any, **kwargs: Any) -> Plan:
    """`mc.plan`, run outside any active dispatch mode (fake tensors while tracing): the
    planner computes with small real tensors, and a plan holds none."""
    if _get_current_dispatch_mode() is None:
        return plan(*args, **kwargs)
    with _disable_current_modes():
        return plan(*args, **kwargs)


def backward_plan(forward: Plan, dtype: torch.dtype) -> Plan:
    """The plan backward runs: the output gradient from `dst'` to `src'` (see module doc)."""
    op = forward.src.reduce_op
    if op in ("max", "min"):
        raise PlanError(
            f'reshard from "{forward.src}" has no gradient: a pending {op} over'
            f" {', '.join(forward.src.partial_axes)} is not differentiable here."
            f" fix: reduce it first (reshard to \"{without_reduction(forward.src)}\") and"
            " differentiate from there, or detach the input")
    return plan_untraced(forward.mesh, forward.shape, without_reduction(forward.dst),
                         without_reduction(forward.src), dtype=dtype,
                         cost_model=forward.cost_model)


class Reshard(torch.autograd.Function):
    """`execute(plan, x, bound)` with the backward of the module doc (double backward too)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: BoundMesh, plan_: Plan,
                trace: ByteTrace | None) -> Tensor:
        ctx.bound, ctx.plan = bound, plan_
        out = execute(plan_, x, bound, trace=trace)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = backward_plan(ctx.plan, grad.dtype)
        scale = grad_scale(ctx.plan)
        out = reshard_autograd(grad, ctx.bound, back)
        return (out * scale if scale != 1 else out), None, None, None


def reshard_autograd(x: Tensor, bound: BoundMesh, plan_: Plan,
                     trace: ByteTrace | None = None) -> Tensor:
    """`plan_` on this rank, recorded for autograd when `x` needs a gradient."""
    if torch.is_grad_enabled() and x.requires_grad:
        out: Tensor = Reshard.apply(x, bound, plan_, trace)  # type: ignore[no-untyped-call]
        return out
    return execute(plan_, x, bound, trace=trace)
