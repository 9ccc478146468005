"""Padded rows: a bucket of plans run on one flat buffer, the way FSDP2 runs a unit.

Executor layer, part of the engine (`prepare(..., pad_rows=True)`). A plan fits when its
first step gathers (all_gather) or scatters (reduce_scatter) one dim of the local tensor
over one group in `torch.chunk` rows (position p holds rows p*pad .. of that dim, the last
positions fewer or none), and every further step is an all_reduce of the scattered shard
(HSDP's replicas). FSDP2 splits dim 0; a recipe may split another (a row-parallel weight
stored "(tp mlp) (fsdp embed)"): its rows are then `outer` runs of rows, one per index of
the dims before. Each plan's shard is padded to the longest position's rows and the
bucket's shards lie side by side in one buffer:

- gather: one `_foreach_copy_` of every shard into its place (casting to the plan's dtype:
  mixed precision's copy-in), one all_gather; each output is its rows of the gathered
  buffer, the padding dropped.
- scatter: one pad per short plan and one concatenation (each position's chunks side by
  side), one reduce_scatter, then one all_reduce per further step on the flat shard; each
  output is its rows of the reduced buffer (a view), an avg divided once for the bucket.

Everything a step needs is a number fixed here at prepare time (`Rows`), so issuing costs a
few tensor ops per plan whatever the group size. Bytes are those the calls measure
(`Wire`): the padding travels, as in FSDP2.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.reduce_ops import chunk_sizes, divide
from ...planner.values import Plan
from ..steps import Wire
from . import wire
from .groups import Groups
from .handlers import ByteTrace, Later, Out, group_of

FIRST = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Item:
    """One plan's place in the buffer: this position's rows, the longest position's rows
    (`pad`), the elements of a row, the rows gathered, this rank's shapes, and the runs of
    rows (`outer`: the product of the dims before the split one; 1 for dim 0)."""

    rows: int
    pad: int
    inner: int
    total: int
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...]
    outer: int = 1
    n: int = 1                     # positions along the axis
    size: int = field(init=False)  # the item's elements in one position's part of the buffer
    cut: bool = field(init=False)  # the gathered rows are fewer than n * pad (padding to drop)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", self.outer * self.pad * self.inner)
        object.__setattr__(self, "cut", self.total != self.n * self.pad)


@dataclass(frozen=True)
class Rows:
    """A bucket's padded-rows layout on this rank, fixed at prepare time."""

    kinds: tuple[str, ...]              # per step: all_gather | reduce_scatter, all_reduce..
    ops: tuple[str, ...]                # per step: the plan's op ("" for a gather)
    axes: tuple[tuple[str, ...], ...]   # per step: its axes (for the byte trace)
    groups: tuple[wire.Group, ...]      # per step: this rank's group
    items: tuple[Item, ...]
    offsets: tuple[int, ...]            # where each item starts in one position's part
    width: int                          # one position's padded elements
    short: bool                         # some item of this position is shorter than its pad
    dtype: torch.dtype
    gather: bool = field(init=False)    # the first step gathers (else it scatters)
    n: int = field(init=False)          # positions of the first step's group
    div: int = field(init=False)        # what the output is divided by (avg steps)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gather", self.kinds[0] == "all_gather")
        object.__setattr__(self, "n", self.groups[0].size)
        object.__setattr__(self, "div", math.prod(
            g.size for g, op in zip(self.groups, self.ops) if op == "avg"))

    def wires(self) -> list[Wire]:
        """Each call's `Wire` on this rank, as the call will measure it (elements)."""
        w, out = self.width, []
        for kind, g in zip(self.kinds, self.groups):
            if kind == "all_gather":
                out.append(Wire(kind, g.size, g.pos, w, g.size * w))
            elif kind == "reduce_scatter":
                out.append(Wire(kind, g.size, g.pos, g.size * w, w))
            else:
                out.append(Wire(kind, g.size, g.pos, w, w))
        return out


