"""What both executors do on one rank's tensor: local steps, and packing transfers.

Pure torch: no communication. The simulated and the torch.distributed executors
call these same functions, so a local step, and the buffer a send_recv sends, is
one code path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.layout import chunk_range
from ..core.mesh import Mesh
from ..core.positions import block_flat
from ..core.reduce_ops import divide, identity_like, op_reduce, op_reduce_rows
from ..core.untraced import tracing, untraced
from ..planner.values import Rearrange, Step, Transfer

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
        y = rearranged(step.pre, x) if step.pre else x
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


def rearranged(r: Rearrange, x: Tensor) -> Tensor:
    """`r.apply(x)`, the same tensor, in one reshape where the rearrange permutes nothing and
    else in a reshape, a permute and a reshape, their sizes worked out once per rearrange
    and input shape (a cached step's call costs a dict lookup, not a pass over its factors)."""
    if tracing() or torch.compiler.is_compiling():   # sizes may be symbolic: no cache key
        return r.apply(x)
    sizes, perm, out = _rearrange_sizes(r, tuple(x.shape))
    if perm is None:
        return x.reshape(out)
    return x.reshape(sizes).permute(perm).reshape(out)


@functools.lru_cache(maxsize=4096)
def _rearrange_sizes(r: Rearrange, shape: tuple[int, ...]
                     ) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple[int, ...]]:
    """The split sizes, the permutation (None for none) and the output shape of `r` on a
    tensor of `shape`, as `Rearrange.apply` makes them (run once on a meta tensor, which
    checks the factors too)."""
    sizes = tuple(n for d, factors in enumerate(r.split)
                  for n in ((shape[d],) if factors is None else factors))
    out = tuple(r.apply(torch.empty(shape, device="meta")).shape)
    return sizes, None if r.perm == tuple(range(len(r.perm))) else r.perm, out


def rank_transfers(step: Step, rank: int) -> list[Transfer]:
    """The transfers of `step` that `rank` takes part in (`Step.rank_transfers`), worked
    out outside any active dispatch mode: the planner counts with small real tensors, which
    must not become fake (data-dependent) ones while torch.compile traces the executor."""
    return list(untraced(step.rank_transfers, rank))


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
            parts.append(block(x, t.src_index).reshape(-1))
            splits[where[t.dst]] += t.numel
    if len(parts) == 1:
        return parts[0], splits      # one block: no copy where it is the whole tensor
    flat = torch.cat(parts) if parts else x.new_empty(0)
    return flat, splits


def block(x: Tensor, index: Index) -> Tensor:
    """The cartesian block of `x` at per-dim positions `index` (`x` itself when empty):
    a view where every dim's positions are one run, else a copy (advanced indexing)."""
    if not index:
        return x
    runs = [run_slice(ix) for ix in index]
    if all(r is not None for r in runs):
        return x[tuple(runs)]
    return x[grid(index, x.device)]


def recv_splits(transfers: Iterable[Transfer], mesh: Order, rank: int) -> list[int]:
    """Elements `rank` receives from each position of `mesh`."""
    where = _positions(mesh)
    splits = [0] * len(where)
    for t in transfers:
        if t.dst == rank:
            splits[where[t.src]] += t.numel
    return splits


def assemble(parts: Sequence[tuple[Transfer, Tensor]], out_shape: tuple[int, ...],
             fill_op: str | None, like: Tensor, fresh: bool = False) -> Tensor:
    """An output of `out_shape` from received (or kept) blocks: each flat tensor written at
    its transfer's `dst_index`. With `fresh` (the one part is a buffer nobody else holds),
    one block that is the whole output is the output, not a copy. With `fill_op`, elements
    no block writes hold that reduction's identity."""
    if fresh and len(parts) == 1 and parts[0][1].numel() == math.prod(out_shape) and _whole(
            parts[0][0].dst_index, out_shape):
        return parts[0][1].reshape(out_shape)
    out = like.new_empty(out_shape) if fill_op is None else identity_like(
        like.new_empty(out_shape), fill_op)
    for t, part in parts:
        if not t.dst_index:
            out = part.reshape(out_shape).clone()
            continue
        runs = [run_slice(ix) for ix in t.dst_index]
        shape = [len(ix) for ix in t.dst_index]
        if all(r is not None for r in runs):
            out[tuple(runs)] = part.reshape(shape)
        else:
            out[grid(t.dst_index, like.device)] = part.reshape(shape)
    return out


