"""What both executors do on one rank's tensor: local steps, and packing transfers.

Pure torch: no communication. The simulated and the torch.distributed executors
call these same functions, so a local step, and the buffer a send_recv sends, is
one code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..core.layout import chunk_range
from ..core.mesh import Mesh
from ..core.reduce_ops import identity_like
from ..planner.transfers import step_transfers
from ..planner.values import Step, Transfer

Index = tuple[Sequence[int], ...]   # per dim: positions (a range where they are one run)


def local_move(step: Step, x: Tensor, pos: int, g: int, out_shape: tuple[int, ...],
               rank: int, mesh: Mesh, shape: tuple[int, ...]) -> Tensor:
    """A local step on one rank at group position `pos` of a group of `g` (shared with dist).

    `out_shape` is the rank's local shape after the step (from the step's layout); `mesh`
    and `shape` (the global shape) locate the blocks of a select or reindex.
    """
    if step.action == "slice":
        if step.dim is not None:
            start, length = chunk_range(0, x.shape[step.dim], g, pos)
            return x.narrow(step.dim, start, length).clone()
        y = step.pre.apply(x) if step.pre else x
        return y[pos].clone()
    if step.action == "mark_partial":
        keep = step.op != "sum" or pos == 0
        return x.clone() if keep else torch.zeros_like(x)
    if step.action == "relabel":
        return x.clone()
    if step.action == "select":
        return fill_reindexed(step_transfers(step, mesh, shape, rank), rank, x,
                                  x.new_empty(out_shape))
    if step.action == "reindex":
        out = identity_like(torch.empty(out_shape, dtype=x.dtype), step.op or "sum")
        return fill_reindexed(step_transfers(step, mesh, shape, rank), rank, x, out)
    raise AssertionError(f"unknown local action {step.action!r} in {step}")


def fill_reindexed(transfers: Iterable[Transfer], rank: int, x: Tensor, out: Tensor) -> Tensor:
    """Write the blocks `rank` keeps into `out` (for a reindex, already holding the op's
    identity; for a select, every element is written)."""
    for t in transfers:
        if t.dst == rank:
            if t.dst_index:
                out[grid(t.dst_index)] = x[grid(t.src_index)]
            else:
                out = x.clone()
    return out


# -- running a send_recv step as one all_to_all with uneven splits -------------------
def positions(ix: Sequence[int]) -> Tensor:
    """One dim's positions as an int64 tensor."""
    if isinstance(ix, range):
        return torch.arange(ix.start, ix.stop, ix.step, dtype=torch.long)
    return torch.tensor(ix, dtype=torch.long)


def run_slice(ix: Sequence[int]) -> slice | None:
    """One dim's positions as a slice when they are one run (or none), else None."""
    if isinstance(ix, range) and ix.step == 1:
        return slice(ix.start, ix.stop)
    if not ix:
        return slice(0, 0)
    return slice(ix[0], ix[0] + len(ix)) if tuple(ix) == tuple(range(ix[0], ix[0] + len(ix))) \
        else None


def slices(index: Index) -> tuple[slice, ...] | None:
    """`index` as basic slices (a view, not a copy) when every dim is one run, else None."""
    out = [run_slice(ix) for ix in index]
    return None if any(s is None for s in out) else tuple(s for s in out if s is not None)


def grid(index: Index) -> tuple[Tensor, ...]:
    """Advanced-indexing tensors for the cartesian product of per-dim positions."""
    axes = [positions(ix) for ix in index]
    return torch.meshgrid(*axes, indexing="ij") if axes else ()


def take(tensor: Tensor, index: Index) -> Tensor:
    """The sub-tensor at the cartesian product of per-dim positions (a copy)."""
    out = tensor
    for d, ix in enumerate(index):
        if len(ix) == out.shape[d] and (ix == range(len(ix)) if isinstance(ix, range)
                                        else ix == tuple(range(len(ix)))):
            continue
        out = out.index_select(d, positions(ix))
    return out.clone() if out is tensor else out


Order = Mesh | tuple[int, ...]


def _positions(order: Order) -> dict[int, int]:
    """Rank -> position: mesh order for a Mesh, else the order of the given ranks."""
    ranks = order.ranks if isinstance(order, Mesh) else order
    return {r: i for i, r in enumerate(ranks)}


def pack(transfers: Iterable[Transfer], mesh: Order, rank: int,
         x: Tensor) -> tuple[Tensor, list[int]]:
    """The flat buffer `rank` sends (blocks in destination order) and its split sizes.

    Positions are those of `mesh` (a Mesh, or the ranks of a cross-mesh plan).
    """
    where = _positions(mesh)
    splits = [0] * len(where)
    parts = []
    for t in sorted(transfers, key=lambda t: where[t.dst] if t.src == rank else -1):
        if t.src == rank:
            parts.append(x[grid(t.src_index)].reshape(-1) if t.src_index else x.reshape(-1))
            splits[where[t.dst]] += t.numel
    flat = torch.cat(parts) if parts else x.new_empty(0)
    return flat, splits


def recv_splits(transfers: Iterable[Transfer], mesh: Order, rank: int) -> list[int]:
    """Elements `rank` receives from each position of `mesh`."""
    where = _positions(mesh)
    splits = [0] * len(where)
    for t in transfers:
        if t.dst == rank:
            splits[where[t.src]] += t.numel
    return splits


def unpack(transfers: Iterable[Transfer], mesh: Order, rank: int, flat: Tensor,
           out_shape: tuple[int, ...], fill_op: str | None = None) -> Tensor:
    """`rank`'s output tensor from the flat buffer it received (blocks in source order).

    With `fill_op`, elements no transfer writes hold that reduction's identity (a rank
    that only contributes part of a pending reduction)."""
    out = flat.new_empty(out_shape) if fill_op is None else identity_like(
        flat.new_empty(out_shape), fill_op)
    offset = 0
    where = _positions(mesh)
    for t in sorted(transfers, key=lambda t: where[t.src] if t.dst == rank else -1):
        if t.dst == rank:
            block = flat[offset:offset + t.numel]
            if t.dst_index:
                out[grid(t.dst_index)] = block.reshape([len(ix) for ix in t.dst_index])
            else:
                out = block.reshape(out_shape).clone()
            offset += t.numel
    return out