def misfit(plan: Plan) -> str | None:
    """Why `plan` cannot run as padded rows, or None when it can."""
    steps = plan.steps
    if not steps or steps[0].kind not in FIRST:
        return "its first step is not an all_gather or a reduce_scatter"
    first = steps[0]
    if len(first.axes) != 1:
        return f"its {first.kind} runs over {len(first.axes)} axes, not one"
    if any(s.kind != "all_reduce" for s in steps[1:]):
        return "a step after the first is not an all_reduce"
    if first.kind == "all_gather" and len(steps) > 1:
        return "it gathers, then reduces"
    if split_dim(plan) is None:
        return (f'its {first.kind} does not move the rows of one dim ("{first.before}" ->'
                f' "{first.after}")')
    return None


def split_dim(plan: Plan) -> int | None:
    """The dim whose rows the plan's first step gathers or scatters (its axis the dim's most
    minor split), or None."""
    first = plan.steps[0]
    whole, part = ((first.after, first.before) if first.kind == "all_gather"
                   else (first.before, first.after))
    whole, part = whole.without_reduction(), part.without_reduction()
    return next((d for d in range(whole.ndim) if whole.split(d, first.axes[0]) == part), None)


def rows_of(plans: Sequence[Plan], bound: Groups) -> Rows:
    """The padded-rows layout of `plans` on `bound`'s rank (every plan must fit: `misfit`,
    and share its step kinds, axes, ops and dtype with the first)."""
    first = plans[0]
    kinds = tuple(s.kind for s in first.steps)
    axes = tuple(s.axes for s in first.steps)
    ops = tuple(s.op or "" for s in first.steps)
    mesh, rank = bound.mesh, bound.rank
    items = []
    for i, p in enumerate(plans):
        why = misfit(p)
        if why is None and (tuple(s.kind for s in p.steps), tuple(s.axes for s in p.steps),
                            tuple(s.op or "" for s in p.steps), p.dtype) != (
                                kinds, axes, ops, first.dtype):
            why = "its steps or dtype differ from those of the bucket's first plan"
        if why is not None:
            raise ValueError(f"prepare(pad_rows=True): plan {i} (\"{p.src}\" -> \"{p.dst}\")"
                             f" cannot run as padded rows: {why}. fix: prepare it without"
                             " pad_rows")
        s, d = p.steps[0], split_dim(p)
        assert d is not None, "a plan that fits has a split dim"
        whole = s.after if s.kind == "all_gather" else s.before
        full = whole.local_shape(mesh, p.shape, rank)
        members, pos = group_of(mesh, rank, s.axes)
        sizes = chunk_sizes(full[d], len(members))
        shard = (*full[:d], sizes[pos], *full[d + 1:])
        shape_in, shape_out = (shard, full) if s.kind == "all_gather" else (full, shard)
        if s.before.local_shape(mesh, p.shape, rank) != shape_in or \
                s.after.local_shape(mesh, p.shape, rank) != shape_out:
            raise ValueError(f"prepare(pad_rows=True): plan {i} (\"{p.src}\" -> \"{p.dst}\")"
                             f" does not cut dim 0 in torch.chunk rows on rank {rank}")
        items.append(Item(sizes[pos], max(sizes, default=0), math.prod(full[d + 1:]), full[d],
                          shape_in, shape_out, math.prod(full[:d]), len(members)))
    sizes_ = [it.size for it in items]
    groups = []
    for ax in axes:
        members, pos = group_of(mesh, rank, ax)
        groups.append(wire.Group(bound.group_name(ax), len(members), pos))
    return Rows(kinds, ops, axes, tuple(groups), tuple(items),
                tuple([0, *itertools.accumulate(sizes_)][:-1]), sum(sizes_),
                any(it.rows < it.pad for it in items), first.dtype)


