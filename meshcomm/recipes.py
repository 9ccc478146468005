"""Layout recipes: logical dim names mapped to mesh axes, loaded from TOML files.

Model code names its tensors' dims once, by meaning ("batch seq embed"), and gets
its layout from a recipe (`logical("batch seq embed", recipe)`), the way flax
logical axis rules keep parallelism out of model code. A recipe is a TOML file
(`layouts/*.toml`, shipped as `meshcomm/_layouts`) validated by the pydantic
models below; every problem is a `RecipeError` naming the file, the key and its
line. This module never communicates; `logical` is pure and cached.

Resolution rules of `logical` (see docs/recipes.md):
  - a dim named L whose rule gives axes (a, b) becomes "(a b L)"; without a rule, "L";
  - a mesh axis goes to the first dim (left to right) whose rule names it; later dims
    skip it (the flax rule), and axes of a pending reduction are taken before any dim;
  - names in "| sum(...)" are logical names (their rule's axes) or mesh axes;
  - with a mesh, axes that are not in it are dropped.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .core import notation
from .core.errors import LayoutSyntaxError, MeshAxisError, MeshcommError, RecipeError, did_you_mean
from .core.layout import Layout
from .core.mesh import AxisName, Mesh

__all__ = ["NamedTensor", "Recipe", "builtin_recipes", "layout_dirs", "logical", "recipe"]

Rules = tuple[tuple[str, tuple[AxisName, ...]], ...]
Loc = tuple[Union[str, int], ...]
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PACKAGE = Path(__file__).resolve().parent


# -- values -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NamedTensor:
    """A tensor a recipe lists: its logical dims, kind, example shape and a note."""

    name: str
    logical: str
    kind: str
    shape: tuple[int, ...] | None
    about: str


@dataclass(frozen=True, slots=True)
class Recipe:
    """Logical-name rules plus named example tensors, as loaded from one TOML file.

    >>> r = recipe("fsdp_tp")
    >>> r.layout("batch seq embed"), r.layout("embed mlp")
    (Layout('(dp fsdp batch) seq embed'), Layout('(fsdp embed) (tp mlp)'))
    """

    name: str
    description: str
    mesh: Mesh                      # an example mesh that names every axis of the rules
    rules: Rules                    # (logical name, mesh axes), in file order
    tensors: tuple[NamedTensor, ...]
    source: str                     # the file, as shown in messages
    builtin: bool = False

    def __repr__(self) -> str:
        return f"recipe({self.name if self.builtin else self.source!r})"

    def axes_of(self, name: str) -> tuple[AxisName, ...]:
        """The mesh axes the rule of logical `name` gives (empty when it has none)."""
        return dict(self.rules).get(name, ())

    def layout(self, dims: str, mesh: Mesh | str | None = None) -> Layout:
        """`logical(dims, self, mesh)`: the layout of logical `dims` under this recipe."""
        return logical(dims, self, mesh)

    def tensor(self, name: str) -> NamedTensor:
        """The named tensor `name` (RecipeError listing the names when it is unknown)."""
        for t in self.tensors:
            if t.name == name:
                return t
        names = [t.name for t in self.tensors]
        hint = did_you_mean(name, names)
        raise RecipeError(f'recipe "{self.name}" has no tensor "{name}"; it has'
                          f" {', '.join(names) or 'none'}" + (f"\n  fix: {hint}" if hint else ""))

    def layouts(self, mesh: Mesh | str | None = None) -> dict[str, Layout]:
        """Every named tensor's layout, by name, in file order."""
        return {t.name: logical(t.logical, self, mesh) for t in self.tensors}

    def check(self, mesh: Mesh | str | None = None) -> None:
        """Raise if a named tensor's layout does not fit its example shape on `mesh`
        (default: the recipe's example mesh)."""
        mesh = self.mesh if mesh is None else _as_mesh(mesh)
        for t in self.tensors:
            if t.shape is not None:
                logical(t.logical, self, mesh).placements(mesh, t.shape)


