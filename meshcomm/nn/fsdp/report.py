"""`fsdp_schedule`: the collectives of a model's units, in order, and what each overlaps.
Every byte figure comes from the units' prepared plans (`Prepared.calls`)."""

from __future__ import annotations

from torch import nn

from ...executors.distributed import Call
from .param import UNIT_ATTR


def fsdp_schedule(module: nn.Module) -> str:
    """The FSDP schedule of `module`'s units, one line per collective, in the order they are
    issued, and what each overlaps (the order is the one the first forward recorded); the
    bytes are those this rank receives::

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

    def kind(c: Call) -> str:
        return c.kind if c.axes == (order[0].axis,) else f"{c.kind}({', '.join(c.axes)})"

    for i, u in enumerate(order):
        name = units[id(u)]
        prev = units[id(order[i - 1])] if i else None
        shared = bool(i) and order[i - 1].schedule is u.schedule   # one model: prefetched
        when = (f"issued before {prev} computes (prefetch)" if u.prefetch and prev and shared
                else "issued when it starts, waited on at once")
        rows += [("forward", kind(c), name, format_bytes(c.recv_bytes), when)
                 for c in u.gathers.calls()]
    for i in range(len(order) - 1, -1, -1):
        u, name = order[i], units[id(order[i])]
        nxt = units[id(order[i + 1])] if i + 1 < len(order) else None
        if u.reshard_after_forward:
            when = (f"issued while {nxt}'s backward computes (prefetch)" if u.prefetch and nxt
                    and order[i + 1].reshard_after_forward
                    and order[i + 1].schedule is u.schedule else "issued when its backward starts")
            rows += [("backward", kind(c), name, format_bytes(c.recv_bytes), when)
                     for c in u.gathers.calls()]
        before = units[id(order[i - 1])] if i else None
        for k, c in enumerate(u.reduces.calls()):
            if c.kind != "all_reduce" or set(c.axes) != set(u.replicate):
                when = (f"runs while {before}'s backward computes" if before
                        else "waited on when backward ends")
            else:
                when = (f"issued with {before}'s reduce_scatter, runs while backward goes on"
                        if before else "issued when backward ends")
            rows.append(("backward", kind(c), name, format_bytes(c.recv_bytes), when))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
                     for r in rows)
