"""Losses over sharded logits: cross-entropy with the vocabulary split over a mesh axis.

`vocab_parallel_cross_entropy` takes this rank's shard of the logits, laid out as
"... (tp v)" (the last dim split over one mesh axis in contiguous `torch.chunk` pieces,
the rule meshcomm's layouts use for uneven dims), and never gathers them: per position it
reduces a max, a sum of exponentials and the target's logit over the axis, so each rank
sends O(positions) bytes whatever the vocabulary size. Backward is local. docs/losses.md.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..core.errors import MeshAxisError, MeshMismatchError, ShapeError, did_you_mean
from ..core.layout import chunk_range
from ..runtime.bind import BoundMesh, require_bound
from ..runtime.collectives import all_reduce, wait

__all__ = ["vocab_parallel_cross_entropy", "vocab_range"]

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FN = "vocab_parallel_cross_entropy"


def vocab_range(vocab_size: int, parts: int, position: int) -> tuple[int, int]:
    """[start, end) of the vocabulary held at `position` of `parts` along the split axis.

    The rule of the layout "... (tp v)": `torch.chunk` pieces of ceil(vocab_size / parts)
    classes, the last ones shorter (or empty) when `parts` does not divide `vocab_size`.

    >>> vocab_range(64, 4, 1)
    (16, 32)
    >>> [vocab_range(50257, 4, p) for p in range(4)]
    [(0, 12565), (12565, 25130), (25130, 37695), (37695, 50257)]
    >>> [vocab_range(5, 4, p) for p in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    if not _is_int(vocab_size) or vocab_size < 0:
        raise ShapeError(f"vocab_range: vocab_size={vocab_size!r} is not an int >= 0")
    if not _is_int(parts) or parts < 1:
        raise ShapeError(f"vocab_range: parts={parts!r} is not an int >= 1")
    if not _is_int(position) or not 0 <= position < parts:
        raise ShapeError(f"vocab_range: position={position!r} is not in 0..{parts - 1}")
    start, length = chunk_range(0, vocab_size, parts, position)
    return start, start + length


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, mesh: BoundMesh,
                                 axis: str = "tp", *, ignore_index: int = -100,
                                 reduction: Reduction = "mean",
                                 vocab_size: int | None = None) -> Tensor:
    """Cross-entropy of logits whose last (vocabulary) dim is split over mesh axis `axis`.

    `logits`: this rank's shard, shape (..., V_local), of global logits (..., V) in the
    layout "... (axis v)": the rank at position p along `axis` holds the classes
    `vocab_range(V, n, p)` (contiguous `torch.chunk` pieces). `target`: class indices of
    shape `logits.shape[:-1]`, any integer dtype, the same on every rank of the group.
    `vocab_size`: the global V; needed when the axis size n does not divide it (else V is
    n * V_local, and the ranks check that they agree). The result equals
    `F.cross_entropy(full.reshape(-1, V), target.reshape(-1), ignore_index=...,
    reduction=...)` on the gathered logits, and is the same on every rank of the group: a
    scalar for "mean" and "sum" ("mean" divides by the positions not ignored), shape
    `target.shape` for "none" (0 where ignored).

    Communication: two all_reduces over `axis` per call (max of (positions,) values, then
    the sum of a (2, positions) stack: exp-sums and target logits), none in backward.
    Backward gives softmax - onehot on this rank's classes, recomputed from the saved
    logits and the per-position max and exp-sum, scaled by the output gradient (and
    1/count for "mean"); rows of ignored positions are 0.

    Dtypes: float32 and float64 compute in their own dtype; bfloat16 and float16 logits
    compute the softmax pieces in float32 and return a float32 loss (F.cross_entropy
    would return the input dtype: `.to(logits.dtype)` if you need that); the logits'
    gradient has the logits' dtype.

    Errors (meshcomm errors, raised on every rank before any communication for inputs
    that agree across ranks): a non-BoundMesh `mesh` (MeshMismatchError), an unknown
    `axis` (MeshAxisError), a wrong dtype or shape of `logits`/`target`, a V_local that
    is not this rank's piece of `vocab_size`, an unknown `reduction`, and targets outside
    [0, V) other than `ignore_index` (ShapeError). Without `vocab_size`, unequal V_local
    across the group and out-of-range targets are found after the first all_reduce, and
    every rank raises the same ShapeError. On a GPU the target check is a device-side
    assert (no host sync, as F.cross_entropy's), and `vocab_size` spares the one host read
    that inferring V takes.

    >>> bound = mc.init_mesh("tp=4")                                    # doctest: +SKIP
    >>> lo, hi = vocab_range(50257, 4, bound.coords["tp"])               # doctest: +SKIP
    >>> loss = vocab_parallel_cross_entropy(full[..., lo:hi], target, bound, "tp",
    ...                                     vocab_size=50257)            # doctest: +SKIP
    >>> loss.backward()                                                  # doctest: +SKIP
    """
    n, pos, vocab, checked = _check_args(logits, target, mesh, axis, ignore_index, reduction,
                                         vocab_size)
    out: Tensor = _VocabParallelCE.apply(  # type: ignore[no-untyped-call]
        logits, target, mesh, axis, n, pos, vocab, checked, ignore_index, reduction)
    return out


