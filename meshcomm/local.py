"""Local steps of a plan on one rank's tensor: shared by every executor.

Pure torch: no communication. The simulated and the torch.distributed
executors call these same functions, so a local step is one code path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import p2p
from .identity import identity_like
from .layout import chunk_range
from .mesh import Mesh
from .plan import Step


def local_move(step: Step, x: Tensor, pos: int, g: int, out_shape: tuple[int, ...],
               rank: int, mesh: Mesh, shape: tuple[int, ...]) -> Tensor:
    """A local step on one rank at group position `pos` of a group of `g` (shared with dist).

    `out_shape` is the rank's local shape after the step (from the step's layout); `mesh`
    and `shape` (the global shape) locate the blocks of a select or reindex.
    """
    if step.action == "slice":
        if step.dim is not None:
            start, length = chunk_range(0, x.shape[step.dim], g, pos)
            return x.narrow(step.dim, start, length).clone()
        y = step.pre.apply(x) if step.pre else x
        return y[pos].clone()
    if step.action == "mark_partial":
        keep = step.op != "sum" or pos == 0
        return x.clone() if keep else torch.zeros_like(x)
    if step.action == "relabel":
        return x.clone()
    if step.action == "select":
        return p2p.fill_reindexed(p2p.step_transfers(step, mesh, shape, rank), rank, x,
                                  x.new_empty(out_shape))
    if step.action == "reindex":
        out = identity_like(torch.empty(out_shape, dtype=x.dtype), step.op or "sum")
        return p2p.fill_reindexed(p2p.step_transfers(step, mesh, shape, rank), rank, x, out)
    raise AssertionError(f"unknown local action {step.action!r} in {step}")