def _whole(index: Index, shape: Sequence[int]) -> bool:
    """Whether per-dim positions `index` cover all of `shape` in order."""
    if not index:
        return True
    return len(index) == len(shape) and all(
        run_slice(ix) == slice(0, n) for ix, n in zip(index, shape))


# -- a send_recv step on one mesh, as flat index tensors ---------------------------------
class Exchange(NamedTuple):
    """One rank's part of a send_recv step as flat index tensors (`exchange`), so that running
    the step costs a few tensor calls whatever the number of peers."""

    send: Tensor | None      # flat input positions sent, in destination order (None: none)
    send_splits: list[int]   # elements sent to each group member
    recv_splits: list[int]   # elements received from each group member
    recv: Tensor             # each received element's flat output position (+ slot * numel)
    slots: int               # outputs filled: 1, or g partials for a reducing send_recv
    even: bool = False       # every member sends and receives as much: no split lists needed
    view: View | None = None      # the received buffer as (slots, ...) in output order ...
    gather: Tensor | None = None  # ... or, where no view is, the inverse of `recv`


class View(NamedTuple):
    """A received buffer, reshaped to `sizes` and permuted by `perm`: its elements in output
    order, slot major, with the slots as dim 0 (`received`, no copy)."""

    sizes: tuple[int, ...]
    perm: tuple[int, ...]


def exchange(step: Step, rank: int, order: Order, mesh: Mesh, in_shape: tuple[int, ...],
             out_shape: tuple[int, ...], device: torch.device) -> Exchange:
    """`rank`'s Exchange for `step` (positions over `order`, the step's group or the mesh),
    built once per step, rank and device from the step's transfers (O(group) work), then
    cached. While torch.compile traces (a dispatch mode active, or dynamo), the positions are
    worked out outside the mode, like `rank_transfers`, and the index tensors made in it: a
    cached tensor would not be one of the trace's fake tensors."""
    if not tracing() and not torch.compiler.is_compiling():
        return _exchange(step, blocks_key(step), rank, order, mesh, in_shape, out_shape, device)
    host, send, recv, gather = untraced(_host_exchange, step, rank, order, mesh, in_shape,
                                        out_shape)

    def made(ix: list[int] | None) -> Tensor | None:
        return None if ix is None else torch.tensor(ix, dtype=torch.long, device=device)

    return host._replace(send=made(send), gather=made(gather),
                         recv=torch.tensor(recv, dtype=torch.long, device=device))


def _host_exchange(step: Step, rank: int, order: Order, mesh: Mesh, in_shape: tuple[int, ...],
                   out_shape: tuple[int, ...]
                   ) -> tuple[Exchange, list[int] | None, list[int], list[int] | None]:
    """The Exchange on the host, and its positions as lists (send, recv, gather)."""
    host = _exchange(step, blocks_key(step), rank, order, mesh, in_shape, out_shape,
                     torch.device("cpu"))
    return (host, None if host.send is None else host.send.tolist(), host.recv.tolist(),
            None if host.gather is None else host.gather.tolist())


def blocks_key(step: Step) -> object:
    """What a step's per-rank blocks are computed from (the arguments of `step.blocks_of`:
    layouts or states, with the global shape), for caches keyed on the step: two steps on
    different global shapes may compare equal (equal layouts and byte counts) while their
    blocks differ."""
    found = step.blocks_of
    return found.args if isinstance(found, functools.partial) else None


