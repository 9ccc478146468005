"""The public surface (docs/api.md): what `mc` exports, its namespaces, and the 0.1 spellings
that still work with a DeprecationWarning naming the one new spelling."""

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


@pytest.mark.parametrize("namespace", sorted(NAMESPACES - {"nn"}))
def test_every_namespace_name_resolves(namespace: str) -> None:
    module = getattr(mc, namespace)
    assert module.__all__, namespace
    for name in module.__all__:
        assert getattr(module, name) is not None, f"mc.{namespace}.{name}"


def test_errors_print_with_their_public_module() -> None:
    assert mc.errors.ShapeError.__module__ == "meshcomm.errors"
    assert issubclass(mc.errors.ShapeError, mc.errors.MeshcommError)


OLD = {
    "all_gather": (mc.collectives, "mc.collectives.all_gather"),
    "sendrecv": (mc.collectives, "mc.collectives.sendrecv"),
    "from_dtensor": (mc.dtensor, "mc.dtensor.from_dtensor"),
    "to_placements": (mc.dtensor, "mc.dtensor.to_placements"),
    "ShapeError": (mc.errors, "mc.errors.ShapeError"),
    "RankFailure": (mc.errors, "mc.errors.RankFailure"),
}


@pytest.mark.parametrize("name", sorted(OLD))
def test_old_spellings_warn_and_are_the_same_object(name: str) -> None:
    home, instead = OLD[name]
    with pytest.warns(DeprecationWarning, match=re.escape(instead)):
        old = getattr(mc, name)
    assert old is getattr(home, name)


def test_other_old_spellings() -> None:
    with pytest.warns(DeprecationWarning, match=r"mc\.Layout"):
        assert mc.as_layout("b h") == mc.Layout("b h")
    with pytest.warns(DeprecationWarning, match="meshcomm.planner.plan_cache_info"):
        assert "maxsize" in mc.plan_cache_info()
    with pytest.warns(DeprecationWarning, match="meshcomm.executors.distributed"):
        assert mc.dist.init_mesh is mc.init_mesh
    with pytest.warns(DeprecationWarning, match=r"check=True"):
        assert callable(mc.checks)


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
            and "deprecated" not in line and "0.1" not in line]
    assert not hits, "\n".join(hits)


def test_every_cache_in_the_docs_table_exists_and_is_bounded() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    table = text[text.index("| cache | what it keys |"):text.index("bounds each plan cache")]
    names = [n for n in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", table)
             if not n.startswith("mc.") and n != "executors.distributed.checks"]
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
