"""Import layering (checked with `ast`, nothing is imported) and README/CI agreement."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "meshcomm"
PURE = ("errors", "mesh", "notation", "layout", "states", "moves", "plan", "bounds",
        "rearrange", "blocks")
FORBIDDEN = ("torch.distributed", "rich", "pydantic", "meshcomm.sim", "meshcomm.dist",
             "meshcomm.display")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, with relative imports resolved.

    `from X import y` counts as importing both X and X.y (y may be a submodule).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def violates(name: str, banned: str) -> bool:
    return name == banned or name.startswith(banned + ".")


def test_import_resolution_helper():
    assert "meshcomm.sim.collectives" in imports(PACKAGE / "sim" / "shards.py")
    assert "meshcomm.errors" in imports(PACKAGE / "sim" / "shards.py")
    assert "meshcomm.sim" in imports(PACKAGE / "__init__.py")
    assert "meshcomm.errors" in imports(PACKAGE / "mesh.py")


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_never_import_executors_or_printers(name):
    path = PACKAGE / f"{name}.py"
    if not path.exists():
        pytest.skip(f"meshcomm/{name}.py does not exist yet")
    bad = sorted(i for i in imports(path) for banned in FORBIDDEN if violates(i, banned))
    assert not bad, f"meshcomm/{name}.py imports {bad}; pure modules must not (STYLE.md §1)"


def meshcomm_imports_closure(start: str) -> set[str]:
    """Modules of meshcomm reachable from `start` through explicit imports."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        rel = name.split(".")[1:]
        for path in (ROOT.joinpath("meshcomm", *rel).with_suffix(".py"),
                     ROOT.joinpath("meshcomm", *rel, "__init__.py")):
            if rel and path.exists():
                todo.extend(i for i in imports(path) if i.startswith("meshcomm.")
                            and i not in seen)
                break
    return seen


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_do_not_reach_executors_through_other_modules(name):
    if not (PACKAGE / f"{name}.py").exists():
        pytest.skip(f"meshcomm/{name}.py does not exist yet")
    reached = meshcomm_imports_closure(f"meshcomm.{name}")
    bad = sorted(m for m in reached for banned in FORBIDDEN if violates(m, banned))
    assert not bad, f"meshcomm/{name}.py reaches {bad} through its imports"
    for module in reached:
        rel = module.split(".")[1:]
        path = ROOT.joinpath("meshcomm", *rel).with_suffix(".py")
        if path.exists():
            third = sorted(i for i in imports(path) for banned in FORBIDDEN[:3]
                           if violates(i, banned))
            assert not third, f"meshcomm/{name}.py reaches {module}, which imports {third}"


def test_display_is_the_only_module_importing_rich():
    users = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                   if any(violates(i, "rich") for i in imports(p)))
    assert users == ["meshcomm/display.py"]


def fenced_bash_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)]


def test_readme_test_command_is_what_ci_runs():
    blocks = fenced_bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2, "the README has exactly two set-up commands"
    command = blocks[1]
    assert "\n" not in command and "pytest" in command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run must run the README's test command verbatim: {command}"


def test_ci_script_fails_on_errors():
    text = (ROOT / ".ci" / "run").read_text()
    assert text.startswith("#!")
    assert "set -euo pipefail" in text or "set -e" in text
