"""The ring strategy: each rank keeps its queries; the key/value blocks pass around the
group of the sequence's axes, one hop (+1, in mesh order) per step, and each rank attends
its queries to every block as it arrives, merging the partial results by their
log-sum-exp (`blocks.merge`, in float32; float64 for float64 inputs).

Overlap: at each step the next block's exchange is posted (`post_shift`) before this
block's attention is computed, and waited after it. Blocks that no query of the rank
sees by position (`Mask.skips`: causal, window) are passed on but not computed.

Backward is the classic ring: the blocks pass around again; each rank recomputes a
block's probabilities from the saved q, out and log-sum-exp, adds to its own dq, and adds
its share of the block's dK/dV to a buffer that travels one step behind the block, in the
same message as the next block (one message a step: `Ring.exchange`); after the full
cycle the last buffer takes one more hop, to its block's owner. Saved: q, k, v, out and the
log-sum-exp (this rank's, never the sequence's). Uneven splits send each block at its true
size (every rank derives every block's size from the layout); an empty block is not sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ...core.mesh import AxisName
from ...runtime.collectives import Shifted, post_shift
from .blocks import Seen, block, block_grads, compute_dtype, merge
from .call import Call


@dataclass(frozen=True)
class Ring:
    """One call's ring on this rank: the sequence's axes in mesh order, their group's global
    ranks in that order, and this rank's position. At step t this rank holds the key/value
    block of position (pos - t) mod size."""

    call: Call
    axes: tuple[AxisName, ...]
    ranks: tuple[int, ...]
    pos: int

    @classmethod
    def of(cls, call: Call) -> Ring:
        axes = tuple(a for a in call.mesh.axis_names if a in call.seq_axes)
        ranks = call.mesh.members(call.bound.rank, *axes)
        return cls(call, axes, ranks, ranks.index(call.bound.rank))

    @property
    def size(self) -> int:
        return len(self.ranks)

    def kpos(self, step: int) -> Sequence[int]:
        """The global key positions of the block this rank holds at `step`."""
        owner = self.ranks[(self.pos - step) % self.size]
        return self.call.positions(self.call.kv_layout, self.call.kv_shape, owner)

    def qpos(self) -> Sequence[int]:
        return self.call.positions(self.call.q_layout, self.call.q_shape, self.call.bound.rank)

    def seen(self, step: int, qdoc: Tensor | None, kdoc: Tensor | None,
             device: torch.device) -> Seen | None:
        """How this rank's queries see the block of `step` (`Mask.seen`); None when no query
        sees a key of it by position (the block is skipped)."""
        return self.call.mask.seen(self.qpos(), self.kpos(step), qdoc, kdoc, device)

    def shape(self, step: int, like: Tensor) -> tuple[int, ...]:
        """`like` ((2, b, h, s, d): K and V, or dK and dV) at the length of `step`'s block."""
        return (*like.shape[:3], len(self.kpos(step)), like.shape[4])

    def shift(self, x: Tensor, shape: Sequence[int]) -> Shifted:
        """Post `x` to the next member and the receive of `shape` from the previous one.
        Compiled for a second batch size (Dynamo's automatic dynamic shapes), shapes hold
        SymInts, which `post_shift` refuses: the receive's shape is made ints here, a guard
        on sizes the call's plan guards on already (`Call`'s shapes are ints)."""
        return post_shift(x, self.call.bound, self.axes, shift=1,
                          recv_shape=tuple(int(n) for n in shape))

    def exchange(self, parts: Sequence[Tensor | None], expect: Sequence[Part | None]
                 ) -> Callable[[], list[Tensor | None]]:
        """Send `parts` (None: absent) to the next member in one message and receive the
        previous member's, whose parts have the shapes and dtypes of `expect` (None:
        absent); the function waits them. One message a step, never two to one peer: under
        torch.compile inductor orders independent sends by each rank's own graph, and the
        ranks' graphs differ by their skipped blocks. Several parts travel as bytes, each in
        place by its dtype (`_PACKING`: the widest items first, so every part starts
        aligned); a lone part as itself."""
        sent = [p for p in parts if p is not None]
        want = [(i, e) for i, e in enumerate(expect) if e is not None]
        if not sent:
            return lambda: [None] * len(expect)
        if len(sent) == 1:             # one part each way (the same on every member)
            got = self.shift(sent[0], want[0][1][0])

            def one() -> list[Tensor | None]:
                out: list[Tensor | None] = [None] * len(expect)
                out[want[0][0]] = got.wait()
                return out
            return one
        data = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in sent])
        sizes = [math.prod(shape) * _itemsize(dtype) for _, (shape, dtype) in want]
        both = self.shift(data, (sum(sizes),))

        def arrive() -> list[Tensor | None]:
            got = both.wait()
            out: list[Tensor | None] = [None] * len(expect)
            at = 0
            for (i, (shape, dtype)), n in zip(want, sizes):
                out[i] = got[at:at + n].view(dtype).view(shape)
                at += n
            return out
        return arrive

    def doc_part(self, doc: Tensor | None, step: int) -> Part | None:
        """The doc ids of the block of `step` as a received part (int64), or None."""
        return None if doc is None else ((doc.shape[0], len(self.kpos(step))), torch.int64)


