"""The package's import graph, built with `ast` (nothing is imported): layers and no cycles.

Every `import` and `from ... import` anywhere in a file counts: at module level, inside
functions (lazy imports) and under `if TYPE_CHECKING:`. `from X import y` is an edge to the
module X.y when that is a module, else to X. The implicit import of a parent package (which
Python runs before any submodule) is not an edge. docs/architecture.md draws the layers.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "meshcomm"

# Bottom up. A module imports only from its own layer or below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("meshcomm.core",)),
    ("planner", ("meshcomm.planner",)),
    ("executors", ("meshcomm.executors",)),
    ("runtime", ("meshcomm.runtime",)),
    ("adapters", ("meshcomm.interop", "meshcomm.display", "meshcomm.pipeline_display",
                  "meshcomm.recipes", "meshcomm.testing")),
    ("sharded", ("meshcomm.sharded",)),
    ("building blocks", ("meshcomm.nn", "meshcomm.dtensor", "meshcomm.collectives",
                         "meshcomm.errors", "meshcomm.dryrun", "meshcomm.sim")),
    ("entry points", ("meshcomm.cli", "meshcomm.__main__", "meshcomm")),
)
# Siblings inside one layer that must not import each other (either direction).
SIBLINGS: tuple[tuple[str, str], ...] = (
    ("meshcomm.executors.sim", "meshcomm.executors.distributed"),
    ("meshcomm.interop", "meshcomm.display"),
    ("meshcomm.interop", "meshcomm.recipes"),
    ("meshcomm.display", "meshcomm.recipes"),
)
# Modules the tree must have (docs/architecture.md names them); missing ones fail.
REQUIRED = (
    "meshcomm.core.errors", "meshcomm.core.mesh", "meshcomm.core.notation",
    "meshcomm.core.layout", "meshcomm.core.reduce_ops", "meshcomm.core.names",
    "meshcomm.planner.values", "meshcomm.planner.explain", "meshcomm.planner.rearrange",
    "meshcomm.planner.states", "meshcomm.planner.blocks", "meshcomm.planner.moves",
    "meshcomm.planner.traffic", "meshcomm.planner.bounds", "meshcomm.planner.transfers",
    "meshcomm.planner.rank_transfers",
    "meshcomm.planner.search", "meshcomm.planner.crossmesh", "meshcomm.planner.plan",
    "meshcomm.planner.memo",
    "meshcomm.executors.steps", "meshcomm.executors.local", "meshcomm.executors.sim",
    "meshcomm.executors.distributed", "meshcomm.runtime.launch",
    "meshcomm.interop.placements", "meshcomm.interop.runtime", "meshcomm.sharded",
    "meshcomm.recipes", "meshcomm.display", "meshcomm.nn", "meshcomm.dtensor",
    "meshcomm.collectives", "meshcomm.errors", "meshcomm.cli", "meshcomm.dryrun",
    "meshcomm.sim", "meshcomm.executors.distributed.wire", "meshcomm.executors.distributed.groups",
    "meshcomm.executors.distributed.agreement",
    "meshcomm.runtime.bind", "meshcomm.runtime.checks", "meshcomm.runtime.collectives",
    "meshcomm.runtime.compiler",
)
# The one module that hands tensors to torch's functional collectives (and records them).
WIRE = "meshcomm.executors.distributed.wire"
# Who may import it: the engine's own package, and the functional collectives of the
# runtime (`mc.collectives`: one wire call per collective, no plan to run).
ENGINE = "meshcomm.executors.distributed"
FUNCTIONAL_COLLECTIVES = "meshcomm.runtime.collectives"
# The pure layers: no process groups, no printers, no config parsing, no executors.
PURE_LAYERS = ("meshcomm.core", "meshcomm.planner")
FORBIDDEN_IN_PURE = ("torch.distributed", "rich", "pydantic", "meshcomm.executors",
                     "meshcomm.display", "meshcomm.sharded")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    root = package.parent
    return {module_name(p, root): p for p in sorted(package.rglob("*.py"))}


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module name `path` imports anywhere in the file (relative imports resolved);
    `from X import y` gives both X and X.y (callers keep what exists)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
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


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a `from X import module` names the module
    only; parents that Python imports implicitly are not edges)."""
    mods = modules(package)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = imports(path, package.parent)
        edges = {m for m in found if m in mods}
        # `from X import sub` where X.sub is a module: the edge is to X.sub, not X.
        for m in list(edges):
            if any(f.startswith(m + ".") and f in mods for f in found) and not _names_non_module(
                    path, m, mods, package.parent):
                edges.discard(m)
        out[name] = edges - {name}
    return out


