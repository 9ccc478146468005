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

from ..core.layout import chunk_range
from ..core.mesh import AxisName, Mesh
from .states import DimState, State, chunk_sizes, chunk_spans

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
    if not b.digits:           # one run
        return b.stop - b.start
    radix = _radix(b.size, b.digits)
    if radix is None:
        return int(_indices(b).numel())
    if radix == _CONTRADICTION:
        return 0
    return _below(radix, b.stop) - _below(radix, b.start)


@functools.lru_cache(maxsize=64)   # index lists: execution only, a few per rank
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


# -- many pairs of blocks of two dims at once ------------------------------------------
# Blocks of dim `a` are indexed by the coordinate combinations of the axes sharding it
# (`coords_grid` order), and likewise for dim `b`.
Rows = tuple[Tensor, Tensor, Tensor]


@functools.lru_cache(maxsize=4096)
def digit_rows(a: DimState, b: DimState, mesh: Mesh) -> Rows | None:
    """Both dims' blocks on one mixed radix: per block and per elementary digit the value
    it fixes (-1 where free), and each digit's base; None unless both dims are even with
    stride points that chain (then a block is exactly its row)."""
    points = sorted(set(a.bounds()) | set(b.bounds()))
    if a.chunks or b.chunks or a.size == 0 or any(y % x for x, y in zip(points, points[1:])):
        return None
    digits = list(reversed(list(zip(points, points[1:]))))   # (unit, unit * base), major first
    bases = torch.tensor([hi // lo for lo, hi in digits], dtype=torch.long)
    return (_fixed(a, in_mesh_order(mesh, a.axes), digits, mesh),
            _fixed(b, in_mesh_order(mesh, b.axes), digits, mesh), bases)


def _fixed(dim: DimState, axes: tuple[AxisName, ...], digits: list[tuple[int, int]],
           mesh: Mesh) -> Tensor:
    grid = combos(mesh, axes)
    out = torch.full((grid.shape[0], len(digits)), -1, dtype=torch.long)
    for lo, hi, axis in dim.shards:
        coord = grid[:, axes.index(axis)]
        for k, (unit, top) in enumerate(digits):
            if lo <= unit and top <= hi:
                out[:, k] = (coord // (unit // lo)) % (top // unit)
    return out


@functools.lru_cache(maxsize=4096)
def pair_counts(a: DimState, b: DimState, mesh: Mesh) -> Tensor:
    """|block x of `a` ∩ block y of `b`| for every pair: a [blocks of a, blocks of b] table."""
    rows = digit_rows(a, b, mesh)
    if rows is not None:
        return counts_at(a, b, mesh, torch.arange(len(rows[0]))[:, None],
                         torch.arange(len(rows[1]))[None, :])
    # Stride points that do not chain (or chunks): label every index of the dim with the
    # block of `a` and the block of `b` holding it and count the pairs, a slice at a time:
    # O(dim size) vector work, whatever the number of blocks (not blocks x blocks counts).
    na, nb = len(block_sizes(a, mesh)), len(block_sizes(b, mesh))
    table = torch.zeros(na * nb, dtype=torch.long)
    for index in index_slices(a.size):
        pairs = block_of(a, mesh, index) * nb + block_of(b, mesh, index)
        table += torch.bincount(pairs, minlength=na * nb)
    return table.reshape(na, nb)


_LABEL_SLICE = 1 << 20   # indices labelled at once (8 MiB a label tensor)


def index_slices(size: int) -> Iterator[Tensor]:
    """The indices 0 .. size-1 of a dim, `_LABEL_SLICE` at a time: labelling a dim by
    blocks (`block_of`) keeps to bounded memory, whatever the dim's size."""
    for start in range(0, size, _LABEL_SLICE):
        yield torch.arange(start, min(size, start + _LABEL_SLICE), dtype=torch.long)


def block_of(dim: DimState, mesh: Mesh, index: Tensor) -> Tensor:
    """The block (`coords_grid` order over the axes sharding `dim`) holding each index."""
    if dim.chunks:
        start, stop = intervals(dim, mesh)
        held = torch.nonzero(stop > start).reshape(-1)       # empty chunks hold nothing
        held = held[torch.argsort(start[held])]              # by where they start
        return held[torch.searchsorted(start[held], index, right=True) - 1]
    axes = in_mesh_order(mesh, dim.axes)
    coord = {axis: (index // lo) % (hi // lo) for lo, hi, axis in dim.shards}
    out = torch.zeros_like(index)
    for axis in axes:
        out = out * mesh.axis_size(axis) + coord[axis]
    return out


def counts_at(a: DimState, b: DimState, mesh: Mesh, x: Tensor, y: Tensor) -> Tensor:
    """|block x of `a` ∩ block y of `b`| for index tensors `x` and `y` (broadcast): digit
    by digit or interval by interval, so a rank-by-rank question costs O(ranks x digits),
    never a full table."""
    if b.is_local or a == b:   # the common cases need no digits
        sizes = block_sizes(a, mesh)[x]
        return sizes + 0 * y if b.is_local else torch.where(x == y, sizes, 0)
    if a.is_local:
        return block_sizes(b, mesh)[y] + 0 * x
    rows = digit_rows(a, b, mesh)
    if rows is not None:
        fa, fb, bases = rows
        u, v = fa[x], fb[y]
        both_free = (u < 0) & (v < 0)
        agree = torch.where(both_free, bases, ((u < 0) | (v < 0) | (u == v)).long())
        return agree.prod(-1)
    if a.size and (a.chunks or b.chunks):
        if a.chunks and b.chunks:   # two intervals
            (sa, ea), (sb, eb) = intervals(a, mesh), intervals(b, mesh)
            return (torch.minimum(ea[x], eb[y]) - torch.maximum(sa[x], sb[y])).clamp(min=0)
        chunk, even, i, j = (a, b, x, y) if a.chunks else (b, a, y, x)
        start, stop = intervals(chunk, mesh)
        return _below_many(even, mesh, stop[i], j) - _below_many(even, mesh, start[i], j)
    return pair_counts(a, b, mesh)[x, y]


@functools.lru_cache(maxsize=4096)
def intervals(dim: DimState, mesh: Mesh) -> tuple[Tensor, Tensor]:
    """Each block's [start, stop) of a chunk dim (nested `torch.chunk`s, major first)."""
    axes = in_mesh_order(mesh, dim.chunks)
    grid = combos(mesh, axes)
    start = torch.zeros(len(grid), dtype=torch.long)
    length = torch.full((len(grid),), dim.size, dtype=torch.long)
    for axis in dim.chunks:
        n, c = mesh.axis_size(axis), grid[:, axes.index(axis)]
        step = (length + n - 1) // n
        lo, hi = torch.minimum(c * step, length), torch.minimum((c + 1) * step, length)
        start, length = start + lo, hi - lo
    return start, start + length


@functools.lru_cache(maxsize=4096)
def _own_rows(dim: DimState, mesh: Mesh) -> Rows:
    """An even dim's blocks on its own radix: fixed digit values (-1 free), units, bases."""
    points = list(dim.bounds())
    digits = list(reversed(list(zip(points, points[1:]))))
    return (_fixed(dim, in_mesh_order(mesh, dim.axes), digits, mesh),
            torch.tensor([lo for lo, _ in digits], dtype=torch.long),
            torch.tensor([hi // lo for lo, hi in digits], dtype=torch.long))


def _below_many(dim: DimState, mesh: Mesh, limit: Tensor, block: Tensor) -> Tensor:
    """How many indices below `limit` each `block` of even `dim` holds (broadcast): the
    count of `_below` digit by digit, for all pairs at once."""
    fixed, units, bases = _own_rows(dim, mesh)
    rows = fixed[block]                                   # [..., digits]
    options = torch.where(rows < 0, bases, torch.ones_like(bases))
    after = torch.cat([options.flip(-1).cumprod(-1).flip(-1)[..., 1:],
                       torch.ones_like(options[..., :1])], -1)   # combinations below digit k
    count = torch.zeros_like(limit)
    alive = torch.ones_like(limit, dtype=torch.bool)
    for k in range(rows.shape[-1]):
        xd = (limit // units[k]) % bases[k]
        f = rows[..., k]
        step = torch.where(f < 0, xd, (f < xd).long()) * after[..., k]
        count = count + torch.where(alive, step, torch.zeros_like(step))
        alive = alive & ((f < 0) | (f == xd))
    total = options.prod(-1)
    return torch.where(limit >= dim.size, total, count)


@functools.lru_cache(maxsize=4096)
def block_sizes(dim: DimState, mesh: Mesh) -> Tensor:
    """The size of each block of `dim`."""
    if not dim.chunks:
        parts = math.prod(hi // lo for lo, hi, _ in dim.shards)
        count = mesh.group_size(dim.axes)
        return torch.full((count,), dim.size // parts if dim.size else 0, dtype=torch.long)
    start, stop = intervals(dim, mesh)
    return stop - start


@functools.lru_cache(maxsize=4096)
def rank_blocks(dim: DimState, mesh: Mesh) -> Tensor:
    """The index of the block each rank (mesh order) holds of `dim`."""
    return flat_index(coords_table(mesh), mesh, in_mesh_order(mesh, dim.axes))


@functools.lru_cache(maxsize=1024)
def own_and_need(state: State, dst: State, mesh: Mesh) -> tuple[Tensor, Tensor]:
    """Per rank (mesh order), elements of its `dst` block that it holds in `state`, and
    the size of its `dst` block. They may be cached tensors: never modify them in place."""
    own, need = own_and_need_counts(state, dst, mesh)
    return _per_rank(own, mesh), _per_rank(need, mesh)


@functools.lru_cache(maxsize=1024)
def own_and_need_counts(state: State, dst: State, mesh: Mesh
                        ) -> tuple[int | Tensor, int | Tensor]:
    """`own_and_need`, each one int where every rank is alike (no tensor op), else a flat
    tensor. Cached: callers must not modify them."""
    own: int | Tensor = 1
    need: int | Tensor = 1
    for a, b in zip(state.dims, dst.dims):
        own = _product(own, _rank_counts(a, b, mesh))
        need = _product(need, _rank_sizes(b, mesh))
    return own, need


def _product(a: int | Tensor, b: int | Tensor) -> int | Tensor:
    """a * b, with no tensor op where either is the int 1."""
    if isinstance(a, int) and a == 1:
        return b
    return a if isinstance(b, int) and b == 1 else a * b


def _per_rank(value: int | Tensor, mesh: Mesh) -> Tensor:
    return value if isinstance(value, Tensor) else torch.full((mesh.size,), value,
                                                              dtype=torch.long)


@functools.lru_cache(maxsize=4096)
def _rank_counts(a: DimState, b: DimState, mesh: Mesh) -> int | Tensor:
    """Per rank, the size of its block of `a` ∩ its block of `b` (states of a search share
    most dims, so each pair is counted once), as one int where every rank is alike. Counted
    from each rank's coordinates, never through tables of blocks (`counts_at`) where both
    dims are even or both chunked. Cached: callers must not modify it."""
    if b.is_local or a == b:
        return _rank_sizes(a, mesh)
    if a.is_local:
        return _rank_sizes(b, mesh)
    if a.size and a.chunks and b.chunks:   # two intervals per rank
        (sa, ea), (sb, eb) = _rank_chunks(a, mesh), _rank_chunks(b, mesh)
        return (torch.minimum(ea, eb) - torch.maximum(sa, sb)).clamp(min=0)
    if not a.chunks and not b.chunks and a.size:
        points = sorted(set(a.bounds()) | set(b.bounds()))
        if not any(y % x for x, y in zip(points, points[1:])):
            return _digit_counts(a, b, points, mesh)
    return counts_at(a, b, mesh, rank_blocks(a, mesh), rank_blocks(b, mesh))


def _digit_counts(a: DimState, b: DimState, points: list[int], mesh: Mesh) -> int | Tensor:
    """`_rank_counts` of two even dims on one mixed radix (`points` chain): per elementary
    digit, its base where both blocks leave it free, 1 where one does, else whether the
    two ranks' values agree (as `counts_at` does with `digit_rows`)."""
    out: int | Tensor = 1
    for unit, top in zip(points, points[1:]):
        va, vb = _digit_value(a, unit, top, mesh), _digit_value(b, unit, top, mesh)
        if va is None and vb is None:
            out = out * (top // unit)
        elif va is not None and vb is not None:
            out = out * (va == vb).long()
    return out


def _digit_value(dim: DimState, unit: int, top: int, mesh: Mesh) -> Tensor | None:
    """Per rank, the value its block of even `dim` fixes on digit [unit, top), or None
    where the dim leaves that digit free."""
    for lo, hi, axis in dim.shards:
        if lo <= unit and top <= hi:
            coord = coords_table(mesh)[:, mesh.axis_names.index(axis)]
            step, base = unit // lo, top // unit
            if step > 1:
                coord = coord // step
            # the coordinate, below the axis size, needs no modulo where the base covers it
            return coord if (mesh.axis_size(axis) - 1) // step < base else coord % base
    return None


def _rank_sizes(dim: DimState, mesh: Mesh) -> int | Tensor:
    """Per rank, the size of its block of `dim` (`block_sizes` at `rank_blocks`); one int
    for an even dim."""
    if not dim.chunks:
        return dim.size // math.prod(hi // lo for lo, hi, _ in dim.shards) if dim.size else 0
    return chunk_sizes(dim, mesh)


def _rank_chunks(dim: DimState, mesh: Mesh) -> tuple[Tensor, Tensor]:
    """Per rank, the [start, stop) of its block of chunk `dim` (`intervals` at `rank_blocks`)."""
    return chunk_spans(dim, mesh)


def summed_overlap(have: State, need: State, mesh: Mesh, vary: frozenset[AxisName],
                   in_need: bool) -> Tensor:
    """Per rank p (mesh order): the sum, over every choice of coordinates on the axes
    `vary` (in place of p's own, in the blocks of `need` if `in_need`, else of `have`), of
    |have block ∩ need block|.

    Each axis shards at most one dim, so the sum of per-dim products is a product over
    dims of per-dim sums: O(ranks x combinations of one dim's axes), never ranks².
    """
    coords = coords_table(mesh)
    moving = need if in_need else have
    out: int | Tensor = mesh.group_size(x for x in vary if moving.axis_dim(x) is None)
    for a, b in zip(have.dims, need.dims):
        dim = b if in_need else a
        mine = in_mesh_order(mesh, vary & set(dim.axes))
        if len(mine) == len(dim.axes):
            # every block of `dim` in turn: they partition the dim, so the overlaps with
            # the fixed block add up to that block's size
            out = out * _rank_sizes(a if in_need else b, mesh)
            continue
        other = combos(mesh, mine)
        index = torch.zeros(mesh.size, len(other), dtype=torch.long)
        for axis in in_mesh_order(mesh, dim.axes):
            c = other[:, mine.index(axis)][None, :] if axis in mine \
                else coords[:, mesh.axis_names.index(axis)][:, None]
            index = index * mesh.axis_size(axis) + c
        fixed = rank_blocks(a if in_need else b, mesh)[:, None]
        counts = counts_at(a, b, mesh, fixed, index) if in_need else \
            counts_at(a, b, mesh, index, fixed)
        out = out * counts.sum(1)
    return _per_rank(out, mesh)


# -- per-rank values over the axes that matter ------------------------------------------
def combos(mesh: Mesh, axes: tuple[AxisName, ...]) -> Tensor:
    """Every combination of coordinates on `axes` as rows of a tensor (`coords_grid` order)."""
    if not axes:
        return torch.zeros(1, 0, dtype=torch.long)
    sizes = [mesh.axis_size(a) for a in axes]
    return torch.stack([g.reshape(-1) for g in torch.meshgrid(
        *(torch.arange(n) for n in sizes), indexing="ij")], 1)


def coords_grid(mesh: Mesh, axes: tuple[AxisName, ...]) -> Iterator[dict[AxisName, int]]:
    """Every combination of coordinates on `axes` (mesh order, last fastest)."""
    for values in itertools.product(*(range(mesh.axis_size(a)) for a in axes)):
        yield dict(zip(axes, values))


def in_mesh_order(mesh: Mesh, axes: object) -> tuple[AxisName, ...]:
    """The mesh axes among `axes`, in mesh order."""
    wanted = set(axes)  # type: ignore[call-overload]
    return tuple(a for a in mesh.axis_names if a in wanted)


@functools.lru_cache(maxsize=1024)
def group_positions(mesh: Mesh, axes: tuple[AxisName, ...]) -> torch.Tensor:
    """Each rank's position in its group over `axes`, as a tensor of the mesh's shape."""
    out = torch.zeros(mesh.shape, dtype=torch.long)
    for a in axes:
        view = [1] * len(mesh.shape)
        view[mesh.axis_names.index(a)] = mesh.axis_size(a)
        out = out * mesh.axis_size(a) + torch.arange(mesh.axis_size(a)).view(view)
    return out


@functools.lru_cache(maxsize=256)
def coords_table(mesh: Mesh) -> torch.Tensor:
    """Every rank's coordinates, [ranks, axes] in mesh order."""
    return torch.stack([group_positions(mesh, (a,)).reshape(-1) for a in mesh.axis_names], 1)


def flat_index(coords: torch.Tensor, mesh: Mesh, axes: tuple[AxisName, ...]) -> torch.Tensor:
    """Row-major index of each row of `coords` over `axes`."""
    out = torch.zeros(coords.shape[0], dtype=torch.long)
    for a in axes:
        out = out * mesh.axis_size(a) + coords[:, mesh.axis_names.index(a)]
    return out
