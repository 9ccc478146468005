"""The one place that hands tensors to PyTorch's functional collectives.

Every collective call of meshcomm (the executor's steps, `mc.collectives`, check mode,
`fully_shard`) is one of `all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all` and
`broadcast` here. Each returns its result and the `Wire` it measured: the sizes of the
buffers it was handed, from which every byte figure meshcomm reports is computed. Inside
`recording()` every call's Wire is also collected, whoever made it.

Complex tensors travel as real pairs (a view, no copy); `wait=True` waits at once (the
executor's local rearranges need the data anyway), `wait=False` returns the async tensor
that is waited on at first use (`mc.collectives`). Traced calls are already waited on.

The functional collectives by the names of torch 2.12 and later, on any torch from 2.6:
`all_gather_single` and `reduce_scatter_single` (before: `all_gather_tensor`,
`reduce_scatter_tensor`, the same calls) and `batch_p2p` (before torch's
`batch_p2p_ops_inplace`: `batch_isend_irecv`, waited on, which torch.compile cannot trace).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..steps import Wire
from .groups import Group as Group  # re-exported: every call takes one (`wire.Group`)
from .groups import resolve_group

Heard = tuple[Wire, int]          # one call's Wire and its element size in bytes
_LISTENERS: list[list[Heard]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Heard]]:
    """Collect the (Wire, element size) of every collective call made inside the block, in
    call order, by any part of meshcomm."""
    heard: list[Heard] = []
    _LISTENERS.append(heard)
    try:
        yield heard
    finally:
        _LISTENERS.remove(heard)


def _heard(call: Wire, x: Tensor) -> Wire:
    for heard in _LISTENERS:
        heard.append((call, x.element_size()))
    return call


# -- the collectives: (result, measured Wire) --------------------------------------------------
def all_gather(x: Tensor, group: Group, *, wait: bool = True) -> tuple[Tensor, Wire]:
    """Every member's `x` stacked along dim 0 (group order)."""
    y = call(all_gather_single, x, 0, group.name, wait=wait)
    return y, _heard(Wire("all_gather", group.size, group.pos, x.numel(), y.numel()), x)


def reduce_scatter(x: Tensor, op: str, group: Group, *,
                   wait: bool = True) -> tuple[Tensor, Wire]:
    """This position's chunk along dim 0 of the `op` of every member's `x`."""
    y = call(reduce_scatter_single, x, op, 0, group.name, wait=wait)
    return y, _heard(Wire("reduce_scatter", group.size, group.pos, x.numel(), y.numel()), x)


def all_reduce(x: Tensor, op: str, group: Group, *, wait: bool = True) -> tuple[Tensor, Wire]:
    """The `op` of every member's `x`, on every member."""
    y = call(all_reduce_single, x, op, group.name, wait=wait)
    return y, _heard(Wire("all_reduce", group.size, group.pos, x.numel(), y.numel()), x)


def broadcast(x: Tensor, root: int, group: Group, *, wait: bool = True) -> tuple[Tensor, Wire]:
    """The `x` of group position `root` on every member."""
    y = call(broadcast_single, x.contiguous(), root, group.name, wait=wait)
    return y, _heard(Wire("broadcast", group.size, group.pos, x.numel(), y.numel(),
                          root=root), x)


