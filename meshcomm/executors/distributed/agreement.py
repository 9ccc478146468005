"""Check mode's exchange: whether every member of a group passed the same fingerprint.

Executor layer. Check mode (`meshcomm.runtime.checks`) builds the fingerprints and reads
the rows that come back; this module only moves them, and like every collective of the
package through `wire` (so `wire.recording()` counts them). It decides nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import wire
from .groups import Group


def compare(probe: Tensor, row: Tensor, group: Group) -> Tensor | None:
    """None when every member of `group` passed the same `probe`; otherwise every member's
    `row`, stacked along dim 0 in group order (the same on every member).

    `probe` is (h, -h) for a hash h: one all_reduce(max) gives (max h, -min h), which
    equals this member's probe on every member when all hashes agree and differs on every
    member otherwise, so every member takes the same branch. Only then are the rows
    all-gathered. Raises what the collectives raise (a dead or absent member)."""
    seen, _ = wire.all_reduce(probe, "max", group)
    if torch.equal(seen, probe):
        return None
    return gather(row, group)


def gather(row: Tensor, group: Group) -> Tensor:
    """Every member's `row` (the same shape on every member), stacked along dim 0 in group
    order: what check mode reads after `compare` found a difference."""
    rows, _ = wire.all_gather(row, group)
    return rows
