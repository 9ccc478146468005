"""DTensor placements <-> meshcomm layouts: the pure half of DTensor interop (no process group).

Converting never communicates and never copies. DTensor splits a tensor over the mesh dims
left to right: `Shard(d)` takes the rank's `torch.chunk` of what is left of dim d,
`_StridedShard(d, split_factor=k)` cuts it into k pieces first and takes the rank's chunk
of each. A layout maps to placements only where those are its shards on every rank, and
only for dims whose placements torch 2.13 reads back right (`full_tensor`): blocks
"(axes... rest)" in any axis order (uneven too, where the chunks agree) and one axis after
local or sized factors ("(b dp)", "(x=2 dp b)"; DTensor's `redistribute` still gets some
of those wrong). Otherwise `InteropError` names the factor and suggests the nearest layout
that maps. The other direction accepts any placements a layout describes (docs/dtensor.md).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import InteropError, caret
from ..core.layout import (
    DimPlacement,
    Layout,
    Shape,
    as_layout,
    chunk_range,
)
from ..core.mesh import AxisName, Mesh
from ..core.names import fresh_names, positional_names
from ..core.reduce_ops import REDUCE_OPS

# One placement as plain values: ("R",) | ("P", op) | ("S", dim, split_factor).
Desc = tuple[str | int, ...]
Placements = tuple[Any, ...]


# -- layout -> placements (pure: no process group needed) -------------------------------
def to_placements(mesh: Mesh, shape: Sequence[int], layout: str | Layout) -> Placements:
    """The DTensor placements, one per mesh axis, that give every rank its shard of `layout`.

    >>> mc.dtensor.to_placements(mc.Mesh("dp=2 tp=2"), (8, 6), "(tp dp b) h")
    (_StridedShard(dim=0, sf=2), Shard(dim=0))
    >>> mc.dtensor.to_placements(mc.Mesh("dp=2 tp=2"), (8, 6), "(b dp) h | sum(tp)")
    (_StridedShard(dim=0, sf=4), Partial(sum))
    """
    return _build(_to_desc(mesh, tuple(int(s) for s in shape), as_layout(layout)))


@functools.lru_cache(maxsize=4096)
def _to_desc(mesh: Mesh, shape: Shape, layout: Layout) -> tuple[Desc, ...]:
    placed = layout.placements(mesh, shape)
    if layout.zigzag_dims:
        d = layout.zigzag_dims[0]
        raise InteropError(f'layout "{layout}": dim {d} {layout.dims[d]} (head-tail) has no'
                           " DTensor placement; fix: reshard to its contiguous twin"
                           f' "{layout.without_zigzag()}" first (mc.reshard)')
    names = mesh.axis_names
    out: list[Desc] = [("R",)] * len(names)
    for axis in layout.partial_axes:
        out[names.index(axis)] = ("P", str(layout.reduce_op))
    for d, dim in enumerate(placed):
        shards = []
        for i, part in enumerate(dim.parts):
            if part.axis:
                me = names.index(part.name)
                # the factors split off before this axis, minus the axes DTensor applied earlier
                split = math.prod(p.size for p in dim.parts[:i]
                                  if not (p.axis and names.index(p.name) < me))
                out[me] = ("S", d, split)
                shards.append((me, part.name, part.size, split))
        _check_expressible(mesh, shape, layout, d, dim, [s[1:] for s in sorted(shards)])
    return tuple(out)


def _check_expressible(mesh: Mesh, shape: Shape, layout: Layout, d: int, dim: DimPlacement,
                       shards: list[tuple[AxisName, int, int]]) -> None:
    axes = [p.name for p in dim.parts if p.axis]
    if not axes:
        return
    last_axis = max(i for i, p in enumerate(dim.parts) if p.axis)
    before = [p for p in dim.parts[:last_axis] if not p.axis and p.size != 1]
    if before and len(axes) > 1:
        text = str(layout)
        at = next(re.finditer(rf"\b{re.escape(before[0].name)}\b", text)).start()
        raise InteropError(
            f'layout "{text}" on {mesh!r} has no DTensor placements: dim {d}'
            f' "{layout.dims[d]}" has the local factor "{before[0].name}" before mesh axis'
            f' "{dim.parts[last_axis].name}" while {len(axes)} axes ({", ".join(axes)}) shard it\n'
            + caret(text, at, at + len(before[0].name), "DTensor writes a dim over several"
                    " axes only as blocks, \"(axes... name)\" in any axis order")
            + f'\n  fix: use "{_blocks(layout, mesh, d)}" (mc.reshard to it first)')
    if dim.uneven and len(axes) > 1 and not _matches(mesh, shape[d], axes, shards):
        order = [a for a in mesh.axis_names if a in axes]
        total = mesh.group_size(axes)
        # A multiple of `total` is even, so always fits; a smaller uneven size may too.
        pad = _smallest_size(shape[d], -(-shape[d] // total) * total,
                             lambda m: m % total == 0 or _matches(mesh, m, axes, shards))
        raise InteropError(
            f'layout "{layout}" of shape {shape} on {mesh!r} has no DTensor placements:'
            f" dim {d} has {shape[d]} elements, not a multiple of {total}, and DTensor's"
            f' uneven _StridedShard splits it differently from "{layout.dims[d]}".'
            f' fix: use "{_blocks(layout, mesh, d, order)}" (mesh order: plain Shard),'
            f" or pad dim {d} to {pad}")


def _smallest_size(n: int, limit: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest size m, n <= m <= limit, that `fits`; None where none does (a
    padding suggestion: only the size of one dim changes)."""
    return next((m for m in range(n, limit + 1) if fits(m)), None)