def all_to_all(rows: Tensor, group: Group, out_splits: Sequence[int] | None = None,
               in_splits: Sequence[int] | None = None, *,
               wait: bool = True) -> tuple[Tensor, Wire]:
    """all_to_all_single along dim 0 (splits in rows of dim 0, group order).

    A rank that sends nothing but receives sends itself one row of zeros and drops it from
    what it receives: every backend takes that, and torch's fake process group (which
    fills a receive from the rank's own input, to time host work) cannot take an empty
    input. The row never leaves the rank."""
    rows = rows.contiguous()
    send, ins, outs, own = rows, in_splits, out_splits, None
    if in_splits is not None and out_splits is not None and rows.shape[0] == 0 \
            and any(out_splits):
        own = sum(out_splits[:group.pos])      # where the row comes back
        send = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])   # keeps autograd
        ins, outs = _plus_one(in_splits, group.pos), _plus_one(out_splits, group.pos)
    # split lists go to the op as given (a list or tuple each): a copy per call would be
    # O(group) work in Python, on a rank of a 4,096-rank send_recv ~16 us
    y = call(all_to_all_single, send, outs, ins, group.name, wait=wait)
    if own is not None:
        y = torch.cat([y[:own], y[own + 1:]])
    if out_splits is not None and torch.compiler.is_compiling():
        # traced, uneven splits give the output an unknown length; it is their sum, and
        # saying so lets the compiler slice it without guarding on data
        torch._check(y.shape[0] == sum(out_splits))  # type: ignore[no-untyped-call]
    row = math.prod(rows.shape[1:])
    return y, _heard(Wire("all_to_all", group.size, group.pos, rows.numel(), y.numel(),
                          _elements(in_splits, row), _elements(out_splits, row)), rows)


def _plus_one(splits: Sequence[int], pos: int) -> list[int]:
    """`splits` with one more row at `pos` (a copy: the caller's may be cached)."""
    out = list(splits)
    out[pos] += 1
    return out


def _elements(splits: Sequence[int] | None, row: int) -> tuple[int, ...]:
    """Row splits in elements, for the Wire. A flat buffer's (`row` 1) is a C-level copy;
    callers on a hot path pass flat buffers, so no Python loop over the group runs per call
    (a generator over 4,096 splits costs ~0.2 ms)."""
    if not splits:
        return ()
    if row == 1:
        return splits if isinstance(splits, tuple) else tuple(splits)
    return tuple(s * row for s in splits)


# -- the functional ops, and torch's names across versions ------------------------------------
# Eager, with no gradient recorded through the call (a reshard's forward, an engine step), a
# collective is the functional op itself, dispatched below autograd, its result wrapped to be
# waited on at first use (and `waited` waits below autograd too). funcol's Python wrapper
# adds a group lookup, an autograd custom op to wrap the result, and the ops' Python autograd
# kernels: over the fake backend an all_reduce waited on costs 19.4 us through funcol and
# 9 us here (3.4 us for the two ops alone). An eager all_to_all is what its functional op
# runs inside (`_all_to_all_posted`: the process group's alltoall_base, the work registered
# for `wait_tensor`), so its cost does not grow with the group where the splits are even.
# Traced, or recording a gradient (`mc.collectives` on an input that requires grad), the
# call goes through funcol (looked up per call, as tests wrap funcol).
_OPS = torch.ops._c10d_functional
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
_ALL_REDUCE = _OPS.all_reduce.default
_ALL_GATHER = _OPS.all_gather_into_tensor.default
_REDUCE_SCATTER = _OPS.reduce_scatter_tensor.default
_ALL_TO_ALL = _OPS.all_to_all_single.default
_BROADCAST = _OPS.broadcast.default
_WAIT = _OPS.wait_tensor.default
# how the functional ops hand a process group's work to `wait_tensor` (absent: the op is used)
_REGISTER_WORK: Callable[[Tensor, Any], None] | None = getattr(
    torch._C._distributed_c10d, "_register_work", None) if dist.is_available() else None


def _direct(x: Tensor) -> bool:
    """Whether a call on `x` runs the functional op directly (see above)."""
    return not (x.requires_grad and torch.is_grad_enabled()) and not funcol._are_we_tracing()


def _lazy(op: Callable[..., Tensor], *args: object) -> Tensor:
    """`op(*args)` below autograd, its result waited on at its first use (as funcol gives
    it: an AsyncCollectiveTensor)."""
    with _BELOW_AUTOGRAD():
        y = op(*args)
    return funcol.AsyncCollectiveTensor(y)


def all_reduce_single(x: Tensor, op: str, group: str) -> Tensor:
    """The functional all_reduce of `x` with `op` over group `group`."""
    if _direct(x):
        return _lazy(_ALL_REDUCE, x, op, group)
    fn: Callable[..., Tensor] = funcol.all_reduce
    return fn(x, op, group)