def _names_non_module(path: Path, module: str, mods: Mapping[str, Path], root: Path) -> bool:
    """Whether some `from module import y` (or `import module`) in `path` takes a y that is
    not a submodule, i.e. really needs `module` itself."""
    tree = ast.parse(path.read_text())
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            if name == module and any(f"{module}.{a.name}" not in mods for a in node.names):
                return True
    return False


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    """Index of `name`'s layer (the longest matching prefix wins)."""
    best, depth = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if within(name, p) and len(p) > depth:
                best, depth = i, len(p)
    return best


def upward(edges: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for src, dsts in edges.items():
        for dst in dsts:
            if layer_of(dst) > layer_of(src):
                bad.append(f"{src} ({LAYERS[layer_of(src)][0]}) imports {dst}"
                           f" ({LAYERS[layer_of(dst)][0]})")
    return sorted(bad)


GRAPH = graph()


# -- the checkers can fail: a fake package with a cycle and an upward import ---------------
def test_checkers_find_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "meshcomm"
    (pkg / "core").mkdir(parents=True)
    (pkg / "planner").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "planner" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ..planner import b\n")
    (pkg / "planner" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..core.a import f\n")
    edges = graph(pkg)
    assert edges["meshcomm.core.a"] == {"meshcomm.planner.b"}     # lazy import counted
    assert edges["meshcomm.planner.b"] == {"meshcomm.core.a"}     # TYPE_CHECKING counted
    assert cycles(edges) == [["meshcomm.core.a", "meshcomm.planner.b"]]
    assert upward(edges) == ["meshcomm.core.a (core) imports meshcomm.planner.b (planner)"]


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in GRAPH if layer_of(m) < 0)
    assert not missing, f"modules outside every layer: {missing}; add them to LAYERS"


@pytest.mark.parametrize("name", REQUIRED)
def test_required_module_exists(name: str) -> None:
    assert name in GRAPH, f"{name} is missing (tests/test_architecture.py names it)"


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == [], "import cycles"


def test_imports_point_down() -> None:
    assert upward(GRAPH) == []


@pytest.mark.parametrize("a, b", SIBLINGS)
def test_siblings_stay_apart(a: str, b: str) -> None:
    bad = sorted(f"{s} imports {d}" for s, ds in GRAPH.items() for d in ds
                 if within(s, a) and within(d, b) or within(s, b) and within(d, a))
    assert not bad


def test_pure_layers_never_import_executors_printers_or_process_groups() -> None:
    mods = modules()
    bad = []
    for name, path in mods.items():
        if any(within(name, p) for p in PURE_LAYERS):
            bad += [f"{name} imports {i}" for i in sorted(imports(path))
                    for banned in FORBIDDEN_IN_PURE if within(i, banned)]
    assert not bad


def test_no_folder_named_like_build_output() -> None:
    bad = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*")
           if p.is_dir() and p.name in ("dist", "build", "test", "tests", "out")]
    assert not bad


def test_the_launcher_is_not_a_testing_module() -> None:
    assert "meshcomm.runtime.launch" in GRAPH["meshcomm.cli"] or any(
        "launch" in i for i in imports(PACKAGE / "cli.py"))
    assert not any(within(m, "meshcomm.testing") for m in GRAPH["meshcomm.cli"])