# -- logical(): names to layouts ---------------------------------------------------------
RecipeLike = Union[Recipe, str, "os.PathLike[str]", Mapping[str, Union[str, Sequence[str]]]]


def logical(dims: str | Layout, recipe: RecipeLike, mesh: Mesh | str | None = None) -> Layout:
    """The layout of a tensor whose dims have logical names, under `recipe`'s rules.

    >>> logical("batch seq embed", {"batch": ["dp", "fsdp"], "embed": "tp"})
    Layout('(dp fsdp batch) seq (tp embed)')
    >>> logical("batch seq embed | sum(tp)", {"batch": "dp", "embed": "tp"}, "dp=4")
    Layout('(dp batch) seq embed')

    `dims` is a layout of logical names (text or a `Layout`, e.g.
    `Layout.of_names(names).pending("sum", ["batch"])`). `recipe` is a Recipe, a built-in
    name or TOML path, or a mapping of rules. With
    `mesh`, mesh axes it lacks are dropped, so one recipe serves smaller meshes.
    """
    rules = _as_rules(recipe)
    mesh_axes = None if mesh is None else _as_mesh(mesh).axis_names
    return _logical(str(dims), rules, mesh_axes)


@functools.lru_cache(maxsize=4096)
def _logical(dims: str, rules: Rules, mesh_axes: tuple[AxisName, ...] | None) -> Layout:
    pattern = notation.parse(dims)
    table = dict(rules)
    taken = {a for _, axes in rules for a in axes} | set(mesh_axes or ())

    def kept(axes: Sequence[AxisName], used: Sequence[AxisName]) -> list[AxisName]:
        return [a for a in axes if (mesh_axes is None or a in mesh_axes) and a not in used]

    pending: list[AxisName] = []                # taken before any dim
    for name in pattern.reduce_axes:
        pending += kept(table.get(name, (name,)), pending)
    used = list(pending)
    out = []
    for i, dim in enumerate(pattern.dims):
        name = _dim_name(dims, i, dim)
        if name in taken:
            raise MeshAxisError(
                f'logical dims "{dims}": "{name}" is a mesh axis, not a logical name'
                '\n  fix: name the dim by meaning (e.g. "batch") and map it to'
                f' "{name}" in the recipe')
        axes = kept(table.get(name, ()), used)
        used += axes
        out.append([*axes, name])
    return Layout.of_dims(out, pattern.reduce_op, pending)


def _dim_name(dims: str, i: int, dim: notation.Dim) -> str:
    if len(dim.factors) == 1 and dim.factors[0].size is None:
        return dim.factors[0].name
    raise LayoutSyntaxError(
        f'logical dims "{dims}": dim {i} is "{dim}", but each dim is one logical name'
        '\n  fix: write one name per dim (e.g. "batch seq embed") and put mesh axes in the'
        " recipe's rules")


def _as_rules(value: RecipeLike) -> Rules:
    if isinstance(value, Recipe):
        return value.rules
    if isinstance(value, Mapping):
        try:
            return tuple((str(k), _axes_of_rule(v)) for k, v in value.items())
        except ValueError as err:
            raise RecipeError(f"rules {dict(value)!r}: {err}") from None
    return recipe(value).rules


def _as_mesh(mesh: Mesh | str) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh(mesh)


# -- the file format (pydantic) -------------------------------------------------------
def _identifier(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f'"{name}" is not a name; names are letters, digits and _'
                         " (not starting with a digit)")
    return name


def _axes_of_rule(value: object) -> tuple[AxisName, ...]:
    """Mesh axes of a rule value: "tp", "dp fsdp", ["dp", "fsdp"] or [] (replicated)."""
    if isinstance(value, str):
        items = [v for v in re.split(r"[,\s]+", value) if v]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise ValueError(f'a rule is a mesh axis "tp" or a list ["dp", "fsdp"], got {value!r}')
    for axis in items:
        _identifier(axis)
        if items.count(axis) > 1:
            raise ValueError(f'the rule {value!r} names mesh axis "{axis}" twice; an axis'
                             f' splits a dim once\n  fix: write "{axis}" once')
    return tuple(items)


