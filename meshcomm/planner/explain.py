"""Plain-text explanation of a Plan: the table behind `print(plan)` and `plan.explain()`.

This module never imports rich. Its cell and line helpers (`step_cells`,
`total_lines`, `layout_lines`) are plain strings that `display.render_plan`
reuses, so the rich table and the plain one say the same thing in the same
words. Bytes print in binary units ("1.0 KiB"); the exact counts are in
`plan.to_json()`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..core.layout import Layout, Shape
from ..core.mesh import Mesh
from ..core.units import format_bytes, format_us


# This module sits below the plan values (whose `explain()` and `str()` call
# `format_plan`), so it names the fields it reads of a `meshcomm.planner.values.Plan`, its
# steps and their transfers, rather than importing the classes: the values satisfy these.
class TransferFields(Protocol):
    """What this module reads of a `Transfer`."""

    @property
    def src(self) -> int: ...
    @property
    def dst(self) -> int: ...
    @property
    def dst_index(self) -> tuple[Sequence[int], ...]: ...


class StepFields(Protocol):
    """What this module reads of a `Step`."""

    @property
    def mesh(self) -> Mesh | None: ...
    @property
    def dst_mesh(self) -> Mesh | None: ...
    @property
    def after(self) -> Layout: ...
    @property
    def send_bytes(self) -> tuple[int, ...]: ...
    @property
    def transfers(self) -> Sequence[TransferFields]: ...
    def rank_transfers(self, rank: int) -> Sequence[TransferFields]: ...


class CostFields(Protocol):
    """What this module reads of a `CostModel`."""

    @property
    def models_time(self) -> bool: ...


class Plan(Protocol):
    """What this module reads of a `meshcomm.planner.values.Plan`."""

    @property
    def mesh(self) -> Mesh: ...
    @property
    def dst_mesh(self) -> Mesh | None: ...
    @property
    def shape(self) -> Shape: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def src(self) -> Layout: ...
    @property
    def dst(self) -> Layout: ...
    @property
    def steps(self) -> Sequence[StepFields]: ...
    @property
    def cost_model(self) -> CostFields: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def bound_ratio(self) -> float: ...
    def rows(self) -> Sequence[dict[str, Any]]: ...
    def summary(self) -> dict[str, Any]: ...

HEADERS = ("#", "step", "axes (group)", "local shape", "sent", "received", "time (µs)",
           "peak mem")
TIME = HEADERS.index("time (µs)")
NO_STEPS = "(no communication: layouts are equal)"
RIGHT = frozenset({0, 4, 5, 6, 7})     # numeric columns, right-aligned
def dtype_name(plan: Plan) -> str:
    """The plan's dtype without the "torch." prefix, e.g. "float32"."""
    return str(plan.dtype).removeprefix("torch.")


def title_lines(plan: Plan, width: int = 100) -> tuple[str, ...]:
    """'plan "src" -> "dst": shape (8, 6) float32 on Mesh(dp=2, tp=2)', in two lines
    (the shape on the second) when one would be wider than `width`, and three (the mesh on
    the third) when the second would be too."""
    head = f'plan "{plan.src}" -> "{plan.dst}"'
    tail = f"shape {tuple(plan.shape)} {dtype_name(plan)} on {plan.mesh!r}"
    if plan.dst_mesh is not None:
        tail += f" -> {plan.dst_mesh!r}"
    one = f"{head}: {tail}"
    if len(one) <= width:
        return (one,)
    if len(tail) + 2 <= width:
        return (f"{head}:", f"  {tail}")
    shape, mesh = tail.split(" on ", 1)
    return (f"{head}:", f"  {shape}", f"  on {mesh}")


def step_name(row: dict[str, Any]) -> str:
    """The step column: the collective, or the local action, plus its reduce op if any."""
    name = row["action"] if row["kind"] == "local" else row["kind"]
    return f"{name} {row['op']}" if row["op"] else name


def _shape_text(shape: Sequence[int]) -> str:
    return str(tuple(shape))


def headers(plan: Plan) -> tuple[str, ...]:
    """The table's column titles: `HEADERS`, less the time column when the plan's cost model
    does not model time (the default: see `CostModel.models_time`)."""
    return HEADERS if plan.cost_model.models_time else HEADERS[:TIME] + HEADERS[TIME + 1:]


def step_cells(row: dict[str, Any], *, timed: bool = True) -> tuple[str, ...]:
    """The cells of one `plan.rows()` row, in `headers(plan)` order (`timed=False` leaves
    the time cell out)."""
    axes = f"{','.join(row['axes'])} ({row['group_size']})" if row["axes"] else "-"
    shapes = f"{_shape_text(row['local_shape_before'])} -> {_shape_text(row['local_shape_after'])}"
    time = (format_us(row["time_s"]),) if timed else ()
    return (str(row["step"]), step_name(row), axes, shapes, format_bytes(row["send_bytes"]),
            format_bytes(row["recv_bytes"]), *time, format_bytes(row["peak_bytes"]))


