"""explain: the plain-text plan table, its rich version, and `meshcomm plan` / `demo`."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

import meshcomm as mc
from meshcomm import cli, display
from meshcomm.core.units import format_bytes, format_us
from meshcomm.planner.explain import NO_STEPS, format_plan

MESH = mc.Mesh("dp=2 tp=4")
SRC, DST = "(dp b) s (tp h)", "b (dp s) (tp h)"
ISSUE = mc.plan(MESH, (8, 16, 32), SRC, DST)
PLAN_ARGV = ["plan", "--mesh", "dp=2 tp=4", "--shape", "8,16,32", "--src", SRC, "--dst", DST,
             "--width", "100"]


@pytest.fixture(autouse=True)
def _no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")


def render(p: mc.Plan, width: int = 100, **kwargs: bool) -> str:
    console = Console(width=width, no_color=True, force_terminal=False, record=True,
                      file=io.StringIO())
    mc.show_plan(p, console=console, **kwargs)
    return console.export_text()


# -- plain text ---------------------------------------------------------------------
def test_format_all_to_all() -> None:
    lines = format_plan(ISSUE).splitlines()
    assert lines[0] == ('plan "(dp b) s (tp h)" -> "b (dp s) (tp h)": shape (8, 16, 32) float32'
                        " on Mesh(dp=2, tp=4)")
    assert lines[1].split() == ["#", "step", "axes", "(group)", "local", "shape", "sent",
                                "received", "peak", "mem"]
    assert lines[2].split() == ["1", "all_to_all", "dp", "(2)", "(4,", "16,", "8)", "->", "(8,",
                                "8,", "8)", "1.0", "KiB", "1.0", "KiB", "4.0", "KiB"]
    assert lines[3].strip() == '"(dp b) s (tp h)" -> "b (dp s) (tp h)"'
    assert lines[4] == "total: 1 collective in 1 step, 1.00x of the lower bound (1024 B)"
    assert "busiest rank sends 1.0 KiB and receives 1.0 KiB (all ranks receive 8.0 KiB)" in lines[5]
    assert lines[6] == "  peak memory 4.0 KiB per rank"   # the default models no time
    assert lines[7] == 'before: "(dp b) s (tp h)"  local (4, 16, 8); sharded over dp, tp'
    assert lines[8] == 'after:  "b (dp s) (tp h)"  local (8, 8, 8); sharded over dp, tp'
    assert max(len(line) for line in lines) <= 100


def test_str_and_explain_are_format_plan() -> None:
    assert str(ISSUE) == ISSUE.explain() == format_plan(ISSUE)


def test_format_local_slice_then_all_reduce() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "b s | sum(tp)", "(dp b) s")
    text = format_plan(p)
    rows = [line.split() for line in text.splitlines()[2:6:2]]
    assert rows[0][:3] == ["1", "slice", "dp"] and rows[0][-6:-2] == ["0", "B", "0", "B"]
    assert rows[1][:4] == ["2", "all_reduce", "sum", "tp"]
    assert '"b s | sum(tp)" -> "(dp b) s | sum(tp)"' in text
    assert "total: 1 collective in 2 steps, 1.00x of the lower bound (96 B)" in text
    assert 'before: "b s | sum(tp)"  local (8, 6); replicated over dp; pending sum over tp' in text


def test_format_empty_plan() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(dp b) s", "(dp b) s")
    lines = format_plan(p).splitlines()
    assert lines[1] == NO_STEPS == "(no communication: layouts are equal)"
    assert lines[2] == "total: 0 collectives in 0 steps, 1.00x of the lower bound (0 B)"
    assert lines[4] == "  peak memory 96 B per rank"


def test_time_is_shown_only_with_a_cost_model() -> None:
    """The default CostModel's bandwidth is a placeholder: its times (0.0102 µs for 1 KiB)
    read as broken, so the column and the total appear once latency or bandwidth is given."""
    cm = mc.CostModel(latency_s={"dp": 20e-6, "tp": 2e-6}, bandwidth=25e9)
    timed = mc.plan(ISSUE.mesh, ISSUE.shape, ISSUE.src, ISSUE.dst, cost_model=cm)
    lines = format_plan(timed).splitlines()
    assert "time (µs)" in lines[1] and "time (µs)" not in format_plan(ISSUE)
    assert lines[2].split()[-3:] == ["20.0", "4.0", "KiB"]     # 20 µs + 1024 B / 25 GB/s (0.04 µs)
    assert lines[6] == "  peak memory 4.0 KiB per rank; modelled time 20.0 µs"
    assert not mc.CostModel().models_time and cm.models_time
    assert mc.CostModel(bandwidth={"dp": 100e9}).models_time   # per-axis numbers count as given
    assert "time (µs)" in render(timed) and "time (µs)" not in render(ISSUE)


def test_format_multi_axis_group() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(b dp tp) s", "(dp tp b) s")
    assert format_plan(p).splitlines()[2].split()[:4] == ["1", "send_recv", "dp,tp", "(4)"]


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                     (1536, "1.5 KiB"), (2**20 - 1, "1.0 MiB"),
                                     (5 * 2**30, "5.0 GiB"), (2**17, "128 KiB"),
                                     (1023 * 2**20, "1023 MiB"), (2**60, "1024 PiB")])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("seconds, text", [(0.0, "0"), (1.024e-08, "0.0102"), (2e-6, "2.00"),
                                           (1.5e-3, "1500")])
def test_format_us(seconds: float, text: str) -> None:
    assert format_us(seconds) == text


# -- rich -----------------------------------------------------------------------------
def test_show_plan_draws_table_totals_and_both_pictures() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(b dp) h | sum(tp)", "(dp tp b) h")
    out = render(p)
    assert out.splitlines()[0] == ('plan "(b dp) h | sum(tp)" -> "(dp tp b) h": shape (8, 6)'
                                   " float32 on Mesh(dp=2, tp=2)")
    # each partial straight to its owner: one step at the bound (a reduce_scatter and an
    # all_to_all before the default cost model had a latency)
    assert "send_recv sum" in out and "partials to their owners, as all_to_all" in out
    assert "of the lower bound (72 B)" in out
    before = out.index('layout "(b dp) h | sum(tp)" of shape (8, 6) on Mesh(dp=2, tp=2)')
    after = out.index('layout "(dp tp b) h" of shape (8, 6) on Mesh(dp=2, tp=2)')
    assert out.index("total:") < before < after
    assert "r0 dp0 tp0 (+)" in out and "\x1b[" not in out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 100


def test_show_plan_without_pictures_and_empty() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=2"), (8, 6), "(dp b) s", "(dp b) s")
    out = render(p, pictures=False)
    assert NO_STEPS in out and "layout " not in out and "shards per rank" not in out


def test_render_plan_issue_row() -> None:
    console = Console(width=100, no_color=True, record=True, file=io.StringIO())
    console.print(display.render_plan(ISSUE, width=100))
    out = console.export_text()
    row = next(line for line in out.splitlines() if "all_to_all" in line).split()
    assert row == ["1", "all_to_all", "dp", "(2)", "(4,", "16,", "8)", "->", "(8,", "8,", "8)",
                   "1.0", "KiB", "1.0", "KiB", "4.0", "KiB"]
    assert out.count("shards per rank") == 2


# -- cli --------------------------------------------------------------------------------
def test_cli_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(PLAN_ARGV) == 0
    out, err = capsys.readouterr()
    assert out.startswith('plan "(dp b) s (tp h)" -> "b (dp s) (tp h)"') and err == ""
    assert "all_to_all" in out and "dp (2)" in out and "1.00x of the lower bound (1024 B)" in out
    assert 'layout "(dp b) s (tp h)" of shape' in out and 'layout "b (dp s) (tp h)" of shape' in out


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*PLAN_ARGV, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(json.dumps(ISSUE.to_json()))
    assert {"mesh", "shape", "dtype", "src", "dst", "send_bytes", "recv_bytes", "recv_bytes_sum",
            "lower_bound_bytes", "bound_ratio", "peak_bytes", "cost_s", "plan"} <= set(data)
    assert data["plan"][0]["kind"] == "all_to_all" and data["plan"][0]["axes"] == ["dp"]
    assert data["recv_bytes"] == data["lower_bound_bytes"] == 1024


def plan_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    assert cli.main([*PLAN_ARGV, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_cli_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, "--dtype", "bfloat16")
    assert data["dtype"] == "torch.bfloat16" and data["recv_bytes"] == 512


@pytest.mark.parametrize("flags, cost", [     # a latency not given is NCCL's default, 10 µs
    ((), 10e-6 + 1024 / 100e9),
    (("--latency-s", "2e-6"), 2e-6 + 1024 / 100e9),
    (("--latency-s", "dp=20e-6,tp=2e-6"), 20e-6 + 1024 / 100e9),
    (("--bandwidth", "1e9"), 10e-6 + 1024 / 1e9),
    (("--bandwidth", "dp=25e9,tp=450e9", "--latency-s", "1e-6"), 1e-6 + 1024 / 25e9),
    (("--bandwidth", "1e9,dp=2e9"), 10e-6 + 1024 / 2e9),
])
def test_cli_cost_model_flags(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                              cost: float) -> None:
    assert plan_json(capsys, *flags)["cost_s"] == pytest.approx(cost)


def test_cost_flags_match_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    cm = mc.CostModel(latency_s={"dp": 20e-6, "tp": 2e-6}, bandwidth=25e9)
    want = mc.plan(MESH, (8, 16, 32), SRC, DST, cost_model=cm).cost
    assert plan_json(capsys, "--latency-s", "dp=20e-6 tp=2e-6", "--bandwidth", "25e9")["cost_s"] \
        == pytest.approx(want)


@pytest.mark.parametrize("flags, message", [
    (("--latency-s", "fast"), 'argument --latency-s: "fast" is not a number or a list of'),
    (("--bandwidth", "dp=1e9,dp=2e9"), 'argument --bandwidth: "dp=1e9,dp=2e9" is not a number'),
    (("--bandwidth", "0"), "CostModel needs bandwidth > 0 and latency >= 0"),
    (("--latency-s", "dq=1e-6"),
     'MeshAxisError: --latency-s names "dq", not an axis of Mesh(dp=2, tp=4) (axes: dp, tp);'
     ' fix: did you mean "dp"?'),
    (("--dtype", "float8"), "argument --dtype: invalid choice: 'float8'"),
    (("--src", "(dq b) s (tp h)"), '"dq" is not a mesh axis'),
    (("--shape", "8,16"), "ShapeError"),
])
def test_cli_plan_bad_input_exits_2(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                                    message: str) -> None:
    assert cli.main([*PLAN_ARGV, *flags]) == 2
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err and out == ""


def test_cli_plan_missing_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--mesh", "dp=2", "--shape", "4", "--src", "(dp b)"]) == 2
    assert "--dst" in capsys.readouterr().err


def test_demo_runs_planned_reshards(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("OK: ") == len(cli.DEMO_LAYOUTS)
    pairs = zip(cli.DEMO_LAYOUTS, cli.DEMO_LAYOUTS[1:] + cli.DEMO_LAYOUTS[:1])
    for src, dst in pairs:
        assert f'plan "{src}" -> "{dst}": shape (8, 6) float32 on Mesh(dp=2, tp=2)' in out
    assert out.count("of the lower bound") == len(cli.DEMO_LAYOUTS)
    assert "bytes moved as planned" in out


def test_explain_shows_how_a_step_runs_where_it_is_not_its_own_kind() -> None:
    even = mc.plan(mc.Mesh("tp=4"), (8, 6), "(tp a) b", "a b")
    uneven = mc.plan(mc.Mesh("tp=4"), (10, 6), "(tp a) b", "a b")
    assert [(s.kind, s.wire) for s in even.steps] == [("all_gather", "all_gather")]
    assert [(s.kind, s.wire) for s in uneven.steps] == [("all_gather", "all_to_all")]
    assert '"(tp a) b" -> "a b"\n' in even.explain() + "\n"
    assert '   "(tp a) b" -> "a b"; as all_to_all' in uneven.explain().splitlines()
    assert uneven.rows()[0]["wire"] == "all_to_all"


@pytest.mark.parametrize("width", [80, 60])
def test_a_narrow_console_wraps_the_plan_table_and_drops_no_column(width: int) -> None:
    p = mc.plan(mc.Mesh("tp=4"), (10, 6), "(tp a) b", "a (tp b)",
                cost_model=mc.CostModel(latency_s=5e-6))    # with its time column
    console = Console(file=io.StringIO(), width=width, no_color=True)
    display.show_plan(p, console=console, pictures=False)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert max(len(line) for line in text.splitlines()) <= width
    if width >= 80:    # narrower still, long words fold across lines (nothing is dropped)
        flat = " ".join(text.split())
        for word in ("sent", "peak", "mem", "(µs)", "send_recv", "as all_to_all"):
            assert word in flat, (word, text)
    row = p.rows()[0]
    for cell in ("48 B", "56 B", "152 B", format_us(row["time_s"])):
        assert cell in text, (cell, text)


def test_a_plan_s_repr_is_one_line() -> None:
    """At a REPL a plan shows its move, not a dump of every field (print() gives the table)."""
    p = mc.plan(mc.Mesh("dp=2 tp=4"), (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)")
    assert repr(p) == ('Plan("(dp b) s (tp h)" -> "b (dp s) (tp h)", shape=(8, 16, 32), float32,'
                       " Mesh(dp=2, tp=4), steps=[all_to_all(dp)])")
    cross = mc.plan(mc.Mesh("tp=2"), (8, 4), "(tp b) h", "b h",
                    dst_mesh=mc.Mesh("tp=2", ranks=[2, 3]))
    assert repr(cross).endswith("dst_mesh=Mesh(tp=2, ranks=[2, 3]), steps=[send_recv])")