def issue(rows: Rows, xs: Sequence[Tensor], k: int, state: Out | None,
          trace: ByteTrace | None) -> Later:
    """Step `k` of the bucket: from its inputs `xs` (k = 0) or the landed flat buffer of
    step k - 1 (`state`), in flight. The last step's lands as the list of every item's
    output, the others' as the flat buffer."""
    kind, group = rows.kinds[k], rows.groups[k]
    if k == 0:
        buf = _gather_in(rows, xs) if rows.gather else _scatter_in(rows, xs)
    else:
        assert isinstance(state, Later), "a later step of padded rows follows a collective"
        buf = state.result()
    if kind == "all_gather":
        out, call = wire.all_gather(buf, group, wait=False)
    elif kind == "reduce_scatter":
        out, call = wire.reduce_scatter(buf, _op(rows.ops[k]), group, wait=False)
    else:
        out, call = wire.all_reduce(buf, _op(rows.ops[k]), group, wait=False)
    if trace is not None:
        trace.add(kind, rows.axes[k], call.sent * buf.element_size(),
                  call.received * buf.element_size())
    if k + 1 < len(rows.kinds):
        return Later((out,), _flat)
    return Later((out,), functools.partial(_gather_out if rows.gather else _scatter_out,
                                           rows))  # type: ignore[arg-type]


def _op(op: str) -> str:
    return "sum" if op in ("", "avg") else op


def _flat(y: Tensor) -> Tensor:
    return y


def _gather_in(rows: Rows, xs: Sequence[Tensor]) -> Tensor:
    """Every shard copied (and cast) into its place of one buffer, in one op."""
    buf = torch.empty(rows.width, dtype=rows.dtype, device=xs[0].device)
    if rows.short:               # some shard of this rank is short: zero its padding
        buf.zero_()
    # dim 0: a prefix of the item's part; another dim: `outer` runs of rows, each padded
    srcs, dsts = [], []
    for it, o, x in zip(rows.items, rows.offsets, xs):
        if it.outer == 1:
            srcs.append(x.reshape(-1))
            dsts.append(buf[o:o + it.rows * it.inner])
        else:
            srcs.append(x.reshape(it.outer, it.rows, it.inner))
            dsts.append(buf[o:o + it.size].view(it.outer, it.pad, it.inner)[:, :it.rows])
    torch._foreach_copy_(dsts, srcs)
    return buf


def _gather_out(rows: Rows, y: Tensor) -> list[Tensor]:
    """Each item's gathered rows (views of the buffer where the item is alone and even)."""
    n = rows.n
    flat = y.view(n, rows.width)
    out = []
    for it, off in zip(rows.items, rows.offsets):
        if it.outer == 1:
            block = flat[:, off:off + it.size].reshape(n * it.pad, it.inner)
            out.append((block[:it.total] if it.cut else block).view(it.shape_out))
            continue
        # (n, outer, pad, inner) -> (outer, n * pad, inner)
        block = flat[:, off:off + it.size].view(n, it.outer, it.pad, it.inner) \
            .transpose(0, 1).reshape(it.outer, n * it.pad, it.inner)
        out.append((block[:, :it.total] if it.cut else block).reshape(it.shape_out))
    return out


def _scatter_in(rows: Rows, xs: Sequence[Tensor]) -> Tensor:
    """Each position's chunks side by side: a pad per short item, one concatenation."""
    n, columns = rows.n, []
    for it, x in zip(rows.items, xs):
        if it.outer == 1:
            flat = x.reshape(-1)
            if it.cut:
                flat = F.pad(flat, (0, (n * it.pad - it.total) * it.inner))
            columns.append(flat.view(n, it.size))
            continue
        block = x.reshape(it.outer, it.total, it.inner)
        if it.cut:
            block = F.pad(block, (0, 0, 0, n * it.pad - it.total))
        columns.append(block.view(it.outer, n, it.pad, it.inner).transpose(0, 1)
                       .reshape(n, it.size))
    return torch.cat(columns, dim=1).reshape(-1)


def _scatter_out(rows: Rows, y: Tensor) -> list[Tensor]:
    """Each item's rows of the reduced buffer (views), an avg divided once for the bucket."""
    if rows.div != 1:
        y = y.div_(rows.div) if y.is_floating_point() else divide(y, rows.div)
    return [y[off:off + it.rows * it.inner].view(it.shape_out) if it.outer == 1
            else y[off:off + it.size].view(it.outer, it.pad, it.inner)[:, :it.rows]
            .reshape(it.shape_out) for it, off in zip(rows.items, rows.offsets)]