# ---- checks, all local -----------------------------------------------------------------------

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_args(logits: object, target: object, mesh: object, axis: object,
                ignore_index: object, reduction: object,
                vocab_size: object) -> tuple[int, int, int | None, bool]:
    """(axis size, this rank's position, global V or None, whether the targets are checked)."""
    bound = require_bound(mesh, _FN)
    m = bound.mesh
    if not isinstance(axis, str):
        raise MeshAxisError(f"{_FN}: axis={axis!r} must name one mesh axis of {m!r}, e.g."
                            f' "{m.axis_names[-1]}"; the vocabulary is split over one axis')
    if axis not in m.axis_names:
        hint = did_you_mean(axis, m.axis_names)
        raise MeshAxisError(f'{_FN}: axis="{axis}" is not an axis of {m!r}; axes are'
                            f" {', '.join(m.axis_names)}" + (f"\n  fix: {hint}" if hint else ""))
    if not bound.in_mesh:
        raise MeshMismatchError(f"{_FN}: rank {bound.rank} is not in {m!r}; only its ranks"
                                f" {list(m.ranks)} call it")
    if not isinstance(logits, Tensor):
        raise ShapeError(f"{_FN}: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, Tensor):
        raise ShapeError(f"{_FN}: target must be a torch.Tensor of class indices, got"
                         f" {type(target).__name__}; fix: torch.as_tensor(target)")
    if logits.dtype not in _FLOATS:
        raise ShapeError(f"{_FN}: logits has dtype {logits.dtype}; expected float16, bfloat16,"
                         " float32 or float64. fix: logits.float()")
    if logits.dim() < 1:
        raise ShapeError(f"{_FN}: logits is 0-d; expected shape (..., V_local) with the"
                         " vocabulary shard last")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ShapeError(f"{_FN}: target has dtype {target.dtype}; expected integer class"
                         " indices (class probabilities are not supported). fix: target.long()")
    lead = tuple(logits.shape[:-1])
    if tuple(target.shape) != lead:
        raise ShapeError(f"{_FN}: target has shape {tuple(target.shape)}, but logits of shape"
                         f" {tuple(logits.shape)} need target.shape == logits.shape[:-1] =="
                         f" {lead}. fix: one class index per position, vocabulary dim last")
    if target.device != logits.device:
        raise ShapeError(f"{_FN}: target is on {target.device} but logits on {logits.device};"
                         " fix: target.to(logits.device)")
    if not _is_int(ignore_index):
        raise ShapeError(f"{_FN}: ignore_index={ignore_index!r} is not an int")
    if reduction not in REDUCTIONS:
        hint = did_you_mean(str(reduction), REDUCTIONS)
        raise ShapeError(f"{_FN}: reduction={reduction!r}; expected one of"
                         f" {', '.join(REDUCTIONS)}" + (f"\n  fix: {hint}" if hint else ""))
    n, pos = m.axis_size(axis), bound.mesh.coords(bound.rank)[axis]
    local = logits.shape[-1]
    if vocab_size is None:
        return n, pos, None, False
    if not _is_int(vocab_size) or vocab_size < 1:  # type: ignore[operator]
        raise ShapeError(f"{_FN}: vocab_size={vocab_size!r} is not an int >= 1 (the global"
                         " number of classes)")
    vocab = int(vocab_size)  # type: ignore[call-overload]
    start, end = vocab_range(vocab, n, pos)
    if local != end - start:
        raise ShapeError(
            f'{_FN}: logits on rank {bound.rank} (position {pos} of {n} along "{axis}") has'
            f" {local} classes in its last dim, but vocab_size={vocab} split over {n} gives it"
            f" classes [{start}, {end}) ({end - start}). fix: pass this rank's shard"
            f" full_logits[..., {start}:{end}], or the global vocab_size")
    _check_targets(target, vocab, ignore_index)  # type: ignore[arg-type]
    return n, pos, vocab, True


def _check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Targets in [0, vocab) or equal to ignore_index. On the CPU a ShapeError; on a device
    an asynchronous device-side assert (as F.cross_entropy's), never a host sync."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), f"{_FN}: target holds class indices outside"
                            f" [0, {vocab}) that are not ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        first = target[bad].reshape(-1)[0].item()
        raise ShapeError(f"{_FN}: target holds {int(bad.sum())} class indices outside"
                         f" [0, {vocab}) (e.g. {first}) that are not ignore_index={ignore_index};"
                         " fix: clamp or mask them, or set them to ignore_index")


# ---- the function ----------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, bound: BoundMesh, axis: str, n: int,
                pos: int, vocab: int | None, checked: bool, ignore_index: int,
                reduction: str) -> Tensor:
        local = logits.shape[-1]
        rows = target.numel()
        cdtype = _compute_dtype(logits.dtype)
        x = logits.reshape(rows, local).to(cdtype)
        # 1. the max per position; without vocab_size, two more values: +-V_local
        local_max = (x.amax(dim=-1) if local else
                     torch.full((rows,), float("-inf"), dtype=cdtype, device=x.device))
        if vocab is None:
            sizes = torch.tensor([local, -local], dtype=cdtype, device=x.device)
            got = wait(all_reduce(torch.cat([local_max, sizes]), bound, axis, op="max"))
            most, neg_least = (int(v) for v in got[rows:].tolist())
            least = -neg_least
            if most != least:
                raise ShapeError(
                    f'{_FN}: the logits of the ranks of the group over "{axis}" hold from'
                    f" {least} to {most} classes (this rank {local}): the vocabulary is split"
                    f" unevenly, so its size cannot be inferred. fix: pass vocab_size=<the"
                    f" global V> on every rank")
            vocab = n * local
            if vocab < 1:
                raise ShapeError(f"{_FN}: logits have 0 classes on every rank of the group"
                                 f' over "{axis}"; expected (..., V_local) with V_local >= 1')
            if not checked:
                _check_targets(target, vocab, ignore_index)
            top = got[:rows]
        else:
            top = wait(all_reduce(local_max, bound, axis, op="max"))
        start, end = vocab_range(vocab, n, pos)
        # 2. one sum of a (2, rows) stack: the exp-sums and the target logits
        t = target.reshape(rows).long()
        valid = t != ignore_index
        owned = valid & (t >= start) & (t < end)
        index = torch.where(owned, t - start, 0)
        exp_sum = torch.exp(x - top.unsqueeze(-1)).sum(dim=-1)
        if local:
            picked = torch.where(owned, x.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
        else:
            picked = torch.zeros(rows, dtype=cdtype, device=x.device)
        sums = wait(all_reduce(torch.stack([exp_sum, picked]), bound, axis, op="sum"))
        total, z = sums[0], sums[1]
        # log_softmax at the target is (z - max) - log(sum); the loss is its negative
        per_row = torch.where(valid, torch.log(total) - (z - top), 0.0)
        count = valid.sum()
        if reduction == "mean":
            out = per_row.sum() / count
        elif reduction == "sum":
            out = per_row.sum()
        else:
            out = per_row.reshape(target.shape)
        ctx.save_for_backward(logits, top, total, index, owned, valid)
        ctx.reduction, ctx.count = reduction, count
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        logits, top, total, index, owned, valid = ctx.saved_tensors
        rows, local = top.shape[0], logits.shape[-1]
        cdtype = top.dtype
        x = logits.reshape(rows, local).to(cdtype)
        soft = torch.exp(x - top.unsqueeze(-1)) / total.unsqueeze(-1)
        if local:
            soft.scatter_add_(-1, index.unsqueeze(-1), -owned.to(cdtype).unsqueeze(-1))
        g = grad.to(cdtype)
        if ctx.reduction == "none":
            scale = g.reshape(rows)
        elif ctx.reduction == "mean":
            scale = (g / ctx.count).expand(rows)
        else:
            scale = g.expand(rows)
        out = soft.mul_(scale.unsqueeze(-1)).masked_fill_(~valid.unsqueeze(-1), 0.0)
        return (out.reshape(logits.shape).to(logits.dtype),
                None, None, None, None, None, None, None, None, None)
