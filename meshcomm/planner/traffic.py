"""Traffic: the bytes each rank of a mesh sends and receives in one planned collective.

The planner's one place for these formulas (per-rank element counts, in mesh order). The
executors never recompute them: they measure the buffers they hand to each collective
(`meshcomm.executors.steps.Wire`), and the tests compare the two. Where ranks differ
(uneven shards) the arithmetic runs on tensors of the mesh's shape, so it costs O(ranks)
in C, not in Python.
"""

from __future__ import annotations

import array
import itertools
import math

import torch

from ..core.mesh import AxisName, Mesh
from .blocks import group_positions


# Per-rank values are tuples in mesh order; where ranks differ (uneven shards) the
# arithmetic runs on tensors of the mesh's shape, so it costs O(ranks) in C, not Python.
def uniform(sizes: tuple[int, ...]) -> bool:
    """Whether every rank's count is alike (the ends first: most that differ, differ there)."""
    return sizes[-1] == sizes[0] and sizes.count(sizes[0]) == len(sizes)


def on_mesh(mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
    return as_tensor(sizes).reshape(mesh.shape)


def as_tensor(values: tuple[int, ...]) -> torch.Tensor:
    """Per-rank ints as an int64 tensor (through a buffer: `torch.tensor` of a tuple of
    1,024 ints takes ~10x as long)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else \
        torch.zeros(0, dtype=torch.long)


def axis_dims(mesh: Mesh, axes: tuple[AxisName, ...]) -> tuple[int, ...]:
    return tuple(mesh.axis_names.index(a) for a in axes)


def gather_traffic(mesh: Mesh, axes: tuple[AxisName, ...], sizes: tuple[int, ...] | None,
                   mine: torch.Tensor | None = None
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`mine`: `sizes` as a tensor of the mesh's shape, where the caller has it (then
    `sizes` may be None)."""
    g = mesh.group_size(axes)
    if sizes is not None and uniform(sizes):   # sent = received: one tuple for both
        each = ((g - 1) * sizes[0],) * mesh.size
        return each, each
    if mine is None:
        assert sizes is not None, "gather_traffic needs the ranks' sizes"
        mine = on_mesh(mesh, sizes)
    total = mine.sum(axis_dims(mesh, axes), keepdim=True)
    return (tuple(((g - 1) * mine).reshape(-1).tolist()),
            tuple((total - mine).reshape(-1).tolist()))


def scatter_traffic(mesh: Mesh, axes: tuple[AxisName, ...], ins: tuple[int, ...],
                     outs: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    g = mesh.group_size(axes)
    if uniform(ins) and uniform(outs):
        return (ins[0] - outs[0],) * mesh.size, ((g - 1) * outs[0],) * mesh.size
    send = tuple(i - o for i, o in zip(ins, outs))
    recv = tuple((g - 1) * o for o in outs)
    return send, recv


def all_reduce_traffic(mesh: Mesh, axes: tuple[AxisName, ...],
                        sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    g = mesh.group_size(axes)
    if uniform(sizes) and sizes[0] % g == 0:
        out = (sizes[0] - sizes[0] // g + (g - 1) * (sizes[0] // g),) * mesh.size
        return out, out
    total = on_mesh(mesh, sizes)
    pos = group_positions(mesh, axes)
    step = (total + g - 1) // g          # torch.chunk of the flat tensor: chunk `pos`
    c = torch.clamp(torch.minimum((pos + 1) * step, total) - torch.minimum(pos * step, total),
                    min=0)
    out = tuple(((total - c) + (g - 1) * c).reshape(-1).tolist())
    return out, out


def off_diagonal(mesh: Mesh, sizes: tuple[int, ...], a: AxisName, b: AxisName) -> tuple[int, ...]:
    """`sizes`, zero at ranks whose coordinates on `a` and `b` agree (they keep their block)."""
    if a == b:
        return (0,) * mesh.size
    if uniform(sizes):
        return _off_diagonal_of(mesh, sizes[0], a, b)
    ca, cb = group_positions(mesh, (a,)), group_positions(mesh, (b,))
    return tuple(torch.where(ca == cb, 0, on_mesh(mesh, sizes)).reshape(-1).tolist())


def _off_diagonal_of(mesh: Mesh, n: int, a: AxisName, b: AxisName) -> tuple[int, ...]:
    """`off_diagonal` where every rank holds `n`: laid out by list repetition (no tensor op;
    a cold one costs more than the whole). In mesh order a rank's index is
    ((((p A + i) M + m) B + j) Q + q), i and j its coordinates on the first and second of
    the two axes (sizes A and B), p, m and q on the axes before, between and after them."""
    first, second = sorted((mesh.axis_names.index(a), mesh.axis_names.index(b)))
    shape = mesh.shape
    size_a, size_b = shape[first], shape[second]
    between, after = math.prod(shape[first + 1:second]), math.prod(shape[second + 1:])
    out: list[int] = []
    for i in range(size_a):
        row = [n] * size_b
        if i < size_b:
            row[i] = 0
        if after > 1:
            row = list(itertools.chain.from_iterable(map(itertools.repeat, row,
                                                         itertools.repeat(after))))
        out += row * between
    return tuple(out * math.prod(shape[:first]))


def all_to_all_traffic(mesh: Mesh, axes: tuple[AxisName, ...],
                       sizes: tuple[int, ...]) -> tuple[int, ...]:
    """An even all_to_all: each rank keeps 1/g of its tensor and sends (receives) the rest."""
    g = mesh.group_size(axes)
    if uniform(sizes):
        return (sizes[0] - sizes[0] // g,) * len(sizes)
    return tuple(s - s // g for s in sizes)