def wire_note(row: dict[str, Any]) -> str:
    """'; as all_to_all' where a step runs as another collective than its kind, else ''; for
    a tree step, '; a tree, as 3 all_to_alls'; for a rotated send_recv, '; senders rotated
    over replicas, as all_to_all'."""
    wire = row.get("wire") or ""
    if row.get("action") == "tree":
        return f"; a tree, as {row.get('rounds', 1)} {wire}s"
    if row.get("action") == "direct":
        return f"; partials to their owners, as {wire}"
    if row.get("action") == "rotate":
        return f"; senders rotated over replicas, as {wire}"
    return f"; as {wire}" if wire and wire != row["kind"] else ""


def step_layouts(row: dict[str, Any]) -> str:
    """'"before" -> "after"': the layouts around one step, and the collective it runs as
    where that is not its own kind ('; as all_to_all')."""
    return f'"{row["before"]}" -> "{row["after"]}"{wire_note(row)}'


def bound_text(plan: Plan) -> str:
    """'1.00x of the lower bound (1024 B)', from the busiest rank's received bytes."""
    s = plan.summary()
    ratio = plan.bound_ratio
    if math.isinf(ratio):
        return f"receives {s['recv_bytes']} B where the lower bound is 0 B"
    return f"{ratio:.2f}x of the lower bound ({s['lower_bound_bytes']} B)"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def total_lines(plan: Plan) -> tuple[str, ...]:
    """The totals: the bound, the busiest rank's and all ranks' traffic, memory and time."""
    s = plan.summary()
    return (
        f"total: {_count(s['collectives'], 'collective')} in {_count(s['steps'], 'step')},"
        f" {bound_text(plan)}",
        f"  busiest rank sends {format_bytes(s['send_bytes'])} and receives"
        f" {format_bytes(s['recv_bytes'])} (all ranks receive {format_bytes(s['recv_bytes_sum'])})",
        f"  peak memory {format_bytes(s['peak_bytes'])} per rank"
        + (f"; modelled time {format_us(s['cost_s'])} µs" if plan.cost_model.models_time
           else ""),
    )


def _layout_note(plan: Plan, layout: Layout, mesh: Mesh) -> str:
    shape = max((layout.local_shape(mesh, plan.shape, r) for r in mesh.ranks), key=math.prod)
    parts = [f"local {_shape_text(shape)}"]
    if plan.dst_mesh is not None:
        parts.append(f"on {mesh!r}")
    for word, axes in (("sharded", layout.sharded_axes(mesh)),
                       ("replicated", layout.replicated_axes(mesh))):
        if axes:
            parts.append(f"{word} over {', '.join(axes)}")
    note = "; ".join(parts)
    if layout.reduce_op is not None:
        note += f"; pending {layout.reduce_op} over {', '.join(layout.partial_axes)}"
    return note


def layout_lines(plan: Plan) -> tuple[str, ...]:
    """'before: "src"  local (4, 6); sharded over dp' and the same for after."""
    pairs = (("before:", plan.src, plan.mesh), ("after:", plan.dst, plan.dst_mesh or plan.mesh))
    quoted = [f'"{layout}"' for _, layout, _ in pairs]
    pad = max(map(len, quoted))
    return tuple(f"{word:<7} {text:<{pad}}  {_layout_note(plan, layout, mesh)}"
                 for (word, layout, mesh), text in zip(pairs, quoted))


