"""Pictures and tables of layouts: which rank holds which part of a tensor.

This is the only module that imports rich. Its data half (`shard_rows`,
`block_grid`, `format_indices`) is plain values that any printer can use; the
rich half renders them. Colour only decorates: every block and row also says in
words which ranks hold it, so the output reads the same with NO_COLOR or in a pipe.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike

from rich import box
from rich.align import Align
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from .core.layout import Layout, Shape, as_layout
from .core.mesh import AxisName, Mesh
from .pipeline_display import IDLE, KIND_NAMES, fit
from .planner import explain
from .planner.pipeline import Timeline
from .planner.values import Plan

__all__ = ["BlockGrid", "Console", "ShardRow", "block_grid", "dim_names", "export_svg",
           "format_indices", "make_console", "owner_label", "render_layout", "render_plan",
           "render_timeline", "shard_rows", "show", "show_plan", "show_timeline", "status"]

EMPTY = "∅"
MAX_BLOCKS = 16
MAX_LISTED_OWNERS = 4
MAX_PICTURE_WIDTH = 100  # a wider console leaves the block picture at this (labels may need more)
PARTIAL_MARK = {"sum": "+", "avg": "avg", "max": "max", "min": "min"}
_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7",
            "#bebada", "#80b1d3", "#fccde5", "#d9d9d9", "#ccebc5")


# -- plain data ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShardRow:
    """What one rank holds: its coords, local shape and per-dim global index ranges.

    `replica_of` is the first rank (mesh order) holding the same values, when that
    is another rank; `partial` is e.g. "sum over tp" for a pending reduction.
    """

    rank: int
    coords: tuple[tuple[AxisName, int], ...]
    local_shape: Shape
    ranges: tuple[str, ...]
    replica_of: int | None
    partial: str

    @property
    def note(self) -> str:
        """The rank's row remark in words, e.g. "replica of r0; partial sum over tp"."""
        notes = []
        if 0 in self.local_shape:
            notes.append("empty shard")
        if self.replica_of is not None:
            notes.append(f"replica of r{self.replica_of}")
        if self.partial:
            notes.append(f"partial {self.partial}")
        return "; ".join(notes)


@dataclass(frozen=True, slots=True)
class BlockGrid:
    """A 1-D or 2-D tensor cut into blocks, each held by one set of ranks.

    `spans[d]` are the (start, stop) runs of dim d whose indices are held by the
    same ranks; `owners[i][j]` are the ranks holding block (row run i, col run j)
    in mesh order (a 1-D tensor has one row).
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    owners: tuple[tuple[tuple[int, ...], ...], ...]


def format_indices(indices: Sequence[int]) -> str:
    """Compact slice text for global indices: "0:4", "0:8:2", "0:2,4:6", or "∅".

    >>> format_indices((0, 2, 4, 6))
    '0:8:2'
    """
    ix = tuple(indices)
    if not ix:
        return EMPTY
    step = ix[1] - ix[0] if len(ix) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(ix, ix[1:])):
        return f"{ix[0]}:{ix[-1] + 1}" if step == 1 else f"{ix[0]}:{ix[-1] + step}:{step}"
    parts = [f"{a}:{b}" for a, b in _runs(ix)]
    if len(parts) > 4:
        parts = [*parts[:3], "…", parts[-1]]
    return ",".join(parts)


def _runs(ix: tuple[int, ...]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive indices as (start, stop)."""
    out = [[ix[0], ix[0] + 1]]
    for i in ix[1:]:
        if i == out[-1][1]:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


def shard_rows(mesh: Mesh | str, shape: Sequence[int],
               layout: str | Layout) -> tuple[ShardRow, ...]:
    """One plain row per rank (mesh order) saying what part of the tensor it holds.

    >>> rows = shard_rows(Mesh("dp=2"), (8, 6), "(b dp) h")
    >>> rows[1].ranges
    ('1:9:2', '0:6')
    """
    mesh, layout, shape = _as_mesh(mesh), as_layout(layout), tuple(int(s) for s in shape)
    layout.placements(mesh, shape)
    partial = _partial_text(layout)
    first: dict[object, int] = {}
    rows = []
    for rank in mesh.ranks:
        coords = mesh.coords(rank)
        index = layout.indices(mesh, shape, rank)
        key = (index, tuple(coords[a] for a in layout.partial_axes))
        empty = any(len(ix) == 0 for ix in index)
        owner = rank if empty else first.setdefault(key, rank)  # empty shards copy nobody
        rows.append(ShardRow(rank, tuple(coords.items()), tuple(len(ix) for ix in index),
                             tuple(format_indices(ix) for ix in index),
                             None if owner == rank else owner, partial))
    return tuple(rows)


