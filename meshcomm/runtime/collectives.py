"""Functional collectives addressed by mesh axis, over torch.distributed.

Runtime layer. Each collective checks every input it can check locally, then
calls PyTorch's functional collectives (`torch.distributed._functional_collectives`)
with a process-group *name*, so it returns a new tensor at once, is waited on at
first use, and traces under `torch.compile(fullgraph=True)` with no process-group
object in the program. Results equal `meshcomm.executors.sim.collectives` bit for bit.
Positions (`src`, `dst`, `pairs`, split lists) are positions in the group as the
caller names it: axes in any order, first-named axis major. Process groups exist
only in mesh order, so a group named in another order reorders blocks locally.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import MeshAxisError, MeshMismatchError, ShapeError, did_you_mean
from ..core.mesh import AxisName
from ..core.reduce_ops import REDUCE_OPS, chunk_sizes, divide, op_reduce
from ..executors.distributed import wire
from .bind import BoundMesh
from .checks import agree_collective, checking

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "collective_permute", "recv",
           "reduce_scatter", "send", "sendrecv"]

Axes = AxisName | int | Sequence[AxisName]
GroupLike = (BoundMesh | DeviceMesh | tuple[DeviceMesh, int | str] | dist.ProcessGroup
             | Sequence[int])


class _Group(NamedTuple):
    """This rank's group: funcol name, global ranks in the caller's order, and the mapping."""

    name: c10d.GroupName     # what funcol takes: no process-group object in traced programs
    ranks: tuple[int, ...]
    order: tuple[int, ...]   # order[p]: position in the process group of caller position p
    inv: tuple[int, ...]     # inv[q]: caller position of process-group position q
    pos: int                 # this rank's caller position
    size: int
    desc: tuple[object, object]  # (axes or None, owner) for messages: see `_where`

    @property
    def wire(self) -> wire.Group:
        """The group as the wire module takes it (positions in process-group order)."""
        return wire.Group(self.name, self.size, self.order[self.pos])


def _where(g: _Group | tuple[object, object]) -> str:
    """'over "tp" of Mesh(dp=2, tp=2)': built only for a message, never on the hot path."""
    axes, owner = g.desc if isinstance(g, _Group) else g
    if axes is None:
        return f"of {owner}"
    return f"over {_axes_text(axes)} of {owner!r}"


def _axes_text(axes: object) -> str:
    return f'"{axes}"' if isinstance(axes, str) else repr(axes)


def _make_group(name: str, ranks: tuple[int, ...], pg_ranks: tuple[int, ...], rank: int,
                desc: tuple[object, object]) -> _Group:
    # Plain loops only: this runs under torch.compile tracing too.
    order = tuple([pg_ranks.index(r) for r in ranks])
    inv = [0] * len(order)
    for p, q in enumerate(order):
        inv[q] = p
    return _Group(cast(c10d.GroupName, name), ranks, order, tuple(inv), ranks.index(rank),
                  len(ranks), desc)


def _bound_checks(fn: str, bound: BoundMesh, axes: object) -> tuple[AxisName, ...]:
    mesh = bound.mesh
    key = (axes,) if isinstance(axes, str) else tuple(axes) if isinstance(axes, Sequence) else ()
    if not key or not all(isinstance(a, str) for a in key):
        raise MeshAxisError(f"{fn}: axes={axes!r} does not name mesh axes of {mesh!r}; fix: pass"
                            f' an axis or a tuple of axes, e.g. "{mesh.axis_names[-1]}" or'
                            f" {mesh.axis_names}")
    for a in key:
        if a not in mesh.axis_names:
            hint = did_you_mean(a, mesh.axis_names)
            raise MeshAxisError(f'{fn}: "{a}" is not an axis of {mesh!r}; axes are'
                                f' {", ".join(mesh.axis_names)}'
                                + (f"\n  fix: {hint}" if hint else ""))
    if len(set(key)) != len(key):
        raise MeshAxisError(f"{fn}: axes {list(key)} name an axis twice; fix: name each once")
    if not bound.in_mesh:
        raise MeshMismatchError(f"{fn}: rank {bound.rank} is not in {mesh!r}; only its ranks"
                                f" {list(mesh.ranks)} run its collectives")
    return key


def _bound_group(fn: str, bound: BoundMesh, axes: object) -> _Group:
    key = _bound_checks(fn, bound, axes)
    mesh_order = tuple([a for a in bound.mesh.axis_names if a in key])
    ranks = bound.mesh.members(bound.rank, *key)
    pg_ranks = ranks if mesh_order == key else bound.mesh.members(bound.rank, *mesh_order)
    return _make_group(bound.group_name(mesh_order), ranks, pg_ranks, bound.rank,
                       (axes, bound.mesh))


@functools.lru_cache(maxsize=1024)
def _bound_group_cached(fn: str, bound: BoundMesh, axes: AxisName | tuple[AxisName, ...]
                        ) -> _Group:
    return _bound_group(fn, bound, axes)


def _pg_group(fn: str, pg: dist.ProcessGroup, ranks: tuple[int, ...] | None,
              desc: tuple[object, object]) -> _Group:
    pg_ranks = tuple(dist.get_process_group_ranks(pg))
    rank = dist.get_rank()
    if rank not in pg_ranks:
        raise MeshMismatchError(f"{fn}: rank {rank} is not in the group {_where(desc)} (ranks"
                                f" {list(pg_ranks)}); only its members call its collectives")
    return _make_group(pg.group_name, pg_ranks if ranks is None else ranks, pg_ranks, rank, desc)


def _device_group(fn: str, dm: DeviceMesh, axes: Axes | None) -> _Group:
    names = tuple(dm.mesh_dim_names or ())
    if axes is None and dm.ndim == 1:
        dim = 0
    elif isinstance(axes, int) and not isinstance(axes, bool) and 0 <= axes < dm.ndim:
        dim = axes
    elif isinstance(axes, str) and axes in names:
        dim = names.index(axes)
    else:
        hint = did_you_mean(axes, names) if isinstance(axes, str) else ""
        raise MeshAxisError(
            f"{fn}: axes={axes!r} is not one dim of {dm} (dims 0..{dm.ndim - 1}, names {names});"
            " a DeviceMesh gives one dim per collective. fix: "
            + (hint or "name one dim, or bind a meshcomm mesh (mc.init_mesh) for flattened axes"))
    return _pg_group(fn, dm.get_group(dim), None, (axes if axes is not None else 0, dm))


def _ranks_group(fn: str, ranks: tuple[int, ...]) -> _Group:
    if len(set(ranks)) != len(ranks):
        raise MeshAxisError(f"{fn}: the group of ranks {list(ranks)} names a rank twice")
    pg = c10d._find_pg_by_ranks_and_tag("", list(ranks))
    if pg is None:
        raise MeshAxisError(f"{fn}: no process group has the ranks {list(ranks)}; fix: create it"
                            f" on every rank with torch.distributed.new_group({sorted(ranks)}),"
                            " or bind a mesh with mc.init_mesh and name its axes")
    return _pg_group(fn, pg, ranks, (None, f"ranks {list(ranks)}"))


def _group(fn: str, mesh: GroupLike, axes: Axes | None) -> _Group:
    """Resolve the group argument forms (see docs/collectives.md) to this rank's group."""
    if isinstance(mesh, BoundMesh):
        hashable = isinstance(axes, str) or isinstance(axes, tuple) and all(
            isinstance(a, str) for a in axes)
        if hashable and not torch.compiler.is_compiling():  # dynamo traces the plain one
            return _bound_group_cached(fn, mesh, axes)
        return _bound_group(fn, mesh, axes)
    if isinstance(mesh, DeviceMesh):
        return _device_group(fn, mesh, axes)
    if axes is not None:
        raise MeshAxisError(f"{fn}: axes={axes!r} goes with a BoundMesh or a DeviceMesh, but the"
                            f" group is a {type(mesh).__name__}, which names its ranks already;"
                            " fix: drop axes")
    if isinstance(mesh, tuple) and len(mesh) == 2 and isinstance(mesh[0], DeviceMesh):
        return _device_group(fn, mesh[0], mesh[1])
    if isinstance(mesh, dist.ProcessGroup):
        return _pg_group(fn, mesh, None, (None, f"process group {mesh.group_name!r}"))
    if isinstance(mesh, Sequence) and mesh and all(_is_int(r) for r in mesh):
        return _ranks_group(fn, tuple(cast(Sequence[int], mesh)))
    raise MeshAxisError(f"{fn}: {mesh!r} is not a group; pass a BoundMesh and axes"
                        ' (mc.init_mesh(...), "tp"), a DeviceMesh, (DeviceMesh, dim), a'
                        " ProcessGroup, or a list of global ranks")


