"""Planner states: a layout resolved on a mesh and shape, in a form moves can edit.

This module never communicates. A dim of global size n is described by the
mesh axes that shard it. Where its size divides, an axis owns a factor of the
dim written as a stride interval [lo, hi): global index i has digit
(i // lo) % (hi // lo) equal to the rank's coordinate (einops' factor
semantics). Where the size does not divide (uneven), the dim is a chain of
axes applied as nested `torch.chunk`s, major first. Everything not owned by an
axis is local. Every state is canonical: equal distributions compare equal.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from ..core import reduce_ops
from ..core.layout import DimPlacement, Layout, Shape, chunk_range
from ..core.mesh import AxisName, Mesh
from ..core.names import fresh_name
from ..core.notation import Dim, Factor, Pattern

Shard = tuple[int, int, AxisName]   # (lo, hi, axis): the axis owns stride interval [lo, hi)


@dataclass(frozen=True, slots=True)
class DimState:
    """One dim: even shards (stride intervals, major first) or an uneven chunk chain."""

    size: int
    shards: tuple[Shard, ...] = ()
    chunks: tuple[AxisName, ...] = ()

    @property
    def axes(self) -> tuple[AxisName, ...]:
        return self.chunks if self.chunks else tuple(s[2] for s in self.shards)

    @property
    def is_local(self) -> bool:
        return not self.shards and not self.chunks

    def bounds(self) -> tuple[int, ...]:
        """Every stride boundary of the dim, ascending (1 and size included)."""
        points = {1, self.size} | {s[0] for s in self.shards} | {s[1] for s in self.shards}
        return tuple(sorted(points))

    def local_runs(self) -> tuple[tuple[int, int], ...]:
        """Local stride intervals, major first, adjacent ones merged."""
        runs = []
        hi = self.size
        for lo_s, hi_s, _ in self.shards:
            if hi_s < hi:
                runs.append((hi_s, hi))
            hi = lo_s
        if hi > 1:
            runs.append((1, hi))
        return tuple(runs)


@dataclass(frozen=True, slots=True)
class State:
    """A whole layout on a mesh: its dims and its pending reduction."""

    dims: tuple[DimState, ...]
    partial: tuple[AxisName, ...] = ()
    op: str | None = None

    def axis_dim(self, axis: AxisName) -> int | None:
        for d, dim in enumerate(self.dims):
            if axis in dim.axes:
                return d
        return None

    def used_axes(self) -> frozenset[AxisName]:
        return frozenset(a for dim in self.dims for a in dim.axes) | frozenset(self.partial)


def is_chain(points: tuple[int, ...]) -> bool:
    """True if each sorted point divides the next (a valid mixed-radix factorization)."""
    return all(b % a == 0 for a, b in zip(points, points[1:]))


def even_dim(size: int, shards: tuple[Shard, ...]) -> DimState:
    return DimState(size, tuple(sorted(shards, key=lambda s: -s[0])))


def chunk_dim(size: int, chunks: tuple[AxisName, ...], mesh: Mesh) -> DimState:
    """The canonical DimState of a chunk chain (even intervals when the sizes divide)."""
    total = mesh.group_size(chunks)
    if size % total or (size == 0 and chunks):  # an empty dim has no stride intervals
        return DimState(size, (), chunks)
    shards = []
    hi = size
    for a in chunks:
        lo = hi // mesh.axis_size(a)
        shards.append((lo, hi, a))
        hi = lo
    return even_dim(size, tuple(shards))


def as_chunks(dim: DimState) -> tuple[AxisName, ...] | None:
    """The chunk chain equal to `dim` (even shards packed from the top), else None."""
    if dim.chunks or dim.is_local:
        return dim.chunks
    hi = dim.size
    for lo, hi_s, _ in dim.shards:
        if hi_s != hi:
            return None
        hi = lo
    return tuple(s[2] for s in dim.shards)


def _dim_from_placement(p: DimPlacement, mesh: Mesh) -> DimState:
    # zigzag dims are planned by `planner.zigzag` on their contiguous twins, never here
    assert not p.zigzag, "a zigzag dim reached the planner's states; this is a meshcomm bug"
    # A size-1 axis shards nothing: it is left out, so that states stay canonical.
    if p.uneven or p.size == 0:
        return chunk_dim(p.size, tuple(a for a in p.axes if mesh.axis_size(a) > 1), mesh)
    shards = []
    stride = 1
    for part in reversed(p.parts):
        if part.axis and part.size > 1:
            shards.append((stride, stride * part.size, part.name))
        stride *= part.size
    return even_dim(p.size, tuple(shards))


def from_layout(layout: Layout, mesh: Mesh, shape: Shape) -> State:
    """The planner state of `layout` (validates it on `mesh` and `shape`).

    Axes of size 1 are left out: sharding over one rank keeps everything, and a pending
    reduction over one rank is already its result, so no step ever runs over them.
    """
    return _from_layout(layout, mesh, tuple(shape))


@functools.lru_cache(maxsize=8192)
def _from_layout(layout: Layout, mesh: Mesh, shape: Shape) -> State:
    dims = tuple(_dim_from_placement(p, mesh) for p in layout.placements(mesh, shape))
    partial = tuple(a for a in mesh.axis_names
                    if a in layout.partial_axes and mesh.axis_size(a) > 1)
    return State(dims, partial, layout.reduce_op if partial else None)


def to_layout(state: State, names: tuple[str, ...], mesh: Mesh) -> Layout:
    """A Layout for `state`, naming each dim's minor local factor after `names`."""
    taken = set(mesh.axis_names) | set(names)
    dims = tuple(_dim_pattern(dim, name, taken) for dim, name in zip(state.dims, names))
    partial = tuple(state.partial)
    return Layout._from_pattern(Pattern(dims, state.op if partial else None, partial))


