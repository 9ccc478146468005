"""cli: exit codes, output and error messages of `meshcomm show|demo`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshcomm import cli

from conftest import scaled

def show_argv(mesh: str = "dp=2 tp=2", shape: str = "8,6",
              layout: str = "(dp b) (tp h)") -> list[str]:
    return ["show", "--mesh", mesh, "--shape", shape, "--layout", layout, "--width", "100"]


@pytest.fixture(autouse=True)
def _no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")


def test_show_prints_grid_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(show_argv()) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == 'layout "(dp b) (tp h)" of shape (8, 6) on Mesh(dp=2, tp=2)'
    assert "r1 dp0 tp1" in out and "shards per rank" in out
    assert "\x1b[" not in out and err == ""


def test_show_partial_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(show_argv(layout="(b dp) h | sum(tp)")) == 0
    out = capsys.readouterr().out
    assert "partial sum over tp: values pending reduction" in out and "0:8:2" in out


def test_show_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.svg"
    assert cli.main([*show_argv(), "--svg", str(path)]) == 0
    assert "<svg" in path.read_text()
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (show_argv(layout="(dq b) (tp h)"),
     'MeshAxisError: layout "(dq b) (tp h)" on Mesh(dp=2, tp=2)'),
    (show_argv(layout="(dp b (tp h)"), 'LayoutSyntaxError: cannot parse layout "(dp b (tp h)"'),
    (show_argv(mesh="dp=2 tp"), 'MeshAxisError: cannot parse mesh "dp=2 tp"'),
    (show_argv(shape="7,6", layout="(b dp) (tp h)"),
     'ShapeError: layout "(b dp) (tp h)" does not fit dim 0 of size 7'),
    (show_argv(shape="8,6,4"), 'ShapeError: layout "(dp b) (tp h)" has 2 dims'),
])
def test_meshcomm_errors_exit_2(argv: list[str], message: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("meshcomm: ") and message in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("shape", ["8,x", "", "8,-6"])
def test_bad_shape_names_the_flag(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(show_argv(shape=shape)) == 2
    err = capsys.readouterr().err
    assert f'argument --shape: "{shape}" is not a shape' in err and "e.g. 8,6" in err


@pytest.mark.parametrize("text, shape", [("8,6", (8, 6)), ("(8, 6)", (8, 6)), ("8 6 2", (8, 6, 2)),
                                         ("5", (5,))])
def test_parse_shape(text: str, shape: tuple[int, ...]) -> None:
    assert cli.parse_shape(text) == shape


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2
    assert cli.main(["show", "--mesh", "dp=2"]) == 2
    assert "required" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--width", "120"]) == 0
    out = capsys.readouterr().out
    for layout in cli.DEMO_LAYOUTS:
        assert f'layout "{layout}" of shape (8, 6) on Mesh(dp=2, tp=2)' in out
    ok = [line for line in out.splitlines() if line.startswith("OK: ")]
    assert len(ok) == 3 and "FAIL" not in out
    assert 'reshard "(b dp) h | sum(tp)" -> "(dp tp b) h"' in out


def test_demo_reshard_reports_failure(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from meshcomm.executors import sim

    real = sim.scatter
    calls = []

    def wrong_scatter(x, mesh, layout):  # type: ignore[no-untyped-def]
        calls.append(layout)
        shards = real(x, mesh, layout)
        return [s + 1 for s in shards] if len(calls) == 2 else shards

    monkeypatch.setattr(sim, "scatter", wrong_scatter)
    assert cli.main(["demo"]) == 1
    assert "FAIL: " in capsys.readouterr().out


def test_commands_are_registered() -> None:
    assert set(cli.COMMANDS) >= {"show", "demo"}
    parser = cli.build_parser()
    assert parser.parse_args(show_argv()).shape == (8, 6)


def test_cli_does_not_import_rich() -> None:
    tree = ast.parse(Path(cli.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "rich"]


def test_python_dash_m() -> None:
    root = Path(cli.__file__).resolve().parent.parent
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "meshcomm", *show_argv(layout="(dq b) h")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=scaled(60))
    assert done.returncode == 2 and '"dq" is not a mesh axis' in done.stderr


def test_recipe_list_fits_the_terminal(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20 item 12: at 80 columns the list was 123 wide; descriptions now wrap."""
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["recipe", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.startswith("ddp ") for line in lines)
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["recipe", "list"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert len(wide) < len(lines)       # room enough: one line per recipe