def dim_names(mesh: Mesh, layout: Layout) -> tuple[str, ...]:
    """A label per dim: its local factor (not a mesh axis, not sized), else "dimN" (labels
    are printed, never parsed as a layout: `Layout.dim_names` names dims for layouts)."""
    return tuple(n or f"dim{d}" for d, n in enumerate(layout.local_names(mesh)))


def _partial_text(layout: Layout) -> str:
    if layout.reduce_op is None:
        return ""
    return f"{layout.reduce_op} over {', '.join(layout.partial_axes)}"


def block_grid(mesh: Mesh | str, shape: Sequence[int], layout: str | Layout) -> BlockGrid | None:
    """Blocks of a 1-D or 2-D tensor and the ranks holding each; None for other ranks.

    >>> block_grid(Mesh("dp=2"), (4,), "(dp b)").owners
    (((0,), (1,)),)
    """
    mesh, layout, shape = _as_mesh(mesh), as_layout(layout), tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        return None
    masks = _index_masks(mesh, shape, layout)
    spans = tuple(_mask_spans(m) for m in masks)
    row_masks = [masks[0][a] for a, _ in spans[0]] if len(shape) == 2 else [(1 << mesh.size) - 1]
    col_masks = [masks[-1][a] for a, _ in spans[-1]]
    owners = tuple(tuple(_ranks_of(mesh, rm & cm) for cm in col_masks) for rm in row_masks)
    return BlockGrid(spans, owners)


def _index_masks(mesh: Mesh, shape: Shape, layout: Layout) -> list[list[int]]:
    """Per dim, per global index, a bitmask of the mesh positions holding it."""
    masks = [[0] * size for size in shape]
    for pos, rank in enumerate(mesh.ranks):
        for d, ix in enumerate(layout.indices(mesh, shape, rank)):
            for i in ix:
                masks[d][i] |= 1 << pos
    return masks


def _mask_spans(mask: list[int]) -> tuple[tuple[int, int], ...]:
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if spans and mask[spans[-1][0]] == m:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return tuple(spans)


def _ranks_of(mesh: Mesh, mask: int) -> tuple[int, ...]:
    return tuple(r for pos, r in enumerate(mesh.ranks) if mask >> pos & 1)


# -- rich rendering --------------------------------------------------------------
def render_layout(mesh: Mesh | str, shape: Sequence[int], layout: str | Layout,
                  *, width: int = 100) -> RenderableType:
    """A rich renderable: title, block grid (1-D/2-D tensors) and per-rank table.

    `width` is the width the grid is laid out for (the console's, usually).
    """
    mesh, layout, shape = _as_mesh(mesh), as_layout(layout), tuple(int(s) for s in shape)
    rows = shard_rows(mesh, shape, layout)
    return Group(_title(mesh, shape, layout, width), _summary(mesh, layout),
                 *_grid_part(mesh, shape, layout, width), _rank_table(mesh, layout, rows, width))


def _grid_part(mesh: Mesh, shape: Shape, layout: Layout, width: int) -> list[RenderableType]:
    """The block picture and its notes, or one line saying why there is none."""
    grid = block_grid(mesh, shape, layout)
    if grid is None:
        return [Text(f"(no block picture for a {len(shape)}-D tensor; see the table)")]
    if 0 in shape:
        return [Text("(no block picture for a tensor with no elements; see the table)")]
    if max(len(s) for s in grid.spans) > MAX_BLOCKS:
        return [Text(f"(no block picture: the tensor splits into more than {MAX_BLOCKS}"
                     " blocks along a dim; see the table)")]
    return [_grid_table(mesh, layout, grid, width), *_idle_note(mesh, grid)]


def _as_mesh(mesh: Mesh | str) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh(mesh)


