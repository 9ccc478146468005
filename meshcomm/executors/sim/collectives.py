"""Exact in-process simulation of functional collectives on lists of per-rank tensors.

This module never communicates. `xs[r]` is rank r's tensor; `groups` are disjoint tuples of
ranks (e.g. `mesh.groups("tp")`) and a rank's position is its index in its group; ranks in no
group keep a copy and move 0 bytes. Inputs are checked first and never mutated; outputs alias
nothing. Reductions run in group order (`op_reduce`), so results are bit-reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from ...core.errors import MeshAxisError, ShapeError
from ...core.reduce_ops import check_op as _check_op
from ...core.reduce_ops import chunk_sizes, op_reduce
from ...planner.values import Transfer
from ..local import take
from ..steps import Wire

Groups = Sequence[Sequence[int]]
Splits = Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class SimResult:
    """What every rank holds after a collective, and the bytes each rank sent and received.

    >>> r = all_gather([torch.ones(2), torch.zeros(2)], [(0, 1)], dim=0)
    >>> r.outputs[1].tolist(), r.send_bytes, r.recv_bytes
    ([1.0, 1.0, 0.0, 0.0], (8, 8), (8, 8))
    >>> r.then(r).send_bytes
    (16, 16)
    """

    outputs: tuple[Tensor, ...]
    send_bytes: tuple[int, ...]
    recv_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("outputs", "send_bytes", "recv_bytes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        sizes = (len(self.outputs), len(self.send_bytes), len(self.recv_bytes))
        assert len(set(sizes)) == 1, f"SimResult needs one entry per rank, got lengths {sizes}"

    @staticmethod
    def noop(xs: Sequence[Tensor]) -> SimResult:
        """Copies of `xs` with no bytes moved: a start value for accumulating a trace."""
        return _result(_prepare("SimResult.noop", xs)[0], (), [])

    def then(self, other: SimResult) -> SimResult:
        """`other`'s outputs, with this trace's bytes and `other`'s added rank by rank."""
        if len(other.outputs) != len(self.outputs):
            raise ShapeError(f"SimResult.then: this result has {len(self.outputs)} ranks but the"
                             f" next has {len(other.outputs)}; fix: chain results of one rank list")
        return SimResult(other.outputs, tuple(map(sum, zip(self.send_bytes, other.send_bytes))),
                         tuple(map(sum, zip(self.recv_bytes, other.recv_bytes))))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prepare(fn: str, xs: Sequence[Tensor], groups: Groups = ()
             ) -> tuple[tuple[Tensor, ...], tuple[tuple[int, ...], ...]]:
    if isinstance(xs, Tensor) or not isinstance(xs, Sequence):
        raise ShapeError(f"{fn}: xs must be a list of per-rank tensors, got {type(xs).__name__};"
                         " fix: pass [tensor_of_rank_0, tensor_of_rank_1, ...]")
    for r, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise ShapeError(f"{fn}: xs[{r}] is a {type(x).__name__}, expected a torch.Tensor")
    owner, n = dict[int, int](), len(xs)
    for gi, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not group:
            raise MeshAxisError(f"{fn}: groups[{gi}] = {group!r} is not a non-empty tuple of"
                                ' ranks; fix: pass e.g. mesh.groups("tp") == ((0, 1), (2, 3))')
        for r in group:
            if not _is_int(r) or not 0 <= r < n:
                raise MeshAxisError(
                    f"{fn}: groups[{gi}] = {tuple(group)} names rank {r!r} but xs has {n} ranks"
                    f" (0..{n - 1}); fix: build groups from the mesh that xs was made for")
            if r in owner:
                where = "twice" if owner[r] == gi else f"and in groups[{owner[r]}]"
                raise MeshAxisError(
                    f"{fn}: rank {r} is in groups[{gi}] = {tuple(group)} {where}; groups must be"
                    ' disjoint. fix: use the groups of one mesh axis, e.g. mesh.groups("tp")')
            owner[r] = gi
    return tuple(xs), tuple(tuple(group) for group in groups)