def all_gather_single(x: Tensor, dim: int, group: str) -> Tensor:
    """The functional all_gather of `x` along `dim` over group `group`."""
    if dim == 0 and _direct(x):
        return _lazy(_ALL_GATHER, x, _group_size(group), group)
    fn: Callable[..., Tensor] = (getattr(funcol, "all_gather_single", None)
                                 or funcol.all_gather_tensor)
    return fn(x, dim, group)


def reduce_scatter_single(x: Tensor, op: str, dim: int, group: str) -> Tensor:
    """The functional reduce_scatter of `x` along `dim` with `op` over group `group`."""
    if dim == 0 and _direct(x):
        size = _group_size(group)
        if x.shape[0] % size == 0:     # else funcol raises its error
            return _lazy(_REDUCE_SCATTER, x, op, size, group)
    fn: Callable[..., Tensor] = (getattr(funcol, "reduce_scatter_single", None)
                                 or funcol.reduce_scatter_tensor)
    return fn(x, op, dim, group)


def all_to_all_single(x: Tensor, out_splits: Sequence[int] | None,
                      in_splits: Sequence[int] | None, group: str) -> Tensor:
    """The functional all_to_all of `x`'s dim-0 rows (even splits where both are None)."""
    if _direct(x) and (out_splits is None) == (in_splits is None):
        if _REGISTER_WORK is not None:
            return _all_to_all_posted(x, out_splits, in_splits, group)
        if out_splits is None or in_splits is None:
            size = _group_size(group)
            out_splits = in_splits = [x.shape[0] // size] * size
        return _lazy(_ALL_TO_ALL, x, out_splits, in_splits, group)
    fn: Callable[..., Tensor] = funcol.all_to_all_single
    return fn(x, None if out_splits is None else list(out_splits),
              None if in_splits is None else list(in_splits), group)


def _all_to_all_posted(x: Tensor, out_splits: Sequence[int] | None,
                       in_splits: Sequence[int] | None, group: str) -> Tensor:
    """What the functional all_to_all does (the group's `alltoall_base` into a new output,
    its work registered for `wait_tensor`), below autograd, without its per-member split
    lists where the splits are even, and with plain int lists where not. The op reads each
    list as SymInts, ~0.15 us per member per list: 1.3 ms per call on 4,096 ranks; the
    process group takes no list for even splits (the backend splits evenly), and an
    uneven one at ~10 ns per member."""
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    register: Callable[[Tensor, Any], None] = _REGISTER_WORK  # type: ignore[assignment]
    with _BELOW_AUTOGRAD():
        out = x.new_empty((rows, *x.shape[1:]))
        # the splits as given (a list or tuple: the binding takes any sequence of ints)
        outs = cast(list[int], [] if out_splits is None else out_splits)
        ins = cast(list[int], [] if in_splits is None else in_splits)
        work = resolve_group(group).alltoall_base(out, x, outs, ins, dist.AllToAllOptions())
    register(out, work)
    return funcol.AsyncCollectiveTensor(out)


def broadcast_single(x: Tensor, root: int, group: str) -> Tensor:
    """The functional broadcast of group position `root`'s `x` over group `group`."""
    if _direct(x):
        return _lazy(_BROADCAST, x, root, group)
    fn: Callable[..., Tensor] = funcol.broadcast
    return fn(x, root, group)


def _group_size(name: str) -> int:
    from torch.distributed import distributed_c10d as c10d

    return int(c10d._get_group_size_by_name(c10d.GroupName(name)))


def batch_p2p(kinds: Sequence[str], peers: Sequence[int], tensors: list[Tensor],
              name: str) -> list[Tensor]:
    """Sends ("isend") and receives ("irecv", filling the tensor given) with group-rank
    `peers` over group `name`, posted together; per op, an empty token for a send and the
    filled tensor for a receive."""
    p2p: Callable[..., Sequence[Tensor]] | None = getattr(funcol, "batch_p2p_ops_inplace", None)
    if p2p is not None:
        return list(p2p(list(kinds), list(peers), [0] * len(kinds), tensors, name))
    group = resolve_group(name)
    ops = [(t, dist.get_global_rank(group, peer)) for peer, t in zip(peers, tensors)]
    for work in post_p2p([o for o, k in zip(ops, kinds) if k == "isend"],
                         [o for o, k in zip(ops, kinds) if k == "irecv"], group):
        work.wait()
    # as the functional op: a send gives back an empty token, a receive its filled tensor
    return [t if kind == "irecv" else t.new_empty(0) for kind, t in zip(kinds, tensors)]


WORLD = ""    # the default group's name for funcol: peers are global ranks


def ranks_group(ranks: Sequence[int]) -> Group | None:
    """This rank's `Group` over the global `ranks` (ascending, this rank among them): an
    existing process group of exactly those ranks in that order and of the default group's
    backend (the world, a bound mesh's group), or None. Never creates one: it runs while
    torch.compile traces, on those ranks only."""
    from torch.distributed import distributed_c10d as c10d

    want = {r: i for i, r in enumerate(ranks)}
    backend = dist.get_backend()
    for pg, members in c10d._world.pg_group_ranks.items():
        if members == want and dist.get_backend(pg) == backend:
            return Group(pg.group_name, len(ranks), want[dist.get_rank()])
    return None


class Posted(NamedTuple):
    """A batch of point-to-point messages in flight (`p2p`): the receive buffers, and what
    to wait on before reading them (eager: the batch's works; traced: the functional op's
    outputs, which are the buffers themselves, with the send tokens)."""

    received: tuple[Tensor, ...]
    works: tuple[Any, ...] = ()
    tokens: tuple[Tensor, ...] = ()

    def landed(self) -> tuple[Tensor, ...]:
        """The receive buffers, filled: every message of the batch waited on."""
        for work in self.works:
            work.wait()
        for token in self.tokens:
            waited(token)
        return tuple(waited(t) for t in self.received)

    def unwaited(self) -> tuple[Tensor, ...]:
        """The receive buffers without waiting where they wait at first use (traced);
        eager messages are waited on here (a work has no lazy tensor)."""
        return self.landed() if self.works else self.received

    def tied(self, x: Tensor) -> Tensor:
        """`x`, made to depend on the sends' tokens (empty tensors) where traced, so that a
        compiled program keeps the sends of a rank that receives nothing."""
        if not self.tokens:
            return x
        parts = [t.to(x.dtype).reshape(-1) for t in self.tokens]
        return torch.cat([*parts, x.reshape(-1)]).view(x.shape)


def p2p(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
        name: str, group: Group | None = None, like: Tensor | None = None
        ) -> tuple[Posted, Wire]:
    """Post sends and receives (tensor, peer's rank in group `name`; `WORLD`: global ranks)
    together, without waiting, and the measured `Wire` ("p2p": the elements sent and
    received). Receives fill the tensors given. Eager, the messages are one
    `batch_isend_irecv` whose works `Posted.landed` waits (PyTorch's functional
    `batch_p2p_ops` leaves one work per batch in its registry even once every output is
    waited on: a leak per step); traced (or on the meta device), the functional op.

    `group`: every member of the group posts its batch in this call (a permute, a ring
    shift), tensors of `like`'s dtype. Traced, the batch is then one all_to_all over the
    group, which the compiler orders and keeps the buffers of as any collective's: a
    traced `batch_p2p_ops` raced under inductor (wrong values about one run in three)."""
    call = Wire("p2p", len(sends) + len(recvs), 0, sum(t.numel() for t, _ in sends),
                sum(t.numel() for t, _ in recvs))
    for heard in _LISTENERS:
        heard.append((call, (sends or recvs)[0][0].element_size() if sends or recvs else 1))
    if group is not None and like is not None and torch.compiler.is_compiling():
        return _p2p_as_all_to_all(sends, recvs, group, like), call
    if not sends and not recvs:
        return Posted(()), call
    first = (sends or recvs)[0][0]
    if not torch.compiler.is_compiling() and not first.is_meta:   # meta: no eager backend
        pg = resolve_group(name) if name != WORLD else None
        peer = (lambda p: p) if pg is None else (lambda p: dist.get_global_rank(pg, p))
        works = post_p2p([(t.contiguous(), peer(p)) for t, p in sends],
                         [(t, peer(p)) for t, p in recvs], pg)
        return Posted(tuple(t for t, _ in recvs), tuple(works)), call
    kinds = ["isend"] * len(sends) + ["irecv"] * len(recvs)
    pairs = [*sends, *recvs]
    got = batch_p2p(kinds, [p for _, p in pairs],
                    [as_real(t.contiguous()) if k == "isend" else as_real(t)
                     for (t, _), k in zip(pairs, kinds)], name)
    # a complex receive travels as real pairs: given back complex (a view, still in flight)
    received = tuple(torch.view_as_complex(r) if t.is_complex() else r
                     for r, (t, _) in zip(got[len(sends):], recvs))
    return Posted(received, (), tuple(got[:len(sends)])), call


def _p2p_as_all_to_all(sends: Sequence[tuple[Tensor, int]],
                       recvs: Sequence[tuple[Tensor, int]], group: Group,
                       like: Tensor) -> Posted:
    """A batch of point-to-point messages within `group` as one all_to_all: each peer's
    sends in the send buffer (peer order), each peer's receive cut from the output."""
    real = as_real(like.reshape(-1)[:0])
    ins, outs = [0] * group.size, [0] * group.size
    for t, p in sends:
        ins[p] += as_real(t.contiguous()).numel()
    for t, p in recvs:
        outs[p] += as_real(t).numel()
    order = sorted(range(len(sends)), key=lambda i: sends[i][1])
    parts = [as_real(sends[i][0].contiguous()).reshape(-1) for i in order]
    buf = torch.cat(parts) if parts else real
    y, _ = all_to_all(buf.reshape(-1, 1), group, outs, ins, wait=False)
    y = y.reshape(-1)
    start = [sum(outs[:p]) for p in range(group.size)]
    received = []
    for t, p in recvs:
        n = as_real(t).numel()
        got = y[start[p]:start[p] + n]
        start[p] += n
        got = got.view(as_real(t).shape)
        received.append(torch.view_as_complex(got) if t.is_complex() else got.view(t.shape))
    return Posted(tuple(received), (), () if received else (y,))


def post_p2p(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
             group: Any = None) -> list[Any]:
    """Post sends and receives (tensor, global peer rank) together in one batch; the works
    to wait on. Complex tensors travel as real pairs."""
    ops = ([dist.P2POp(dist.isend, as_real(t), peer, group) for t, peer in sends]
           + [dist.P2POp(dist.irecv, as_real(t), peer, group) for t, peer in recvs])
    return list(dist.batch_isend_irecv(ops)) if ops else []


def as_real(x: Tensor) -> Tensor:
    """`x` as the backend sends it: complex tensors as real pairs (a view, no copy)."""
    return torch.view_as_real(x) if x.is_complex() else x


def waited(t: Tensor) -> Tensor:
    """`t`, waited on if it is an eager functional-collective result (once: the items of a
    bucket share one result, and a second wait would be a second wait_tensor op)."""
    if isinstance(t, funcol.AsyncCollectiveTensor):
        if not t.completed and not t.elem.requires_grad and not torch.compiler.is_compiling():
            with _BELOW_AUTOGRAD():      # as `trigger_wait`, without the autograd kernel
                _WAIT(t.elem)
            t.completed = True
            return t.elem
        out: Tensor = t.trigger_wait()  # type: ignore[no-untyped-call]
        return out
    return t


def call(fn: Callable[..., Tensor], x: Tensor, *args: object, wait: bool = True) -> Tensor:
    """`fn(x, *args)` with complex `x` sent as real pairs and given back complex."""
    y = fn(as_real(x), *args)
    if wait:
        y = waited(y)
    return torch.view_as_complex(y) if x.is_complex() else y