def _title(mesh: Mesh, shape: Shape, layout: Layout, width: int = 100) -> Text:
    """'layout "(dp b) h" of shape (8, 6) on Mesh(dp=2)'; where wider than `width`, a new
    line before "of shape" and before "on", so neither the shape nor the mesh is split."""
    parts = [f" of shape {shape}", f" on {mesh!r}"]
    if len(f'layout "{layout}"') + sum(map(len, parts)) > width:
        parts = [f"\n  {part[1:]}" for part in parts]
    text = Text("layout ")
    text.append(f'"{layout}"', style="bold")
    text.append("".join(parts))
    return text


def _summary(mesh: Mesh, layout: Layout) -> Text:
    sharded = ", ".join(layout.sharded_axes(mesh)) or "none"
    replicated = ", ".join(layout.replicated_axes(mesh)) or "none"
    text = Text(f"sharded over: {sharded} · replicated over: {replicated}")
    if layout.reduce_op is not None:
        mark = PARTIAL_MARK[layout.reduce_op]
        text.append(f"\npartial {_partial_text(layout)}: values pending reduction"
                    f" (blocks marked ({mark}))", style="bold")
    return text


def _idle_note(mesh: Mesh, grid: BlockGrid) -> list[Text]:
    held = {r for row in grid.owners for cell in row for r in cell}
    idle = [r for r in mesh.ranks if r not in held]
    if not idle:
        return []
    return [Text(f"empty shards (hold no elements): {', '.join(f'r{r}' for r in idle)}")]


def owner_label(mesh: Mesh, ranks: Sequence[int], reduce_op: str | None = None,
                *, coords: bool = True) -> str:
    """The label of a block: one "r1 dp0 tp1" line per owner, or "r0-7" when many.

    >>> owner_label(Mesh("dp=2 tp=2"), (1, 3), "sum")
    'r1 dp0 tp1 (+)\\nr3 dp1 tp1 (+)'
    """
    mark = f" ({PARTIAL_MARK[reduce_op]})" if reduce_op else ""
    if not ranks:
        return "no rank"
    if len(ranks) > MAX_LISTED_OWNERS:
        spans = _runs(tuple(ranks))
        text = ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in spans)
        return f"r{text}{mark}\n({len(ranks)} ranks)"
    if not coords:
        return "\n".join(f"r{r}{mark}" for r in ranks)
    return "\n".join(f"r{r} {_coord_text(mesh, r)}{mark}" for r in ranks)


def _coord_text(mesh: Mesh, rank: int) -> str:
    return " ".join(f"{a}{c}" for a, c in mesh.coords(rank).items())


def _grid_labels(mesh: Mesh, layout: Layout, grid: BlockGrid,
                 room: int) -> tuple[list[list[str]], bool]:
    """Block labels with mesh coords, or with ranks only (True) when those do not fit `room`."""
    for coords in (True, False):
        labels = [[owner_label(mesh, cell, layout.reduce_op, coords=coords) for cell in row]
                  for row in grid.owners]
        if sum(_label_widths(grid.spans[-1], labels)) <= room:
            break
    return labels, not coords


def _grid_table(mesh: Mesh, layout: Layout, grid: BlockGrid, width: int) -> Table:
    two_d = len(grid.spans) == 2
    names = dim_names(mesh, layout)
    head = f"{names[0]}\\{names[1]}" if two_d else names[0]
    head_w = max([len(head)] + [len(_span_text(s)) for s in grid.spans[0]]) + 2 if two_d else 0
    col_spans = grid.spans[-1]
    room = min(width, MAX_PICTURE_WIDTH) - head_w - len(col_spans) - 2
    labels, compact = _grid_labels(mesh, layout, grid, room)
    table = Table(show_header=True, show_lines=True, box=box.SQUARE, padding=0,
                  title=None if two_d else f"dim 0 ({head})", title_justify="left",
                  caption="(blocks name ranks only; coords are in the table)" if compact else None,
                  caption_justify="left")
    if two_d:
        table.add_column(head, justify="center", vertical="middle", width=head_w)
    for span, w in zip(col_spans, _col_widths(col_spans, labels, room)):
        table.add_column(_span_text(span), justify="center", width=w)
    styles = _cell_styles(grid)
    heights = _row_heights(grid, labels)
    for i, row in enumerate(labels):
        cells = [Align(Text(label), "center", style=styles[grid.owners[i][j]], vertical="middle",
                       height=heights[i]) for j, label in enumerate(row)]
        lead = [Align(Text(_span_text(grid.spans[0][i])), "center", vertical="middle",
                      height=heights[i])] if two_d else []
        table.add_row(*lead, *cells)
    return table


