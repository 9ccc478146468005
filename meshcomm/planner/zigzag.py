"""Plans to and from zigzag (head-tail) layouts, such as "b zigzag(cp s) d".

This module never communicates. A zigzag dim gives every rank the block its contiguous twin
"(cp s)" gives it, cut in two and laid out head and tail (`core.layout.zigzag_spans`): the
same local tensors over a permuted global order. So a plan is made of two kinds of part:

- a dim that is zigzag alike in the source and the destination is planned as its twin by
  the searched planner (`search.single_plan`): the permutation is the same on both sides,
  so any plan between the twins moves the right values (its steps print the twins);
- a dim that is zigzag in the source and whole in the destination is planned as its twin
  too (the gather brings every rank the whole dim, in the twin's order: the ranks' blocks in
  group order, each head then tail), then one local select at the end puts it in order:
  the bytes of a plain gather, and no exchange (the steps between print the twins, so the
  select prints as from the destination to itself);
- a dim that is zigzag on one side only otherwise is *folded* (or unfolded): one send_recv
  over the dim's axes between the zigzag form and its twin, in which each rank receives
  from the members of its group the part of its new block it does not hold. Bytes come
  from the blocks' runs (two per rank at most), counted once per group position, never per
  element. A whole dim becomes zigzag by a local select, first.

`zigzag_plan`: fold the source's lone zigzag dims, plan between the twins, unfold the
destination's, put the gathered dims in order.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

from ..core.errors import PlanError
from ..core.layout import DimPlacement, Layout, Shape, chunk_spans, group_position, zigzag_spans
from ..core.mesh import AxisName, Mesh
from ..core.positions import as_positions
from . import bounds, search
from .blocks import in_mesh_order
from .values import CostModel, Plan, Step, Transfer


def zigzag_plan(mesh: Mesh, shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout,
                cost_model: CostModel) -> Plan:
    """The plan from `src` to `dst` on `mesh` where either has a zigzag dim (module doc)."""
    src.placements(mesh, shape)
    dst.placements(mesh, shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    steps: list[Step] = []
    at = src
    # a dim whole in the source and zigzag in the destination: each rank selects its part
    for d in dst.zigzag_dims:
        if (src.dims[d] != dst.dims[d] and not src.dim_axes(d, mesh)
                and not set(dst.dim_axes(d, mesh)) & set(src.partial_axes)):
            steps.append(_reorder(mesh, shape, at, at.dim_from(d, dst), d, itemsize,
                                  cost_model))
            at = steps[-1].after
    # a dim zigzag in the source and whole in the destination: gathered as its twin
    gathered = tuple(d for d in at.zigzag_dims if not dst.dim_axes(d, mesh))
    lone_src = [d for d in at.zigzag_dims if at.dims[d] != dst.dims[d] and d not in gathered]
    lone_dst = [d for d in dst.zigzag_dims if dst.dims[d] != at.dims[d]]
    for d in lone_src:
        steps.append(_reorder(mesh, shape, at, at.without_zigzag((d,)), d, itemsize,
                              cost_model))
        at = steps[-1].after
    steps += search.single_plan(mesh, shape, dtype, at.without_zigzag(),
                                dst.without_zigzag(), cost_model).steps
    at = dst.without_zigzag(lone_dst)
    for i, d in enumerate(lone_dst):
        after = dst.without_zigzag(lone_dst[i + 1:])
        steps.append(_reorder(mesh, shape, at, after, d, itemsize, cost_model))
        at = after
    out_of_order = tuple(d for d in gathered if not _in_group_order(src.placements(mesh, shape)[d]))
    if out_of_order:
        steps.append(_put_in_order(mesh, shape, src, dst, out_of_order, itemsize))
    n = mesh.size

    def total(field: str) -> tuple[int, ...]:
        return tuple(sum(getattr(s, field)[i] for s in steps) for i in range(n))
    peak = tuple(max((s.peak_bytes[i] for s in steps), default=0) for i in range(n))
    return Plan(mesh, shape, dtype, src, dst, tuple(steps), total("send_bytes"),
                total("recv_bytes"), _lower_bound(mesh, shape, src, dst, itemsize), peak,
                sum(s.time_s for s in steps), cost_model)


def _reorder(mesh: Mesh, shape: Shape, before: Layout, after: Layout, dim: int, itemsize: int,
             cost_model: CostModel) -> Step:
    """The step from `before` to `after`, equal but in dim `dim` (zigzag on one side; a
    contiguous split or whole on the other): a send_recv over the dim's axes in which each
    rank receives what it lacks of its new block, or a local select where none lacks any."""
    axes = in_mesh_order(mesh, {*before.dim_axes(dim, mesh), *after.dim_axes(dim, mesh)})
    was, now = before.placements(mesh, shape)[dim], after.placements(mesh, shape)[dim]
    spots = [dict(zip(axes, c)) for c in itertools.product(*(range(mesh.axis_size(a))
                                                               for a in axes))]
    overlap = _overlap(tuple(_runs(was, c) for c in spots), tuple(_runs(now, c) for c in spots))
    kept = overlap.diagonal()
    sends = (overlap.sum(1) - kept).tolist()              # [position]: held, needed elsewhere
    recvs = (torch.tensor([sum(n for _, n in _runs(now, c)) for c in spots]) - kept).tolist()
    send, recv, peak = [], [], []
    for rank in mesh.ranks:
        where = mesh.coords(rank)
        p = 0
        for a in axes:
            p = p * mesh.axis_size(a) + where[a]
        local = before.local_shape(mesh, shape, rank)
        other = math.prod(n for i, n in enumerate(local) if i != dim) * itemsize
        send.append(sends[p] * other)
        recv.append(recvs[p] * other)
        peak.append((local[dim] + after.local_shape(mesh, shape, rank)[dim]) * other)
    blocks = functools.partial(_reorder_transfers, before, after, mesh, shape, dim, axes)
    if not any(recv):
        zeros = (0,) * mesh.size
        return Step("local", (), before, after, action="select", send_bytes=zeros,
                    recv_bytes=zeros, peak_bytes=tuple(peak), blocks_of=blocks)
    busiest = max(max(send), max(recv))
    return Step("send_recv", axes, before, after, op=before.reduce_op, send_bytes=tuple(send),
                recv_bytes=tuple(recv), peak_bytes=tuple(peak),
                time_s=cost_model.time(axes, busiest), wire="all_to_all", blocks_of=blocks)


def _put_in_order(mesh: Mesh, shape: Shape, src: Layout, dst: Layout, dims: tuple[int, ...],
                  itemsize: int) -> Step:
    """The local select that puts dims `dims` of `dst` (whole there, zigzag in `src`) from
    the twin's order, in which the plan gathered them, into their own."""
    peak = tuple(2 * math.prod(dst.local_shape(mesh, shape, r)) * itemsize for r in mesh.ranks)
    zeros = (0,) * mesh.size
    return Step("local", (), dst, dst, action="select", send_bytes=zeros, recv_bytes=zeros,
                peak_bytes=peak,
                blocks_of=functools.partial(_in_order_transfers, src, dst, mesh, shape, dims))


