"""Blocks: the global indices a rank holds, per dim, as a few numbers instead of lists.

This module never communicates and never enumerates a tensor to plan. A rank's block
of a dim of size n is the set

    {i in [start, stop) : (i // lo) % (hi // lo) == v for every digit (lo, hi, v)}

Even shards fix digits (stride intervals); uneven chunk chains fix the interval. The
block of a whole tensor is the cartesian product of its dims' blocks, so the size of an
intersection is a product of per-dim counts, each a few operations per digit. Bounds and
the traffic of point-to-point steps therefore follow the layouts and the mesh shape, never
the element count. Index lists (`DimBlock.indices`) exist only for execution, per rank.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import chunk_range
from .mesh import AxisName, Mesh
from .states import DimState, State

Digit = tuple[int, int, int]    # (lo, hi, value): (i // lo) % (hi // lo) == value


@dataclass(frozen=True, slots=True)
class DimBlock:
    """The indices of one dim that a rank holds (see the module docstring)."""

    size: int
    start: int
    stop: int
    digits: tuple[Digit, ...] = ()

    def __and__(self, other: DimBlock) -> DimBlock:
        assert self.size == other.size, f"blocks of dims of size {self.size} and {other.size}"
        return DimBlock(self.size, max(self.start, other.start), min(self.stop, other.stop),
                        tuple(sorted(set(self.digits + other.digits), reverse=True)))

    def count(self) -> int:
        """How many indices the block holds."""
        return _count(self)

    def indices(self) -> Tensor:
        """The block's global indices, ascending (int64): what a rank's local tensor holds
        along this dim, in local order. For execution only: this is O(block size)."""
        return _indices(self)


def dim_block(dim: DimState, mesh: Mesh, coords: dict[AxisName, int]) -> DimBlock:
    """The block of `dim` held at mesh coordinates `coords`."""
    if dim.chunks:
        start, length = 0, dim.size
        for a in dim.chunks:
            start, length = chunk_range(start, length, mesh.axis_size(a), coords[a])
        return DimBlock(dim.size, start, start + length)
    return DimBlock(dim.size, 0, dim.size,
                    tuple(sorted(((lo, hi, coords[a]) for lo, hi, a in dim.shards), reverse=True)))


def block(state: State, mesh: Mesh, coords: dict[AxisName, int]) -> tuple[DimBlock, ...]:
    """Per dim, the block held at `coords` in `state`."""
    return tuple(dim_block(dim, mesh, coords) for dim in state.dims)


def numel(blocks: tuple[DimBlock, ...]) -> int:
    return math.prod(b.count() for b in blocks)


def overlap(a: tuple[DimBlock, ...], b: tuple[DimBlock, ...]) -> int:
    """Elements in both `a` and `b`."""
    return math.prod((x & y).count() for x, y in zip(a, b))


# -- counting -----------------------------------------------------------------------------
Radix = tuple[tuple[int, int, int | None], ...]   # (unit, base, fixed value or None), major first
_CONTRADICTION: Radix = ((0, 0, 0),)   # two digits disagree: the block is empty


@functools.lru_cache(maxsize=65536)
def _radix(size: int, digits: tuple[Digit, ...]) -> Radix | None:
    """The digits refined into one mixed radix (major first), or None when the stride
    points do not divide each other (the rare layouts counted by enumeration), or an
    empty radix with a None marker when two digits disagree (the block is empty)."""
    points = sorted({1, size} | {lo for lo, _, _ in digits} | {hi for _, hi, _ in digits})
    if any(b % a for a, b in zip(points, points[1:])):
        return None
    out: list[tuple[int, int, int | None]] = []
    for a, b in reversed(list(zip(points, points[1:]))):
        fixed: int | None = None
        for lo, hi, v in digits:
            if lo <= a and b <= hi:
                sub = (v // (a // lo)) % (b // a)
                if fixed is not None and fixed != sub:
                    return _CONTRADICTION
                fixed = sub
        out.append((a, b // a, fixed))
    return tuple(out)


def _below(radix: Radix, x: int) -> int:
    """How many i in [0, x) match `radix` (a digit-by-digit count, major first)."""
    free = [1]
    for _, base, fixed in reversed(radix):
        free.append(free[-1] * (base if fixed is None else 1))
    free.reverse()   # free[k]: matching combinations of the digits after k
    if x >= math.prod(base for _, base, _ in radix):
        return free[0]
    count = 0
    for k, (unit, base, fixed) in enumerate(radix):
        xd = (x // unit) % base
        if fixed is None:
            count += xd * free[k + 1]
            continue
        if fixed < xd:
            count += free[k + 1]
        if fixed != xd:
            return count
    return count


@functools.lru_cache(maxsize=65536)
def _count(b: DimBlock) -> int:
    if b.stop <= b.start or b.size == 0:
        return 0
    radix = _radix(b.size, b.digits)
    if radix is None:
        return int(_indices(b).numel())
    if radix == _CONTRADICTION:
        return 0
    return _below(radix, b.stop) - _below(radix, b.start)


@functools.lru_cache(maxsize=1024)
def _indices(b: DimBlock) -> Tensor:
    if b.stop <= b.start or b.size == 0:
        return torch.zeros(0, dtype=torch.long)
    radix = _radix(b.size, b.digits)
    if radix == _CONTRADICTION:
        return torch.zeros(0, dtype=torch.long)
    if radix is None:   # stride points that do not chain: test every index of the range
        idx = torch.arange(b.start, b.stop, dtype=torch.long)
        for lo, hi, v in b.digits:
            idx = idx[(idx // lo) % (hi // lo) == v]
        return idx
    idx = torch.zeros(1, dtype=torch.long)
    for unit, base, fixed in radix:   # major first: the result comes out ascending
        options = torch.arange(base) if fixed is None else torch.tensor([fixed])
        idx = (idx[:, None] + options[None, :] * unit).reshape(-1)
    return idx[(idx >= b.start) & (idx < b.stop)]


# -- per-rank values over the axes that matter ------------------------------------------
def coords_grid(mesh: Mesh, axes: tuple[AxisName, ...]) -> Iterator[dict[AxisName, int]]:
    """Every combination of coordinates on `axes` (mesh order, last fastest)."""
    for values in itertools.product(*(range(mesh.axis_size(a)) for a in axes)):
        yield dict(zip(axes, values))


@functools.lru_cache(maxsize=256)
def grid_positions(mesh: Mesh, axes: tuple[AxisName, ...]) -> tuple[int, ...]:
    """For each rank in mesh order, its index in `coords_grid(mesh, axes)`."""
    names, sizes = mesh.axis_names, mesh.shape
    index = torch.zeros(sizes, dtype=torch.long)
    stride = 1
    for a in reversed(axes):
        k = names.index(a)
        view = [1] * len(sizes)
        view[k] = sizes[k]
        index = index + torch.arange(sizes[k]).view(view) * stride
        stride *= sizes[k]
    return tuple(index.reshape(-1).tolist())


def spread(mesh: Mesh, axes: tuple[AxisName, ...], values: list[int]) -> tuple[int, ...]:
    """Values given per combination of `axes` coordinates, as one value per rank."""
    if len(values) == 1:
        return (values[0],) * mesh.size
    return tuple(values[i] for i in grid_positions(mesh, axes))


def in_mesh_order(mesh: Mesh, axes: object) -> tuple[AxisName, ...]:
    """The mesh axes among `axes`, in mesh order."""
    wanted = set(axes)  # type: ignore[call-overload]
    return tuple(a for a in mesh.axis_names if a in wanted)
