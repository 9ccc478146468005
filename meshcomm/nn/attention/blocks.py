"""Attention of one block of queries against one block of keys, located by their global
token positions; the merge of partial results by their log-sum-exp. Pure tensor math: no
communication, no mesh. Every strategy (`strategies.py`) is these two functions applied to
the blocks a rank holds or receives.

Tensors are in the canonical order `b h s d` (batch, heads, sequence, head dim). Keys and
values may have fewer heads than queries (GQA: query head i reads key head i // (hq / hk)).
Positions are the global indices of the tokens along the sequence (a negative position is
padding: no query sees it). The log-sum-exp is kept in float32 at least (float64 inputs:
float64), so merging blocks in any order gives the softmax over their union.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor


@dataclass(frozen=True)
class Mask:
    """Which keys a query sees, from positions alone: `causal` (keys at or before the
    query), `window` (keys fewer than `window` positions away: before the query when
    causal, on either side otherwise); document ids, when given, also confine a query to
    its own document.

    >>> Mask(causal=True, window=4)
    Mask(causal=True, window=4)
    """

    causal: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"attention: window={self.window!r}; expected a positive int (the"
                             " number of positions a query sees, itself included)")

    def allowed(self, qpos: Tensor, kpos: Tensor, qdoc: Tensor | None = None,
                kdoc: Tensor | None = None) -> Tensor:
        """(..., sq, sk) booleans: may query i see key j. `qpos` (sq,) and `kpos` (sk,) are
        positions; `qdoc` (b, sq) and `kdoc` (b, sk) document ids (the result is then
        (b, 1, sq, sk))."""
        q, k = qpos[:, None], kpos[None, :]
        ok = (k >= 0) & (q >= 0)
        if self.causal:
            ok = ok & (k <= q)
        if self.window is not None:
            ok = ok & ((q - k) < self.window)
            if not self.causal:
                ok = ok & ((k - q) < self.window)
        if qdoc is not None and kdoc is not None:
            ok = ok & (qdoc[:, None, :, None] == kdoc[:, None, None, :])
        return ok

    def skips(self, qpos: range | tuple[int, ...], kpos: range | tuple[int, ...]) -> bool:
        """True when no query of `qpos` sees a key of `kpos` by position (no document ids
        read): a block every strategy skips. Host-side integers only: no device sync."""
        if not qpos or not kpos:
            return True
        if self.causal and min(kpos) > max(qpos):
            return True
        if self.window is not None:
            if min(qpos) - max(kpos) >= self.window:
                return True
            if not self.causal and min(kpos) - max(qpos) >= self.window:
                return True
        return False


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, the log-sum-exp and merges are kept in: float64 for float64 inputs,
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float
          ) -> tuple[Tensor, Tensor]:
    """(out, lse) of queries `q` (b, hq, sq, d) over keys `k` and values `v` (b, hk, sk, d)
    where `allowed` (broadcast to (b, hq, sq, sk)); out in the compute dtype, lse (b, hq,
    sq). A query that sees no key gets out 0 and lse -inf (it merges as nothing)."""
    dt = compute_dtype(q.dtype)
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scores = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.matmul(p, v.to(dt)), lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention over the union of two key sets from each one's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse


def reference(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float | None = None,
              doc: Tensor | None = None) -> Tensor:
    """Whole-sequence attention in one process (`b h s d`, positions 0..s-1): what every
    strategy must equal. `doc` (b, s): document ids."""
    s_q, s_k = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = mask.allowed(torch.arange(s_q), torch.arange(s_k), doc, doc)
    out, _ = block(q, k, v, allowed.to(q.device), scale)
    return out.to(q.dtype)


def block_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
                allowed: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, in the compute dtype, from the whole attention's `lse`
    (b, hq, sq) and `delta` = sum(dout * out, -1): the probabilities recomputed, as flash
    attention's backward. GQA: dk and dv summed over the query heads of each key head."""
    dt = compute_dtype(q.dtype)
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk if hk else 1      # a rank may hold no heads (ulysses, uneven)
    kr, vr = k.to(dt), v.to(dt)
    if group > 1:
        kr, vr = kr.repeat_interleave(group, dim=1), vr.repeat_interleave(group, dim=1)
    qd, dod = q.to(dt), dout.to(dt)
    scores = torch.matmul(qd, kr.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dod)
    ds = p * (torch.matmul(dod, vr.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qd) * scale
    if group > 1:
        b, _, sk, d = dk.shape
        dk = dk.view(b, hk, group, sk, d).sum(2)
        dv = dv.view(b, hk, group, sk, d).sum(2)
    return dq, dk, dv


# -- many blocks of keys, flash-style: nothing of size queries x sequence is kept -----------
KEY_CHUNK = 4096      # keys per block of `chunked` (its scores: queries x this many)


def chunked(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float,
            qpos: Sequence[int], kpos: Sequence[int], qdoc: Tensor | None = None,
            kdoc: Tensor | None = None, chunk: int = KEY_CHUNK) -> Tensor:
    """The attention of queries `q` (b, hq, sq, d) at positions `qpos` over keys and values
    (b, hk, sk, d) at positions `kpos`, in the compute dtype, block by block of `chunk`
    keys: blocks no query sees by position are skipped, partial results merge by their
    log-sum-exp, and backward recomputes each block's probabilities from the saved q, out
    and lse (`block_grads`). Memory: queries x `chunk` scores at a time, never queries x
    keys. Differentiable in q, k and v."""
    out = _Chunked.apply(q, k, v, mask, scale, tuple(qpos), tuple(kpos), qdoc, kdoc,
                         max(1, chunk))  # type: ignore[no-untyped-call]
    return cast(Tensor, out)


def _blocks(mask: Mask, qpos: tuple[int, ...], kpos: tuple[int, ...], qdoc: Tensor | None,
            kdoc: Tensor | None, chunk: int, device: torch.device
            ) -> Iterator[tuple[int, int, Tensor]]:
    """(start, stop, allowed) of each block of `chunk` keys some query sees by position (the
    others skipped), for forward and backward alike."""
    qp = torch.tensor(qpos, dtype=torch.long, device=device)
    for c0 in range(0, len(kpos), chunk):
        c1 = min(c0 + chunk, len(kpos))
        if mask.skips(qpos, kpos[c0:c1]):
            continue
        kp = torch.tensor(kpos[c0:c1], dtype=torch.long, device=device)
        yield c0, c1, mask.allowed(qp, kp, qdoc, None if kdoc is None else kdoc[:, c0:c1])


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float,
                qpos: tuple[int, ...], kpos: tuple[int, ...], qdoc: Tensor | None,
                kdoc: Tensor | None, chunk: int) -> Tensor:
        dt = compute_dtype(q.dtype)
        out = q.new_zeros(q.shape, dtype=dt)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=dt)
        for c0, c1, allowed in _blocks(mask, qpos, kpos, qdoc, kdoc, chunk, q.device):
            o, s = block(q, k[:, :, c0:c1], v[:, :, c0:c1], allowed, scale)
            out, lse = merge(out, lse, o, s)
        ctx.args = (mask, scale, qpos, kpos, chunk)
        ctx.save_for_backward(q, k, v, out, lse, qdoc, kdoc)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, qdoc, kdoc = ctx.saved_tensors
        mask, scale, qpos, kpos, chunk = ctx.args
        dt = compute_dtype(q.dtype)
        delta = (dout.to(dt) * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=k.device)
        dv = torch.zeros(v.shape, dtype=dt, device=v.device)
        for c0, c1, allowed in _blocks(mask, qpos, kpos, qdoc, kdoc, chunk, q.device):
            gq, gk, gv = block_grads(q, k[:, :, c0:c1], v[:, :, c0:c1], dout, lse, delta,
                                     allowed, scale)
            dq += gq
            dk[:, :, c0:c1] = gk
            dv[:, :, c0:c1] = gv
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None,
                None, None, None)