@functools.lru_cache(maxsize=4096)
def _exchange(step: Step, key: object, rank: int, order: Order, mesh: Mesh,
              in_shape: tuple[int, ...], out_shape: tuple[int, ...],
              device: torch.device) -> Exchange:
    transfers = step.rank_transfers(rank)
    where = _positions(order)
    resolve = [a for a in step.before.partial_axes if a not in step.after.partial_axes]
    sizes = [mesh.axis_size(a) for a in resolve]
    numel = math.prod(out_shape)

    def slot(src: int) -> int:     # which of the g partials a sender's block is
        out = 0
        for a, n in zip(resolve, sizes):
            out = out * n + mesh.coords(src)[a]
        return out

    sent, send_splits = _by_peer((t for t in transfers if t.src == rank), where, sending=True,
                                 place=lambda t: block_flat(t.src_index, in_shape))
    got, recv_splits = _by_peer((t for t in transfers if t.dst == rank), where, sending=False,
                                place=lambda t: block_flat(t.dst_index, out_shape)
                                + slot(t.src) * numel)
    slots = mesh.group_size(resolve)
    ex = _made(sent, send_splits, got, recv_splits, slots, torch.device("cpu"))
    assert len(ex.recv) == slots * numel, f"{step}: rank {rank} receives {len(ex.recv)} of" \
        f" {slots} x {numel} elements"
    inverse = torch.empty_like(ex.recv)
    inverse[ex.recv] = torch.arange(len(ex.recv))
    assert bool((ex.recv[inverse] == torch.arange(len(ex.recv))).all()), \
        f"{step}: rank {rank} receives some output element twice"
    view = strided_view(inverse, slots)
    return ex._replace(send=None if ex.send is None else _to(ex.send, device),
                       recv=_to(ex.recv, device), view=view,
                       gather=None if view is not None else _to(inverse, device))