def _parses_as_logical(text: str) -> str:
    pattern = notation.parse(text)
    for i, dim in enumerate(pattern.dims):
        _dim_name(text, i, dim)
    return text


def _parses_as_mesh(text: str) -> str:
    Mesh(text)
    return text


Name = Annotated[str, AfterValidator(_identifier)]
AxisList = Annotated[tuple[str, ...], BeforeValidator(_axes_of_rule)]


class TensorModel(BaseModel):
    """`[tensors.NAME]`: one named tensor of a recipe file."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    logical: Annotated[str, AfterValidator(_parses_as_logical)]
    kind: Literal["param", "activation", "grad"] = "activation"
    shape: list[Annotated[int, Field(ge=1)]] | None = None
    about: str = ""


class RecipeModel(BaseModel):
    """A whole recipe file (see docs/recipes.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    description: str
    mesh: Annotated[str, AfterValidator(_parses_as_mesh)]
    rules: dict[Name, AxisList]
    sizes: dict[Name, Annotated[int, Field(ge=1)]] = {}
    tensors: dict[Name, TensorModel] = {}


# Keys people write for the ones the format has (checked before spelling hints).
_SYNONYMS = {"layout": "logical", "dims": "logical", "axes": "logical", "type": "kind",
             "doc": "about", "description": "about", "rule": "rules", "tensor": "tensors",
             "size": "sizes", "shapes": "sizes"}
_KEYS = {(): tuple(RecipeModel.model_fields), ("tensors",): tuple(TensorModel.model_fields)}


# -- loading ----------------------------------------------------------------------------
def layout_dirs() -> tuple[Path, ...]:
    """Folders searched for built-in recipes: the package's `_layouts` (wheels), then the
    source tree's `layouts/` (editable installs and checkouts)."""
    root = _PACKAGE.parent
    dirs = [_PACKAGE / "_layouts"]
    if (root / "pyproject.toml").is_file():
        dirs.append(root / "layouts")
    return tuple(d for d in dirs if d.is_dir())


def builtin_recipes() -> tuple[str, ...]:
    """Names of the built-in recipes, sorted."""
    return tuple(sorted({p.stem for d in layout_dirs() for p in d.glob("*.toml")}))


def recipe(name_or_path: str | os.PathLike[str] | Recipe) -> Recipe:
    """The recipe of a built-in name ("fsdp_tp") or a TOML file path, validated.

    >>> recipe("tp").layout("embed mlp")
    Layout('embed (tp mlp)')
    """
    if isinstance(name_or_path, Recipe):
        return name_or_path
    text = os.fspath(name_or_path)
    builtin = not (text.endswith(".toml") or os.sep in text or "/" in text)
    if not builtin:
        path = Path(text)
        if not path.is_file():
            raise RecipeError(f'recipe file "{text}" does not exist'
                              "\n  fix: check the path, or give a built-in name such as"
                              f' "{(builtin_recipes() or ("fsdp_tp",))[0]}"')
    else:
        path = _builtin_path(text)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f'cannot read recipe file "{text}": {err}') from None
    return _load(source, _shown_path(path), path.stem, builtin)


def _builtin_path(name: str) -> Path:
    for d in layout_dirs():
        if (d / f"{name}.toml").is_file():
            return d / f"{name}.toml"
    names = builtin_recipes()
    hint = did_you_mean(name, names)
    raise RecipeError(f'"{name}" is not a built-in recipe; built-ins are {", ".join(names)}'
                      f"\n  fix: {hint or 'give a built-in name or a path to a .toml file'}")


