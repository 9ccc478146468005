"""`fsdp_schedule`: the collectives of a model's units, in order, and what each overlaps."""

from __future__ import annotations

import torch
from torch import nn

from .param import UNIT_ATTR
from .unit import Unit


def fsdp_schedule(module: nn.Module) -> str:
    """The FSDP schedule of `module`'s units, one line per collective, in the order they are
    issued, and what each overlaps (the order is the one the first forward recorded)::

        forward   all_gather      layers.1   96.0 KiB  issued before layers.0 computes
        backward  reduce_scatter  layers.1   96.0 KiB  runs while layers.0's backward computes
    """
    from ...core.units import format_bytes

    units = {id(getattr(m, UNIT_ATTR)): name or "(root)" for name, m in module.named_modules()
             if hasattr(m, UNIT_ATTR)}
    root = getattr(module, UNIT_ATTR, None)
    recorded = root.schedule.order if root is not None and not root.schedule.recording else []
    order = [u for u in recorded if id(u) in units] or [
        getattr(m, UNIT_ATTR) for _, m in module.named_modules() if hasattr(m, UNIT_ATTR)]
    order = [u for u in order if u.params]
    if not order:
        return "no fully_shard units with parameters"
    rows = []

    def size(u: Unit, dtype: torch.dtype) -> str:
        per_rank = sum(p.pad * p.inner for p in u.params) * dtype.itemsize
        return format_bytes(per_rank * (u.n - 1))

    for i, u in enumerate(order):
        name = units[id(u)]
        prev = units[id(order[i - 1])] if i else None
        shared = bool(i) and order[i - 1].schedule is u.schedule   # one model: prefetched
        when = (f"issued before {prev} computes (prefetch)" if u.prefetch and prev and shared
                else "issued when it starts, waited on at once")
        rows.append(("forward", "all_gather", name, size(u, u.compute_dtype), when))
    for i in range(len(order) - 1, -1, -1):
        u, name = order[i], units[id(order[i])]
        nxt = units[id(order[i + 1])] if i + 1 < len(order) else None
        if u.reshard_after_forward:
            when = (f"issued while {nxt}'s backward computes (prefetch)" if u.prefetch and nxt
                    and order[i + 1].reshard_after_forward
                    and order[i + 1].schedule is u.schedule else "issued when its backward starts")
            rows.append(("backward", "all_gather", name, size(u, u.compute_dtype), when))
        before = units[id(order[i - 1])] if i else None
        dtype = u.mp.reduce_dtype or u.params[0].param.dtype
        rows.append(("backward", "reduce_scatter", name, size(u, dtype),
                     f"runs while {before}'s backward computes" if before
                     else "waited on when backward ends"))
        if u.replicate:
            shard = sum(p.pad * p.inner for p in u.params) * dtype.itemsize
            rows.append(("backward", f"all_reduce({u.replicate})", name,
                         format_bytes(2 * shard * (u.n_rep - 1) // u.n_rep),
                         f"issued with {before}'s reduce_scatter, runs while backward goes on"
                         if before else "issued when backward ends"))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
                     for r in rows)