def _span_text(span: tuple[int, int]) -> str:
    return f"{span[0]}:{span[1]}"


def _label_widths(spans: Sequence[tuple[int, int]], labels: list[list[str]]) -> list[int]:
    """Per column, the width its widest label line (or its range header) needs."""
    return [max([len(_span_text(span))] + [len(line) for row in labels
                                           for line in row[j].split("\n")]) + 2
            for j, span in enumerate(spans)]


def _col_widths(spans: Sequence[tuple[int, int]], labels: list[list[str]],
                room: int) -> list[int]:
    """Widths proportional to each block's length, never narrower than its labels."""
    total = spans[-1][1] - spans[0][0] or 1
    return [max(need, room * (b - a) // total)
            for need, (a, b) in zip(_label_widths(spans, labels), spans)]


def _row_heights(grid: BlockGrid, labels: list[list[str]]) -> list[int]:
    """Heights proportional to each row block's length (12 lines in all), at least its labels."""
    lines = [max(label.count("\n") + 1 for label in row) for row in labels]
    if len(grid.spans) == 1:
        return lines
    total = grid.spans[0][-1][1] or 1
    return [max(n, round(12 * (b - a) / total)) for n, (a, b) in zip(lines, grid.spans[0])]


def _cell_styles(grid: BlockGrid) -> dict[tuple[int, ...], str]:
    """One background colour per owner set (decoration only: labels carry the meaning)."""
    styles: dict[tuple[int, ...], str] = {}
    for row in grid.owners:
        for cell in row:
            if cell not in styles:
                styles[cell] = f"black on {_PALETTE[len(styles) % len(_PALETTE)]}"
    return styles


def _rank_table(mesh: Mesh, layout: Layout, rows: Sequence[ShardRow],
                width: int = 100) -> Table:
    """One row per rank, a column per dim. Where its cells are wider than `width`, the dims share
    one column of "b=0:4 h=0:3" words (a row takes more lines), so no column is dropped and
    no shape, range or coordinate splits."""
    names = dim_names(mesh, layout)
    heads = [f"dim {d}" if name == f"dim{d}" else f"{name} (dim {d})"
             for d, name in enumerate(names)]
    table = _rank_rows(rows, heads, [list(row.ranges) for row in rows])
    table.show_header = False                       # headers may wrap; cells may not
    fits = _one_line_width(table) <= width
    table.show_header = True
    if fits:
        return table
    words = [" ".join(f"{name}={span}" for name, span in zip(names, row.ranges)) for row in rows]
    return _rank_rows(rows, ["index range per dim"], [[text] for text in words], keep=True)


def _rank_rows(rows: Sequence[ShardRow], heads: Sequence[str],
               ranges: Sequence[Sequence[str]], *, keep: bool = False) -> Table:
    """The table of `_rank_table`; `keep`: the coords and shape columns as wide as their
    widest cell (the range column wraps instead)."""
    table = Table(box=box.SIMPLE_HEAD, title="shards per rank", title_justify="left")
    table.add_column("rank", justify="right")
    for head, cells in (("coords", [_coords_text(row) for row in rows]),
                        ("local shape", [str(row.local_shape) for row in rows])):
        table.add_column(head, min_width=max(map(len, cells)) if keep and rows else None)
    for head in heads:
        table.add_column(head)
    table.add_column("note")
    for row, spans in zip(rows, ranges):
        table.add_row(f"r{row.rank}", _coords_text(row), str(row.local_shape), *spans, row.note)
    return table


def _coords_text(row: ShardRow) -> str:
    return " ".join(f"{a}{c}" for a, c in row.coords)


# -- plans ------------------------------------------------------------------------
def render_plan(plan: Plan, *, width: int = 100, pictures: bool = True) -> RenderableType:
    """A rich renderable of `plan`: its steps as a table, the totals against the lower
    bound, then (with `pictures`) the layouts before and after as `show` draws them.

    The cells are the words of `plan.explain()`, so the two read the same.
    """
    parts: list[RenderableType] = [Text("\n".join(explain.title_lines(plan, width)),
                                        style="bold")]
    rows = plan.rows()
    parts.append(_plan_table(plan, rows, width) if rows else Text(explain.NO_STEPS))
    parts.append(Text("\n".join(explain.total_lines(plan))))
    if plan.dst_mesh is not None:
        parts.append(Text("\n".join(explain.transfer_lines(plan))))
    if pictures:
        for word, layout, mesh in (("before", plan.src, plan.mesh),
                                   ("after", plan.dst, plan.dst_mesh or plan.mesh)):
            parts += [Text(""), Text(f"{word}:", style="bold underline"),
                      render_layout(mesh, plan.shape, layout, width=width)]
    return Group(*parts)


def _plan_table(plan: Plan, rows: Sequence[dict[str, object]],
                width: int = 100) -> RenderableType:
    """One row per step; under its local shapes, the layout the step leaves (and the
    collective it runs as). Where that table is wider than `width`, one block of lines per
    step instead, each cell labelled, and a shape or layout never split across lines."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    heads = list(explain.headers(plan))
    heads[3] = "local shape\nlayout after"
    cells_per_row = [explain.step_cells(row, timed=plan.cost_model.models_time) for row in rows]
    for i, head in enumerate(heads):
        table.add_column(head, justify="right" if i in explain.RIGHT else "left")
    for row, cells in zip(rows, cells_per_row):
        shapes = Text(cells[3])
        shapes.append(f'\n"{row["after"]}"{explain.wire_note(row)}', style="italic")
        table.add_row(*cells[:3], shapes, *cells[4:])
    if _one_line_width(table) <= width:
        return table
    return Group(*(_step_block(plan, row, cells, width)
                   for row, cells in zip(rows, cells_per_row)))


def _step_block(plan: Plan, row: dict[str, object], cells: tuple[str, ...],
                width: int) -> Text:
    """One step as labelled lines (the narrow form of a table row):
        1  send_recv over dp,tp,pp (256), as all_to_all
           local shape (5120, 2752, 400, 128) -> (5120, 1376, 800, 128)
           layout after "(tp b) (dp s) (pp h) d"
           sent 2.6 TiB · received 2.6 TiB · peak mem 5.2 TiB"""
    heads = explain.headers(plan)
    note = explain.wire_note(row)
    over = f" over {cells[2]}" if cells[2] != "-" else ""
    first = _fill([f"{cells[0]}  {cells[1]}{over}{',' if note else ''}", note[2:]], width, 3)
    before, after = (_tuple_text(row[key]) for key in ("local_shape_before", "local_shape_after"))
    lines = [first,
             _fill(["local shape", before, "->", after], width, 3),
             _fill(["layout after", f'"{row["after"]}"'], width, 3),
             _fill([" · ".join(f"{head} {cell}" for head, cell in zip(heads[4:], cells[4:]))],
                   width, 3)]
    return Text("\n".join(line if i == 0 else "   " + line for i, line in enumerate(lines)))


def _fill(atoms: Sequence[str], width: int, indent: int) -> str:
    """`atoms` joined by spaces, a new line (indented) before an atom that would pass `width`;
    an atom is never split."""
    lines = [""]
    for atom in (a for a in atoms if a):
        if lines[-1] and indent + len(lines[-1]) + 1 + len(atom) > width:
            lines.append("")
        lines[-1] = f"{lines[-1]} {atom}" if lines[-1] else atom
    return f"\n{' ' * indent}".join(lines)


def _one_line_width(renderable: RenderableType) -> int:
    """How wide `renderable` is when nothing in it wraps."""
    return Console(width=10_000).measure(renderable).maximum


def _tuple_text(values: object) -> str:
    """A plan row's shape (a list) as a tuple: "(4, 6)"."""
    assert isinstance(values, (list, tuple)), values
    return str(tuple(values))


def show_plan(plan: Plan, *, console: Console | None = None, width: int | None = None,
              pictures: bool = True) -> None:
    """Print `plan`: one row per step, totals against the lower bound, layout pictures.

    >>> import meshcomm as mc
    >>> p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(dp b) h", "b (dp h)")
    >>> show_plan(p, width=100)  # doctest: +SKIP
    """
    console = console or make_console(width=width)
    console.print(render_plan(plan, width=width or console.width, pictures=pictures),
                  highlight=False)


# -- pipeline timelines -----------------------------------------------------------
_KIND_COLOURS = {"F": (0x4e, 0x79, 0xa7), "B": (0x59, 0xa1, 0x4f), "I": (0x76, 0xb7, 0xb2),
                 "W": (0xf2, 0x8e, 0x2b)}


def _shade(kind: str, shade: int) -> str:
    """The block colour of `kind` for a rank's stage number `shade`: later stages lighter."""
    mix = min(shade, 3) * 0.2
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in _KIND_COLOURS[kind])