def _table(plan: Plan, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Fixed-width table lines: a header, then each step and its layouts indented below."""
    heads = headers(plan)
    cells = [step_cells(row, timed=plan.cost_model.models_time) for row in rows]
    widths = [max(len(c[i]) for c in [heads, *cells]) for i in range(len(heads))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in RIGHT else v.ljust(w)
                 for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(parts).rstrip()

    out = [line(heads)]
    for row, values in zip(rows, cells):
        out.append(line(values))
        out.append(" " * (widths[0] + 2) + step_layouts(row))
    return out


# -- steps between two meshes: who sends what to whom, and how evenly ---------------
def index_text(indices: Sequence[int]) -> str:
    """Global indices as slice text: "0:4", "1:8:2", "0:2,4:6" (runs), "∅" when empty.

    >>> index_text((0, 1, 2, 3)), index_text((1, 3, 5)), index_text((0, 1, 4, 5)), index_text(())
    ('0:4', '1:7:2', '0:2,4:6', '∅')
    """
    ix = tuple(indices)
    if not ix:
        return "∅"
    step = ix[1] - ix[0] if len(ix) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(ix, ix[1:])):
        return f"{ix[0]}:{ix[-1] + 1}" if step == 1 else f"{ix[0]}:{ix[-1] + step}:{step}"
    runs, start = [], 0
    for k in range(1, len(ix) + 1):
        if k == len(ix) or ix[k] != ix[k - 1] + 1:
            runs.append(f"{ix[start]}:{ix[k - 1] + 1}")
            start = k
    return ",".join(runs)


def transfer_rows(plan: Plan) -> tuple[dict[str, Any], ...]:
    """One plain row per (sender, receiver) pair of each step between two meshes: the step
    number, the ranks, the blocks sent (global index ranges per dim, e.g. "[0:4, 0:8]") and
    their bytes. What a rank keeps for itself moves nothing and has no row."""
    out = []
    pos = {r: k for k, r in enumerate(plan.ranks)}
    for i, step in enumerate(plan.steps, 1):
        if step.dst_mesh is None:
            continue
        pairs: dict[tuple[int, int], list[str]] = {}
        sizes: dict[tuple[int, int], int] = {}
        for t in sorted(_received(step), key=lambda t: (pos[t.src], pos[t.dst])):
            src, dst, dst_index = t.src, t.dst, t.dst_index
            if src == dst:
                continue
            where = step.after.indices(step.dst_mesh, plan.shape, dst)
            block = [index_text([w[k] for k in ix]) for w, ix in zip(where, dst_index)]
            pairs.setdefault((src, dst), []).append(f"[{', '.join(block)}]")
            sizes[src, dst] = (sizes.get((src, dst), 0)
                               + math.prod(len(ix) for ix in dst_index) * plan.dtype.itemsize)
        out += [{"step": i, "src": s, "dst": r, "blocks": blocks, "bytes": sizes[s, r]}
                for (s, r), blocks in pairs.items()]
    return tuple(out)


def _received(step: StepFields) -> list[TransferFields]:
    """The blocks the receivers of a step between two meshes get: the plan's transfers, or
    for a step planned by counting, each receiver's own (`Step.rank_transfers`) in turn."""
    if step.transfers:
        return list(step.transfers)
    dst_mesh = step.dst_mesh
    assert dst_mesh is not None, "only a step between two meshes has receivers to list"
    return [t for r in dst_mesh.ranks for t in step.rank_transfers(r) if t.dst == r]


def balance(plan: Plan) -> tuple[dict[str, Any], ...]:
    """Per step between two meshes: the busiest sender's bytes against the ideal, the total
    sent spread evenly over the source mesh's ranks (`ideal_bytes` = total / senders)."""
    pos = {r: i for i, r in enumerate(plan.ranks)}
    out = []
    for i, step in enumerate(plan.steps, 1):
        if step.dst_mesh is None:
            continue
        senders = (step.mesh or plan.mesh).ranks
        sends = [step.send_bytes[pos[r]] for r in senders]
        out.append({"step": i, "send_bytes_max": max(sends), "send_bytes_total": sum(sends),
                    "senders": len(senders), "ideal_bytes": sum(sends) / len(senders)})
    return tuple(out)


def transfer_lines(plan: Plan, max_blocks: int = 3) -> tuple[str, ...]:
    """Per step between two meshes: one line per (sender, receiver) pair with its blocks and
    bytes, then the balance line. Empty for a plan on one mesh."""
    rows = transfer_rows(plan)
    lines: list[str] = []
    for b in balance(plan):
        mine = [row for row in rows if row["step"] == b["step"]]
        lines.append(f"step {b['step']}, sender -> receiver: block (global index ranges), bytes")
        pairs = [f"r{row['src']} -> r{row['dst']}" for row in mine]
        blocks = [" + ".join(row["blocks"][:max_blocks])
                  + (f" + … ({len(row['blocks'])} blocks)" if len(row["blocks"]) > max_blocks
                     else "") for row in mine]
        sizes = [format_bytes(row["bytes"]) for row in mine]
        widths = [max(map(len, col), default=0) for col in (pairs, blocks, sizes)]
        lines += [f"  {p:<{widths[0]}}  {k:<{widths[1]}}  {n:>{widths[2]}}"
                  for p, k, n in zip(pairs, blocks, sizes)]
        if not mine:
            lines.append("  (nothing to send: every receiver already holds its block)")
        ideal, busiest = b["ideal_bytes"], b["send_bytes_max"]
        ratio = f"{busiest / ideal:.2f}x" if ideal else "1.00x"
        lines.append(f"  balance: busiest sender sends {format_bytes(busiest)}, ideal"
                     f" {format_bytes(math.ceil(ideal))} ({format_bytes(b['send_bytes_total'])}"
                     f" over {_count(b['senders'], 'source rank')}): {ratio}")
    return tuple(lines)


def format_plan(plan: Plan) -> str:
    """The plan as fixed-width text: title, one row per step, totals, layouts before and after.

    >>> import meshcomm as mc
    >>> p = mc.plan(mc.Mesh("dp=2 tp=4"), (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)")
    >>> print(format_plan(p).splitlines()[2])
    1  all_to_all  dp (2)        (4, 16, 8) -> (8, 8, 8)  1.0 KiB   1.0 KiB     0.0102   4.0 KiB
    """
    rows = plan.rows()
    lines = list(title_lines(plan))
    lines += _table(plan, rows) if rows else [NO_STEPS]
    lines += [*total_lines(plan), *transfer_lines(plan), *layout_lines(plan)]
    return "\n".join(lines)