def _shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is inside it, else absolute."""
    full = path.resolve()
    try:
        return str(full.relative_to(Path.cwd()))
    except ValueError:
        return str(full)


@functools.lru_cache(maxsize=256)
def _load(source: str, shown: str, name: str, builtin: bool) -> Recipe:
    """Parse and validate TOML text `source` (read from `shown`) into a Recipe (cached)."""
    data = _toml(source, shown)
    try:
        model = RecipeModel.model_validate(data)
    except ValidationError as err:
        problems = [(tuple(e["loc"]), _pydantic_message(e)) for e in err.errors()]
        raise _recipe_error(source, shown, problems) from None
    built = _build(model, shown, name, builtin)
    problems = _cross_check(model, built)
    if problems:
        raise _recipe_error(source, shown, problems)
    return built


def _toml(source: str, shown: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ModuleNotFoundError:
            raise RecipeError("reading recipe files needs Python 3.11+ (tomllib) or tomli"
                              "\n  fix: pip install tomli") from None
    try:
        data: dict[str, Any] = tomllib.loads(source)
        return data
    except tomllib.TOMLDecodeError as err:
        found = re.search(r"line (\d+), column (\d+)", str(err))
        line, col = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
        why = re.sub(r"\s*\(at (end of document|line \d+, column \d+)\)", "", str(err))
        lines = source.splitlines()
        where = f"{shown} (line {line})" if line else shown
        shown_line = ""
        if 0 < line <= len(lines):
            shown_line = "\n    " + lines[line - 1] + "\n    " + " " * max(col - 1, 0) + "^"
        raise RecipeError(f"{where}: not valid TOML: {why}{shown_line}\n  fix: write"
                          ' key = value lines under [table] headers; strings need quotes,'
                          ' e.g. logical = "batch seq embed"') from None


def _build(model: RecipeModel, shown: str, name: str, builtin: bool) -> Recipe:
    sizes = model.sizes
    tensors = []
    for tname, t in model.tensors.items():
        dims = notation.parse(t.logical).dims
        names = [d.factors[0].name for d in dims]
        shape = None if t.shape is None else tuple(t.shape)
        if shape is None and all(n in sizes for n in names):
            shape = tuple(sizes[n] for n in names)
        tensors.append(NamedTensor(tname, str(notation.parse(t.logical)), t.kind, shape,
                                   t.about))
    return Recipe(name, model.description, Mesh(model.mesh), tuple(model.rules.items()),
                  tuple(tensors), shown, builtin)


def _cross_check(model: RecipeModel, built: Recipe) -> list[tuple[Loc, str]]:
    """Problems between keys: names vs axes, the example mesh, tensors that do not resolve."""
    problems: list[tuple[Loc, str]] = []
    mesh = built.mesh
    axes = {a for _, rule in built.rules for a in rule} | set(mesh.axis_names)
    for lname, rule in built.rules:
        if lname in axes:
            problems.append((("rules", lname), f'logical name "{lname}" is also a mesh axis;'
                             " a rule maps a name by meaning to axes\n  fix: rename it"))
        problems += [(("rules", lname), _missing_axis(a, model.mesh))
                     for a in rule if a not in mesh.axis_names]
    known = set(model.rules) | set(model.sizes)
    for t in built.tensors:
        problems += _tensor_problems(t, known, built)
    return problems


def _tensor_problems(t: NamedTensor, known: set[str], built: Recipe) -> list[tuple[Loc, str]]:
    loc: Loc = ("tensors", t.name, "logical")
    pattern = notation.parse(t.logical)
    problems = [(loc, _unknown_name(t, d.factors[0].name, known)) for d in pattern.dims
                if d.factors[0].name not in known]
    problems += [(loc, f'"{n}" in "{t.logical}" is neither a logical name of [rules] nor an'
                  f" axis of the example mesh {built.mesh!r}") for n in pattern.reduce_axes
                 if n not in known and n not in built.mesh.axis_names]
    if t.shape is not None and len(t.shape) != len(pattern.dims):
        return problems + [(("tensors", t.name, "shape"),
                            f"shape {list(t.shape)} has {len(t.shape)} dims but"
                            f' "{t.logical}" has {len(pattern.dims)}')]
    if not problems:
        try:
            layout = logical(t.logical, built, built.mesh)
            if t.shape is not None:
                layout.placements(built.mesh, t.shape)
        except MeshcommError as err:
            problems.append((loc, str(err)))
    return problems


def _missing_axis(axis: str, text: str) -> str:
    hint = did_you_mean(axis, Mesh(text).axis_names)
    return (f'mesh axis "{axis}" is not in the example mesh "{text}"'
            f"\n  fix: {hint or f'add {axis}=2 to mesh, or remove it from the rule'}")


def _unknown_name(t: NamedTensor, name: str, known: set[str]) -> str:
    hint = did_you_mean(name, known)
    return (f'"{name}" in "{t.logical}" is not a logical name of [rules] or [sizes]'
            f"\n  fix: {hint or f'add {name} = [] to [rules] (replicated) and a size to [sizes]'}")


# -- error messages ------------------------------------------------------------------------
def _pydantic_message(err: Mapping[str, Any]) -> str:
    """One pydantic error in meshcomm's words (the original message of our own checks)."""
    loc = tuple(err["loc"])
    kind = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, Exception):
        return str(cause)
    if kind == "extra_forbidden":
        keys = _KEYS.get(("tensors",) if loc[:1] == ("tensors",) else (), ())
        hint = _SYNONYMS.get(str(loc[-1]), "") if _SYNONYMS.get(str(loc[-1])) in keys else ""
        hint = f'did you mean "{hint}"?' if hint else did_you_mean(str(loc[-1]), keys)
        return (f'unknown key "{loc[-1]}"; the keys here are {", ".join(keys)}'
                + (f"\n  fix: {hint}" if hint else ""))
    if kind == "missing":
        return f'missing key "{loc[-1]}"\n  fix: add {loc[-1]} = ... (see docs/recipes.md)'
    if kind in ("model_type", "dict_type"):
        return (f"expected a table, got {err['input']!r}\n  fix: write it as a [table]"
                ' (e.g. [tensors.wq] with logical = "embed heads")')
    msg = str(err["msg"])
    return f"{msg[:1].lower()}{msg[1:]}, got {err['input']!r}"