def _blocks(layout: Layout, mesh: Mesh, d: int, order: Sequence[str] | None = None) -> str:
    """`layout` with dim d rewritten as "(axes... name)": its axes (in `order`), then its name."""
    dim = layout.dims[d]
    axes = list(order) if order else [f.name for f in dim.factors if f.name in mesh.axis_names]
    name = layout.dim_names(mesh)[d]
    dims = [str(x) for x in layout.dims]
    dims[d] = f"({' '.join([*axes, name])})"
    tail = str(layout).partition("|")[2]
    return " ".join(dims) + (f" |{tail}" if tail else "")


# -- placements -> layout -----------------------------------------------------------------
def from_placements(mesh: Mesh, shape: Sequence[int], placements: Sequence[Any], *,
                    names: str | Sequence[str] | None = None) -> Layout:
    """The layout whose shards are those of DTensor `placements` (one per mesh axis).

    >>> from torch.distributed.tensor import Shard, Partial
    >>> mc.dtensor.from_placements(mc.Mesh("dp=2 tp=2"), (8, 6), [Shard(1), Partial("max")],
    ...                            names="b h")
    Layout('b (dp h) | max(tp)')

    `names` names the dims (default d0, d1, ..., or dim0, dim1, ... on an unnamed mesh,
    whose axes are d0, d1, ...); sized factors get fresh names.
    """
    shape_t = tuple(int(s) for s in shape)
    return _from_desc(mesh, shape_t, _descs(mesh, placements, len(shape_t)),
                      _dim_names(mesh, names, len(shape_t)))