def render_timeline(timeline: Timeline, *, width: int = 100) -> RenderableType:
    """A pipeline timeline as coloured blocks, one row per rank (`pipeline_display`): the
    labels carry the meaning, so it reads the same with NO_COLOR or in a pipe."""
    grid, head = fit(timeline, width)
    lines = []
    for row in grid.rows:
        line = Text()
        line.append(head(row.rank), style="bold")
        line.append("│")
        at = 0
        for b in row.blocks:
            line.append(IDLE * (b.col - at), style="dim")
            line.append(b.text, style=f"black on {_shade(b.kind, b.shade)}")
            at = b.col + b.width
        line.append(IDLE * (grid.width - at), style="dim")
        line.append(f"│ {grid.stats(row)}")
        lines.append(line)
    pad = " " * (len(head(0)) + 1)
    lines.append(Text(pad + grid.axis(), style="dim"))
    legend = Text(pad)
    for kind in grid.kinds:
        legend.append(f" {kind} ", style=f"black on {_shade(kind, 0)}")
        legend.append(f" {KIND_NAMES[kind]}  ")
    if any(b.shade for row in grid.rows for b in row.blocks):
        legend.append("(lighter: a rank's later stages)", style="dim")
    legend.rstrip()
    lines += [legend, Text(grid.footer())]
    return Group(*lines)