def _in_group_order(dim: DimPlacement) -> bool:
    """Whether the zigzag dim's runs, taken in group order, are already the dim in order
    (a group of one; a dim of one token per rank)."""
    at = 0
    for start, n in (run for pair in zigzag_spans(dim) for run in pair if run[1]):
        if start != at:
            return False
        at += n
    return True


@functools.lru_cache(maxsize=256)
def _in_order_transfers(src: Layout, dst: Layout, mesh: Mesh, shape: Shape,
                        dims: tuple[int, ...], rank: int) -> tuple[Transfer, ...]:
    """What `rank` keeps in the select of `_put_in_order`: its whole local tensor, each dim
    of `dims` read at the twin-order position of every index (one block, one copy)."""
    local = dst.local_shape(mesh, shape, rank)
    read: list[Sequence[int]] = [range(n) for n in local]
    for d in dims:
        where = [0] * shape[d]
        for k, i in enumerate(src.zigzag_order(mesh, shape, d)):
            where[i] = k
        read[d] = as_positions(where)
    return (Transfer(rank, rank, tuple(read), tuple(range(n) for n in local)),)


def _runs(dim: DimPlacement, where: dict[AxisName, int]) -> tuple[tuple[int, int], ...]:
    """The (start, length) runs of the dim that coordinates `where` hold."""
    if dim.zigzag:
        return zigzag_spans(dim)[group_position(dim, where)]
    if not dim.axes:
        return ((0, dim.size),)
    if any(p.size > 1 and not p.axis for p in dim.parts[:-1]):
        raise PlanError(f"a zigzag dim reorders to a contiguous split or a whole dim; got"
                        f" {dim} (a meshcomm bug, please report it)")
    return (chunk_spans(dim)[group_position(dim, where)],)