Part = tuple[tuple[int, ...], torch.dtype]      # a part of a ring message: shape, dtype


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ring_attention(call: Call, q: Tensor, k: Tensor, v: Tensor, qdoc: Tensor | None,
                   kdoc: Tensor | None) -> Tensor:
    """This rank's attention output (in `q`'s layout) by the ring; `qdoc` / `kdoc`: the doc
    ids (b, s) of this rank's queries and keys, or None."""
    out = _RingAttention.apply(q, k, v, Ring.of(call), qdoc, kdoc)  # type: ignore[no-untyped-call]
    return cast(Tensor, out)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: Ring, qdoc: Tensor | None,
                kdoc: Tensor | None) -> Tensor:
        call = ring.call
        kv = torch.stack([call.canonical(k), call.canonical(v)])
        out, lse = _forward(ring, call.canonical(q), kv, qdoc, kdoc)
        y = call.user(out.to(q.dtype))
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, y, lse, qdoc, kdoc)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, y, lse, qdoc, kdoc = ctx.saved_tensors
        ring: Ring = ctx.ring
        call = ring.call
        kv = torch.stack([call.canonical(k), call.canonical(v)])
        dq, dkv = _backward(ring, call.canonical(q), kv, call.canonical(y), lse,
                            call.canonical(dy), qdoc, kdoc)
        return (call.user(dq.to(q.dtype)), call.user(dkv[0].to(k.dtype)),
                call.user(dkv[1].to(v.dtype)), None, None, None)


def _forward(ring: Ring, q: Tensor, kv: Tensor, qdoc: Tensor | None, kdoc: Tensor | None
             ) -> tuple[Tensor, Tensor]:
    """(out, lse) of queries `q` (b, hq, s, d) over every block, in the compute dtype;
    `kv` (2, b, hk, s, d) is this rank's block."""
    out: Tensor | None = None
    lse: Tensor | None = None
    kdoc = None if kdoc is None else kdoc.to(torch.int64)
    for step in range(ring.size):
        arriving = None
        if step + 1 < ring.size:           # the next block (and its doc ids) on its way
            arriving = ring.exchange([kdoc, kv], [ring.doc_part(kdoc, step + 1),
                                                  (ring.shape(step + 1, kv), kv.dtype)])
        seen = ring.seen(step, qdoc, kdoc, q.device)
        if seen is not None:
            o, s = block(q, kv[0], kv[1], seen[0], ring.call.scale, seen[1])
            out, lse = (o, s) if out is None or lse is None else merge(out, lse, o, s)
        if arriving is not None:
            kdoc, got = arriving()
            kv = cast(Tensor, got)
    if out is None or lse is None:          # no key seen: out 0, lse -inf (as `block`)
        dt = compute_dtype(q.dtype)
        return q.new_zeros(q.shape, dtype=dt), q.new_full(q.shape[:3], float("-inf"), dtype=dt)
    return out, lse


def _backward(ring: Ring, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
              qdoc: Tensor | None, kdoc: Tensor | None) -> tuple[Tensor, Tensor]:
    """(dq, dkv) in the compute dtype: dq of this rank's queries, dkv (2, b, hk, s, d) the
    gradient of this rank's keys and values, summed over every rank's queries. At each step
    one message goes to the next member: the next block (and its doc ids) and the dK/dV
    buffer of the block this rank computed at the step before, which the next member holds
    now; after the last step the last buffer takes one more hop, to its block's owner."""
    dt = compute_dtype(q.dtype)
    delta = (dout.to(dt) * out.to(dt)).sum(-1)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    kdoc = None if kdoc is None else kdoc.to(torch.int64)
    acc: Tensor | None = None                # the buffer of the block of the step before
    for step in range(ring.size):
        more = step + 1 < ring.size
        arriving = ring.exchange(
            [kdoc if more else None, acc, kv if more else None],
            [ring.doc_part(kdoc, step + 1) if more else None,
             (ring.shape(step, kv), dt) if step else None,
             (ring.shape(step + 1, kv), kv.dtype) if more else None])
        seen = ring.seen(step, qdoc, kdoc, q.device)
        grads = None
        if seen is not None:
            grads = block_grads(q, kv[0], kv[1], dout, out, lse, delta, seen[0],
                                ring.call.scale, seen[1])
            dq += grads[0]
        got = arriving()
        mine = got[1] if step else kv.new_zeros(kv.shape, dtype=dt)  # the ranks' before
        assert mine is not None
        if grads is not None:
            mine[0] += grads[1]
            mine[1] += grads[2]
        acc = mine
        if more:
            kdoc, kv = got[0], cast(Tensor, got[2])
    home = ring.exchange([acc], [(ring.shape(ring.size, kv), dt)])()[0]
    return dq, cast(Tensor, home)


def traffic(call: Call, dtype: torch.dtype) -> tuple[int, int, int]:
    """(bytes sent, extra bytes, point-to-point batches) of a forward and backward on this
    rank, doc ids aside. Sent: K and V of every block but the one that would come back,
    forward and again backward, and the dK/dV buffer of every block (compute dtype), each
    at its true size. Extra: two K/V blocks (the one computing, the one arriving) and two
    dK/dV buffers, of the largest block. Batches: size - 1 forward; backward one a step
    (the block and the buffer of the step before travel together) and the last buffer's
    hop home: size + 1 (2 size in all; torch's ring posts 3 size - 2)."""
    ring = Ring.of(call)
    if ring.size == 1:
        return 0, 0, 0
    item = torch.empty((), dtype=dtype).element_size()
    grad_item = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    mesh = call.mesh
    numel = [math.prod(call.kv_layout.local_shape(mesh, call.kv_shape,
                                                  ring.ranks[(ring.pos - step) % ring.size]))
             for step in range(ring.size)]
    sent = 2 * 2 * sum(numel[:-1]) * item + 2 * sum(numel) * grad_item
    extra = 2 * 2 * max(numel) * (item + grad_item)
    return sent, extra, 2 * ring.size
