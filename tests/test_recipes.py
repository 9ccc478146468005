"""recipes: every layouts/*.toml, logical() resolution, recipe file errors, `meshcomm recipe`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import meshcomm as mc
from meshcomm import cli, recipes
from meshcomm.core.errors import LayoutSyntaxError, MeshAxisError, RecipeError

from conftest import scaled

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"ddp", "fsdp", "tp", "fsdp_tp", "sequence_parallel", "expert_parallel"}


@pytest.fixture(autouse=True)
def _no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")


# -- built-ins -----------------------------------------------------------------------
def test_builtins_are_the_layouts_folder() -> None:
    names = set(recipes.builtin_recipes())
    assert names >= REQUIRED
    assert names == {p.stem for p in (ROOT / "layouts").glob("*.toml")}


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "layouts").glob("*.toml")))
def test_every_builtin_loads_and_resolves(name: str) -> None:
    r = mc.recipe(name)
    assert r.name == name and r.description and r.tensors and repr(r) == f"recipe('{name}')"
    kinds = {t.kind for t in r.tensors}
    assert {"param", "activation"} <= kinds, "show both parameters and activations"
    used = {a for _, axes in r.rules for a in axes}
    assert used <= set(r.mesh.axis_names)
    for t in r.tensors:
        layout = r.layout(t.logical)
        assert mc.Layout(str(layout)) == layout
        assert t.shape is not None, f"{name}: tensor {t.name} has no example shape"
        placed = layout.placements(r.mesh, t.shape)
        assert len(placed) == len(t.shape)
        for rank in r.mesh.ranks:
            layout.local_shape(r.mesh, t.shape, rank)
    # a mesh holding only the first axis: the other axes are dropped, shapes still fit
    small = mc.Mesh({r.mesh.axis_names[0]: r.mesh.shape[0]})
    r.check(small)
    for layout in r.layouts(small).values():
        named = {f.name for d in layout.dims for f in d.factors} | set(layout.partial_axes)
        assert not (named & used) - set(small.axis_names)


@pytest.mark.parametrize("name, tensor, layout", [
    ("ddp", "x", "(dp batch) seq embed"),
    ("ddp", "w_up", "embed mlp"),
    ("ddp", "w_up_grad", "embed mlp | sum(dp)"),
    ("fsdp", "w_up", "(fsdp embed) mlp"),
    ("fsdp", "x", "(fsdp batch) seq embed"),
    ("fsdp", "w_up_grad", "embed mlp | sum(fsdp)"),
    ("tp", "w_up", "embed (tp mlp)"),
    ("tp", "w_down", "(tp mlp) embed"),
    ("tp", "mlp_out", "(dp batch) seq embed | sum(tp)"),
    ("tp", "embedding", "(tp vocab) embed"),
    ("fsdp_tp", "w_up", "(fsdp embed) (tp mlp)"),
    ("fsdp_tp", "w_down", "(tp mlp) (fsdp embed)"),
    ("fsdp_tp", "x", "(dp fsdp batch) seq embed"),
    ("fsdp_tp", "mlp_out", "(dp fsdp batch) seq embed | sum(tp)"),
    ("fsdp_tp", "w_up_grad", "embed (tp mlp) | sum(dp, fsdp)"),
    ("sequence_parallel", "x", "(dp batch) (tp norm_seq) embed"),
    ("sequence_parallel", "x_gathered", "(dp batch) seq embed"),
    ("expert_parallel", "w_experts_up", "(ep experts) embed expert_mlp"),
    ("expert_parallel", "dispatched", "(ep experts) (dp capacity) embed"),
    ("expert_parallel", "x", "(dp ep batch) seq embed"),
    ("expert_parallel", "router", "embed gate"),
])
def test_builtin_layouts(name: str, tensor: str, layout: str) -> None:
    assert mc.recipe(name).layouts()[tensor] == mc.Layout(layout)


def test_installed_package_finds_builtins(tmp_path: Path) -> None:
    """From another directory, the installed package (editable here) loads a built-in."""
    code = "import meshcomm as mc; print(mc.recipe('fsdp_tp').layout('embed mlp'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=scaled(60), env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(fsdp embed) (tp mlp)"


def test_wheel_layout_finds_builtins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel holds meshcomm/_layouts (pyproject force-include) and no source tree."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert include == {"layouts": "meshcomm/_layouts"}
    package = tmp_path / "site-packages" / "meshcomm"
    shutil.copytree(ROOT / "layouts", package / "_layouts")
    monkeypatch.setattr(recipes, "_PACKAGE", package)
    assert recipes.layout_dirs() == (package / "_layouts",)
    assert set(recipes.builtin_recipes()) >= REQUIRED
    monkeypatch.chdir(tmp_path)
    r = mc.recipe("tp")
    assert r.source == str(Path("site-packages/meshcomm/_layouts/tp.toml"))
    assert r.layout("mlp embed") == mc.Layout("(tp mlp) embed")


# -- logical() -------------------------------------------------------------------------
MODEL = {"w_up": "embed mlp", "w_down": "mlp embed", "x": "batch seq embed",
         "h": "batch seq mlp", "out": "batch seq embed | sum(mlp)"}


def test_switching_recipe_changes_layouts_not_code() -> None:
    def layouts(recipe: str) -> dict[str, str]:
        return {name: str(mc.logical(dims, recipe)) for name, dims in MODEL.items()}

    assert layouts("fsdp") == {"w_up": "(fsdp embed) mlp", "w_down": "mlp (fsdp embed)",
                               "x": "(fsdp batch) seq embed", "h": "(fsdp batch) seq mlp",
                               "out": "(fsdp batch) seq embed"}
    assert layouts("fsdp_tp") == {
        "w_up": "(fsdp embed) (tp mlp)", "w_down": "(tp mlp) (fsdp embed)",
        "x": "(dp fsdp batch) seq embed", "h": "(dp fsdp batch) seq (tp mlp)",
        "out": "(dp fsdp batch) seq embed | sum(tp)"}


@pytest.mark.parametrize("dims, rules, mesh, layout", [
    ("batch seq embed", {"batch": "dp"}, None, "(dp batch) seq embed"),
    ("batch seq embed", {"batch": ["dp", "fsdp"], "embed": "tp"}, None,
     "(dp fsdp batch) seq (tp embed)"),
    ("batch seq embed", {"batch": "dp fsdp"}, None, "(dp fsdp batch) seq embed"),
    ("batch seq embed", {"batch": [], "seq": ""}, None, "batch seq embed"),
    ("foo bar", {"batch": "dp"}, None, "foo bar"),                  # no rule: replicated
    # a mesh axis goes to the first dim whose rule names it, left to right
    ("batch seq embed", {"batch": "fsdp", "embed": "fsdp"}, None, "(fsdp batch) seq embed"),
    ("embed batch", {"batch": "fsdp", "embed": "fsdp"}, None, "(fsdp embed) batch"),
    ("batch embed", {"batch": ["dp", "fsdp"], "embed": ["fsdp", "tp"]}, None,
     "(dp fsdp batch) (tp embed)"),
    # pending reductions: mesh axes or logical names, taken before any dim
    ("batch seq embed | sum(tp)", {"batch": "dp"}, None, "(dp batch) seq embed | sum(tp)"),
    ("embed mlp | avg(batch)", {"batch": ["dp", "fsdp"], "embed": "fsdp", "mlp": "tp"}, None,
     "embed (tp mlp) | avg(dp, fsdp)"),
    ("batch seq embed | sum(mlp)", {"batch": "dp", "mlp": []}, None, "(dp batch) seq embed"),
    # with a mesh, axes it lacks are dropped
    ("batch seq embed", {"batch": ["dp", "fsdp"], "embed": "tp"}, "dp=4",
     "(dp batch) seq embed"),
    ("batch seq embed | sum(tp)", {"batch": "dp"}, "dp=4", "(dp batch) seq embed"),
    ("batch seq embed", "fsdp_tp", "dp=2 tp=2", "(dp batch) seq embed"),
    ("embed mlp", "fsdp_tp", mc.Mesh("dp=2 tp=2"), "embed (tp mlp)"),
    ("  batch   seq ", "tp", None, "(dp batch) seq"),
])
def test_logical(dims: str, rules: object, mesh: object, layout: str) -> None:
    assert mc.logical(dims, rules, mesh) == mc.Layout(layout)  # type: ignore[arg-type]


def test_logical_accepts_recipe_values_and_paths() -> None:
    r = mc.recipe("tp")
    assert mc.logical("embed mlp", r) == r.layout("embed mlp") == mc.Layout("embed (tp mlp)")
    assert mc.logical("embed mlp", ROOT / "layouts" / "tp.toml") == mc.Layout("embed (tp mlp)")
    assert mc.recipe(r) is r
    assert r.axes_of("batch") == ("dp",) and r.axes_of("nothing") == ()


@pytest.mark.parametrize("dims, rules, error, message", [
    ("batch (seq embed)", {}, LayoutSyntaxError,
     'logical dims "batch (seq embed)": dim 1 is "(seq embed)", but each dim is one logical'
     ' name\n  fix: write one name per dim (e.g. "batch seq embed") and put mesh axes in the'
     " recipe's rules"),
    ("batch x=2", {}, LayoutSyntaxError, 'dim 1 is "x=2", but each dim is one logical name'),
    ("batch (seq", {}, LayoutSyntaxError, 'cannot parse layout "batch (seq"'),
    ("dp seq", {"batch": "dp"}, MeshAxisError,
     'logical dims "dp seq": "dp" is a mesh axis, not a logical name\n  fix: name the dim by'
     ' meaning (e.g. "batch") and map it to "dp" in the recipe'),
    ("batch seq", {"batch": ["dp", "dp"]}, RecipeError,
     "the rule ['dp', 'dp'] names mesh axis \"dp\" twice"),
    ("batch seq", {"batch": 3}, RecipeError, 'a rule is a mesh axis "tp" or a list'),
])
def test_logical_errors(dims: str, rules: dict[str, object], error: type[Exception],
                        message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        mc.logical(dims, rules)  # type: ignore[arg-type]


def test_unknown_recipe_name_and_path() -> None:
    with pytest.raises(RecipeError, match=re.escape(
            '"fsdp_pt" is not a built-in recipe; built-ins are ddp, expert_parallel, fsdp,'
            ' fsdp_tp, sequence_parallel, tp\n  fix: did you mean "fsdp_tp"?')):
        mc.recipe("fsdp_pt")
    with pytest.raises(RecipeError, match='recipe file "nowhere/x.toml" does not exist'):
        mc.recipe("nowhere/x.toml")
    with pytest.raises(RecipeError, match=re.escape(
            'recipe "tp" has no tensor "w_upp"; it has embedding, wq, wo, w_up,')):
        mc.recipe("tp").tensor("w_upp")


# -- recipe file errors ----------------------------------------------------------------
GOOD = """\
description = "test recipe"
mesh = "dp=2 tp=2"