def _lower_bound(mesh: Mesh, shape: Shape, src: Layout, dst: Layout,
                 itemsize: int) -> tuple[int, ...]:
    """Per rank, the bytes any correct plan must receive. Where every dim that is zigzag on
    one side only (or zigzag differently) is whole on the other, renaming each zigzag dim's
    indices into its twin's order maps the problem onto the twins' (whole stays whole), so
    it is their bound (`bounds`). Else, the bytes of its destination block it does not hold
    in the source (0 where a pending reduction is involved: nothing is complete); the count
    factors over dims, each depending on the rank's coordinates on that dim's axes only:
    counted once per such coordinate, from indices."""
    if all(not (src if dst.dims[d].zigzag else dst).dim_axes(d, mesh)
           for d in range(len(shape)) if src.dims[d] != dst.dims[d]
           and (src.dims[d].zigzag or dst.dims[d].zigzag)):
        return tuple(n * itemsize for n in bounds.lower_bound_elements(
            mesh, shape, src.without_zigzag(), dst.without_zigzag()))
    if src.reduce_op or dst.reduce_op:
        return (0,) * mesh.size
    counts: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in shape]
    out = []
    for rank in mesh.ranks:
        where = mesh.coords(rank)
        need, both = 1, 1
        for d in range(len(shape)):
            axes = in_mesh_order(mesh, {*src.dim_axes(d, mesh), *dst.dim_axes(d, mesh)})
            key = tuple(where[a] for a in axes)
            if key not in counts[d]:
                want = dst.indices(mesh, shape, rank)[d]
                counts[d][key] = (len(want),
                                  len(set(want).intersection(src.indices(mesh, shape, rank)[d])))
            need, both = need * counts[d][key][0], both * counts[d][key][1]
        out.append((need - both) * itemsize)
    return tuple(out)


def _overlap(a: tuple[tuple[tuple[int, int], ...], ...],
             b: tuple[tuple[tuple[int, int], ...], ...]) -> torch.Tensor:
    """[len(a), len(b)]: the indices run lists a[p] and b[q] share."""
    def table(runs: tuple[tuple[tuple[int, int], ...], ...]) -> torch.Tensor:
        width = max((len(r) for r in runs), default=1)
        out = torch.zeros(len(runs), width, 2, dtype=torch.long)
        for p, rs in enumerate(runs):
            for j, (lo, n) in enumerate(rs):
                out[p, j, 0], out[p, j, 1] = lo, lo + n
        return out
    x, y = table(a)[:, None, :, None, :], table(b)[None, :, None, :, :]
    common = torch.minimum(x[..., 1], y[..., 1]) - torch.maximum(x[..., 0], y[..., 0])
    return common.clamp(min=0).sum((2, 3))


@functools.lru_cache(maxsize=256)
def _reorder_transfers(before: Layout, after: Layout, mesh: Mesh, shape: Shape, dim: int,
                       axes: tuple[AxisName, ...], rank: int) -> tuple[Transfer, ...]:
    """What `rank` sends (itself included) and receives in a reorder step; in a select, what
    it keeps."""
    if not before.dim_axes(dim, mesh):          # a select: every rank keeps its own part
        return (_cell(before, after, mesh, shape, dim, rank, rank),)
    group = mesh.members(rank, *axes)
    out = [_cell(before, after, mesh, shape, dim, rank, q) for q in group]
    out += [_cell(before, after, mesh, shape, dim, q, rank) for q in group if q != rank]
    return tuple(t for t in out if t.numel)


def _cell(before: Layout, after: Layout, mesh: Mesh, shape: Shape, dim: int, src: int,
          dst: int) -> Transfer:
    have = before.indices(mesh, shape, src)[dim]
    want = after.indices(mesh, shape, dst)[dim]
    at = {i: k for k, i in enumerate(have)}
    pairs = [(at[i], k) for k, i in enumerate(want) if i in at]
    local = before.local_shape(mesh, shape, src)
    src_ix = tuple(as_positions([s for s, _ in pairs]) if d == dim else range(n)
                   for d, n in enumerate(local))
    dst_ix = tuple(as_positions([t for _, t in pairs]) if d == dim else range(n)
                   for d, n in enumerate(local))
    return Transfer(src, dst, src_ix, dst_ix)