def _recipe_error(source: str, shown: str, problems: Sequence[tuple[Loc, str]]) -> RecipeError:
    lines = []
    for loc, message in problems:
        key = ".".join(str(k) for k in loc if k != "[key]")
        line = _line_of(source, loc)
        where = shown + (f", {key}" if key else "") + (f" (line {line})" if line else "")
        lines.append(f"{where}: {message}")
    return RecipeError("\n".join(lines))


def _key_re(key: str) -> str:
    return rf"""(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')"""


def _line_of(source: str, loc: Loc) -> int | None:
    """The 1-based line of the key at `loc` in TOML text, found by scanning (best effort):
    the deepest `[table]` header on the path, then each remaining key inside that table."""
    keys = [k for k in loc if isinstance(k, str)]
    lines = source.splitlines()
    depth, found = 0, None
    for depth in range(len(keys), 0, -1):
        header = re.compile(r"^\s*\[\[?\s*" + r"\s*\.\s*".join(_key_re(k) for k in keys[:depth])
                            + r"\s*\]\]?\s*(#.*)?$")
        found = next((i for i, text in enumerate(lines) if header.match(text)), None)
        if found is not None:
            break
    else:
        depth = 0
    lo = 0 if found is None else found + 1
    hi = next((i for i in range(lo, len(lines)) if re.match(r"\s*\[", lines[i])), len(lines))
    for key in keys[depth:]:
        assign = re.compile(rf"^\s*(?:[\w\"'.\s-]*\.)?\s*{_key_re(key)}\s*[=.]"
                            rf"|[{{,]\s*{_key_re(key)}\s*=")
        at = next((i for i in range(lo, hi) if assign.search(lines[i])), None)
        if at is None:
            break
        found = lo = at
    return None if found is None else found + 1