def _check_group(fn: str, xs: tuple[Tensor, ...], group: tuple[int, ...], gi: int,
                 free: tuple[int, ...] | None = (), rule: str = "", op: str | None = None
                 ) -> None:
    """Members share dtype and device, shape outside `free` dims (unless None), and fit `op`."""
    first, r0 = xs[group[0]], group[0]
    if op is not None:
        _check_op(fn, op, first.dtype)
    for r in group[1:]:
        x = xs[r]
        if x.dtype != first.dtype or x.device != first.device:
            raise ShapeError(
                f"{fn}: groups[{gi}] mixes {first.dtype} on {first.device} (rank {r0}) with"
                f" {x.dtype} on {x.device} (rank {r}); fix: give a group one dtype and device")
        if free is not None and (x.dim() != first.dim() or any(
                a != b for d, (a, b) in enumerate(zip(x.shape, first.shape)) if d not in free)):
            raise ShapeError(
                f"{fn}: in groups[{gi}] rank {r} has shape {tuple(x.shape)} but rank {r0} has"
                f" {tuple(first.shape)}; {rule or 'every rank of a group needs the same shape'}")


def _norm_dim(fn: str, arg: str, dim: int, ndim: int) -> int:
    if not _is_int(dim) or not -ndim <= dim < ndim:
        valid = f"{-ndim}..{ndim - 1}" if ndim else "none, the tensor is 0-d"
        raise ShapeError(f"{fn}: {arg}={dim!r} is not a dim of a {ndim}-d tensor (valid: {valid})")
    return dim % ndim


def _check_sizes(fn: str, arg: str, sizes: Sequence[int], g: int, n: int, where: str) -> None:
    ok = isinstance(sizes, Sequence) and all(_is_int(s) and s >= 0 for s in sizes)
    if not ok or len(sizes) != g or sum(sizes) != n:
        got = f"sums to {sum(sizes)}" if ok and len(sizes) == g else f"is not {g} sizes >= 0"
        raise ShapeError(f"{fn}: {arg}={sizes!r} for {where} {got}; expected {g} sizes, one per"
                         f" group position, that sum to the dim size {n}")


def _per_rank(fn: str, arg: str, splits: Splits | None, n: int) -> list[Sequence[int]] | None:
    """One list of sizes per rank: a shared list repeated, or the per-rank lists as given."""
    items = None if splits is None else list(splits)
    if items is None or all(isinstance(s, Sequence) for s in items) and len(items) == n:
        return items  # type: ignore[return-value]
    if all(isinstance(s, int) for s in items):
        return [items] * n  # type: ignore[list-item]
    raise ShapeError(f"{fn}: {arg}={splits!r} is neither one list of sizes shared by every rank"
                     f" nor one list per rank ({n} ranks); fix: pass [s0, ...] or [[s0, ...], ...]")


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def _result(xs: tuple[Tensor, ...], groups: tuple[tuple[int, ...], ...],
            rows: list[list[tuple[Tensor, int, int]]]) -> SimResult:
    """SimResult from per-group rows of (output, send_bytes, recv_bytes), one per position."""
    done = {r: row for group, grows in zip(groups, rows) for r, row in zip(group, grows)}
    full = [done[r] if r in done else (x.clone(), 0, 0) for r, x in enumerate(xs)]
    return SimResult(*map(tuple, zip(*full))) if full else SimResult((), (), ())


