"""The public surface (docs/api.md): what `mc` exports, its namespaces (each a module), and
the 0.1 spellings removed in 0.2, whose errors name the one new spelling."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

import meshcomm as mc

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"Mesh", "Layout", "CostModel", "Plan", "Step", "BoundMesh", "ByteTrace", "Sharded",
          "Recipe"}
FUNCTIONS = {"plan", "init_mesh", "distribute", "reshard", "reshard_many", "logical", "recipe",
             "show", "show_plan"}
NAMESPACES = {"collectives", "dryrun", "dtensor", "errors", "sim", "nn"}


def test_all_is_the_documented_surface() -> None:
    assert set(mc.__all__) == VALUES | FUNCTIONS | NAMESPACES
    assert len(mc.__all__) == len(set(mc.__all__)) == 24
    for name in mc.__all__:
        assert getattr(mc, name) is not None


def test_dir_lists_the_public_names_only() -> None:
    """`dir(mc)` (tab completion) offers the exports, not the helpers the module imports."""
    names = dir(mc)
    assert names == sorted(VALUES | FUNCTIONS | NAMESPACES | {"__version__"})
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "warnings"} & set(names)
    for name in names:
        assert getattr(mc, name) is not None, name


@pytest.mark.parametrize("namespace", sorted(NAMESPACES - {"nn"}))
def test_every_namespace_name_resolves(namespace: str) -> None:
    module = getattr(mc, namespace)
    assert module.__all__, namespace
    for name in module.__all__:
        assert getattr(module, name) is not None, f"mc.{namespace}.{name}"


def test_errors_print_with_their_public_module() -> None:
    assert mc.errors.ShapeError.__module__ == "meshcomm.errors"
    assert issubclass(mc.errors.ShapeError, mc.errors.MeshcommError)


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_namespace_imports_as_a_module(namespace: str) -> None:
    module = importlib.import_module(f"meshcomm.{namespace}")
    assert module is getattr(mc, namespace)


def test_names_import_from_the_sim_module() -> None:
    from meshcomm.sim import execute, scatter

    assert scatter is mc.sim.scatter and execute is mc.sim.execute


REMOVED = {   # 0.1 spellings, removed in 0.2: each error names the one spelling to use
    "all_gather": "mc.collectives.all_gather", "sendrecv": "mc.collectives.sendrecv",
    "from_dtensor": "mc.dtensor.from_dtensor", "to_placements": "mc.dtensor.to_placements",
    "ShapeError": "mc.errors.ShapeError", "RankFailure": "mc.errors.RankFailure",
    "as_layout": "mc.Layout(...)", "plan_cache_info": "meshcomm.planner.plan_cache_info",
    "dist": "meshcomm.executors.distributed", "checks": "mc.init_mesh(..., check=True)",
}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_removed_spellings_raise_naming_the_new_one(name: str) -> None:
    with pytest.raises(AttributeError, match=re.escape(f"mc.{name} was removed in meshcomm 0.2"
                                                       f" (docs/changelog.md); use"
                                                       f" {REMOVED[name]}")):
        getattr(mc, name)


def test_unknown_names_still_raise_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'all_gahter'"):
            mc.all_gahter  # noqa: B018


def test_docs_and_examples_use_no_deprecated_spelling() -> None:
    old = "|".join(["all_gather", "all_reduce", "all_to_all", "broadcast", "collective_permute",
                    "reduce_scatter", "sendrecv", "from_dtensor", "to_dtensor", "to_placements",
                    "from_placements", "bind_device_mesh", "as_layout", "plan_cache_info",
                    "set_plan_cache_size", "checks", "dist", r"[A-Z]\w*Error", "RankFailure"])
    pattern = re.compile(rf"\bmc\.({old})\b")
    files = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("examples/*.py"),
             *ROOT.glob("benchmarks/*.py")]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and p.name != "architecture.md"
            and "changelog" not in p.name and "0.1" not in line]
    assert not hits, "\n".join(hits)


def test_every_cache_in_the_docs_table_exists_and_is_bounded() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    table = text[text.index("| cache | what it keys |"):text.index("bounds each plan cache")]
    names = [n for n in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", table)
             if not n.startswith("mc.") and n != "runtime.checks"]
    assert len(names) >= 25
    for name in names:
        module, _, attr = name.rpartition(".")
        cached = getattr(importlib.import_module(f"meshcomm.{module}"), attr)
        assert cached.cache_info().maxsize, name


def test_version_is_the_package_s() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10: the tomli backport (a dependency there)
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert mc.__version__ == project["version"]


def test_attention_names_are_exported_from_nn() -> None:
    """`mc.nn` exports the attention entry points side by side (docs/api.md), each the
    attention package's own."""
    package = importlib.import_module("meshcomm.nn.attention")
    for name in ("attention", "attention_costs", "attention_explain", "attention_reference"):
        assert name in mc.nn.__all__, name
        assert getattr(mc.nn, name) is getattr(package, name), name
