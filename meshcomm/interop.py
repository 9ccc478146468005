"""DTensor interop: layouts <-> DTensor placements, Sharded <-> DTensor, mc.reshard on DTensors.

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
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .api import Sharded, is_dtensor, reshard
from .dist.bind import BoundMesh
from .errors import InteropError, MeshMismatchError, caret
from .layout import DimPlacement, Layout, Shape, as_layout, chunk_range
from .mesh import AxisName, Mesh
from .notation import REDUCE_OPS
from .plan import CostModel, plan

# One placement as plain values: ("R",) | ("P", op) | ("S", dim, split_factor).
Desc = tuple[str | int, ...]
Placements = tuple[Any, ...]


# -- layout -> placements (pure: no process group needed) -------------------------------
def to_placements(mesh: Mesh, shape: Sequence[int], layout: str | Layout) -> Placements:
    """The DTensor placements, one per mesh axis, that give every rank its shard of `layout`.

    >>> mc.to_placements(mc.Mesh("dp=2 tp=2"), (8, 6), "(tp dp b) h")
    (_StridedShard(dim=0, sf=2), Shard(dim=0))
    >>> mc.to_placements(mc.Mesh("dp=2 tp=2"), (8, 6), "(b dp) h | sum(tp)")
    (_StridedShard(dim=0, sf=4), Partial(sum))
    """
    return _build(_to_desc(mesh, tuple(int(s) for s in shape), as_layout(layout)))


@functools.lru_cache(maxsize=4096)
def _to_desc(mesh: Mesh, shape: Shape, layout: Layout) -> tuple[Desc, ...]:
    placed = layout.placements(mesh, shape)
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
        total = math.prod(mesh.axis_size(a) for a in axes)
        raise InteropError(
            f'layout "{layout}" of shape {shape} on {mesh!r} has no DTensor placements:'
            f" dim {d} has {shape[d]} elements, not a multiple of {total}, and DTensor's"
            f' uneven _StridedShard splits it differently from "{layout.dims[d]}".'
            f' fix: use "{_blocks(layout, mesh, d, order)}" (mesh order: plain Shard),'
            f" or pad dim {d} to {-(-shape[d] // total) * total}")


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
    >>> mc.from_placements(mc.Mesh("dp=2 tp=2"), (8, 6), [Shard(1), Partial("max")], names="b h")
    Layout('b (dp h) | max(tp)')

    `names` names the dims (default d0, d1, ...); sized factors get fresh names.
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
        taken = set(mesh.axis_names)
        return tuple(next(n for n in (f"d{i}", f"d{i}_", f"dim{i}") if n not in taken)
                     for i in range(ndim))
    out = tuple(names.split() if isinstance(names, str) else names)
    if len(out) != ndim or len(set(out)) != ndim or set(out) & set(mesh.axis_names):
        raise InteropError(f"names={names!r}: give {ndim} distinct dim names that are not"
                           f" mesh axes ({', '.join(mesh.axis_names)}), e.g. \"b s h\"")
    return out


@functools.lru_cache(maxsize=4096)
def _from_desc(mesh: Mesh, shape: Shape, desc: tuple[Desc, ...],
               names: tuple[str, ...]) -> Layout:
    taken = set(names) | set(mesh.axis_names)
    fresh = (n for n in (f"{c}{k or ''}" for k in itertools.count() for c in "xyz")
             if n not in taken)
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
    total = math.prod(k for _, k, _ in shards)
    raise InteropError(
        f"dim {d} of shape {shape} on {mesh!r} is split unevenly ({', '.join(placements)})"
        " in a way no layout describes: only \"(axes... name)\" groups may be uneven, split"
        f" with torch.chunk axis by axis. fix: pad dim {d} to {-(-shape[d] // total) * total},"
        " or redistribute it to Shard placements in mesh order")


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


# -- DTensor <-> Sharded (runtime: reads process groups, never communicates) -------------
def bind_device_mesh(device_mesh: Any) -> BoundMesh:
    """A BoundMesh over a DeviceMesh's existing process groups (creates none, sends nothing).

    >>> bound = mc.bind_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))  # doctest: +SKIP

    Each axis uses the DeviceMesh's own group. A group over several axes (which plans
    use for some collectives) is any existing process group with exactly the ranks of
    that flattened group in mesh order: the world group, groups made by `mc.init_mesh`
    or by `DeviceMesh._flatten()`. A plan that needs one that does not exist raises
    before it communicates (every rank sees the same groups, so every rank raises).
    """
    import torch.distributed as dist

    mesh = Mesh.from_device_mesh(device_mesh)
    rank = dist.get_rank()
    if rank not in mesh.ranks:
        raise MeshMismatchError(f"rank {rank} is not in {mesh!r} (the DTensor's DeviceMesh);"
                                " fix: convert DTensors only on the ranks of their mesh")
    names = {(axis,): device_mesh.get_group(i).group_name
             for i, axis in enumerate(mesh.axis_names)}
    existing = _groups_by_ranks()
    for k in range(2, len(mesh.axis_names) + 1):
        for axes in itertools.combinations(mesh.axis_names, k):
            ranks = next(g for g in mesh.groups(*axes) if rank in g)
            if ranks in existing:
                names[axes] = existing[ranks]
    group = device_mesh.get_group(0)
    device = (torch.device("cpu") if device_mesh.device_type == "cpu" else
              torch.device(device_mesh.device_type, torch.get_device_module(
                  device_mesh.device_type).current_device()))
    bound = BoundMesh(mesh, dist.get_backend(group), device, rank, names)
    vars(bound)["device_mesh"] = device_mesh   # BoundMesh.device_mesh is this mesh itself
    return bound


def _groups_by_ranks() -> dict[tuple[int, ...], str]:
    """Every process group this rank belongs to, by its global ranks in group order."""
    from torch.distributed import distributed_c10d as c10d

    out: dict[tuple[int, ...], str] = {}
    for pg, ranks in c10d._world.pg_group_ranks.items():
        if isinstance(pg, c10d.ProcessGroup):    # non-members hold a placeholder
            order = tuple(sorted(ranks, key=ranks.__getitem__))
            out.setdefault(order, pg.group_name)
    return out


def from_dtensor(dt: Any, *, mesh: BoundMesh | None = None,
                 names: str | Sequence[str] | None = None) -> Sharded:
    """The Sharded with `dt`'s local tensor (the same tensor: no copy, no communication).

    >>> s = mc.from_dtensor(dt, names="b h")                       # doctest: +SKIP
    >>> s.layout, s.shape                                            # doctest: +SKIP
    (Layout('(dp b) (tp h)'), (8, 6))

    `mesh` is the BoundMesh to run later reshards on (e.g. from `mc.init_mesh`); it must
    be the DeviceMesh's mesh (names, sizes, ranks). Without it, the Sharded is bound to
    the DeviceMesh's own groups (`bind_device_mesh`). `names` names the dims.
    """
    if not is_dtensor(dt):
        raise InteropError(f"from_dtensor needs a torch DTensor, got {type(dt).__name__};"
                           " fix: for a local shard use mc.Sharded(local, bound, layout, shape)")
    dm = dt.device_mesh
    if mesh is None:
        mesh = bind_device_mesh(dm)
    elif Mesh.from_device_mesh(dm) != mesh.mesh:
        raise MeshMismatchError(
            f"from_dtensor(mesh=...) got a BoundMesh of {mesh.mesh!r} but the DTensor lives on"
            f" {Mesh.from_device_mesh(dm)!r}; fix: leave mesh= out, or bind"
            " mc.init_mesh(mc.Mesh.from_device_mesh(dt.device_mesh))")
    shape = tuple(dt.shape)
    layout = from_placements(mesh.mesh, shape, _placements_of(dt), names=names)
    return Sharded(dt.to_local(), mesh, layout, shape)


def _placements_of(dt: Any) -> Placements:
    """`dt.placements`, with an explicit non-default `shard_order` of its spec written as the
    _StridedShards that encode it (DTensor's own conversion)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = dt._spec
    order = getattr(spec, "shard_order", None)
    if order and not spec.use_strided_shard_as_shard_order \
            and not DTensorSpec.is_default_device_order(order):
        try:
            return tuple(DTensorSpec._convert_shard_order_to_StridedShard(
                order, tuple(spec.placements), dt.device_mesh))
        except ValueError as exc:
            raise InteropError(f"DTensor placements {list(spec.placements)} with shard order"
                               f" {order} have no layout: {exc}") from None
    return tuple(dt.placements)


def to_dtensor(sharded: Sharded, *, device_mesh: Any = None) -> Any:
    """A DTensor with `sharded`'s local tensor and the placements of its layout (no copy).

    >>> dt = mc.distribute(torch.arange(8.0), bound, "(tp dp b)").to_dtensor()  # doctest: +SKIP
    >>> dt.placements                                                            # doctest: +SKIP
    (_StridedShard(dim=0, sf=2), Shard(dim=0))

    Raises `InteropError`, before anything else, for a layout DTensor cannot express.
    `device_mesh` defaults to `sharded.mesh.device_mesh`; another must be over the same mesh.
    """
    placements = to_placements(sharded.mesh.mesh, sharded.shape, sharded.layout)
    dm = sharded.mesh.device_mesh if device_mesh is None else device_mesh
    if device_mesh is not None and Mesh.from_device_mesh(dm) != sharded.mesh.mesh:
        raise MeshMismatchError(f"to_dtensor(device_mesh=...) is over"
                                f" {Mesh.from_device_mesh(dm)!r}, the Sharded over"
                                f" {sharded.mesh.mesh!r}; fix: leave device_mesh= out")
    return _wrap(sharded.local, dm, placements, sharded.shape)


def _wrap(local: Tensor, dm: Any, placements: Placements, shape: Shape) -> Any:
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, dm, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def reshard_dtensor(dt: Any, dst: str | Layout | Sequence[Any], *,
                    cost_model: CostModel | None = None, trace: Any = None) -> Any:
    """`dt` resharded by a meshcomm plan to `dst` (a layout or DTensor placements): a DTensor.

    >>> y = mc.reshard(dt, "(dp b) (tp h)")                       # doctest: +SKIP
    >>> y = mc.reshard(dt, [Shard(0), Shard(1)])                  # doctest: +SKIP

    Equals `dt.redistribute(dt.device_mesh, placements)` where DTensor gets that right;
    differentiable. A `dst` DTensor cannot express raises `InteropError` before any
    communication.
    """
    src = from_dtensor(dt)
    mesh, shape = src.mesh.mesh, src.shape
    if isinstance(dst, (str, Layout)):
        layout = as_layout(dst, "dst")
        placements = to_placements(mesh, shape, layout)
    else:
        placements = tuple(dst)
        layout = from_placements(mesh, shape, placements, names=src.layout.dim_names(mesh))
    steps = plan(mesh, shape, src.layout, layout, dtype=src.dtype, cost_model=cost_model).steps
    for step in steps:    # every group first: a missing one raises before any communication
        if step.kind != "local":
            src.mesh.group_name(mesh.axis_names if step.kind == "send_recv" else step.axes)
    out = reshard(src.local, src.mesh, src.layout, layout, shape=shape, cost_model=cost_model,
                  trace=trace)
    return _wrap(out, dt.device_mesh, placements, shape)

