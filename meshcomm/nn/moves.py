"""Activation moves whose gradient is not the reverse reshard: forward runs one plan, backward
another on the gradient. Megatron's `f` (forward nothing, backward an all_reduce), the
sequence-parallel gather (forward an all_gather of the sequence, backward a reduce_scatter),
and the entries of the recipe blocks are all this one autograd function, used by
`parallelize` (parallel.py) and the recipe blocks (tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.layout import Layout, Shape, as_layout
from ..runtime.bind import BoundMesh
from ..sharded import infer_shape, reshard

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
