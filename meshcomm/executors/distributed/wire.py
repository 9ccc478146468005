"""The one place that hands tensors to PyTorch's functional collectives.

Complex tensors travel as real pairs (a view, no copy); `wait=True` waits at once (the
executor's local rearranges need the data anyway), `wait=False` returns the async tensor
that is waited on at first use (`mc.collectives`). Traced calls are already waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def as_real(x: Tensor) -> Tensor:
    """`x` as the backend sends it: complex tensors as real pairs (a view, no copy)."""
    return torch.view_as_real(x) if x.is_complex() else x


def waited(t: Tensor) -> Tensor:
    """`t`, waited on if it is an eager functional-collective result."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def call(fn: Callable[..., Tensor], x: Tensor, *args: object, wait: bool = True) -> Tensor:
    """`fn(x, *args)` with complex `x` sent as real pairs and given back complex."""
    y = fn(as_real(x), *args)
    if wait:
        y = waited(y)
    return torch.view_as_complex(y) if x.is_complex() else y


def all_to_all(rows: Tensor, name: str, out_splits: Sequence[int] | None = None,
               in_splits: Sequence[int] | None = None, *, wait: bool = True) -> Tensor:
    """all_to_all_single along dim 0 (splits in rows of dim 0, process-group order)."""
    y = call(funcol.all_to_all_single, rows.contiguous(),
             None if out_splits is None else list(out_splits),
             None if in_splits is None else list(in_splits), name, wait=wait)
    if out_splits is not None and torch.compiler.is_compiling():
        # traced, uneven splits give the output an unknown length; it is their sum, and
        # saying so lets the compiler slice it without guarding on data
        torch._check(y.shape[0] == sum(out_splits))
    return y
