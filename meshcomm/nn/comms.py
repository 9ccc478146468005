"""What a block communicates, as plain rows: the text behind every block's `explain()`.

This module never communicates. A `Comm` names one thing a block moves (a parameter
gathered for use, a gradient reduced, an activation resharded) with the plan that moves
it, or, for a data-dependent collective such as a MoE all_to_all, a description.
`format_comms` prints one line per comm and, with `full=True`, each plan's own table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.units import format_bytes
from ..planner.values import Plan


@dataclass(frozen=True, slots=True)
class Comm:
    """One communication of a block: `what` moves in `phase` ("forward" or "backward")."""

    phase: str
    what: str
    plan: Plan | None = None
    note: str = ""            # after the plan's steps, or alone for a collective that is not
                              # a layout plan (MoE routing)


def steps_text(plan: Plan) -> str:
    """'all_gather(fsdp) 512 B', 'reduce_scatter avg(fsdp) 512 B, all_reduce sum(dp) 1.0 KiB',
    or 'no communication': each collective with the busiest rank's received bytes."""
    parts = []
    for step in plan.collectives:
        op = f" {step.op}" if step.op else ""
        parts.append(f"{step.kind}{op}({', '.join(step.axes)})"
                     f" {format_bytes(max(step.recv_bytes))}")
    return ", ".join(parts) if parts else "no communication"


def comm_line(comm: Comm) -> str:
    """'backward  weight grad  "embed (tp mlp) | avg(fsdp)" -> "(fsdp embed) (tp mlp)":
    reduce_scatter avg(fsdp) 512 B'."""
    if comm.plan is None:
        return f"{comm.phase:<8}  {comm.what}: {comm.note}"
    p, note = comm.plan, f", {comm.note}" if comm.note else ""
    return (f'{comm.phase:<8}  {comm.what} {tuple(p.shape)}: "{p.src}" -> "{p.dst}":'
            f" {steps_text(p)}{note}")


def format_comms(title: str, comms: Sequence[Comm], *, full: bool = False,
                 notes: Sequence[str] = ()) -> str:
    """A title, one line per comm (forward ones first, in running order), then notes; with
    `full`, each plan that communicates as `plan.explain()` prints it."""
    ordered = ([c for c in comms if c.phase == "forward"]
               + [c for c in comms if c.phase != "forward"])
    lines = [title, *("  " + comm_line(c) for c in ordered), *("  " + n for n in notes)]
    if full:
        for c in ordered:
            if c.plan is not None and c.plan.collectives:
                lines += ["", f"{c.phase} {c.what}:", c.plan.explain()]
    return "\n".join(lines)


def count_collectives(comms: Sequence[Comm], phase: str) -> int:
    """How many collectives the plans of `phase` run, one tensor at a time."""
    return sum(len(c.plan.collectives) if c.plan is not None else 1
               for c in comms if c.phase == phase and (c.plan is None or c.plan.collectives))
