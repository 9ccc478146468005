"""Plain-text explanation of a Plan (no rich): used by `str(plan)` and `plan.explain()`."""

from __future__ import annotations

from typing import Any


def format_plan(plan: Any) -> str:
    """A fixed-width table of `plan.rows()` and its totals (temporary: see display.show_plan)."""
    lines = [f"plan {plan.src} -> {plan.dst} for shape {plan.shape} on {plan.mesh!r}"]
    for row in plan.rows():
        what = row["action"] if row["kind"] == "local" else row["kind"]
        lines.append(f"  {row['step']}. {what}({', '.join(row['axes'])}): {row['before']} -> {row['after']}")
    s = plan.summary()
    lines.append(f"  max bytes received {s['recv_bytes']}, lower bound {s['lower_bound_bytes']}")
    return "\n".join(lines)
