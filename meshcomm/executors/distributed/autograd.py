"""Autograd for reshard, on one mesh and between two: the backward pass runs the planned reverse
transition.

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

Between meshes the reverse plan goes from the destination mesh back to the source, and
every rank of either mesh takes part in both directions. A rank only in the source mesh
gets an empty tensor tied to its input (`token`), whose backward receives the input's
gradient; a rank only in the destination mesh passes an empty placeholder as the input,
so its output's backward sends the gradient back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...planner.values import Plan, grad_scale
from .execute import execute, execute_cross
from .groups import Groups
from .handlers import ByteTrace

Reverse = Callable[[Plan, torch.dtype], Plan]    # (forward plan, gradient dtype) -> plan


class Reshard(torch.autograd.Function):
    """A plan on `src` (to `dst` for a plan between meshes) with the backward of the module
    doc (double backward too)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, src: Groups, dst: Groups | None, plan_: Plan,
                trace: ByteTrace | None, reverse: Reverse, scale: float) -> Tensor:
        ctx.src, ctx.dst, ctx.plan, ctx.reverse = src, dst, plan_, reverse
        ctx.scale = scale
        ctx.like = (x.shape, x.dtype, x.device)
        out = _run(x, src, dst, plan_, trace)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = ctx.reverse(ctx.plan, grad.dtype)
        scale = grad_scale(ctx.plan) * ctx.scale
        if ctx.dst is None:
            out = reshard_autograd(grad, ctx.src, back, reverse=ctx.reverse)
        else:   # the reverse plan from the destination mesh back to the source
            out = reshard_autograd(grad, ctx.dst, back, dst=ctx.src, reverse=ctx.reverse)
            if not ctx.src.in_mesh:       # the input was a placeholder
                shape, dtype, device = ctx.like
                out = torch.zeros(shape, dtype=dtype, device=device)
        return (out * scale if scale != 1 else out), None, None, None, None, None, None


def _run(x: Tensor, src: Groups, dst: Groups | None, plan_: Plan,
         trace: ByteTrace | None) -> Tensor:
    """The plan's output on this rank; between meshes, `token(x)` where this rank holds none."""
    if dst is None:
        return execute(plan_, x, src, trace=trace)
    out = execute_cross(plan_, x if src.in_mesh else None, src, dst, trace=trace)
    return token(x) if out is None else out


def token(x: Tensor) -> Tensor:
    """An empty tensor tied to `x`: what a rank outside a plan's destination mesh gets back."""
    return x.new_empty(0)


def placeholder(plan_: Plan, bound: Groups, requires_grad: bool) -> Tensor:
    """The input a rank outside a plan's source mesh passes: empty, of the plan's dtype."""
    return torch.empty(0, dtype=plan_.dtype, device=bound.device, requires_grad=requires_grad)


def reshard_autograd(x: Tensor, bound: Groups, plan_: Plan, trace: ByteTrace | None = None,
                     *, reverse: Reverse, dst: Groups | None = None,
                     scale: float = 1.0) -> Tensor:
    """`plan_` on this rank (from `bound` to `dst` for a plan between meshes, where a rank
    outside the source mesh passes `placeholder(...)`), recorded for autograd when `x` needs
    a gradient; backward runs `reverse(plan_, grad.dtype)` (the planner's `backward_plan`, or
    a parameter's reduce plan) and multiplies by `scale` too (a parameter's grad_scale)."""
    if torch.is_grad_enabled() and x.requires_grad:
        out: Tensor = Reshard.apply(x, bound, dst, plan_, trace, reverse,  # type: ignore[no-untyped-call]
                                    scale)
        return out
    return _run(x, bound, dst, plan_, trace)
