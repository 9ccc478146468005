"""Flat positions of cartesian blocks: one helper for the planner and the executors.

Pure torch on the host; no communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def block_flat(index: Sequence[Sequence[int]], shape: Sequence[int]) -> torch.Tensor:
    """Flat positions (C order) of the cartesian block `index` (per dim, the positions) of a
    tensor of `shape`; the whole tensor when `index` is empty.

    >>> block_flat(((1,), range(0, 2)), (2, 3)).tolist()
    [3, 4]
    """
    if not index:
        return torch.arange(math.prod(shape), dtype=torch.long)
    flat = torch.zeros((), dtype=torch.long)
    for ix, size in zip(index, shape):
        at = (torch.arange(ix.start, ix.stop, ix.step, dtype=torch.long) if isinstance(ix, range)
              else torch.tensor(list(ix), dtype=torch.long))
        flat = flat.unsqueeze(-1) * size + at
    return flat.reshape(-1)



def as_positions(pos: Sequence[int]) -> Sequence[int]:
    """`pos` as a `range` where it is one ascending run (its min, max, slices and equality
    are then O(1)), else a tuple.

    >>> as_positions([3, 4, 5]), as_positions((2, 0))
    (range(3, 6), (2, 0))
    """
    if isinstance(pos, range) and pos.step == 1:
        return pos
    run = range(pos[0], pos[0] + len(pos)) if len(pos) else range(0)
    return run if tuple(pos) == tuple(run) else tuple(pos)
