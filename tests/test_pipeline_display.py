"""The pipeline timeline picture (`pipeline_display`, `display.render_timeline`) and
`meshcomm pipeline`: one row per rank with the actions' labels in schedule order, letters
alone under NO_COLOR, the Chrome trace and the CSV in PyTorch's notation."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from conftest import scaled
from meshcomm import cli, display
from meshcomm.pipeline_display import Block, format_seconds, label, timeline_grid, timeline_text
from meshcomm.planner.pipeline import Action, Schedule, StageCosts, build, simulate

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^rank +(\d+) │(.*)│ +(\d+)% idle")


def timeline(name: str, p: int, m: int, **kw: int):  # type: ignore[no-untyped-def]
    s = build(name, p, m, **kw)
    return simulate(s, StageCosts.uniform(s.n_stages, weight=1.0 if s.split_backward else 0.0,
                                          activation_bytes=2**20))


def render(tl, width: int = 160) -> str:  # type: ignore[no-untyped-def]
    console = Console(width=width, no_color=True, force_terminal=False, record=True,
                      file=io.StringIO())
    display.show_timeline(tl, console=console)
    return console.export_text()


def rows(text: str) -> dict[int, str]:
    """Rank -> the row's time columns."""
    return {int(m.group(1)): m.group(2) for m in map(ROW.match, text.splitlines()) if m}


def labels(cells: str) -> list[str]:
    return re.findall(r"(?:\d+)?[FBIW]\d+", cells)


@pytest.mark.parametrize("name, p, m, kw", [
    ("gpipe", 4, 4, {}), ("1f1b", 4, 8, {}), ("zero_bubble", 4, 6, {}),
    ("interleaved_1f1b", 2, 4, {"v": 2}), ("zero_bubble_v", 2, 4, {}),
])
def test_one_row_per_rank_with_every_action_in_order(name: str, p: int, m: int,
                                                     kw: dict[str, int]) -> None:
    tl = timeline(name, p, m, **kw)
    text = render(tl, width=240)
    got = rows(text)
    assert sorted(got) == list(range(p))
    several = tl.schedule.n_stages > p
    for r, row in enumerate(tl.schedule.rows):
        want = [str(a) if several else f"{a.kind}{a.microbatch}" for a in row]
        assert labels(got[r]) == want, (r, got[r])
    assert f"step {format_seconds(tl.step_time)}, bubble {tl.bubble_fraction:.1%}" in text


def test_the_picture_at_a_fixed_width() -> None:
    # 1F1B on 2 ranks, 2 microbatches, F 1 s, B 2 s, 9 s in 25 columns: rank 0 waits 2 s
    # for B0's gradient and 1 s for B1's; rank 1 waits 1 s for F0 and 2 s at the end
    text = render(timeline("1f1b", 2, 2), width=60)
    assert text.splitlines() == [
        "rank 0 │F0 F1 ·····B0    ··B1    │  33% idle  peak   2.0 MiB",
        "rank 1 │···F0 B0   F1 B1   ······│  33% idle  peak   1.0 MiB",
        "        0                     9 s",
        "         F  forward   B  backward",
        "1f1b: 2 ranks, 2 stages, 2 microbatches",
        "step 9 s, bubble 33.3%, peak activations 2.0 MiB (rank 0)",
    ]


def test_plain_text_equals_the_no_color_picture() -> None:
    tl = timeline("zero_bubble", 4, 8)
    plain = timeline_text(tl, width=120).splitlines()
    pic = [line.rstrip() for line in render(tl, width=120).splitlines()]
    assert [line for line in pic if "forward" not in line] == plain


def test_colour_is_decoration_only() -> None:
    tl = timeline("zero_bubble_v", 2, 4)
    console = Console(width=140, force_terminal=True, color_system="truecolor", record=True,
                      file=io.StringIO())
    display.show_timeline(tl, console=console)
    assert "\x1b[" in console.file.getvalue()          # type: ignore[attr-defined]
    assert console.export_text() == render(tl, width=140)


def test_labels_shrink_to_fit() -> None:
    a = Action(4, "F", 3)
    # several stages a rank: a space after every label (the next may start with a digit)
    assert [label(a, w, several=True) for w in (5, 4, 3, 2, 1, 0)] == ["4F3", "4F3", "F3", "F",
                                                                       "", ""]
    assert [label(a, w, several=False) for w in (2, 1)] == ["F3", "F"]
    assert Block(a, 0, 4, "F3", 0).text == "F3  "


def test_actions_too_short_for_a_column_are_counted() -> None:
    tl = timeline("1f1b", 4, 64)
    grid = timeline_grid(tl, 40)
    shown = sum(len(r.blocks) for r in grid.rows)
    assert grid.hidden > 0 and shown + grid.hidden == len(tl.events)
    assert f"{grid.hidden} actions too short to draw at 40 columns" in grid.footer()


def test_cli_draws_and_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "out.json"
    assert cli.main(["pipeline", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                     "--width", "160", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert sorted(rows(out)) == [0, 1, 2, 3]
    assert "step 33 s, bubble 27.3%, peak activations 4.0 MiB (rank 0)" in out
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4 * 8 * 2
    assert sorted(e["name"] for e in spans) == sorted(
        str(a) for row in build("1f1b", 4, 8).rows for a in row)
    assert f"wrote {trace} (64 events" in out


@pytest.mark.parametrize("argv", [
    ["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"],
    ["--schedule", "interleaved_1f1b", "--ranks", "2", "--microbatches", "4",
     "--stages-per-rank", "3"],
    ["--schedule", "zero_bubble_v", "--ranks", "3", "--microbatches", "5"],
])
def test_csv_round_trips(argv: list[str], tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    built = build(argv[1], int(argv[3]), int(argv[5]),
                  **({"v": int(argv[7])} if len(argv) > 6 else {}))
    for comms in ([], ["--comms"]):
        assert cli.main(["pipeline", *argv, "--csv", *comms]) == 0
        text = capsys.readouterr().out
        assert Schedule.from_csv(text).rows == (built.with_comms() if comms
                                                else built.compute_only()).rows
    path = tmp_path / "s.csv"
    path.write_text(text)
    assert cli.main(["pipeline", "--from-csv", str(path), "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert f"s.csv: {built.n_ranks} ranks, {built.n_stages} stages" in out
    assert len(rows(out)) == built.n_ranks


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "1f1b", "--stages-per-rank", "2"], "--stages-per-rank goes with"),
    (["--weight", "3"], "expected 0 <= weight <= --backward 2"),
    (["--schedule", "interleaved_1f1b", "--microbatches", "6"], "a multiple of the ranks"),
    (["--from-csv", "no/such.csv"], "--from-csv no/such.csv:"),
])
def test_cli_bad_input_returns_2(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pipeline", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshcomm: ScheduleError: ") and message in err


def test_no_color_in_a_subprocess() -> None:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "meshcomm", "pipeline", "--schedule",
                           "zero_bubble", "--ranks", "2", "--microbatches", "3"],
                          capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout
    got = rows(done.stdout)
    assert labels(got[0]) == [f"{a.kind}{a.microbatch}" for a in build("zero_bubble", 2, 3)
                              .rows[0]]
    assert all(len(line) <= 100 for line in done.stdout.splitlines())
