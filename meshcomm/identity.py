"""The identity element of each reduction op, as a tensor: what a rank holds for a value it
does not own in a pending reduction. Pure torch, no communication."""

from __future__ import annotations

import torch
from torch import Tensor


def identity_like(x: Tensor, op: str) -> Tensor:
    """What a rank holds where it does not own the value: the identity of `op`."""
    if op in ("sum", "avg"):
        return torch.zeros_like(x)
    if x.dtype.is_floating_point:
        return torch.full_like(x, float("-inf") if op == "max" else float("inf"))
    if x.dtype == torch.bool:
        return torch.full_like(x, op == "min")
    info = torch.iinfo(x.dtype)
    return torch.full_like(x, info.min if op == "max" else info.max)
