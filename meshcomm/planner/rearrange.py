"""Rearrange: a local reshape-permute-reshape of one tensor, as a small value.

This module never communicates. Plans carry these values so that every
executor (simulated ranks, torch.distributed, eager or compiled) runs exactly
the same local data movement: split each dim into factors, permute the
factors, merge consecutive factors into the output dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class Rearrange:
    """Split dims into factors, permute them, merge runs of them into output dims.

    `split[d]` gives the factor sizes of input dim d (None: one factor, the
    dim's runtime size, for dims whose size differs between ranks). `perm`
    orders the flat factor list; `merge[k]` counts the permuted factors that
    form output dim k.

    >>> import torch
    >>> r = Rearrange(split=((2, 3),), perm=(1, 0), merge=(2,))
    >>> r.apply(torch.arange(6)).tolist()     # (x=2 y=3) -> (y x)
    [0, 3, 1, 4, 2, 5]
    """

    split: tuple[tuple[int, ...] | None, ...]
    perm: tuple[int, ...]
    merge: tuple[int, ...]

    def __post_init__(self) -> None:
        count = sum(1 if s is None else len(s) for s in self.split)
        assert sorted(self.perm) == list(range(count)), f"bad perm {self.perm} for {count} factors"
        assert sum(self.merge) == count, f"merge {self.merge} does not use {count} factors"

    @property
    def is_identity(self) -> bool:
        flat_dims = len(self.split) == len(self.merge)
        plain = (all(s is None or len(s) == 1 for s in self.split)
                 and all(m == 1 for m in self.merge))
        return flat_dims and plain and self.perm == tuple(range(len(self.perm)))

    def apply(self, x: Tensor) -> Tensor:
        """The rearranged tensor (a view when torch can make one, else a copy)."""
        assert x.dim() == len(self.split), f"rearrange for {len(self.split)} dims got {x.dim()}"
        sizes: list[int] = []
        for d, factors in enumerate(self.split):
            if factors is None:
                sizes.append(x.shape[d])
            else:
                assert math.prod(factors) == x.shape[d], f"dim {d}: {factors} vs {x.shape[d]}"
                sizes.extend(factors)
        y = x.reshape(sizes).permute(self.perm)
        out: list[int] = []
        pos = 0
        for count in self.merge:
            out.append(math.prod(y.shape[pos:pos + count]))
            pos += count
        return y.reshape(out)