def strided_view(gather: Tensor, slots: int) -> View | None:
    """`gather` (output position, slot major -> received position; a permutation) as a
    reshape and permute of the received buffer with the slots as dim 0, or None where it is
    none. Worked out once per step and rank: the runs of equal steps in one slot's positions
    give its dims, innermost first, the distance between slots the slot dim; the result is
    checked against `gather` itself.

    >>> strided_view(torch.tensor([0, 2, 4, 1, 3, 5]), 2)   # 3 blocks of 2 slots each
    View(sizes=(3, 2), perm=(1, 0))
    """
    total = len(gather)
    if total == 0 or total % slots:
        return View((slots, total // slots), (0, 1)) if total == 0 else None
    rest = gather[:total // slots]
    dims: list[tuple[int, int]] = []      # (size, stride) of one slot's dims, innermost first
    while len(rest) > 1:
        stride = int(rest[1] - rest[0])
        breaks = ((rest[1:] - rest[:-1]) != stride).nonzero()
        run = len(rest) if len(breaks) == 0 else int(breaks[0]) + 1
        rows = rest.reshape(-1, run) if stride > 0 and len(rest) % run == 0 else None
        if rows is None or not bool((rows - rows[:, :1] == torch.arange(run) * stride).all()):
            return None
        dims.append((run, stride))
        rest = rows[:, 0]
    if slots > 1:
        step = int(gather[total // slots] - gather[0])
        by_slot = gather.reshape(slots, -1)
        apart = torch.arange(slots)[:, None] * step
        if step <= 0 or not bool((by_slot - by_slot[:1] == apart).all()):
            return None
    else:
        step = total
    out = [(slots, step)] + dims[::-1]          # output order: slot, then outer to inner
    by_stride = sorted(range(len(out)), key=lambda d: -out[d][1])
    sizes = tuple(out[d][0] for d in by_stride)
    perm = tuple(by_stride.index(d) for d in range(len(out)))
    view = View(sizes, perm)
    made = torch.arange(total).reshape(sizes).permute(perm).reshape(-1)
    return view if torch.equal(made, gather) else None


def _by_peer(transfers: Iterable[Transfer], where: dict[int, int], sending: bool,
             place: Callable[[Transfer], Tensor]) -> tuple[list[Tensor], list[int]]:
    """The positions (`place`) of the transfers a rank sends (or receives), in the order of
    the peer's group position, and the elements per peer."""
    splits = [0] * len(where)
    parts = []
    for t in sorted(transfers, key=lambda t: where[t.dst if sending else t.src]):
        parts.append(place(t))
        splits[where[t.dst if sending else t.src]] += t.numel
    return parts, splits


def _made(sent: list[Tensor], send_splits: list[int], got: list[Tensor],
          recv_splits: list[int], slots: int, device: torch.device) -> Exchange:
    """An Exchange from the positions `_by_peer` gives, on `device`."""
    even = len(set(send_splits)) == 1 and len(set(recv_splits)) == 1
    recv = torch.cat(got) if got else torch.zeros(0, dtype=torch.long)
    return Exchange(_to(torch.cat(sent), device) if sent else None, send_splits, recv_splits,
                    _to(recv, device), slots, even)


def _to(index: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def send_buffer(ex: Exchange, x: Tensor) -> Tensor:
    """The flat buffer this rank sends: its blocks, in destination order."""
    return x.new_empty(0) if ex.send is None else x.reshape(-1).index_select(0, ex.send)


def received(ex: Exchange, flat: Tensor, out_shape: tuple[int, ...], op: str | None) -> Tensor:
    """This rank's output from the flat buffer it received (blocks in source order); for a
    reducing send_recv (`op`), the g partials of each element reduced in group order. The
    buffer is put in output order by the view or the one gather its Exchange holds (made once
    per step and rank), and the partials folded by `op_reduce_rows` (`op_reduce`'s bits)."""
    if ex.view is not None:       # a view of the buffer, no copy
        got = flat.reshape(ex.view.sizes).permute(ex.view.perm)
    else:
        assert ex.gather is not None, "received: an Exchange from `exchange` has a view or gather"
        got = flat.index_select(0, ex.gather).reshape(ex.slots, -1)
    if op is None:
        return got.reshape(out_shape)
    return op_reduce_rows(got, op).reshape(out_shape)


# -- a tree step (`meshcomm.planner.trees`): rounds of all_to_alls over a work buffer ------
class TreeRun(NamedTuple):
    """One rank's part of a tree step: an Exchange per round, over its work buffer (its input
    flattened, then its output, then scratch where it combines for others), and the copies
    a root makes of the values it needs."""

    rounds: tuple[Exchange, ...]
    merges: int              # rounds that combine; the others deliver
    keep_src: Tensor         # work positions a root copies from (its combined partials) ...
    keep_dst: Tensor         # ... into its output's positions (offset by the input's numel)
    size: int = 0            # the work positions its transfers reach (scratch included)


def tree_run(step: Step, rank: int, order: Order, device: torch.device) -> TreeRun:
    """`rank`'s TreeRun for `step` (positions over `order`), built once per step, rank and
    device (cached), or made in the trace while torch.compile traces (like `exchange`)."""
    if not tracing() and not torch.compiler.is_compiling():
        return _tree_run(step, blocks_key(step), rank, order, device)
    host, sends, lists = untraced(_host_tree_run, step, rank, order)

    def made(ix: list[int]) -> Tensor:
        return torch.tensor(ix, dtype=torch.long, device=device)

    rounds = tuple(ex._replace(send=None if s is None else made(s), recv=made(r))
                   for ex, s, r in zip(host.rounds, sends, lists))
    return TreeRun(rounds, host.merges, made(lists[-2]), made(lists[-1]), host.size)


def _host_tree_run(step: Step, rank: int, order: Order
                   ) -> tuple[TreeRun, list[list[int] | None], list[list[int]]]:
    """The TreeRun on the host, and its positions as lists: each round's sent (None: none)
    and received ones, then the root's copies from and to."""
    host = _tree_run(step, blocks_key(step), rank, order, torch.device("cpu"))
    sends = [None if ex.send is None else ex.send.tolist() for ex in host.rounds]
    return host, sends, [ex.recv.tolist() for ex in host.rounds] + [
        host.keep_src.tolist(), host.keep_dst.tolist()]


@functools.lru_cache(maxsize=4096)
def _tree_run(step: Step, key: object, rank: int, order: Order,
              device: torch.device) -> TreeRun:
    transfers = step.rank_transfers(rank)
    where = _positions(order)
    by_round: list[list[Transfer]] = [[] for _ in range(step.rounds)]
    keep = []
    for t in transfers:
        if t.src == t.dst:
            keep.append(t)
        else:
            by_round[t.round].append(t)

    def flat(ix: Sequence[int]) -> Tensor:
        return torch.tensor(list(ix), dtype=torch.long)

    rounds = []
    for ts in by_round:
        sent, send_splits = _by_peer((t for t in ts if t.src == rank), where, sending=True,
                                     place=lambda t: flat(t.src_index[0]))
        got, recv_splits = _by_peer((t for t in ts if t.dst == rank), where, sending=False,
                                    place=lambda t: flat(t.dst_index[0]))
        rounds.append(_made(sent, send_splits, got, recv_splits, 1, device))
    size = 1 + max([p for t in transfers if t.src == rank for p in t.src_index[0]]
                   + [p for t in transfers if t.dst == rank for p in t.dst_index[0]], default=-1)
    return TreeRun(tuple(rounds), step.merge_rounds,
                   _index([p for t in keep for p in t.src_index[0]], device),
                   _index([p for t in keep for p in t.dst_index[0]], device), size)


def _index(positions: list[int], device: torch.device) -> Tensor:
    return _to(torch.tensor(positions, dtype=torch.long), device)


def run_tree(step: Step, mesh: Mesh, runs: Sequence[TreeRun], xs: Sequence[Tensor],
             out_shapes: Sequence[tuple[int, ...]],
             exchange: Callable[[int, list[Tensor]], Sequence[Tensor]]) -> list[Tensor]:
    """A tree step on the ranks of `xs` (every rank for the simulator, one for
    torch.distributed), their TreeRuns in `runs`: `exchange(r, buffers)` runs round r's
    all_to_all on what each rank sends and gives back what each received."""
    op = step.op or "sum"
    g = mesh.group_size(a for a in step.before.partial_axes if a not in step.after.partial_axes)
    works = [_tree_work(run, x, out, op) for run, x, out in zip(runs, xs, out_shapes)]
    for r in range(step.rounds):
        if r == step.merge_rounds:
            works = [_tree_finished(run, w, op, g) for run, w in zip(runs, works)]
        got = exchange(r, [send_buffer(run.rounds[r], w) for run, w in zip(runs, works)])
        works = [_tree_received(run, r, w, flat, op) for run, w, flat in zip(runs, works, got)]
    if step.rounds == step.merge_rounds:
        works = [_tree_finished(run, w, op, g) for run, w in zip(runs, works)]
    return [_tree_output(w, x.numel(), out) for w, x, out in zip(works, xs, out_shapes)]


def _tree_work(run: TreeRun, x: Tensor, out_shape: tuple[int, ...], op: str) -> Tensor:
    """A rank's work buffer: its input flattened, then its output and its scratch at the op's
    identity."""
    flat = x.reshape(-1)
    rest = max(math.prod(out_shape), run.size - flat.numel())
    return torch.cat([flat, identity_like(flat.new_empty(rest), op)])


def _tree_received(run: TreeRun, r: int, work: Tensor, flat: Tensor, op: str) -> Tensor:
    """The work buffer after round `r`'s values arrived: combined into it (a merge round:
    each position receives at most one value per round), or written (a delivery)."""
    ex = run.rounds[r]
    if r >= run.merges:
        return work.index_put((ex.recv,), flat)
    return work.index_put((ex.recv,), op_reduce([work[ex.recv], flat], "sum" if op == "avg"
                                                 else op))


def _tree_finished(run: TreeRun, work: Tensor, op: str, g: int) -> Tensor:
    """The work buffer once every partial is combined: an average divided by the g partials,
    and each root's values copied into its output."""
    if op == "avg":
        work = divide(work, g)
    return work.index_put((run.keep_dst,), work[run.keep_src])


def _tree_output(work: Tensor, in_numel: int, out_shape: tuple[int, ...]) -> Tensor:
    """A rank's output: its part of the work buffer, after the input."""
    return work[in_numel:in_numel + math.prod(out_shape)].reshape(out_shape).clone()
