"""Generated dim names come from one place, `meshcomm.core.names`, and never collide with a
mesh's axes or the names beside them (issue 34: the planner named dims d0, d1, which are
the axes of an unnamed DeviceMesh, and a Partial source on such a mesh did not plan)."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.core.names import fresh_name, fresh_names, positional_names

PACKAGE = Path(__file__).resolve().parents[1] / "meshcomm"
HOME = "core/names.py"

# f-strings shaped like a made-up name that are not dim names, each with why.
NOT_DIM_NAMES = {
    ("core/mesh.py", "f'd{i}'"): "a DeviceMesh dim with no name becomes mesh axis d<index>",
    ("display.py", "f'dim{d}'"): "a printed label for a dim with no name; never parsed",
    ("display.py", "f'r{r}'"): "a printed rank label",
    ("display.py", "f'r{row.rank}'"): "a printed rank label",
    ("display.py", "f'r{r}{mark}'"): "a printed rank label",
    ("display.py", "f'{a}{c}'"): "a printed mesh coordinate, dp0",
    ("display.py", "f'{a}'"): "a printed rank number",
    ("planner/pipeline/actions.py", "f'{self.stage}{self.kind}{mb}'"):
        "a pipeline action in PyTorch's notation, 0F1",
    ("nn/checkpoint.py", "f'{prefix}{k}'"): "a state_dict key",
    ("nn/fsdp/param.py", "f'{prefix}{attr}'"): "a parameter's qualified name",
    ("nn/fsdp/param.py", "f'{prefix}{child_name}'"): "a module's qualified name",
    ("runtime/checks.py", "f'item{k}'"): "a field of a cross-rank check record",
    ("nn/hf_plan.py", "f'Local{cls.__name__}'"):
        "the class name of a config view holding this rank's sizes (hf_plan.ConfigView)",
}


def _name_like(node: ast.JoinedStr) -> bool:
    """An f-string of letters and values only, such as f"d{i}" or f"{base}{k}"."""
    if any(isinstance(v, ast.FormattedValue) and v.format_spec for v in node.values):
        return False
    consts = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    values = sum(isinstance(v, ast.FormattedValue) for v in node.values)
    return values >= 1 and len(node.values) <= 3 and all(c.isalpha() or c == "_" for c in consts)


def _name_forms(node: ast.Constant) -> bool:
    """A str.format template of a name, such as "d{}" or "dim{}_"."""
    text = node.value
    return (isinstance(text, str) and "{}" in text and len(text) <= 8
            and all(c.isalpha() or c in "_{}" for c in text))


def test_no_module_but_core_names_makes_up_a_name() -> None:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.JoinedStr) and _name_like(node)) or (
                    isinstance(node, ast.Constant) and _name_forms(node)):
                found.add((where, ast.unparse(node)))
    stray = sorted(found - set(NOT_DIM_NAMES))
    assert not stray, (f"names made up outside meshcomm/{HOME}: {stray}; use positional_names,"
                       " fresh_names or fresh_name there (or, for a printed label, add it to"
                       " NOT_DIM_NAMES with why)")
    assert not set(NOT_DIM_NAMES) - found, "NOT_DIM_NAMES lists f-strings no longer in the code"


def test_the_scan_finds_a_made_up_name() -> None:
    """The scan above sees the f-string that caused issue 34 and a template."""
    tree = ast.parse('names = tuple(f"d{i}" for i in range(n)); t = "dim{}"')
    assert any(isinstance(n, ast.JoinedStr) and _name_like(n) for n in ast.walk(tree))
    assert any(isinstance(n, ast.Constant) and _name_forms(n) for n in ast.walk(tree))


AXIS_NAMES = st.lists(st.sampled_from(["d0", "d1", "d2", "dim0", "dim1", "t0", "t2", "d0_",
                                       "d1_", "d0__", "x", "y", "z", "x1", "a", "b"]),
                      unique=True, max_size=10)


@given(st.integers(0, 6), AXIS_NAMES, AXIS_NAMES)
def test_positional_names_avoid_every_axis_and_name(ndim, axes, avoid) -> None:
    names = positional_names(ndim, axes, avoid)
    assert len(names) == len(set(names)) == ndim
    assert not set(names) & (set(axes) | set(avoid))
    assert all(n.isidentifier() for n in names)


@given(AXIS_NAMES)
def test_fresh_names_never_repeat_or_collide(taken) -> None:
    gen = fresh_names("xyz", taken)
    names = [next(gen) for _ in range(12)]
    assert len(set(names)) == 12 and not set(names) & set(taken)
    pool = set(taken)
    made = [fresh_name("b", pool) for _ in range(3)]
    assert len(set(made)) == 3 and set(made) <= pool and not set(made) & set(taken)


def test_layout_dim_names_never_read_as_an_axis() -> None:
    """A dim with no name of its own gets a positional name that is no axis and no other
    name of the layout, so the layout built from the names reads the same dims."""
    for spec in ("d0=2 d1=2", "dim0=2 dim1=2", "d0=2 dim1=2 t0=1"):
        mesh = mc.Mesh(spec)
        layout = mc.Layout(f"({mesh.axis_names[0]} x=2) d1_ (x2=3)")
        names = layout.dim_names(mesh)
        assert not set(names) & set(mesh.axis_names), (spec, names)
        assert len(set(names)) == 3 and names[1] == "d1_"
        assert mc.Layout.of_names(names).sharded_axes(mesh) == ()