def all_gather(xs: Sequence[Tensor], groups: Groups, dim: int = 0) -> SimResult:
    """Every member gets its group's tensors concatenated along `dim` in group order.

    Blocks may differ in size along `dim` (the "v" form). Bytes: the rank with block
    L_i bytes sends (g-1) * L_i and receives the sum of L_j over the other members j.

    >>> r = all_gather([torch.tensor([0.0]), torch.tensor([1.0, 2.0])], [(0, 1)])
    >>> r.outputs[0].tolist(), r.send_bytes, r.recv_bytes
    ([0.0, 1.0, 2.0], (4, 8), (8, 4))
    """
    xs, groups = _prepare("all_gather", xs, groups)
    dims = []
    for gi, group in enumerate(groups):
        dims.append(_norm_dim("all_gather", "dim", dim, xs[group[0]].dim()))
        _check_group("all_gather", xs, group, gi, (dims[-1],),
                     f"shapes may differ only along dim={dim}")
    rows = []
    for group, d in zip(groups, dims):
        cat = torch.cat([xs[r] for r in group], dim=d)
        sizes = [_nbytes(xs[r]) for r in group]
        calls = [Wire("all_gather", len(group), p, s, sum(sizes)) for p, s in enumerate(sizes)]
        rows.append([(cat.clone(), w.sent, w.received) for w in calls])
    return _result(xs, groups, rows)


def reduce_scatter(xs: Sequence[Tensor], groups: Groups, dim: int = 0, op: str = "sum", *,
                   splits: Sequence[int] | None = None) -> SimResult:
    """Position j gets the reduction over its group (`op_reduce`) of chunk j along `dim`.

    Chunks follow `chunk_sizes` (torch.chunk boundaries, always g of them) unless `splits`
    gives g sizes. Bytes: with input T bytes and own output chunk C_i bytes, position i
    sends T - C_i (every chunk but its own) and receives (g-1) * C_i.

    >>> r = reduce_scatter([torch.arange(4.0), torch.ones(4)], [(0, 1)], op="sum")
    >>> r.outputs[0].tolist(), r.outputs[1].tolist(), r.send_bytes, r.recv_bytes
    ([1.0, 2.0], [3.0, 4.0], (8, 8), (8, 8))
    """
    fn = "reduce_scatter"
    xs, groups = _prepare(fn, xs, groups)
    plans = []
    for gi, group in enumerate(groups):
        _check_group(fn, xs, group, gi, op=op)
        x = xs[group[0]]
        d = _norm_dim(fn, "dim", dim, x.dim())
        sizes = chunk_sizes(x.shape[d], len(group)) if splits is None else splits
        _check_sizes(fn, "splits", sizes, len(group), x.shape[d], f"groups[{gi}]")
        plans.append((d, tuple(sizes)))
    rows = []
    for group, (d, sizes) in zip(groups, plans):
        total = _nbytes(xs[group[0]])
        grows: list[tuple[Tensor, int, int]] = []
        for start, size in zip(accumulate(sizes, initial=0), sizes):
            out = op_reduce([xs[m].narrow(d, start, size) for m in group], op)
            w = Wire("reduce_scatter", len(group), len(grows), total, _nbytes(out))
            grows.append((out, w.sent, w.received))
        rows.append(grows)
    return _result(xs, groups, rows)


def all_reduce(xs: Sequence[Tensor], groups: Groups, op: str = "sum") -> SimResult:
    """Every member gets the reduction over its group (`op_reduce`, group order).

    Bytes model a ring: a reduce_scatter of the flattened tensor into `chunk_sizes(numel, g)`
    element chunks, then an all_gather of them. With T input bytes and own chunk C_i bytes,
    position i sends (T - C_i) + (g-1) * C_i and receives (g-1) * C_i + (T - C_i), which is
    2 (g-1)/g T for equal chunks.

    >>> r = all_reduce([torch.ones(4), torch.ones(4)], [(0, 1)], op="sum")
    >>> r.outputs[1].tolist(), r.send_bytes, r.recv_bytes
    ([2.0, 2.0, 2.0, 2.0], (16, 16), (16, 16))
    """
    xs, groups = _prepare("all_reduce", xs, groups)
    for gi, group in enumerate(groups):
        _check_group("all_reduce", xs, group, gi, op=op)
    rows = []
    for group in groups:
        x, g = xs[group[0]], len(group)
        out = op_reduce([xs[r] for r in group], op)
        calls = [Wire("all_reduce", g, p, x.numel(), x.numel()) for p in range(g)]
        rows.append([(out.clone(), w.sent * x.element_size(), w.received * x.element_size())
                     for w in calls])
    return _result(xs, groups, rows)