def test_display_is_the_only_module_importing_rich() -> None:
    users = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                   if any(within(i, "rich") for i in imports(p)))
    assert users == ["meshcomm/display.py"]


def fenced_bash_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)]


def test_readme_test_command_is_what_ci_runs() -> None:
    blocks = fenced_bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2, "the README has exactly two set-up commands"
    command = blocks[1]
    assert "\n" not in command and "pytest" in command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run must run the README's test command verbatim: {command}"


def test_ci_script_fails_on_errors() -> None:
    text = (ROOT / ".ci" / "run").read_text()
    assert text.startswith("#!")
    assert "set -euo pipefail" in text or "set -e" in text


def test_only_the_wire_module_calls_functional_collectives() -> None:
    """Every functional-collective call goes through `wire`, which measures it (`Wire`)."""
    callers = sorted(name for name, path in modules().items()
                     if "torch.distributed._functional_collectives" in imports(path))
    assert callers == [WIRE], callers


def wire_importers(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """The modules importing `WIRE` other than the engine package and the functional
    collectives."""
    return sorted(name for name, dsts in edges.items() if WIRE in dsts
                  and not within(name, ENGINE) and name != FUNCTIONAL_COLLECTIVES)


def test_the_wire_checker_finds_a_second_caller(tmp_path: Path) -> None:
    pkg = tmp_path / "meshcomm"
    files = {
        "executors/distributed/wire.py": "",
        "executors/distributed/handlers.py": "from . import wire\n",
        "runtime/collectives.py": "from ..executors.distributed import wire\n",
        "runtime/checks.py": "def f():\n    from ..executors.distributed.wire import waited\n",
        "nn/losses.py": "from ..executors.distributed import groups\n",
    }
    for folder in ("", "executors", "executors/distributed", "runtime", "nn"):
        (pkg / folder).mkdir(parents=True, exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "executors/distributed/groups.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert wire_importers(graph(pkg)) == ["meshcomm.runtime.checks"]


def test_only_the_engine_imports_the_wire_module() -> None:
    """Only the engine (`meshcomm.executors.distributed`) and the functional collectives
    (`meshcomm.runtime.collectives`, one wire call each) import `wire`: every other module
    communicates through the engine (check mode: `agreement.compare`; group names:
    `groups.resolve_group`; a collective's result waited on: `runtime.collectives.wait`)."""
    bad = wire_importers(GRAPH)
    assert bad == [], f"{bad} import {WIRE}; fix: go through the engine package"


def test_executors_import_only_planner_values() -> None:
    """A plan runs without the planner: executors read the plan's values (steps, transfers
    listed per rank by `Step.rank_transfers`) and never import the planning modules."""
    found = {name: sorted(m for m in edges if m.startswith("meshcomm.planner")
                          and m != "meshcomm.planner.values")
             for name, edges in graph().items() if name.startswith("meshcomm.executors")}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


# The planner modules the plan values stand on: a step's local moves and the plan's text,
# which import no planner module themselves. Nothing of the search (states, moves, bounds,
# pairs, transfers, ...) is below the values, so an executor that imports them imports
# no search.
BELOW_VALUES = ("meshcomm.planner.explain", "meshcomm.planner.rearrange")


def test_plan_values_sit_below_the_planner_search() -> None:
    reached: set[str] = set()
    todo = ["meshcomm.planner.values"]
    while todo:
        for m in GRAPH[todo.pop()]:
            if within(m, "meshcomm.planner") and m not in reached:
                reached.add(m)
                todo.append(m)
    assert sorted(reached) == sorted(BELOW_VALUES), (
        "meshcomm.planner.values reaches these planner modules (directly or through others):"
        f" {sorted(reached)}; it may stand on {list(BELOW_VALUES)} only")
