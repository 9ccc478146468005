"""`reshard_many`: many reshards, one collective per step for each bucket of like items."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

from ..core.errors import MeshcommError, ShapeError
from ..core.layout import Layout
from ..executors.distributed.autograd import reshard_autograd
from ..executors.distributed.execute import execute_many
from ..executors.distributed.handlers import ByteTrace
from ..planner.plan import backward_plan
from ..planner.values import CostModel, Plan
from ..runtime.bind import BoundMesh
from ..runtime.checks import agree_many, checking, raise_together
from .local import _plan_for
from .value import Sharded

Item = Union[tuple[Sharded, Union[str, Layout]],
             tuple[Tensor, BoundMesh, Union[str, Layout], Union[str, Layout], Sequence[int]]]


def reshard_many(items: Sequence[Item], *, bucket_bytes: int = 25 * 2**20,
                 cost_model: CostModel | None = None,
                 trace: ByteTrace | None = None, check: bool | None = None) -> list[Any]:
    """Each item resharded, with one collective per step for each bucket of items whose
    plans share a collective shape (FSDP-style flat buffers of up to `bucket_bytes`).

    Items are `(sharded, dst)` (gives a Sharded) or `(x_local, mesh, src, dst, shape)`
    (gives a Tensor). Call it on every rank with the same items in the same order.
    Outputs equal `reshard` item by item. When a gradient is needed, items run one by
    one through `reshard`.

    >>> ws = mc.reshard_many([(w, "b h") for w in shards])       # doctest: +SKIP
    """
    try:
        jobs = _many_jobs(items, cost_model)
    except MeshcommError as err:
        first = items[0][0].mesh if items and isinstance(items[0][0], Sharded) else (
            items[0][1] if items and len(items[0]) == 5 else None)
        if first is not None and checking(first, check):
            raise_together(first, err, "reshard_many")   # the others agree, then raise too
        raise
    if jobs and checking(jobs[0][1], check):
        agree_many(jobs)
    if torch.is_grad_enabled() and any(x.requires_grad for x, _, _ in jobs):
        outs = [reshard_autograd(x, bound, p, trace, reverse=backward_plan)
                for x, bound, p in jobs]
    else:
        outs = execute_many(jobs, bucket_bytes=bucket_bytes, trace=trace)
    return [Sharded(out, bound, p.dst, p.shape) if isinstance(item[0], Sharded) else out
            for item, out, (_, bound, p) in zip(items, outs, jobs)]


def _many_jobs(items: Sequence[Item], cost_model: CostModel | None
               ) -> list[tuple[Tensor, BoundMesh, Plan]]:
    """reshard_many's (local, mesh, plan) per item; raises on the first bad item."""
    jobs: list[tuple[Tensor, BoundMesh, Plan]] = []
    for k, item in enumerate(items):
        if len(item) == 2 and isinstance(item[0], Sharded):
            s, dst = item
            jobs.append((s.local, s.mesh, _plan_for(s.local, s.mesh, s.layout, dst, s.shape,
                                                    None, cost_model)))
        elif len(item) == 5:
            x, bound, src, dst, shape = item
            jobs.append((x, bound, _plan_for(x, bound, src, dst, shape, None, cost_model)))
        else:
            raise ShapeError(f"reshard_many: items[{k}] is neither (Sharded, dst) nor"
                             " (x_local, mesh, src, dst, shape)")
    return jobs