def show_timeline(timeline: Timeline, *, console: Console | None = None,
                  width: int | None = None) -> None:
    """Print a pipeline timeline (`render_timeline`) at the console's width.

    >>> from meshcomm.planner.pipeline import StageCosts, build, simulate
    >>> show_timeline(simulate(build("1f1b", 4, 8), StageCosts.uniform(4)))  # doctest: +SKIP
    """
    console = console or make_console(width=width)
    console.print(render_timeline(timeline, width=width or console.width), highlight=False,
                  crop=False)


# -- consoles and output ----------------------------------------------------------
def make_console(*, width: int | None = None, stderr: bool = False,
                 record: bool = False) -> Console:
    """A rich console (honours NO_COLOR and plain output to pipes)."""
    return Console(width=width, stderr=stderr, record=record)


def show(mesh: Mesh | str, shape: Sequence[int], layout: str | Layout, *,
         console: Console | None = None, width: int | None = None) -> None:
    """Print which rank holds which part of a tensor of `shape` under `layout`.

    >>> show("dp=2 tp=2", (8, 6), "(dp b) (tp h)")  # doctest: +SKIP
    """
    console = console or make_console(width=width)
    console.print(render_layout(mesh, shape, layout, width=width or console.width))


def export_svg(mesh: Mesh | str, shape: Sequence[int], layout: str | Layout,
               path: str | PathLike[str], *, width: int = 100) -> None:
    """Write the picture of `show` to an SVG file at `path`."""
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True)
    console.print(render_layout(mesh, shape, layout, width=width))
    console.save_svg(str(path), title=f"meshcomm: {as_layout(layout)}")


def status(console: Console, ok: bool, text: str) -> None:
    """Print an "OK: ..." or "FAIL: ..." line (the word carries the meaning)."""
    word = Text("OK: " if ok else "FAIL: ", style="bold green" if ok else "bold red")
    console.print(word + Text(text), highlight=False)