def _descs(mesh: Mesh, placements: Sequence[Any], ndim: int) -> tuple[Desc, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(placements)
    if len(placements) != len(mesh.axis_names):
        raise InteropError(f"{len(placements)} placements {list(placements)} for {mesh!r}:"
                           f" give one per mesh axis ({', '.join(mesh.axis_names)})")
    out: list[Desc] = []
    for axis, p in zip(mesh.axis_names, placements):
        if type(p) is Replicate:
            out.append(("R",))
        elif type(p) is Partial and p.reduce_op in REDUCE_OPS:
            out.append(("P", p.reduce_op))
        elif type(p) in (Shard, _StridedShard) and -ndim <= p.dim < ndim:
            split = int(p.split_factor) if type(p) is _StridedShard else 1
            out.append(("S", p.dim % ndim, split))
        else:
            raise InteropError(
                f"placement {p!r} on mesh axis {axis} has no meshcomm layout: meshcomm holds"
                f" Replicate, Shard/_StridedShard of dims 0..{ndim - 1} and Partial of"
                f" {', '.join(REDUCE_OPS)}. fix: dt.redistribute(...) it to one of those first")
    ops = {p[1] for p in out if p[0] == "P"}
    if len(ops) > 1:
        raise InteropError(
            f"placements {list(placements)} mix reductions {sorted(map(str, ops))}; a layout"
            " holds one pending reduction. fix: redistribute all but one op to Replicate()")
    return tuple(out)


def _dim_names(mesh: Mesh, names: str | Sequence[str] | None, ndim: int) -> tuple[str, ...]:
    if names is None:
        return positional_names(ndim, mesh.axis_names)
    out = tuple(names.split() if isinstance(names, str) else names)
    if len(out) != ndim or len(set(out)) != ndim or set(out) & set(mesh.axis_names):
        raise InteropError(f"names={names!r}: give {ndim} distinct dim names that are not"
                           f" mesh axes ({', '.join(mesh.axis_names)}), e.g. \"b s h\"")
    return out


@functools.lru_cache(maxsize=4096)
def _from_desc(mesh: Mesh, shape: Shape, desc: tuple[Desc, ...],
               names: tuple[str, ...]) -> Layout:
    taken = set(names) | set(mesh.axis_names)
    fresh = fresh_names("xyz", taken)
    dims = []
    for d, n in enumerate(shape):
        shards = [(mesh.axis_names[md], mesh.shape[md], int(p[2]))
                  for md, p in enumerate(desc) if p[0] == "S" and p[1] == d]
        segments = _even_segments(n, shards)
        if segments is None:
            dims.append(_uneven_dim(mesh, shape, desc, names, d, shards))
        else:
            dims.append(_group(segments, names[d], fresh))
    partial = [a for a, p in zip(mesh.axis_names, desc) if p[0] == "P"]
    op = next((p[1] for p in desc if p[0] == "P"), None)
    text = " ".join(dims) + (f" | {op}({', '.join(partial)})" if partial else "")
    return Layout(text)


Segment = tuple[str, int]   # ("", size) for a local run, (axis, size) for a mesh axis


def _even_segments(n: int, shards: list[tuple[AxisName, int, int]]) -> list[Segment] | None:
    """Dim n split as DTensor does, left to right, or None where a split does not divide."""
    segs: list[Segment] = [("", n)]
    for axis, k, split in shards:
        j = _split_local(segs, split)
        if j is None:
            return None
        while j < len(segs) and segs[j][0]:           # axes already placed stay above it
            j += 1
        if j == len(segs) or segs[j][1] % k:
            return None
        segs[j:j + 1] = [(axis, k), ("", segs[j][1] // k)]
    return segs


def _split_local(segs: list[Segment], split: int) -> int | None:
    """Cut the local runs so that those before index j multiply to `split`; j, or None."""
    acc = 1
    for j, (axis, size) in enumerate(segs):
        if axis:
            continue
        if acc == split:
            return j
        if split % acc == 0 and size % (split // acc) == 0 and split // acc < size:
            segs[j:j + 1] = [("", split // acc), ("", size // (split // acc))]
            return j + 1
        acc *= size
    return len(segs) if acc == split else None


def _group(segments: list[Segment], name: str, fresh: Any) -> str:
    merged: list[Segment] = []
    for axis, size in segments:
        if not axis and size == 1:
            continue
        if not axis and merged and not merged[-1][0]:
            merged[-1] = ("", merged[-1][1] * size)
        else:
            merged.append((axis, size))
    runs = [i for i, (axis, _) in enumerate(merged) if not axis]
    if not runs:
        merged.append(("", 1))
        runs = [len(merged) - 1]
    words = [axis if axis else (name if i == runs[-1] else f"{next(fresh)}={size}")
             for i, (axis, size) in enumerate(merged)]
    return words[0] if len(words) == 1 else f"({' '.join(words)})"


def _uneven_dim(mesh: Mesh, shape: Shape, desc: tuple[Desc, ...], names: tuple[str, ...],
                d: int, shards: list[tuple[AxisName, int, int]]) -> str:
    order = _decode_order(shards)
    text = f"({' '.join([*order, names[d]])})" if order else ""
    if order and _matches(mesh, shape[d], order, shards):
        return text
    placements = [f"{a}: Shard({d})" if split == 1 else
                  f"{a}: _StridedShard({d}, split_factor={split})" for a, _, split in shards]
    # Every split even at a multiple of each axis size times its split factor, where the
    # splits nest at all; search up to twice that for the smallest size that is a layout.
    total = math.prod(k * split for _, k, split in shards)
    limit = 2 * -(-shape[d] // total) * total
    pad = _smallest_size(shape[d], limit, lambda m: (
        _even_segments(m, list(shards)) is not None
        or (order is not None and _matches(mesh, m, order, shards))))
    fix = (f"pad dim {d} to {pad} (the smallest size from {shape[d]} on that a layout"
           " describes), or redistribute it to Shard placements in mesh order"
           if pad is not None else
           f"no size of dim {d} from {shape[d]} to {limit} makes these placements a layout"
           " (their split factors do not nest); redistribute it to Shard placements in"
           " mesh order")
    raise InteropError(
        f"dim {d} of shape {shape} on {mesh!r} is split unevenly ({', '.join(placements)})"
        " in a way no layout describes: only \"(axes... name)\" groups may be uneven, split"
        f" with torch.chunk axis by axis. fix: {fix}")


def _decode_order(shards: list[tuple[AxisName, int, int]]) -> list[AxisName] | None:
    """The shard order DTensor decodes from split factors (its own rule), or None."""
    order: list[tuple[AxisName, int]] = []
    for axis, k, split in reversed(shards):
        acc = 1
        for i in range(len(order) + 1):
            if acc == split:
                order.insert(i, (axis, k))
                break
            if i < len(order):
                acc *= order[i][1]
        else:
            return None
    return [a for a, _ in order]


# -- exact shard comparison (uneven dims), on runs of indices -----------------------------
Run = tuple[int, int]   # (start, length) of consecutive global indices


def dtensor_runs(n: int, steps: Sequence[tuple[int, int, int]]) -> tuple[Run, ...]:
    """The global indices of one dim of size n that a rank holds after DTensor's splits, as
    merged runs. `steps` are (chunks, this rank's coordinate, split_factor) per shard of
    the dim, in mesh order (split_factor 1 is `Shard`).

    >>> dtensor_runs(7, [(2, 0, 2), (2, 1, 1)])     # (tp dp b), 7 rows: rank dp=0 tp=1
    ((4, 2),)
    """
    runs: list[Run] = [(0, n)]
    for k, c, split in steps:
        total = sum(m for _, m in runs)
        out: list[Run] = []
        for j in range(split):
            lo, m = chunk_range(0, total, split, j)
            out += _slice(runs, *chunk_range(lo, m, k, c))
        runs = out
    merged: list[Run] = []
    for start, m in runs:
        if merged and sum(merged[-1]) == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + m)
        else:
            merged.append((start, m))
    return tuple(merged)


def dtensor_indices(n: int, steps: Sequence[tuple[int, int, int]]) -> tuple[int, ...]:
    """`dtensor_runs` as a tuple of indices.

    >>> dtensor_indices(8, [(2, 1, 4)])        # _StridedShard(0, split_factor=4) over 2 ranks
    (1, 3, 5, 7)
    """
    return tuple(i for start, m in dtensor_runs(n, steps) for i in range(start, start + m))


def _slice(runs: list[Run], lo: int, m: int) -> list[Run]:
    """Positions [lo, lo + m) of the runs laid end to end, as runs."""
    out, pos = [], 0
    for start, length in runs:
        a, b = max(lo, pos), min(lo + m, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
    return out


def _matches(mesh: Mesh, n: int, order: Sequence[AxisName],
             shards: list[tuple[AxisName, int, int]]) -> bool:
    """True if "(order... name)" (torch.chunk axis by axis) gives every rank DTensor's shard.

    `shards` are (axis, size, split_factor) of the dim, in mesh order.
    """
    for rank in mesh.ranks:
        coords = mesh.coords(rank)
        start, length = 0, n
        for axis in order:
            start, length = chunk_range(start, length, mesh.axis_size(axis), coords[axis])
        held = dtensor_runs(n, [(k, coords[axis], split) for axis, k, split in shards])
        if held != (((start, length),) if length else ()):
            return False
    return True


def _build(desc: tuple[Desc, ...]) -> Placements:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in desc:
        if p[0] == "R":
            out.append(Replicate())
        elif p[0] == "P":
            out.append(Partial(str(p[1])))
        else:
            out.append(Shard(int(p[1])) if p[2] == 1
                       else _StridedShard(int(p[1]), split_factor=int(p[2])))
    return tuple(out)
