"""display: plain rows and block grids, and the NO_COLOR picture at a fixed width."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import meshcomm as mc
from meshcomm import display
from meshcomm.display import BlockGrid, ShardRow, block_grid, format_indices, shard_rows

MESH = mc.Mesh("dp=2 tp=2")


def render(shape: tuple[int, ...], layout: str, mesh: mc.Mesh = MESH, width: int = 100) -> str:
    console = Console(width=width, no_color=True, force_terminal=False, record=True,
                      file=io.StringIO())
    display.show(mesh, shape, layout, console=console)
    return console.export_text()


def grid_rows(text: str) -> list[list[list[str]]]:
    """Rows of the block grid (header first), each a list of cells, each its text lines."""
    rows: list[list[list[str]]] = []
    fresh = True
    for line in text.splitlines():
        if not line.startswith("│"):
            fresh = True
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if fresh:
            rows.append([[] for _ in cells])
            fresh = False
        for lines, cell in zip(rows[-1], cells):
            if cell:
                lines.append(cell)
    return rows


def cell_at(text: str, row: str, col: str) -> list[str]:
    """The text lines of the grid cell at row range `row` and column range `col`."""
    rows = grid_rows(text)
    j = rows[0].index([col])
    return next(cells[j] for cells in rows[1:] if cells[0] == [row])


@pytest.mark.parametrize("indices, text", [
    ((), "∅"),
    ((3,), "3:4"),
    ((0, 1, 2, 3), "0:4"),
    ((0, 2, 4, 6), "0:8:2"),
    ((1, 3, 5, 7), "1:9:2"),
    ((0, 1, 4, 5), "0:2,4:6"),
    ((0, 1, 4, 5, 8, 9, 12, 13, 16, 17), "0:2,4:6,8:10,…,16:18"),
])
def test_format_indices(indices: tuple[int, ...], text: str) -> None:
    assert format_indices(indices) == text


def test_shard_rows_block_layout() -> None:
    rows = shard_rows(MESH, (8, 6), "(dp b) (tp h)")
    assert rows[1] == ShardRow(1, (("dp", 0), ("tp", 1)), (4, 3), ("0:4", "3:6"), None, "")
    assert [r.ranges for r in rows] == [("0:4", "0:3"), ("0:4", "3:6"), ("4:8", "0:3"),
                                        ("4:8", "3:6")]
    assert all(r.note == "" for r in rows)


def test_shard_rows_replicas_and_partial() -> None:
    rows = shard_rows(MESH, (8, 6), "(dp b) h")
    assert [r.replica_of for r in rows] == [None, 0, None, 2]
    assert rows[3].note == "replica of r2"
    partial = shard_rows(MESH, (8, 6), "(b dp) h | sum(tp)")
    # partial contributions on tp are not replicas of each other
    assert [r.replica_of for r in partial] == [None, None, None, None]
    assert [r.ranges[0] for r in partial] == ["0:8:2", "0:8:2", "1:9:2", "1:9:2"]
    assert partial[0].note == "partial sum over tp"


def test_shard_rows_uneven_empty() -> None:
    rows = shard_rows(MESH, (3, 6), "(dp tp b) h")
    assert [r.local_shape for r in rows] == [(1, 6), (1, 6), (1, 6), (0, 6)]
    assert rows[3].ranges == ("∅", "0:6") and rows[3].note == "empty shard"


def test_shard_rows_raises_meshcomm_errors() -> None:
    with pytest.raises(mc.errors.ShapeError):
        shard_rows(MESH, (7, 6), "(b dp) h")
    with pytest.raises(mc.errors.MeshAxisError):
        shard_rows(MESH, (8, 6), "(dq b) h")


def test_block_grid_2d() -> None:
    grid = block_grid(MESH, (8, 6), "(dp b) (tp h)")
    assert grid == BlockGrid((((0, 4), (4, 8)), ((0, 3), (3, 6))),
                             (((0,), (1,)), ((2,), (3,))))
    assert block_grid(MESH, (8, 6), "(dp b) h").owners == (((0, 1),), ((2, 3),))
    assert block_grid(MESH, (4, 4, 4), "b h c") is None


def test_block_grid_1d_and_cyclic() -> None:
    assert block_grid(MESH, (8,), "(tp b)") == BlockGrid((((0, 4), (4, 8)),),
                                                         (((0, 2), (1, 3)),))
    cyclic = block_grid(MESH, (8, 6), "(b dp) h")
    assert cyclic is not None and len(cyclic.spans[0]) == 8
    assert cyclic.owners[1] == ((2, 3),)


def test_render_title_and_grid_owners() -> None:
    text = render((8, 6), "(dp b) (tp h)")
    assert text.splitlines()[0] == 'layout "(dp b) (tp h)" of shape (8, 6) on Mesh(dp=2, tp=2)'
    assert cell_at(text, "0:4", "3:6") == ["r1 dp0 tp1"]
    assert cell_at(text, "0:4", "0:3") == ["r0 dp0 tp0"]
    assert cell_at(text, "4:8", "3:6") == ["r3 dp1 tp1"]
    assert "\x1b[" not in text


def test_render_replicated_block_lists_all_owners() -> None:
    text = render((8, 6), "(dp b) h")
    assert cell_at(text, "0:4", "0:6") == ["r0 dp0 tp0", "r1 dp0 tp1"]
    assert cell_at(text, "4:8", "0:6") == ["r2 dp1 tp0", "r3 dp1 tp1"]
    assert "replicated over: tp" in text and "replica of r0" in text


def test_render_partial_is_marked() -> None:
    text = render((8, 6), "(b dp) h | sum(tp)")
    assert "partial sum over tp: values pending reduction" in text
    assert cell_at(text, "1:2", "0:6") == ["r2 dp1 tp0 (+)", "r3 dp1 tp1 (+)"]
    assert "0:8:2" in text and "1:9:2" in text


def test_render_cyclic_ranges() -> None:
    text = render((8, 6), "(b dp) h")
    assert cell_at(text, "1:2", "0:6") == ["r2 dp1 tp0", "r3 dp1 tp1"]
    assert "0:8:2" in text and "1:9:2" in text
    assert "b (dim 0)" in text  # the dim is named b, not dp


def test_render_uneven_shows_empty_shard() -> None:
    text = render((3, 6), "(dp tp b) h")
    assert "empty shards (hold no elements): r3" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("r3 "))
    assert "(0, 6)" in row and "∅" in row and "empty shard" in row


def test_render_3d_is_table_only() -> None:
    text = render((4, 4, 4), "(dp b) (tp h) c")
    assert "no block picture for a 3-D tensor" in text
    assert not grid_rows(text)
    row = next(line for line in text.splitlines() if line.strip().startswith("r3 "))
    assert row.split() == ["r3", "dp1", "tp1", "(2,", "2,", "4)", "2:4", "2:4", "0:4"]


def test_render_1d() -> None:
    text = render((8,), "(dp b)")
    assert grid_rows(text) == [[["0:4"], ["4:8"]],
                               [["r0 dp0 tp0", "r1 dp0 tp1"], ["r2 dp1 tp0", "r3 dp1 tp1"]]]


def test_render_many_blocks_falls_back_to_table() -> None:
    text = render((64, 6), "(b dp) h")
    assert "no block picture" in text and not grid_rows(text)
    assert "0:64:2" in text


def test_many_owners_are_compressed() -> None:
    mesh = mc.Mesh("dp=2 tp=4")
    assert display.owner_label(mesh, (0, 1, 2, 3, 4, 5, 6, 7)) == "r0-7\n(8 ranks)"
    assert display.owner_label(mesh, (0, 1), "max") == "r0 dp0 tp0 (max)\nr1 dp0 tp1 (max)"


def test_show_accepts_mesh_text_and_fixed_width() -> None:
    console = Console(width=60, no_color=True, force_terminal=False, record=True,
                      file=io.StringIO())
    display.show("dp=2", (4, 2), "(dp b) h", console=console)
    lines = console.export_text().splitlines()
    assert lines[0] == 'layout "(dp b) h" of shape (4, 2) on Mesh(dp=2)'
    assert max(len(line) for line in lines) <= 60


def test_export_svg(tmp_path) -> None:
    path = tmp_path / "layout.svg"
    display.export_svg(MESH, (8, 6), "(dp b) (tp h)", path)
    text = path.read_text()
    assert "<svg" in text and "dp0" in text


def test_narrow_grid_names_ranks_only() -> None:
    text = render((16, 64), "(dp b) (tp h)", mesh=mc.Mesh("dp=4 tp=8"))
    assert cell_at(text, "4:8", "24:32") == ["r11"]
    assert "(blocks name ranks only; coords are in the table)" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_render_empty_tensor() -> None:
    text = render((0, 6), "(dp b) h")
    assert "no block picture for a tensor with no elements" in text
    assert "empty shard" in text and "replica of" not in text


def test_colour_decorates_but_labels_stay() -> None:
    console = Console(width=100, force_terminal=True, color_system="truecolor", record=True,
                      file=io.StringIO())
    display.show(MESH, (8, 6), "(dp b) (tp h)", console=console)
    assert "\x1b[" in console.file.getvalue()  # type: ignore[attr-defined]
    assert cell_at(console.export_text(), "0:4", "3:6") == ["r1 dp0 tp1"]


def test_empty_shards_are_not_called_replicas() -> None:
    rows = shard_rows(mc.Mesh("dp=4"), (2,), "(dp b)")
    assert [r.replica_of for r in rows] == [None, None, None, None]
    assert "replica" not in rows[3].note


# -- widths: nothing split at 80 columns, nothing stretched at 200 ----------------------------
WIDE_PLAN = ("dp=8 tp=8 pp=4", (40960, 11008, 3200, 128), "(dp b) (pp s) (tp h) d",
             "(tp b) (dp s) (pp h) d")


def printed_plan(width: int) -> str:
    mesh, shape, src, dst = WIDE_PLAN
    p = mc.plan(mc.Mesh(mesh), shape, src, dst)
    console = Console(width=width, no_color=True, record=True, file=io.StringIO())
    display.show_plan(p, console=console)
    return console.export_text()


def test_a_plan_at_80_columns_splits_no_shape_layout_or_mesh() -> None:
    text = printed_plan(80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    whole = ["(5120, 2752, 400, 128)", "(5120, 1376, 800, 128)", '"(tp b) (dp s) (pp h) d"',
             "(40960, 11008, 3200, 128)", "Mesh(dp=8, tp=8, pp=4)", "dp0 tp0 pp1"]
    for atom in whole:
        assert any(atom in line for line in lines), (atom, text)
    # the step keeps every cell, labelled; each rank's ranges keep every dim
    flat = " ".join(text.split())
    for cell in ("send_recv over dp,tp,pp (256), as all_to_all", "sent 2.6 TiB",
                 "received 2.6 TiB", "peak mem 5.2 TiB"):
        assert cell in flat, (cell, text)
    assert "r1 dp0 tp0 pp1 (5120, 2752, 400, 128) b=0:5120 s=2752:5504 h=0:400 d=0:128" in flat


def test_a_plan_that_fits_keeps_its_table() -> None:
    text = printed_plan(160)
    assert "#  step       axes (group)    layout after" in text
    assert "(5120, 2752, 400, 128) -> (5120, 1376, 800, 128)  2.6 TiB" in text
    assert "b (dim 0)" in text


@pytest.mark.parametrize("width", [100, 200])
def test_a_wide_console_does_not_stretch_the_block_picture(width: int) -> None:
    text = render((8, 6), "(dp b) (tp h)", width=width)
    picture = [line for line in text.splitlines() if line.startswith(("┌", "│", "└"))]
    assert picture and display.MAX_PICTURE_WIDTH - 4 <= max(map(len, picture)) <= display.MAX_PICTURE_WIDTH
