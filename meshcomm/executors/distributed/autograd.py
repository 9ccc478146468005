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
reshards it to `src'` and applies the avg scale of `src`: the planner makes that plan
(`meshcomm.planner.backward_plan`, given to `reshard_autograd` as `reverse`) and its
scale (`grad_scale`). This module plans nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...planner.values import Plan, grad_scale
from .execute import ByteTrace, execute
from .groups import Groups

Reverse = Callable[[Plan, torch.dtype], Plan]    # (forward plan, gradient dtype) -> plan


class Reshard(torch.autograd.Function):
    """`execute(plan, x, bound)` with the backward of the module doc (double backward too)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: Groups, plan_: Plan, trace: ByteTrace | None,
                reverse: Reverse) -> Tensor:
        ctx.bound, ctx.plan, ctx.reverse = bound, plan_, reverse
        out = execute(plan_, x, bound, trace=trace)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = ctx.reverse(ctx.plan, grad.dtype)
        scale = grad_scale(ctx.plan)
        out = reshard_autograd(grad, ctx.bound, back, reverse=ctx.reverse)
        return (out * scale if scale != 1 else out), None, None, None, None


def reshard_autograd(x: Tensor, bound: Groups, plan_: Plan, trace: ByteTrace | None = None,
                     *, reverse: Reverse) -> Tensor:
    """`plan_` on this rank, recorded for autograd when `x` needs a gradient; backward runs
    `reverse(plan_, grad.dtype)` (the planner's `backward_plan`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        out: Tensor = Reshard.apply(x, bound, plan_, trace, reverse)  # type: ignore[no-untyped-call]
        return out
    return execute(plan_, x, bound, trace=trace)
