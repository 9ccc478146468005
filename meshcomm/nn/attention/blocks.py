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

from ...core.positions import as_positions


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

    def skips(self, qpos: Sequence[int], kpos: Sequence[int]) -> bool:
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


    def sees_all(self, qpos: Sequence[int], kpos: Sequence[int]) -> bool:
        """True when every query of `qpos` sees every key of `kpos` by position (host-side
        integers only)."""
        if not qpos or not kpos or min(qpos) < 0 or min(kpos) < 0:
            return False
        if self.causal and max(kpos) > min(qpos):
            return False
        if self.window is not None:
            if max(qpos) - min(kpos) >= self.window:
                return False
            if not self.causal and max(kpos) - min(qpos) >= self.window:
                return False
        return True

    def kind(self, qpos: Sequence[int], kpos: Sequence[int], docs: bool = False) -> str | None:
        """How queries at `qpos` see keys at `kpos`, from positions alone (host integers):
        None when none sees any (the block is skipped); "whole": every pair; "causal": the
        causal triangle of a run of positions against itself (the fused kernel skips the
        tiles above the diagonal); "masked": a mask decides. With document ids (`docs`)
        every block seen at all is masked."""
        if self.skips(qpos, kpos):
            return None
        if docs:
            return "masked"
        if self.sees_all(qpos, kpos):
            return "whole"
        if self.causal and self.window is None and _same(qpos, kpos) and _is_run(qpos):
            return "causal"
        return "masked"

    def seen(self, qpos: Sequence[int], kpos: Sequence[int], qdoc: Tensor | None,
             kdoc: Tensor | None, device: torch.device) -> Seen | None:
        """`kind` as `block` takes it: None (skipped), else `(allowed, causal)`:
        `(None, False)` every pair, `(None, True)` the causal triangle, else the boolean
        mask."""
        found = self.kind(qpos, kpos, qdoc is not None and kdoc is not None)
        if found is None:
            return None
        if found != "masked":
            return None, found == "causal"
        return self.allowed(torch.tensor(qpos, dtype=torch.long, device=device),
                            torch.tensor(kpos, dtype=torch.long, device=device),
                            qdoc, kdoc), False


Seen = tuple[Tensor | None, bool]      # `Mask.seen`: (the mask, or None; aligned causal)


def _is_run(pos: Sequence[int]) -> bool:
    """True when `pos` is one run of consecutive positions, ascending."""
    return len(pos) > 0 and as_positions(pos) == range(pos[0], pos[0] + len(pos))


def _same(a: Sequence[int], b: Sequence[int]) -> bool:
    return a == b if isinstance(a, range) and isinstance(b, range) else tuple(a) == tuple(b)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, the log-sum-exp and merges are kept in: float64 for float64 inputs,
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# torch's fused CPU attention (flash-style tiles; returns the log-sum-exp): the block math on
# CPU. Elsewhere (CUDA, meta) the blocks are plain tensor ops.
_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q: Tensor, k: Tensor) -> bool:
    """Whether the fused CPU kernel runs this block (it cannot take empty tensors)."""
    return q.device.type == "cpu" and q.numel() > 0 and k.numel() > 0


