"""What both executors do on one rank's tensor: local steps, and packing transfers.

Pure torch: no communication. The simulated and the torch.distributed executors
call these same functions, so a local step, and the buffer a send_recv sends, is
one code path.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode,
)

from ..core.layout import chunk_range
from ..core.mesh import Mesh
from ..core.reduce_ops import identity_like, op_reduce
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
        return fill_reindexed(rank_transfers(step, rank), rank, x,
                                  x.new_empty(out_shape))
    if step.action == "reindex":
        out = identity_like(x.new_empty(out_shape), step.op or "sum")
        return fill_reindexed(rank_transfers(step, rank), rank, x, out)
    raise AssertionError(f"unknown local action {step.action!r} in {step}")


def rank_transfers(step: Step, rank: int) -> list[Transfer]:
    """The transfers of `step` that `rank` takes part in (`Step.rank_transfers`), worked
    out outside any active dispatch mode: the planner counts with small real tensors, which
    must not become fake (data-dependent) ones while torch.compile traces the executor."""
    if _get_current_dispatch_mode() is None:
        return list(step.rank_transfers(rank))
    with _disable_current_modes():
        return list(step.rank_transfers(rank))


def fill_reindexed(transfers: Iterable[Transfer], rank: int, x: Tensor, out: Tensor) -> Tensor:
    """Write the blocks `rank` keeps into `out` (for a reindex, already holding the op's
    identity; for a select, every element is written)."""
    for t in transfers:
        if t.dst == rank:
            if t.dst_index:
                out[grid(t.dst_index, x.device)] = x[grid(t.src_index, x.device)]
            else:
                out = x.clone()
    return out


def storage_key(t: Tensor) -> int:
    """An id of `t`'s storage: the same for every view of it, distinct for live storages
    on every device (meta storages all have data_ptr 0, so data_ptr cannot tell them apart)."""
    return int(t.untyped_storage()._cdata)


# -- running a send_recv step as one all_to_all with uneven splits -------------------
def positions(ix: Sequence[int], device: torch.device | None = None) -> Tensor:
    """One dim's positions as an int64 tensor on `device` (the indexed tensor's: an index
    made on the host for a GPU tensor would be a copy and a sync)."""
    if isinstance(ix, range):
        return torch.arange(ix.start, ix.stop, ix.step, dtype=torch.long, device=device)
    if (device is not None and torch.device(device).type == "cuda"
            and not torch.compiler.is_compiling()):
        # from pinned memory without blocking: a pageable copy would wait for the GPU
        return torch.tensor(ix, dtype=torch.long).pin_memory().to(device, non_blocking=True)
    return torch.tensor(ix, dtype=torch.long, device=device)


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


def grid(index: Index, device: torch.device | None = None) -> tuple[Tensor, ...]:
    """Advanced-indexing tensors (on `device`) for the cartesian product of per-dim positions."""
    axes = [positions(ix, device) for ix in index]
    return torch.meshgrid(*axes, indexing="ij") if axes else ()


def take(tensor: Tensor, index: Index) -> Tensor:
    """The sub-tensor at the cartesian product of per-dim positions (a copy)."""
    out = tensor
    for d, ix in enumerate(index):
        if len(ix) == out.shape[d] and (ix == range(len(ix)) if isinstance(ix, range)
                                        else ix == tuple(range(len(ix)))):
            continue
        out = out.index_select(d, positions(ix, tensor.device))
    return out.clone() if out is tensor else out


Order = Mesh | tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _positions(order: Order) -> dict[int, int]:
    """Rank -> position: mesh order for a Mesh, else the order of the given ranks (built
    once per mesh: a step never walks the world). Read only."""
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
            parts.append(x[grid(t.src_index, x.device)].reshape(-1) if t.src_index
                         else x.reshape(-1))
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
    for t, block in _received(transfers, mesh, rank, flat):
        out = _put(out, t, block)
    return out


def received(step: Step, transfers: Iterable[Transfer], order: Order, rank: int, flat: Tensor,
             mesh: Mesh, shape: tuple[int, ...]) -> Tensor:
    """`rank`'s output of a send_recv `step` on `mesh` from the flat buffer it received in
    `order` (`unpack`), reduced for a reducing send_recv, one with an op (`unpack_reduced`)."""
    out_shape = step.after.local_shape(mesh, shape, rank)
    if step.op is None:
        return unpack(transfers, order, rank, flat, out_shape)
    resolve = [a for a in step.before.partial_axes if a not in step.after.partial_axes]
    return unpack_reduced(transfers, order, rank, flat, out_shape, step.op, mesh, resolve)


def unpack_reduced(transfers: Iterable[Transfer], order: Order, rank: int, flat: Tensor,
                   out_shape: tuple[int, ...], op: str, mesh: Mesh,
                   resolve: Sequence[str]) -> Tensor:
    """`rank`'s output of a reducing send_recv: each received block is a partial value of
    its sender's group member over the `resolve` axes; the g partials of every element are
    gathered into one tensor per member and reduced in group order (`op_reduce`)."""
    sizes = [mesh.axis_size(a) for a in resolve]
    slots: dict[int, Tensor] = {}
    for t, block in _received(transfers, order, rank, flat):
        coords = mesh.coords(t.src)
        k = 0
        for a, n in zip(resolve, sizes):
            k = k * n + coords[a]
        slots[k] = _put(slots.get(k, flat.new_empty(out_shape)), t, block)
    if not slots:
        return flat.new_empty(out_shape)
    return op_reduce([slots[k] for k in sorted(slots)], op)


def _received(transfers: Iterable[Transfer], mesh: Order, rank: int,
              flat: Tensor) -> Iterator[tuple[Transfer, Tensor]]:
    """The transfers `rank` receives with their blocks of `flat` (in source order)."""
    offset = 0
    where = _positions(mesh)
    for t in sorted(transfers, key=lambda t: where[t.src] if t.dst == rank else -1):
        if t.dst == rank:
            yield t, flat[offset:offset + t.numel]
            offset += t.numel


def _put(out: Tensor, t: Transfer, block: Tensor) -> Tensor:
    if t.dst_index:
        out[grid(t.dst_index, block.device)] = block.reshape([len(ix) for ix in t.dst_index])
        return out
    return block.reshape(out.shape).clone()
