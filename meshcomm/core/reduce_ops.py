"""Reduction ops in one place: their names, identity values, the reduction itself, and the
torch.chunk sizes that reduce_scatter and all_reduce split by. Pure torch, no communication.

>>> REDUCE_OPS
('sum', 'avg', 'max', 'min')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import reduce
from typing import Literal, get_args

import torch
from torch import Tensor

from .errors import ShapeError, did_you_mean

ReduceOp = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)


def identity_like(x: Tensor, op: str) -> Tensor:
    """What a rank holds where it does not own the value: the identity of `op`."""
    if op in ("sum", "avg"):
        return torch.zeros_like(x)
    if x.dtype.is_floating_point:
        return torch.full_like(x, float("-inf") if op == "max" else float("inf"))
    if x.dtype == torch.bool:
        return torch.full_like(x, op == "min")
    info = torch.iinfo(x.dtype)
    return torch.full_like(x, info.min if op == "max" else info.max)


def check_op(fn: str, op: str, dtype: torch.dtype) -> None:
    if op not in REDUCE_OPS:
        hint = did_you_mean(str(op), REDUCE_OPS)
        raise ShapeError(f"{fn}: unknown reduce op {op!r}; ops are {', '.join(REDUCE_OPS)}"
                         + (f"\n  fix: {hint}" if hint else ""))
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ShapeError(f"{fn}: op 'avg' needs a floating dtype, got {dtype}; fix: reduce"
                         " with op='sum' and divide, or cast to a float dtype")


def chunk_sizes(n: int, g: int) -> tuple[int, ...]:
    """Sizes of `g` chunks of `n` with torch.chunk boundaries (trailing ones may be 0).

    Chunk j is [min(j*c, n), min((j+1)*c, n)) with c = ceil(n / g), always g of them.

    >>> chunk_sizes(5, 4)
    (2, 2, 1, 0)
    """
    assert g >= 1 and n >= 0, f"chunk_sizes needs n >= 0 and g >= 1, got n={n}, g={g}"
    c = -(-n // g)
    return tuple(min((j + 1) * c, n) - min(j * c, n) for j in range(g))


def chunk_size(n: int, g: int, pos: int) -> int:
    """`chunk_sizes(n, g)[pos]` in O(1): what a per-call byte count needs of one position.

    >>> [chunk_size(5, 4, p) for p in range(4)]
    [2, 2, 1, 0]
    """
    c = -(-n // g)
    return min((pos + 1) * c, n) - min(pos * c, n)


def _add(a: Tensor, b: Tensor) -> Tensor:
    return torch.add(a, b)


def _max(a: Tensor, b: Tensor) -> Tensor:
    return torch.maximum(a, b)


def _min(a: Tensor, b: Tensor) -> Tensor:
    return torch.minimum(a, b)


_STEPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "sum": _add, "avg": _add, "max": _max, "min": _min}


def op_reduce(tensors: Sequence[Tensor], op: str) -> Tensor:
    """Elementwise reduction of `tensors` by `op`, left to right in order, as a new tensor.

    sum is ((t0 + t1) + t2) + ...; avg is that sum, then divided by len(tensors); max and
    min apply torch.maximum / torch.minimum left to right (NaN propagates).

    >>> op_reduce([torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])], "avg").tolist()
    [2.0, 3.5]
    """
    if not tensors:
        raise ShapeError("op_reduce: needs at least one tensor")
    first = tensors[0]
    check_op("op_reduce", op, first.dtype)
    for i, t in enumerate(tensors[1:], 1):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ShapeError(f"op_reduce: tensors[{i}] is {t.dtype} {tuple(t.shape)} on {t.device}"
                             f" but tensors[0] is {first.dtype} {tuple(first.shape)}")
    step = _STEPS[op]
    acc: Tensor = reduce(step, tensors[1:], first.clone())  # a left fold: ((t0 op t1) op t2)
    return divide(acc, len(tensors)) if op == "avg" else acc



def op_reduce_rows(stacked: Tensor, op: str) -> Tensor:
    """`op_reduce` of the slices of `stacked` along dim 0, bit for bit: one tensor call
    where no order can change the result (integer and bool dtypes: sums wrap, max and min
    pick), else the same left fold over views of `stacked` (floating sums are not
    associative, and every executor folds in group order).

    >>> op_reduce_rows(torch.tensor([[1, 5], [3, 2], [2, 2]]), "sum").tolist()
    [6, 9]
    """
    dtype = stacked.dtype
    if stacked.dim() == 0 or stacked.shape[0] <= 1:
        return op_reduce(list(stacked.unbind(0)) if stacked.dim() else [], op)
    check_op("op_reduce", op, dtype)
    if dtype.is_floating_point or dtype.is_complex:
        # op_reduce's fold, into one accumulator (each step the same elementwise op, in
        # place: no new tensor per partial)
        parts = stacked.unbind(0)
        acc = parts[0].clone()
        into = _INTO[op]
        for t in parts[1:]:
            into(acc, t)
        return divide(acc, len(parts)) if op == "avg" else acc
    if dtype == torch.bool:          # torch.add of bools is "or", maximum "or", minimum "and"
        return stacked.all(0) if op == "min" else stacked.any(0)
    if op == "sum":
        return stacked.sum(0, dtype=dtype)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _add_into(acc: Tensor, t: Tensor) -> None:
    acc.add_(t)


def _max_into(acc: Tensor, t: Tensor) -> None:
    torch.maximum(acc, t, out=acc)


def _min_into(acc: Tensor, t: Tensor) -> None:
    torch.minimum(acc, t, out=acc)


_INTO: dict[str, Callable[[Tensor, Tensor], None]] = {
    "sum": _add_into, "avg": _add_into, "max": _max_into, "min": _min_into}


def divide(x: Tensor, n: int) -> Tensor:
    """`x / n` for an avg, complex tensors part by part (torch's complex division by a real
    number rounds differently from dividing the real and imaginary parts; every executor
    divides so, so averages agree bit for bit).

    >>> divide(torch.tensor([1 + 2j]), 4).tolist()
    [(0.25+0.5j)]
    """
    if x.is_complex():
        return torch.view_as_complex(torch.view_as_real(x) / n)
    return x / n