[rules]
batch = "dp"
embed = "tp"
seq = []

[sizes]
batch = 8
seq = 4
embed = 6

[tensors.x]
kind = "activation"
logical = "batch seq embed"
"""


def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> recipes.Recipe:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text(text)
    return mc.recipe("bad.toml")


def test_good_file_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = load(tmp_path, monkeypatch, GOOD)
    assert r.name == "bad" and r.source == "bad.toml" and repr(r) == "recipe('bad.toml')"
    assert r.rules == (("batch", ("dp",)), ("embed", ("tp",)), ("seq", ()))
    assert r.tensors == (recipes.NamedTensor("x", "batch seq embed", "activation", (8, 4, 6),
                                             ""),)
    assert r.layouts() == {"x": mc.Layout("(dp batch) seq (tp embed)")}


@pytest.mark.parametrize("old, new, message", [
    ('batch = "dp"', "batch = dp",
     "bad.toml (line 5): not valid TOML: Invalid value\n    batch = dp\n            ^\n"
     "  fix: write key = value lines under [table] headers; strings need quotes,"
     ' e.g. logical = "batch seq embed"'),
    ('kind = "activation"', 'kind = "activation"\nlayout = "batch seq embed"',
     'bad.toml, tensors.x.layout (line 16): unknown key "layout"; the keys here are logical,'
     ' kind, shape, about\n  fix: did you mean "logical"?'),
    ("[sizes]", "colour = 3\n[sizes]",
     'bad.toml, rules.colour (line 9): a rule is a mesh axis "tp" or a list ["dp", "fsdp"],'
     " got 3"),
    ('description = "test recipe"', 'description = "test recipe"\ncolour = 3',
     'bad.toml, colour (line 2): unknown key "colour"; the keys here are description, mesh,'
     " rules, sizes, tensors"),
    ('batch = "dp"', 'batch = ["dp", "dp"]',
     "bad.toml, rules.batch (line 5): the rule ['dp', 'dp'] names mesh axis \"dp\" twice;"
     ' an axis splits a dim once\n  fix: write "dp" once'),
    ('logical = "batch seq embed"', 'logical = "batch (seq embed"',
     'bad.toml, tensors.x.logical (line 16): cannot parse layout "batch (seq embed"\n'
     "    batch (seq embed\n          ^^^^^^^^^^ this group is never closed\n"
     "  fix: add ')' at the end of the group"),
    ('logical = "batch seq embed"', 'logical = "batch (seq embed)"',
     'bad.toml, tensors.x.logical (line 16): logical dims "batch (seq embed)": dim 1 is'
     ' "(seq embed)", but each dim is one logical name'),
    ('logical = "batch seq embed"', 'logical = "batch seq embd"',
     'bad.toml, tensors.x.logical (line 16): "embd" in "batch seq embd" is not a logical name'
     ' of [rules] or [sizes]\n  fix: did you mean "embed"?'),
    ('logical = "batch seq embed"', 'logical = "batch seq embed | sum(cp)"',
     'bad.toml, tensors.x.logical (line 16): "cp" in "batch seq embed | sum(cp)" is neither a'
     " logical name of [rules] nor an axis of the example mesh Mesh(dp=2, tp=2)"),
    ('embed = "tp"', 'embed = "tq"',
     'bad.toml, rules.embed (line 6): mesh axis "tq" is not in the example mesh "dp=2 tp=2"'
     '\n  fix: did you mean "tp"?'),
    ("seq = []", "seq = []\ntp = []",
     'bad.toml, rules.tp (line 8): logical name "tp" is also a mesh axis'),
    ('mesh = "dp=2 tp=2"', 'mesh = "dp=2 tp"', 'bad.toml, mesh (line 2): cannot parse mesh'
     ' "dp=2 tp"'),
    ('logical = "batch seq embed"', 'logical = "batch seq embed"\nshape = [8, 4]',
     'bad.toml, tensors.x.shape (line 17): shape [8, 4] has 2 dims but "batch seq embed" has 3'),
    ('kind = "activation"', 'kind = "act"',
     "bad.toml, tensors.x.kind (line 15): input should be 'param', 'activation' or 'grad',"
     " got 'act'"),
    ('description = "test recipe"\n', "",
     'bad.toml, description: missing key "description"\n  fix: add description = ...'),
    ('logical = "batch seq embed"', 'about = "no dims"',
     'bad.toml, tensors.x.logical (line 14): missing key "logical"'),
    ("batch = 8\n", "batch = 0\n",
     "bad.toml, sizes.batch (line 10): input should be greater than or equal to 1, got 0"),
])
def test_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str,
                     message: str) -> None:
    assert GOOD.count(old) == 1
    with pytest.raises(RecipeError, match=re.escape(message)):
        load(tmp_path, monkeypatch, GOOD.replace(old, new))


def test_several_problems_are_listed_one_per_line(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    text = GOOD.replace('embed = "tp"', 'embed = "tq"').replace("seq = []", "seq = []\ndp = []")
    with pytest.raises(RecipeError) as info:
        load(tmp_path, monkeypatch, text)
    lines = [line for line in str(info.value).splitlines() if line.startswith("bad.toml")]
    assert [line.split(":")[0] for line in lines] == ["bad.toml, rules.embed (line 6)",
                                                      "bad.toml, rules.dp (line 8)"]
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("text, loc, line", [
    ('a = 1\n[rules]\nbatch = "dp"\n', ("rules", "batch"), 3),
    ('rules = { batch = "dp", embed = "tp" }\n', ("rules", "embed"), 1),
    ('x = 1\nrules.batch = "dp"\nrules.embed = "tp"\n', ("rules", "embed"), 3),
    ('[tensors.a]\nlogical = "x"\n[tensors.b]\nlogical = "y"\n', ("tensors", "b", "logical"),
     4),
    ('[tensors.a]\nlogical = "x"\n[tensors.b]\nkind = "param"\n', ("tensors", "b", "logical"),
     3),
    ('[tensors]\na.logical = "x"\nb.logical = "y"\n', ("tensors", "b", "logical"), 3),
    ('[ "tensors" . b ]\nlogical = "y"\n', ("tensors", "b", "logical"), 2),
    ('[rules]\nbatch = "dp"\n', ("rules", "batch", 0), 2),
    ('description = "x"\n', ("mesh",), None),
])
def test_line_of_key(text: str, loc: tuple[str | int, ...], line: int | None) -> None:
    assert recipes._line_of(text, loc) == line


# -- command line ----------------------------------------------------------------------
def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipe", "list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == sorted(recipes.builtin_recipes())
    assert "fsdp_tp            dp=2 fsdp=2 tp=2    2-D: batch over dp and fsdp" in out


def test_cli_show(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["recipe", "show", "fsdp_tp", "--mesh", "dp=2 tp=2", "--shape-of", "w_up=8,8",
            "--width", "100"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith('recipe "fsdp_tp": 2-D: batch over dp and fsdp, parameters sharded')
    assert "  batch -> dp, fsdp  (fsdp not in the mesh: dropped)\n" in out
    assert "  seq   -> (replicated)\n" in out
    assert re.search(r"  w_up +param +embed mlp +embed \(tp mlp\) +\(8, 8\)\n", out)
    assert re.search(r"  mlp_out +activation +batch seq embed \| sum\(mlp\) +"
                     r"\(dp batch\) seq embed \| sum\(tp\) +\(8, 16, 16\)\n", out)
    assert 'layout "embed (tp mlp)" of shape (8, 8) on Mesh(dp=2, tp=2)' in out
    assert 'layout "(dp batch) seq embed | sum(tp)" of shape (8, 16, 16)' in out
    assert "\x1b[" not in out


def test_cli_show_default_mesh_selected_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipe", "show", "tp", "--tensor", "w_down", "--no-pictures"]) == 0
    out = capsys.readouterr().out
    assert "mesh: Mesh(dp=2, tp=2) (the recipe's example mesh)" in out
    assert re.search(r"  w_down +param +mlp embed +\(tp mlp\) embed +\(32, 16\)\n", out)
    assert "w_up" not in out and "layout \"" not in out


@pytest.mark.parametrize("argv, message", [
    (["recipe", "show", "tp", "--shape-of", "w_upp=8,8"],
     'RecipeError: recipe "tp" has no tensor "w_upp"'),
    (["recipe", "show", "tp", "--shape-of", "w_up=8"],
     'ShapeError: layout "embed (tp mlp)" has 2 dims but the shape (8,) has 1'),
    (["recipe", "show", "tpp"], 'RecipeError: "tpp" is not a built-in recipe'),
    (["recipe", "check", "tp", "--mesh", "dp=2 tp"], 'MeshAxisError: cannot parse mesh'),
])
def test_cli_show_errors(argv: list[str], message: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("meshcomm: ") and message in err and out == ""


def test_cli_bad_shape_of_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipe", "show", "tp", "--shape-of", "w_up"]) == 2
    assert '"w_up" is not NAME=SHAPE, e.g. wq=16,8' in capsys.readouterr().err


def test_cli_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.toml").write_text(GOOD)
    assert cli.main(["recipe", "check", "good.toml", "--mesh", "dp=2"]) == 0
    assert capsys.readouterr().out == (
        'OK: good.toml: recipe "good" (3 rules, 1 named tensors) resolves on Mesh(dp=2, tp=2)'
        " and Mesh(dp=2)\n")
    (tmp_path / "bad.toml").write_text(GOOD.replace('batch = "dp"', 'batch = ["dp", "dp"]'))
    assert cli.main(["recipe", "check", "bad.toml"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "meshcomm: RecipeError: bad.toml, rules.batch (line 5): the rule ['dp', 'dp'] names"
        ' mesh axis "dp" twice; an axis splits a dim once\n  fix: write "dp" once\n')


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_cli_check_builtins(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["recipe", "check", str(ROOT / "layouts" / f"{name}.toml")]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
