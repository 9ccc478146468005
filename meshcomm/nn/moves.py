"""Activation moves of tensor parallelism, the one implementation both front doors run:
`parallelize` (parallel.py, layouts from the axis given) and the recipe blocks
(tensor_parallel.py, layouts from a recipe).

- `Entry`: the entry of a tensor-parallel region, forward one plan and backward another on
  the gradient (not the reverse reshard): Megatron's `f` (forward nothing, backward an
  all_reduce) and the sequence-parallel gather (forward an all_gather of the sequence,
  backward a reduce_scatter). `move` is its autograd function.
- `Exit`: a layer's local result resolved by a plan, backward the reverse plan: a
  row-parallel or vocab-parallel output's pending sum all_reduced or reduce_scattered (its
  bias added once, after), or a column-parallel output gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.layout import Layout, Shape, as_layout
from ..core.mesh import Mesh
from ..planner.plan import backward_plan, plan
from ..runtime.bind import BoundMesh
from ..sharded import infer_shape, reshard
from .comms import Comm
from .params import ONE_CALL_PER_STEP

Move = tuple[Layout | str, Layout | str]     # (source layout, destination layout)


class _Moves(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: BoundMesh, fwd: Move, bwd: Move,
                shape: Shape | None) -> Tensor:
        src, dst = as_layout(fwd[0]), as_layout(fwd[1])
        if shape is None:
            shape = infer_shape(bound.mesh, src, tuple(x.shape), bound.rank)
        ctx.bound, ctx.bwd, ctx.shape = bound, bwd, shape
        out = x if src == dst else reshard(x, bound, src, dst, shape=shape)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        src, dst = as_layout(ctx.bwd[0]), as_layout(ctx.bwd[1])
        out = reshard(grad.contiguous(), ctx.bound, src, dst, shape=ctx.shape)
        return out, None, None, None, None


def move(x: Tensor, bound: BoundMesh, forward: Move, backward: Move, *,
         shape: Shape | None = None) -> Tensor:
    """`x` resharded `forward[0] -> forward[1]`; its gradient resharded `backward[0] ->
    backward[1]` (global `shape`: inferred from `x` under `forward[0]` when not given).

    >>> y = move(x, bound, ("b s e", "b s e"), ("b s e | sum(tp)", "b s e"))  # doctest: +SKIP
    """
    out: Tensor = _Moves.apply(x, bound, forward, backward, shape)  # type: ignore[no-untyped-call]
    return out


@dataclass(frozen=True, slots=True)
class Entry:
    """The entry of a tensor-parallel region: forward the input `x -> use`, backward its
    gradient `grad -> x` (`grad` is `use` with the partial sum the region's layers leave).

    >>> f = Entry(Layout("d0 d1"), Layout("d0 d1"), Layout("d0 d1 | sum(tp)"))
    >>> f.grad.partial_axes
    ('tp',)
    """

    x: Layout
    use: Layout
    grad: Layout

    def __call__(self, t: Tensor, bound: BoundMesh, shape: Shape | None = None) -> Tensor:
        """`t` (under `x`) as the region uses it; differentiable."""
        return move(t, bound, (self.x, self.use), (self.grad, self.x), shape=shape)

    def comms(self, mesh: Mesh, shape: Sequence[int]) -> list[Comm]:
        """The input's forward plan and its gradient's backward plan, for global `shape`."""
        shape = tuple(shape)
        return [Comm("forward", "input", plan(mesh, shape, self.x, self.use)),
                Comm("backward", "input grad", plan(mesh, shape, self.grad, self.x))]


@dataclass(frozen=True, slots=True)
class Exit:
    """A layer's local result `y` resolved by a plan to `out`: a pending sum all_reduced or
    reduce_scattered, or a split output gathered; backward runs the reverse plan.

    >>> Exit(Layout("d0 d1 | sum(tp)"), Layout("d0 (tp d1)")).out
    Layout('d0 (tp d1)')
    """

    y: Layout
    out: Layout

    def __call__(self, t: Tensor, bound: BoundMesh, *, shape: Shape | None = None,
                 bias: Tensor | None = None) -> Tensor:
        """`t` (under `y`) under `out`, plus `bias` (added once, after any sum)."""
        if self.y != self.out:
            t = reshard(t, bound, self.y, self.out, shape=shape, cost_model=ONE_CALL_PER_STEP)
        return t if bias is None else t + bias

    def comms(self, mesh: Mesh, shape: Sequence[int], dtype: torch.dtype) -> list[Comm]:
        """The output's forward plan and its gradient's backward plan, for global `shape`."""
        fwd = plan(mesh, tuple(shape), self.y, self.out, dtype=dtype,
                   cost_model=ONE_CALL_PER_STEP)
        return [Comm("forward", "output", fwd),
                Comm("backward", "output grad", backward_plan(fwd, dtype))]