def _a2a_sizes(fn: str, xs: tuple[Tensor, ...], group: tuple[int, ...], gi: int, d: int,
               per_rank: list[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """sizes[p][j]: how much of dim `d` group position p sends to position j."""
    g, out = len(group), []
    for r in group:
        n = xs[r].shape[d]
        if per_rank is None and n % g:
            raise ShapeError(
                f"{fn}: rank {r} has size {n} along split_dim={d}, not divisible by the size {g}"
                f" of groups[{gi}]; fix: pad dim {d} to a multiple of {g}, or pass input_splits")
        sizes = (n // g,) * g if per_rank is None else per_rank[r]
        _check_sizes(fn, "input_splits", sizes, g, n, f"rank {r}")
        out.append(tuple(sizes))
    return out


def _a2a_check(fn: str, xs: tuple[Tensor, ...], group: tuple[int, ...], split: int,
               concat: int, sizes: list[tuple[int, ...]],
               wanted: list[Sequence[int]] | None) -> None:
    """Check output_splits against what is sent, and that each receiver's blocks concatenate."""
    for j, r in enumerate(group):
        sent = [s[j] for s in sizes]
        row = sent if wanted is None else list(wanted[r])
        if row != sent:
            p = next((p for p, (a, b) in enumerate(zip(row, sent)) if a != b), None)
            why = (f"it has {len(row)} sizes for {len(sent)} positions" if p is None else
                   f"position {p} (rank {group[p]}) sends it {sent[p]}, not {row[p]}")
            raise ShapeError(f"{fn}: output_splits for rank {r} is {row} but {why};"
                             f" fix: use {sent} (what input_splits sends it)")
        shapes = [[sent[p] if d == split else n for d, n in enumerate(xs[src].shape)]
                  for p, src in enumerate(group)]
        for p, shape in enumerate(shapes):
            if any(a != b for d, (a, b) in enumerate(zip(shape, shapes[0])) if d != concat):
                raise ShapeError(
                    f"{fn}: rank {r} would concatenate a block of shape {tuple(shapes[0])} from"
                    f" rank {group[0]} with one of shape {tuple(shape)} from rank {group[p]}"
                    f" along concat_dim={concat}; blocks must match in every other dim")


def all_to_all(xs: Sequence[Tensor], groups: Groups, split_dim: int = 0, concat_dim: int = 0,
               *, input_splits: Splits | None = None,
               output_splits: Splits | None = None) -> SimResult:
    """Position j gets block j of each member along `split_dim`, joined along `concat_dim`.

    Blocks join in group order; without `input_splits` they are g equal parts. The "v" form
    takes g sizes shared by every rank, or one list per rank of xs (input_splits[r][j] = how
    much rank r sends to position j; lists of ranks in no group are ignored). `output_splits`
    (same forms: sizes along `split_dim` a rank gets from each position) is only checked.
    Bytes: a rank sends its blocks for other positions and receives theirs for it.

    >>> r = all_to_all([torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])], [(0, 1)])
    >>> [o.tolist() for o in r.outputs], r.send_bytes, r.recv_bytes
    ([[0.0, 2.0], [1.0, 3.0]], (4, 4), (4, 4))
    """
    fn = "all_to_all"
    xs, groups = _prepare(fn, xs, groups)
    per_rank = _per_rank(fn, "input_splits", input_splits, len(xs))
    wanted = _per_rank(fn, "output_splits", output_splits, len(xs))
    plans = []
    for gi, group in enumerate(groups):
        ndim = xs[group[0]].dim()
        _check_group(fn, xs, group, gi, tuple(range(ndim)), "every rank needs the same ndim")
        split = _norm_dim(fn, "split_dim", split_dim, ndim)
        concat = _norm_dim(fn, "concat_dim", concat_dim, ndim)
        sizes = _a2a_sizes(fn, xs, group, gi, split, per_rank)
        _a2a_check(fn, xs, group, split, concat, sizes, wanted)
        plans.append((split, concat, sizes))
    rows = []
    for group, (split, concat, sizes) in zip(groups, plans):
        blocks = [[xs[src].narrow(split, at, s) for at, s in zip(accumulate(row, initial=0), row)]
                  for src, row in zip(group, sizes)]
        moved = [[_nbytes(b) for b in row] for row in blocks]
        calls = [Wire("all_to_all", len(group), j, sum(moved[j]), sum(row[j] for row in moved),
                      tuple(moved[j]), tuple(row[j] for row in moved))
                 for j in range(len(group))]
        rows.append([(torch.cat([row[j] for row in blocks], dim=concat), w.sent, w.received)
                     for j, w in enumerate(calls)])
    return _result(xs, groups, rows)


def _permute_pairs(fn: str, pairs: Sequence[Sequence[int]] | None, shift: int | None,
                   g: int, gi: int) -> tuple[tuple[int, int], ...]:
    if shift is not None:
        return tuple((i, (i + shift) % g) for i in range(g))
    assert pairs is not None, "collective_permute checks that pairs or shift is given"
    for k, pair in enumerate(pairs):
        if not (isinstance(pair, Sequence) and len(pair) == 2
                and all(_is_int(p) and 0 <= p < g for p in pair)):
            raise MeshAxisError(f"{fn}: pair {pair!r} is not (src, dst) with positions in"
                                f" 0..{g - 1} of groups[{gi}]; pairs name positions within a"
                                " group, not global ranks")
        if any(q[1] == pair[1] for q in pairs[:k]):
            raise ShapeError(f"{fn}: position {pair[1]} is the destination of more than one"
                             f" pair in {list(pairs)}; each position may receive once")
    return tuple((src, dst) for src, dst in pairs)


def collective_permute(xs: Sequence[Tensor], groups: Groups,
                       pairs: Sequence[Sequence[int]] | None = None, *,
                       shift: int | None = None) -> SimResult:
    """Position dst gets a copy of position src's tensor for each (src, dst) in `pairs`.

    `shift=k` means pairs (i, (i + k) % g). Positions are within each group; each dst at
    most once. A position that receives nothing gets `torch.zeros_like` its input (as
    jax.lax.ppermute; torch's funcol.permute_tensor instead returns 0 rows along dim 0
    there, since it is an all_to_all_single with zero output splits). Bytes: per pair, src
    sends its tensor's bytes and dst receives them; a pair (i, i) moves 0 bytes.

    >>> r = collective_permute([torch.tensor([1.0]), torch.tensor([2.0])], [(0, 1)], [(0, 1)])
    >>> [o.tolist() for o in r.outputs], r.send_bytes, r.recv_bytes
    ([[0.0], [1.0]], (4, 0), (0, 4))
    """
    fn = "collective_permute"
    xs, groups = _prepare(fn, xs, groups)
    if (pairs is None) == (shift is None) or not (shift is None or _is_int(shift)):
        raise ShapeError(f"{fn}: give exactly one of pairs=[(src, dst), ...] or shift=k (an"
                         f" int), got pairs={pairs!r}, shift={shift!r}")
    plans = []
    for gi, group in enumerate(groups):
        _check_group(fn, xs, group, gi, free=None)
        plans.append(_permute_pairs(fn, pairs, shift, len(group), gi))
    rows = []
    for group, plan in zip(groups, plans):
        send, got = [0] * len(group), dict[int, tuple[Tensor, int]]()
        for src, dst in plan:
            moved = 0 if src == dst else _nbytes(xs[group[src]])
            send[src] += moved
            got[dst] = (xs[group[src]].clone(), moved)
        idle = [got.get(p, (torch.zeros_like(xs[r]), 0)) for p, r in enumerate(group)]
        rows.append([(out, s, recv) for (out, recv), s in zip(idle, send)])
    return _result(xs, groups, rows)


def broadcast(xs: Sequence[Tensor], groups: Groups, src: int = 0) -> SimResult:
    """Every member gets a copy of the tensor at group position `src`.

    Bytes model a pipelined chain from the root in group order (src, src+1, ..., wrapping):
    every member but the last in the chain sends L bytes, every member but the root
    receives L.

    >>> r = broadcast([torch.ones(2), torch.zeros(2), torch.zeros(2)], [(0, 1, 2)], src=1)
    >>> r.outputs[2].tolist(), r.send_bytes, r.recv_bytes
    ([0.0, 0.0], (0, 8, 8), (8, 0, 8))
    """
    xs, groups = _prepare("broadcast", xs, groups)
    for gi, group in enumerate(groups):
        _check_group("broadcast", xs, group, gi)
        if not _is_int(src) or not 0 <= src < len(group):
            raise MeshAxisError(
                f"broadcast: src={src!r} is not a position of groups[{gi}] = {group}"
                f" (0..{len(group) - 1}); src is a position within the group, not a rank")
    rows = []
    for group in groups:
        root, last, size = xs[group[src]], (src - 1) % len(group), _nbytes(xs[group[src]])
        rows.append([(root.clone(), 0 if p == last else size, 0 if p == src else size)
                     for p in range(len(group))])
    return _result(xs, groups, rows)


@dataclass(frozen=True, slots=True)
class SendRecvResult:
    """Blocks each rank received (in transfer order) and the bytes each rank moved.

    To extend a trace: `trace.then(SimResult(outputs, r.send_bytes, r.recv_bytes))`.

    >>> r = send_recv([torch.arange(4.0), torch.zeros(1)], [Transfer(0, 1, ((1, 2),))])
    >>> r.received[1][0].tolist(), r.send_bytes, r.recv_bytes
    ([1.0, 2.0], (8, 0), (0, 8))
    """

    received: tuple[tuple[Tensor, ...], ...]
    send_bytes: tuple[int, ...]
    recv_bytes: tuple[int, ...]


def send_recv(xs: Sequence[Tensor], transfers: Sequence[Transfer]) -> SendRecvResult:
    """Point-to-point copies: for each Transfer, rank `dst` receives the block of `xs[src]` at
    per-dim positions `src_index` (one tuple of positions per dim; `dst_index` is not used).

    `Transfer` is the plan's own (`meshcomm.planner.Transfer`). Bytes: src sends the block's
    bytes and dst receives them; src == dst moves 0 bytes.

    >>> r = send_recv([torch.ones(2), torch.zeros(2)], [Transfer(0, 0, ((0, 1),)),
    ...                                                 Transfer(0, 1, ((0, 1),))])
    >>> len(r.received[0]), r.send_bytes, r.recv_bytes
    (1, (8, 0), (0, 8))
    """
    xs = _prepare("send_recv", xs)[0]
    for k, t in enumerate(transfers):
        if not isinstance(t, Transfer) or not all(
                _is_int(r) and 0 <= r < len(xs) for r in (t.src, t.dst)):
            raise MeshAxisError(f"send_recv: transfers[{k}] = {t!r} is not a Transfer between"
                                f" ranks of xs (0..{len(xs) - 1})")
        shape = tuple(xs[t.src].shape)
        if len(t.src_index) != len(shape) or not all(
                all(_is_int(i) and 0 <= i < n for i in ix) for ix, n in zip(t.src_index, shape)):
            raise ShapeError(f"send_recv: transfers[{k}] = {t} does not index rank {t.src}'s"
                             f" tensor of shape {shape}: src_index needs one tuple of positions"
                             f" per dim ({len(shape)}), each in 0..size-1")
    received: list[list[Tensor]] = [[] for _ in xs]
    send, recv = [0] * len(xs), [0] * len(xs)
    for t in transfers:
        block = take(xs[t.src], t.src_index)
        received[t.dst].append(block)
        if t.src != t.dst:
            send[t.src] += _nbytes(block)
            recv[t.dst] += _nbytes(block)
    return SendRecvResult(tuple(tuple(b) for b in received), tuple(send), tuple(recv))