# ---- local checks, all before any communication ----------------------------------------------

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor(fn: str, x: object, arg: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise ShapeError(f"{fn}: {arg} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _dim(fn: str, g: _Group, arg: str, dim: object, x: Tensor) -> int:
    if not _is_int(dim) or not -x.dim() <= dim < x.dim():  # type: ignore[operator]
        valid = f"{-x.dim()}..{x.dim() - 1}" if x.dim() else "none, x is 0-d"
        raise ShapeError(f"{fn} {_where(g)}: {arg}={dim!r} is not a dim of x with shape"
                         f" {tuple(x.shape)} (valid: {valid})")
    return dim % x.dim()  # type: ignore[operator]


def _sizes(fn: str, g: _Group, arg: str, sizes: object, total: int | None,
           what: str) -> tuple[int, ...]:
    got = tuple(sizes) if isinstance(sizes, Sequence) else ()
    if len(got) != g.size or not all(_is_int(s) and s >= 0 for s in got):
        raise ShapeError(f"{fn} {_where(g)}: {arg}={sizes!r} is not {g.size} sizes >= 0, one per"
                         f" group position")
    out = cast(tuple[int, ...], got)
    if total is not None and sum(out) != total:
        raise ShapeError(f"{fn} {_where(g)}: {arg}={list(out)} sums to {sum(out)}, but {what} is"
                         f" {total}; fix: sizes that sum to {total}")
    return out


def _op(fn: str, g: _Group, op: object, dtype: torch.dtype) -> str:
    if op not in REDUCE_OPS:
        hint = did_you_mean(str(op), REDUCE_OPS)
        raise ShapeError(f"{fn} {_where(g)}: unknown reduce op {op!r}; ops are"
                         f" {', '.join(REDUCE_OPS)}" + (f"\n  fix: {hint}" if hint else ""))
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ShapeError(f"{fn} {_where(g)}: op 'avg' needs a floating dtype, got {dtype}; fix:"
                         " reduce with op='sum' and divide, or cast to a float dtype")
    return str(op)


def _position(fn: str, g: _Group, arg: str, p: object) -> int:
    if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < g.size:
        raise MeshAxisError(f"{fn} {_where(g)}: {arg}={p!r} is not a position of the group"
                            f" (0..{g.size - 1}, ranks {list(g.ranks)}); it is a position"
                            " within the group, not a global rank")
    return p


# ---- local block moves --------------------------------------------------------------------------

def _reorder(t: Tensor, dim: int, sizes: Sequence[int], perm: Sequence[int]) -> Tensor:
    """`t`'s blocks along `dim` (of `sizes`, in order) rearranged: new block i = old perm[i]."""
    if list(perm) == list(range(len(perm))):
        return t
    starts = list(accumulate(sizes, initial=0))
    return torch.cat([t.narrow(dim, starts[p], sizes[p]) for p in perm], dim)


def _check(fn: str, g: _Group, x: Tensor, *args: tuple[str, object]) -> None:
    """Check mode: the members agree on this call (and on `args`) before it runs."""
    if not torch.compiler.is_compiling():
        agree_collective(fn, g.wire, [g.ranks[g.inv[q]] for q in range(g.size)], _where(g), x,
                         tuple((k, str(v)) for k, v in args))


# ---- collectives -------------------------------------------------------------------------------

def all_gather(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, dim: int = 0,
               sizes: Sequence[int] | None = None, check: bool | None = None) -> Tensor:
    """Every member's `x` concatenated along `dim` in group order.

    For example (x: (2, 3) -> y: (8, 3)):

    >>> y = mc.collectives.all_gather(x, bound, "tp", dim=0)     # doctest: +SKIP

    `sizes` (one size along `dim` per group position) gives the uneven form: it runs as one
    all_to_all with uneven splits, so no padding goes on the wire. Without it every member
    must pass the same shape. Backward: reduce_scatter(sum) of the output gradient.
    """
    fn = "all_gather"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    d = _dim(fn, g, "dim", dim, x)
    n = x.shape[d]
    if sizes is not None:
        sizes = _sizes(fn, g, "sizes", sizes, None, "")
        if sizes[g.pos] != n:
            raise ShapeError(f"{fn} {_where(g)}: sizes={list(sizes)} says position {g.pos} (this"
                             f" rank) has {sizes[g.pos]} along dim {d}, but x has {n}")
    if checking(mesh, check):
        shape = tuple(x.shape) if sizes is None else (*x.shape[:d], "*", *x.shape[d + 1:])
        _check(fn, g, x, ("dim", d), ("shape", shape), ("sizes", sizes))
    if sizes is None or len(set(sizes)) == 1:
        # along dim 0 and moved back: a gather along another dim is a chunk-cat that some
        # torch versions cannot compile
        out, _ = wire.all_gather(x.movedim(d, 0).contiguous(), g.wire, wait=False)
        return _reorder(out, 0, [n] * g.size, g.order).movedim(0, d)
    rows = x.movedim(d, 0)
    out_pg = [sizes[p] for p in g.inv]
    out, _ = wire.all_to_all(torch.cat([rows] * g.size), g.wire, out_pg, [n] * g.size,
                             wait=False)
    return _reorder(out, 0, out_pg, g.order).movedim(0, d)


def reduce_scatter(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, dim: int = 0,
                   op: str = "sum", splits: Sequence[int] | None = None,
                   check: bool | None = None) -> Tensor:
    """Chunk p (along `dim`) of the reduction of every member's `x`, at group position p.

    For example (8 -> 2 rows):

    >>> y = mc.collectives.reduce_scatter(x, bound, "tp", dim=0, op="sum")  # doctest: +SKIP

    Chunks follow torch.chunk boundaries unless `splits` gives one size per position. Even
    chunks run as a native reduce_scatter; uneven ones as one all_to_all with uneven splits and
    a local reduction in group order. `avg` is a sum divided by the group size (as the sim).
    Backward (sum, avg): all_gather of the output gradient (divided by the size for avg).
    """
    fn = "reduce_scatter"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    d = _dim(fn, g, "dim", dim, x)
    op = _op(fn, g, op, x.dtype)
    n = x.shape[d]
    chunks = (chunk_sizes(n, g.size) if splits is None
              else _sizes(fn, g, "splits", splits, n, f"dim {d} of x"))
    wire_op = "sum" if op == "avg" else op
    if checking(mesh, check):
        _check(fn, g, x, ("shape", tuple(x.shape)), ("dim", d), ("op", op), ("splits", splits))
    if len(set(chunks)) == 1:
        moved = _reorder(x.movedim(d, 0), 0, chunks, g.inv)
        out, _ = wire.reduce_scatter(moved.contiguous(), wire_op, g.wire, wait=False)
        out = out.movedim(0, d)
        return divide(out, g.size) if op == "avg" else out
    rows = _reorder(x.movedim(d, 0), 0, chunks, g.inv)
    own = chunks[g.pos]
    got, _ = wire.all_to_all(rows, g.wire, [own] * g.size, [chunks[p] for p in g.inv],
                             wait=False)
    blocks = torch.split(got, own) if own else [got] * g.size
    return op_reduce([blocks[q] for q in g.order], op).movedim(0, d)


def all_reduce(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, op: str = "sum",
               check: bool | None = None) -> Tensor:
    """The reduction (`op`: sum, avg, max, min) of every member's `x`, on every member.

    >>> y = mc.collectives.all_reduce(x, bound, ("dp", "tp"), op="sum")   # doctest: +SKIP

    Backward follows PyTorch's functional collectives: the gradient of `x` is the all_reduce
    (sum) of the output gradients of every member (divided by the size for avg); max and min
    are not differentiable.
    """
    fn = "all_reduce"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    op = _op(fn, g, op, x.dtype)
    if checking(mesh, check):
        _check(fn, g, x, ("shape", tuple(x.shape)), ("op", op))
    out, _ = wire.all_reduce(x, "sum" if op == "avg" else op, g.wire, wait=False)
    return divide(out, g.size) if op == "avg" else out


def all_to_all(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, split_dim: int = 0,
               concat_dim: int = 0, input_splits: Sequence[int] | None = None,
               output_splits: Sequence[int] | None = None,
               check: bool | None = None) -> Tensor:
    """Block p of `x` along `split_dim` goes to position p; the blocks received are joined
    along `concat_dim` in group order.

    >>> y = mc.collectives.all_to_all(x, bound, "ep", split_dim=0, concat_dim=1)  # doctest: +SKIP

    The uneven form takes both `input_splits` (rows of `split_dim` this rank sends to each
    position) and `output_splits` (rows it receives from each); the second cannot be derived
    locally, e.g. MoE token counts come from an even all_to_all of `input_splits` first.
    Backward: the inverse all_to_all of the output gradient.
    """
    fn = "all_to_all"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    split = _dim(fn, g, "split_dim", split_dim, x)
    concat = _dim(fn, g, "concat_dim", concat_dim, x)
    n = x.shape[split]
    if (input_splits is None) != (output_splits is None):
        raise ShapeError(f"{fn} {_where(g)}: give input_splits and output_splits together (the"
                         " sizes this rank receives cannot be derived locally); fix: exchange"
                         " the counts first, output_splits ="
                         " mc.collectives.all_to_all(torch.tensor("
                         "input_splits), ...).tolist(), or give neither for equal blocks")
    if input_splits is None:
        if n % g.size:
            raise ShapeError(f"{fn} {_where(g)}: x has size {n} along split_dim={split}, not"
                             f" divisible by the group size {g.size}; fix: pad dim {split} to"
                             f" a multiple of {g.size}, or pass input_splits and output_splits")
        ins = outs = (n // g.size,) * g.size
    else:
        ins = _sizes(fn, g, "input_splits", input_splits, n, f"split_dim={split} of x")
        outs = _sizes(fn, g, "output_splits", output_splits, None, "")
        if ins[g.pos] != outs[g.pos]:
            raise ShapeError(f"{fn} {_where(g)}: position {g.pos} (this rank) sends itself"
                             f" input_splits[{g.pos}]={ins[g.pos]} rows but output_splits"
                             f"[{g.pos}]={outs[g.pos]}; the two must agree")
        if concat != split and len(set(outs)) > 1:
            raise ShapeError(f"{fn} {_where(g)}: output_splits={list(outs)} differ, so the"
                             f" received blocks differ along split_dim={split} and cannot be"
                             f" joined along concat_dim={concat}; fix: concat_dim={split}")
    if checking(mesh, check):
        _check(fn, g, x, ("shape", tuple(x.shape) if input_splits is None else "uneven"),
               ("split_dim", split), ("concat_dim", concat))
    rows = _reorder(x.movedim(split, 0), 0, ins, g.inv)
    outs_pg = [outs[p] for p in g.inv]
    got, _ = wire.all_to_all(rows, g.wire, outs_pg, [ins[p] for p in g.inv], wait=False)
    if concat == split:
        return _reorder(got, 0, outs_pg, g.order).movedim(0, split)
    blocks = torch.split(got, outs_pg[0]) if outs_pg[0] else [got] * g.size
    return torch.cat([blocks[q].movedim(0, split) for q in g.order], concat)


def _permute_pairs(fn: str, g: _Group, pairs: object, shift: object
                   ) -> tuple[tuple[int, int], ...]:
    if (pairs is None) == (shift is None) or not (shift is None or _is_int(shift)):
        raise ShapeError(f"{fn} {_where(g)}: give exactly one of pairs=[(src, dst), ...] or"
                         f" shift=k (an int), got pairs={pairs!r}, shift={shift!r}")
    if shift is not None:
        return tuple((p, (p + shift) % g.size) for p in range(g.size))  # type: ignore[operator]
    if not isinstance(pairs, Sequence):
        raise MeshAxisError(f"{fn} {_where(g)}: pairs={pairs!r} is not a list of (src, dst)")
    for k, pair in enumerate(pairs):
        if not (isinstance(pair, Sequence) and len(pair) == 2
                and all(_is_int(p) and 0 <= p < g.size for p in pair)):
            raise MeshAxisError(f"{fn} {_where(g)}: pair {pair!r} is not (src, dst) with positions"
                                f" in 0..{g.size - 1}; pairs name positions within the group"
                                f" (ranks {list(g.ranks)}), not global ranks")
        if any(q[1] == pair[1] for q in pairs[:k]):
            raise ShapeError(f"{fn} {_where(g)}: position {pair[1]} is the destination of more"
                             f" than one pair in {list(pairs)}; each position may receive once")
    return tuple((int(s), int(d)) for s, d in pairs)


def collective_permute(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *,
                       pairs: Sequence[tuple[int, int]] | None = None,
                       shift: int | None = None, check: bool | None = None) -> Tensor:
    """The `x` of the position that sends here, per (src, dst) in `pairs`, or zeros.

    For example (p gets p-1's):

    >>> y = mc.collectives.collective_permute(x, bound, "pp", shift=1)   # doctest: +SKIP

    `shift=k` means pairs (p, (p + k) % size). A position that receives nothing gets
    `zeros_like(x)` (as jax.lax.ppermute); every member passes the same shape and dtype.
    Runs as point-to-point messages, one per pair (`wire.p2p`). Backward: the inverse permute.
    """
    fn = "collective_permute"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    plan = _permute_pairs(fn, g, pairs, shift)
    if checking(mesh, check):
        _check(fn, g, x, ("shape", tuple(x.shape)), ("pairs", plan))
    to = tuple(sorted(d for s, d in plan if s == g.pos))
    frm = tuple(s for s, d in plan if d == g.pos)
    if torch.is_grad_enabled() and x.requires_grad:
        return cast(Tensor, _Permute.apply(x, g, to, frm))  # type: ignore[no-untyped-call]
    return _route(x, g, to, frm)


def _route(x: Tensor, g: _Group, to: tuple[int, ...], frm: tuple[int, ...]) -> Tensor:
    """Send `x` to caller positions `to`; the sum (in group order) of what `frm` send, or zeros.

    Point-to-point messages (`wire.p2p`, the executor's permute too): one per destination
    and one per source, posted together; a position in both is a local copy. The result is
    built from the in-flight tensors, so a traced program never drops a message on one rank.
    """
    flat = x.contiguous().reshape(-1)
    bufs = {p: flat.new_empty(flat.numel()) for p in frm if p != g.pos}
    posted, _ = wire.p2p([(flat, g.order[p]) for p in to if p != g.pos],
                         [(buf, g.order[p]) for p, buf in bufs.items()], g.name, g.wire, flat)
    got = dict(zip(bufs, posted.landed()))
    parts = [flat if p == g.pos else got[p].view(flat.shape) for p in sorted(frm)]
    if not parts:     # receives nothing: zeros, after the sends
        return posted.tied(flat.new_zeros(flat.numel())).view(x.shape)
    out = parts[0] if len(parts) == 1 else op_reduce(parts, "sum")
    return posted.tied(out.clone() if out is flat else out).view(x.shape)


class Shifted(NamedTuple):
    """A `post_shift` in flight: its point-to-point batch and the tensor that arrives (the
    receive buffer, filled by `wait`; for a shift onto this rank, the copy itself)."""

    posted: wire.Posted
    out: Tensor

    def wait(self) -> Tensor:
        """What position p - shift sent here: the batch waited on (both messages)."""
        got = self.posted.landed()
        return self.posted.tied(got[0].view(self.out.shape) if got else self.out)


def post_shift(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, shift: int = 1,
               recv_shape: Sequence[int] | None = None, check: bool | None = None) -> Shifted:
    """Post the send of `x` to group position p + `shift` and the receive from p - `shift`
    together, without waiting: `.wait()` gives the received tensor (`recv_shape`, default
    `x`'s shape; `x`'s dtype), once the transfer overlapped whatever ran in between.

    >>> nxt = post_shift(kv, bound, "cp", shift=1)   # doctest: +SKIP
    >>> out = attend(q, kv)                         # doctest: +SKIP
    >>> kv = nxt.wait()                             # doctest: +SKIP

    For rings that overlap a transfer with compute (ring attention posts the next block
    before attending to this one). Sizes may differ along the ring: each receiver names the
    shape its sender sends; an empty tensor is not sent, and an empty `recv_shape` is not
    received. One batch of point-to-point messages (`wire.p2p`; every byte recorded;
    traced, one all_to_all over the group); a shift that is a multiple of the group size
    copies `x`. Not differentiable, and not
    exported by `mc.collectives`: meshcomm's own layers call it inside their autograd
    functions (`mc.nn.attention`'s ring), and always wait what they post.
    """
    fn = "post_shift"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    if not _is_int(shift):
        raise ShapeError(f"{fn} {_where(g)}: shift={shift!r} is not an int; fix: shift=1 sends"
                         " to the next position")
    shape = tuple(x.shape) if recv_shape is None else _shape(fn, g, recv_shape)
    dst, src = (g.pos + shift) % g.size, (g.pos - shift) % g.size
    if dst == g.pos and shape != tuple(x.shape):
        raise ShapeError(f"{fn} {_where(g)}: shift={shift} is a multiple of the group size"
                         f" {g.size}, so this rank receives its own x of shape {tuple(x.shape)},"
                         f" not recv_shape={list(shape)}")
    if checking(mesh, check):
        _check(fn, g, x, ("shift", shift % g.size))
    if dst == g.pos:
        return Shifted(wire.Posted(()), x.clone())
    numel = 1
    for n in shape:
        numel *= n
    buf = x.new_empty(numel)
    sends = [(x.contiguous().reshape(-1), g.order[dst])] if x.numel() else []
    recvs = [(buf, g.order[src])] if numel else []
    posted, _ = wire.p2p(sends, recvs, g.name, g.wire, x)     # every member shifts
    return Shifted(posted, buf.view(shape))


def _shape(fn: str, g: _Group, shape: object) -> tuple[int, ...]:
    got = tuple(shape) if isinstance(shape, Sequence) else None
    if got is None or not all(_is_int(n) and n >= 0 for n in got):
        raise ShapeError(f"{fn} {_where(g)}: recv_shape={shape!r} is not a shape (a sequence of"
                         " ints >= 0)")
    return cast(tuple[int, ...], got)


class _Permute(torch.autograd.Function):
    """collective_permute whose backward is the inverse routing (fan-out becomes a sum)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, g: _Group,
                to: tuple[int, ...], frm: tuple[int, ...]) -> Tensor:
        ctx.args = (g, to, frm)  # type: ignore[attr-defined]
        return _route(x, g, to, frm)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor
                 ) -> tuple[Tensor | None, ...]:
        g, to, frm = ctx.args  # type: ignore[attr-defined]
        return _route(grad, g, frm, to), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, g: _Group,
                src: int) -> Tensor:
        ctx.group, ctx.src = g, src  # type: ignore[attr-defined]
        return wire.broadcast(x, g.order[src], g.wire, wait=False)[0]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor
                 ) -> tuple[Tensor, None, None]:
        g, src = ctx.group, ctx.src  # type: ignore[attr-defined]
        # A reduce to src: every member sends its gradient there; src sums them in group order.
        return _route(grad, g, (src,), tuple(range(g.size)) if g.pos == src else ()), None, None


def broadcast(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, src: int = 0,
              check: bool | None = None) -> Tensor:
    """A copy of the `x` of group position `src`, on every member.

    >>> y = mc.collectives.broadcast(x, bound, "tp", src=0)   # doctest: +SKIP

    Every member passes a tensor of the same shape and dtype (its values are unused off src).
    Backward: the gradients of every member summed (in group order) at src, zeros elsewhere.
    """
    fn = "broadcast"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    src = _position(fn, g, "src", src)
    if checking(mesh, check):
        _check(fn, g, x, ("shape", tuple(x.shape)), ("src", src))
    if torch.is_grad_enabled() and x.requires_grad:
        return cast(Tensor, _Broadcast.apply(x, g, src))  # type: ignore[no-untyped-call]
    return wire.broadcast(x, g.order[src], g.wire, wait=False)[0]


def _exchange(x: Tensor | None, like: Tensor | None, g: _Group, dst: int | None,
              src: int | None) -> Tensor:
    """Post a send of `x` to caller position `dst` and a receive like `like` from `src` together.

    Returns what `src` sent, or (no `src`) zeros like `like` built from the send's token, or
    (only a send) the token. The send's token may go unused: the send still completes.
    Functional ops, not `wire.p2p`'s waited works: a send here must not block (two ranks
    that each send, then receive, would wait for each other), and an eager send left
    unwaited would be dropped when the process group is destroyed.
    """
    kinds, peers, tensors = [], [], []
    if dst is not None:
        assert x is not None, "a send needs a tensor"
        kinds, peers, tensors = ["isend"], [g.order[dst]], [x.contiguous()]
    if src is not None:
        assert like is not None, "a receive needs a template tensor"
        # irecv fills the tensor it is given: a fresh buffer keeps `like` (often `x`) intact.
        buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        kinds, peers, tensors = kinds + ["irecv"], peers + [g.order[src]], tensors + [buffer]
    out = wire.batch_p2p(kinds, peers, tensors, g.name)
    if src is None and like is not None:
        token = out[0].to(like.dtype).reshape(-1)
        return torch.cat([token, like.new_zeros(like.numel())]).view(like.shape)
    return out[-1]


class _SendRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, g: _Group,
                dst: int | None, src: int | None, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        ctx.args = (g, dst, src, x.shape, x.dtype)  # type: ignore[attr-defined]
        return _exchange(x, x.new_empty(shape, dtype=dtype), g, dst, src)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor
                 ) -> tuple[Tensor | None, ...]:
        g, dst, src, shape, dtype = ctx.args  # type: ignore[attr-defined]
        back = _exchange(grad, grad.new_empty(shape, dtype=dtype), g, src, dst)
        return back, None, None, None, None, None


def _p2p_checks(fn: str, g: _Group, dst: object, src: object) -> None:
    for arg, p in (("dst", dst), ("src", src)):
        if p is not None and _position(fn, g, arg, p) == g.pos:
            raise MeshAxisError(f"{fn} {_where(g)}: {arg}={p} is this rank's own position; a rank"
                                " does not send to itself. fix: use x.clone() locally")


def send(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, dst: int) -> Tensor:
    """Send `x` to group position `dst`; returns a 0-element token, waited on at first use.

    For example (position 1 calls mc.collectives.recv):

    >>> token = mc.collectives.send(x, bound, "pp", dst=1)   # doctest: +SKIP

    Not differentiable: use `sendrecv` or `collective_permute` for gradients.
    """
    fn = "send"
    x = _tensor(fn, x)
    g = _group(fn, mesh, axes)
    _p2p_checks(fn, g, dst, None)
    return _exchange(x, None, g, dst, None)


def recv(like: Tensor, mesh: GroupLike, axes: Axes | None = None, *, src: int) -> Tensor:
    """A new tensor with the shape and dtype of `like`, received from group position `src`.

    >>> y = mc.collectives.recv(torch.empty(4, 8), bound, "pp", src=0)   # doctest: +SKIP

    `like`'s values are unused. Not differentiable: use `sendrecv` or `collective_permute`.
    """
    fn = "recv"
    like = _tensor(fn, like, "like")
    g = _group(fn, mesh, axes)
    _p2p_checks(fn, g, None, src)
    return _exchange(None, like, g, None, src)


def sendrecv(x: Tensor, mesh: GroupLike, axes: Axes | None = None, *, dst: int | None,
             src: int | None, like: Tensor | None = None) -> Tensor:
    """Send `x` to position `dst` and return what position `src` sends here, in one exchange.

    >>> y = mc.collectives.sendrecv(x, bound, "pp",  # doctest: +SKIP
    ...                             dst=(p + 1) % 4, src=(p - 1) % 4)

    Both sides post their send and receive together, so rings and chains cannot deadlock.
    `dst=None` only receives; `src=None` only sends and returns `zeros_like(like)`. The
    received tensor has the shape and dtype of `like` (default: `x`). Backward: the reverse
    exchange (the output gradient goes back to `src`, `x`'s gradient comes from `dst`).
    """
    fn = "sendrecv"
    x = _tensor(fn, x)
    like = x if like is None else _tensor(fn, like, "like")
    g = _group(fn, mesh, axes)
    _p2p_checks(fn, g, dst, src)
    if dst is None and src is None:
        raise MeshAxisError(f"{fn} {_where(g)}: give dst, src or both; fix: dst=position to send"
                            " to, src=position to receive from")
    if torch.is_grad_enabled() and x.requires_grad:
        out = _SendRecv.apply(x, g, dst, src, like.shape, like.dtype)  # type: ignore[no-untyped-call]
        return cast(Tensor, out)
    return _exchange(x, like, g, dst, src)


def wait(t: Tensor) -> Tensor:
    """`t` waited on now: a collective's result above as a plain tensor (any other tensor
    as given).

    >>> top = wait(all_reduce(x, bound, "tp", op="max"))   # doctest: +SKIP

    Results are waited on at their first use anyway; meshcomm's own layers wait at once
    where a result is used inside a `torch.autograd.Function`'s forward or read on the host
    (`mc.nn.vocab_parallel_cross_entropy`). Not exported by `mc.collectives`: a user's
    code never needs it. Waits through `wire`, the one module that touches torch's
    collectives.
    """
    return wire.waited(t)
