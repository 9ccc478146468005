"""The package type-checks under mypy --strict and passes ruff (pyproject.toml's settings),
with the versions the test extra pins: CI runs both through this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import scaled

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=scaled(900))


def test_mypy_strict_over_the_whole_package() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e .[test]")
    done = _run("mypy")           # [tool.mypy]: strict, files = ["meshcomm"]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout


def test_ruff_over_the_whole_package() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e .[test]")
    done = _run("ruff", "check", "meshcomm")   # [tool.ruff]: 100 columns, E W F I
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