def _bias(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The additive mask the fused kernel takes: 0 where allowed, -inf elsewhere."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, float("-inf"))


def _repeated(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k and v with their heads repeated to q's (GQA)."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and hk:
        return k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    return k, v


def _triangle(q: Tensor, k: Tensor) -> Tensor:
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()


def block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float,
          causal: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of queries `q` (b, hq, sq, d) over keys `k` and values `v` (b, hk, sk, d)
    where `allowed` (broadcast to (b, hq, sq, sk); None: every pair; `causal`: the block
    against itself, `Mask.seen`); out in the compute dtype, lse (b, hq, sq). A query that
    sees no key gets out 0 and lse -inf (it merges as nothing)."""
    dt = compute_dtype(q.dtype)
    k, v = _repeated(q, k, v)
    if _fused(q, k):
        out, lse = _FUSED(q.to(dt), k.to(dt), v.to(dt), 0.0, causal,
                          attn_mask=_bias(allowed, dt), scale=scale)
        if allowed is not None:       # the kernel gives a query that sees nothing lse 0
            lse = lse.masked_fill(~allowed.any(-1), float("-inf"))
        return out, lse
    if causal:
        allowed = _triangle(q, k)
    scores = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    if allowed is not None:
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


def block_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor,
                delta: Tensor, allowed: Tensor | None, scale: float, causal: bool = False
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, in the compute dtype, from the whole attention's `out`,
    `lse` (b, hq, sq) and `delta` = sum(dout * out, -1): the probabilities recomputed, as
    flash attention's backward. GQA: dk and dv summed over the query heads of each key
    head. `allowed` and `causal` as `block` takes them."""
    dt = compute_dtype(q.dtype)
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk if hk else 1      # a rank may hold no heads (ulysses, uneven)
    kr, vr = _repeated(q, k.to(dt), v.to(dt))
    qd, dod = q.to(dt), dout.to(dt)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    if _fused(q, k):
        dq, dk, dv = _FUSED_BACKWARD(dod, qd, kr, vr, out.to(dt), safe, 0.0, causal,
                                     attn_mask=_bias(allowed, dt), scale=scale)
    else:
        if causal:
            allowed = _triangle(q, k)
        scores = torch.matmul(qd, kr.transpose(-1, -2)) * scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.exp(scores - safe[..., None])
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
    out = _Chunked.apply(q, k, v, mask, scale, as_positions(qpos), as_positions(kpos), qdoc, kdoc,
                         max(1, chunk))  # type: ignore[no-untyped-call]
    return cast(Tensor, out)


def key_blocks(mask: Mask, qpos: Sequence[int], kpos: Sequence[int], chunk: int,
               fused: bool = True, docs: bool = False) -> list[tuple[int, int, str]]:
    """(start, stop, `Mask.kind`) of each block of keys some query sees by position (the
    others skipped): blocks of `chunk` keys. For the fused kernel (flash tiles: no scores of
    queries x keys are kept), the queries' own run of positions among the keys is one block
    (the causal triangle, no mask) and neighbouring blocks every query sees whole are one
    block (no mask); the plain math keeps `chunk`. Host integers only: what `chunked`
    computes and what `timing` counts."""
    cuts = set(range(0, len(kpos), chunk)) | {len(kpos)}
    if fused and _is_run(qpos) and _is_run(kpos):
        at = qpos[0] - kpos[0]
        if 0 <= at and at + len(qpos) <= len(kpos):
            cuts = {c for c in cuts if not at < c < at + len(qpos)} | {at, at + len(qpos)}
    edges = sorted(cuts)
    out: list[tuple[int, int, str]] = []
    for c0, c1 in zip(edges, edges[1:]):
        found = mask.kind(qpos, kpos[c0:c1], docs)
        if found is None:
            continue
        if fused and found == "whole" and out and out[-1][2] == "whole" and out[-1][1] == c0:
            out[-1] = (out[-1][0], c1, "whole")
        else:
            out.append((c0, c1, found))
    return out


def _blocks(mask: Mask, qpos: Sequence[int], kpos: Sequence[int], qdoc: Tensor | None,
            kdoc: Tensor | None, chunk: int, device: torch.device, fused: bool = True
            ) -> Iterator[tuple[int, int, Tensor | None, bool]]:
    """(start, stop, allowed, causal) of each of `key_blocks`, its mask built where it
    takes one, for forward and backward alike."""
    docs = qdoc is not None and kdoc is not None
    for c0, c1, found in key_blocks(mask, qpos, kpos, chunk, fused, docs):
        if found != "masked":
            yield c0, c1, None, found == "causal"
            continue
        yield c0, c1, mask.allowed(torch.tensor(qpos, dtype=torch.long, device=device),
                                   torch.tensor(kpos[c0:c1], dtype=torch.long, device=device),
                                   qdoc, None if kdoc is None else kdoc[:, c0:c1]), False


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float,
                qpos: Sequence[int], kpos: Sequence[int], qdoc: Tensor | None,
                kdoc: Tensor | None, chunk: int) -> Tensor:
        dt = compute_dtype(q.dtype)
        out = q.new_zeros(q.shape, dtype=dt)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=dt)
        for c0, c1, allowed, causal in _blocks(mask, qpos, kpos, qdoc, kdoc, chunk, q.device,
                                               _fused(q, k)):
            o, s = block(q, k[:, :, c0:c1], v[:, :, c0:c1], allowed, scale, causal)
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
        for c0, c1, allowed, causal in _blocks(mask, qpos, kpos, qdoc, kdoc, chunk, q.device,
                                               _fused(q, k)):
            gq, gk, gv = block_grads(q, k[:, :, c0:c1], v[:, :, c0:c1], dout, out, lse, delta,
                                     allowed, scale, causal)
            dq += gq
            dk[:, :, c0:c1] = gk
            dv[:, :, c0:c1] = gv
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None,
                None, None, None)