def _dim_pattern(dim: DimState, name: str, taken: set[str]) -> Dim:
    if dim.chunks:
        return Dim(tuple(Factor(a) for a in dim.chunks) + (Factor(name),))
    items: list[tuple[int, Factor | None]] = [(s[0], Factor(s[2])) for s in dim.shards]
    runs = dim.local_runs()
    items += [(lo, None) for lo, _ in runs]
    items.sort(key=lambda t: -t[0])
    sizes = {lo: hi // lo for lo, hi in runs}
    factors: list[Factor] = []
    minor_local = min((lo for lo, _ in runs), default=None)
    for lo, factor in items:
        if factor is not None:
            factors.append(factor)
        elif lo == minor_local:
            factors.append(Factor(name))
        else:
            factors.append(Factor(fresh_name(name, taken), sizes[lo]))
    if minor_local is None:
        factors.append(Factor(name))
    return Dim(tuple(factors))


def uniform_numel(state: State) -> int | None:
    """The elements every rank holds in `state` where all hold as many (no uneven dim, or
    an empty one), else None."""
    n = 1
    for dim in state.dims:
        if dim.size == 0:
            return 0
        if dim.chunks:
            n = -1
        elif n > 0:
            n *= dim.size // math.prod(s[1] // s[0] for s in dim.shards)
    return n if n >= 0 else None


def most_numel(state: State, mesh: Mesh) -> int:
    """The most elements any rank holds in `state`: the first rank's (coordinate 0 on every
    axis), in ints. Its block of each chunk chain is the first `torch.chunk` at every level,
    which is never shorter than any other block of that level (nor is the first chunk of a
    longer span shorter than any chunk of a shorter one); even dims are alike on all ranks.
    So this rank holds the most of every state at once: a sum of states' sizes over the
    ranks is largest there too."""
    n = 1
    for dim in state.dims:
        if not dim.chunks:
            n *= dim.size // math.prod(s[1] // s[0] for s in dim.shards)
            continue
        length = dim.size
        for a in dim.chunks:
            length = chunk_range(0, length, mesh.axis_size(a), 0)[1]
        n *= length
    return n


@functools.lru_cache(maxsize=16384)
def local_numels(state: State, mesh: Mesh) -> tuple[int, ...]:
    """Elements each rank holds in `state`, in mesh order."""
    n = uniform_numel(state)
    if n is not None:
        return (n,) * mesh.size
    laid = block_numels(state, mesh)
    if laid is not None:       # one chunk chain laid on the ranks in Python: no tensor
        return tuple(lay_blocks(*laid, mesh))
    return tuple(local_numels_tensor(state, mesh).reshape(-1).tolist())


@functools.lru_cache(maxsize=16384)
def local_numels_tensor(state: State, mesh: Mesh) -> torch.Tensor:
    """`local_numels` as a tensor of the mesh's shape (chunk chains counted for all ranks
    at once, as nested `torch.chunk`s of coordinates: `chunk_spans`)."""
    n = uniform_numel(state)
    if n is not None:
        return torch.full(mesh.shape, n, dtype=torch.long)
    even = 1
    out: torch.Tensor | None = None
    for dim in state.dims:
        if not dim.chunks:
            even *= dim.size // math.prod(s[1] // s[0] for s in dim.shards)
            continue
        out = chunk_sizes(dim, mesh) if out is None else out * chunk_sizes(dim, mesh)
    assert out is not None, f"{state} has no uneven dim, yet its ranks differ"
    return (out if even == 1 else out * even).reshape(mesh.shape)


@functools.lru_cache(maxsize=4096)
def chunk_sizes(dim: DimState, mesh: Mesh) -> torch.Tensor:
    """Per rank (flat, mesh order), the size of its block of chunk `dim` (`chunk_spans`).

    Up to `_PYTHON_BLOCKS` blocks, in Python, level by level: each level's blocks have at
    most three lengths (a `torch.chunk` gives full chunks, one shorter, then empty ones),
    each chunked once; then one tensor laid on the ranks (`_on_ranks`)."""
    if mesh.group_size(dim.chunks) > _PYTHON_BLOCKS:
        start, stop = chunk_spans(dim, mesh)
        return stop - start
    laid = _chunk_lengths(dim, mesh)
    if laid is None:
        return _on_ranks(torch.frombuffer(array.array("q", _chain_lengths(dim, mesh)),
                                          dtype=torch.long), dim, mesh)
    return torch.frombuffer(array.array("q", laid), dtype=torch.long)


def _chain_lengths(dim: DimState, mesh: Mesh) -> list[int]:
    """The block lengths of chunk `dim`, row-major over its chain (major first)."""
    lengths = [dim.size]
    for a in dim.chunks:
        parts = {n: reduce_ops.chunk_sizes(n, mesh.axis_size(a)) for n in set(lengths)}
        lengths = list(itertools.chain.from_iterable(map(parts.__getitem__, lengths)))
    return lengths


def _chunk_lengths(dim: DimState, mesh: Mesh) -> list[int] | None:
    """`chunk_sizes` as a list, where it is laid on the ranks by repetition (its chain the
    mesh's innermost or outermost axes, in order, of at most `_PYTHON_BLOCKS` blocks);
    else None. Repeated blocks share their int objects."""
    if _laid_inner(dim, mesh) is None:
        return None
    return lay_blocks(_chain_lengths(dim, mesh), dim, mesh)


def _laid_inner(dim: DimState, mesh: Mesh) -> bool | None:
    """True where chunk `dim`'s chain is the mesh's innermost axes (in order), False where
    it is its outermost ones, of at most `_PYTHON_BLOCKS` blocks; else None."""
    k, names = len(dim.chunks), mesh.axis_names
    inner = dim.chunks == names[len(names) - k:]
    if not (inner or dim.chunks == names[:k]) or mesh.group_size(dim.chunks) > _PYTHON_BLOCKS:
        return None
    return inner


def lay_blocks(table: list[int], dim: DimState, mesh: Mesh) -> list[int]:
    """Per-block values of chunk `dim` (row-major over its chain), per rank (mesh order),
    where its chain is laid on the ranks by repetition (`block_numels`): no int copied."""
    if _laid_inner(dim, mesh):                   # the innermost axes: repeat the whole table
        return table * (mesh.size // len(table))
    each = itertools.repeat(mesh.size // len(table))     # the outermost: each block in place
    return list(itertools.chain.from_iterable(map(itertools.repeat, table, each)))


def block_numels(state: State, mesh: Mesh) -> tuple[list[int], DimState] | None:
    """Where `state`'s only uneven dim is a chunk chain laid on the ranks by repetition
    (its mesh's innermost or outermost axes): the elements a rank holding each block of
    it holds (row-major over the chain), and that dim, so that per-rank values worked
    out per block are laid on the ranks by `lay_blocks`; else None."""
    chunked = [dim for dim in state.dims if dim.chunks]
    if len(chunked) != 1 or _laid_inner(chunked[0], mesh) is None:
        return None
    even = math.prod(dim.size // math.prod(s[1] // s[0] for s in dim.shards)
                     for dim in state.dims if not dim.chunks)
    return [even * n for n in _chain_lengths(chunked[0], mesh)], chunked[0]


# Chunk chains of up to this many blocks are sized in Python (`chunk_sizes`): a cold torch
# op costs about as much as ~40 blocks, and the ~10 ops per axis of the tensor form more.
_PYTHON_BLOCKS = 1024


def _on_ranks(table: torch.Tensor, dim: DimState, mesh: Mesh) -> torch.Tensor:
    """Per-block values of chunk `dim` (flat, row-major over its chain, major first), per
    rank (flat, mesh order): one view where the chain is the mesh's axes in order."""
    sizes = [mesh.axis_size(a) for a in dim.chunks]
    if list(dim.chunks) == list(mesh.axis_names):
        return table
    table = table.view(*sizes)
    order = sorted(range(len(sizes)), key=lambda k: mesh.axis_names.index(dim.chunks[k]))
    if order != sorted(order):
        table = table.permute(*order)
    view = [mesh.axis_size(a) if a in dim.chunks else 1 for a in mesh.axis_names]
    return table.reshape(view).expand(*mesh.shape).reshape(-1)


@functools.lru_cache(maxsize=4096)
def chunk_spans(dim: DimState, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank (flat, mesh order), the [start, stop) of its block of chunk `dim`: nested
    `torch.chunk`s, major first, on each rank's coordinates. (Search states share most
    dims, so each is counted once.) Cached: callers must not modify them."""
    if mesh.group_size(dim.chunks) <= _FEW_BLOCKS:
        return _few_chunk_spans(dim, mesh)
    start = torch.zeros(mesh.shape, dtype=torch.long)
    length = torch.full(mesh.shape, dim.size, dtype=torch.long)
    for a in dim.chunks:
        n = mesh.axis_size(a)
        view = [1] * len(mesh.shape)
        view[mesh.axis_names.index(a)] = n
        coord = torch.arange(n).view(view)
        step = (length + n - 1) // n
        lo = torch.minimum(coord * step, length)
        start, length = start + lo, torch.minimum((coord + 1) * step, length) - lo
    return start.reshape(-1), (start + length).reshape(-1)


# Chunk chains of at most this many blocks are counted in Python, block by block (a cold
# torch op costs as much as ~30 blocks), then laid on the ranks in one expand.
_FEW_BLOCKS = 64


def _few_chunk_spans(dim: DimState, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    spans = [(0, dim.size)]                     # row-major over the chain, major first
    for a in dim.chunks:
        n = mesh.axis_size(a)
        spans = [chunk_range(s, length, n, c) for s, length in spans for c in range(n)]
    sizes = [mesh.axis_size(a) for a in dim.chunks]
    table = torch.tensor([[s for s, _ in spans], [s + n for s, n in spans]],
                         dtype=torch.long).view(2, *sizes)
    order = sorted(range(len(sizes)), key=lambda k: mesh.axis_names.index(dim.chunks[k]))
    if order != sorted(order):
        table = table.permute(0, *(k + 1 for k in order))
    view = [2] + [mesh.axis_size(a) if a in dim.chunks else 1 for a in mesh.axis_names]
    flat = table.reshape(view).expand(2, *mesh.shape).reshape(2, -1)
    return flat[0], flat[1]
