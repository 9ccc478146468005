"""Mesh: named axes over a grid of ranks.

This module never communicates. Ranks are laid out row-major (the last axis
varies fastest), the convention of `torch.distributed.device_mesh`, unless an
explicit grid of global ranks is given.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .errors import MeshAxisError, ShapeError, caret

AxisName = str

_AXIS_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ITEM_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*")


def _parse_axes(text: str) -> tuple[tuple[str, int], ...]:
    axes: list[tuple[str, int]] = []
    pos = 0
    stripped = text.replace(",", " ")
    while pos < len(stripped):
        if stripped[pos].isspace():
            pos += 1
            continue
        match = _ITEM_RE.match(stripped, pos)
        if not match:
            end = pos
            while end < len(stripped) and not stripped[end].isspace():
                end += 1
            raise MeshAxisError(
                f'cannot parse mesh "{text}"\n'
                + caret(text, pos, end, "expected NAME=SIZE, e.g. dp=2")
                + '\n  fix: write the axes as "dp=2 tp=4"'
            )
        axes.append((match.group(1), int(match.group(2))))
        pos = match.end()
    return tuple(axes)


MAX_RANKS = 1 << 22   # 4,194,304: a mesh lists its ranks, so its size is bounded


class Mesh:
    """Named mesh axes in order, over a row-major grid of global ranks.

    >>> mesh = Mesh("dp=2 tp=4")
    >>> mesh.coords(5)
    {'dp': 1, 'tp': 1}
    >>> mesh.groups("tp")
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """

    # `_plans` is not part of the value: the planner's memo of the plans made on this mesh
    # (a `meshcomm.planner.memo.PlanMemo`, which the planner sets on the mesh's first
    # `plan()` call), kept here so that a repeated `plan(mesh, ...)` hashes no mesh.
    __slots__ = ("_names", "_sizes", "_ranks", "_where", "_plans", "_hash", "__weakref__")

    def __init__(
        self, spec: str | Mapping[str, int] | None = None, /, *, ranks: Any = None, **sizes: int
    ) -> None:
        if spec is not None and sizes:
            raise MeshAxisError(
                f"Mesh({spec!r}, {', '.join(f'{k}={v}' for k, v in sizes.items())}): give the axes"
                ' once, either as a string "dp=2 tp=4" or as keywords dp=2, tp=4'
            )
        if isinstance(spec, str):
            items = _parse_axes(spec)
        elif isinstance(spec, Mapping):
            items = tuple((str(k), v) for k, v in spec.items())
        elif spec is None:
            items = tuple(sizes.items())
        else:
            raise MeshAxisError(
                f"Mesh({spec!r}): expected a string like \"dp=2 tp=4\", a mapping or keywords"
            )
        names = tuple(name for name, _ in items)
        for name, size in items:
            if not _AXIS_RE.fullmatch(name):
                raise MeshAxisError(f'mesh axis name "{name}" is not an identifier')
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshAxisError(
                    f'mesh axis "{name}" has size {size!r}; sizes are positive integers'
                )
            if names.count(name) > 1:
                raise MeshAxisError(
                    f'mesh axis "{name}" appears {names.count(name)} times in {list(names)};'
                    " fix: give each axis a distinct name"
                )
        if not items:
            raise MeshAxisError('a mesh needs at least one axis, e.g. Mesh("dp=2")')
        self._names = names
        self._sizes = tuple(size for _, size in items)
        self._ranks = self._rank_grid(ranks)
        self._where = {r: i for i, r in enumerate(self._ranks)}
        self._plans: Any = None     # a PlanMemo, which this layer cannot name
        self._hash = hash((self._names, self._sizes, self._ranks))

    def _rank_grid(self, ranks: Any) -> tuple[int, ...]:
        size = math.prod(self._sizes)
        if size > MAX_RANKS:
            axes = " ".join(f"{n}={s}" for n, s in zip(self._names, self._sizes))
            raise MeshAxisError(
                f'Mesh("{axes}") has {size:,} ranks; meshcomm lists a mesh\'s ranks, so it'
                f" takes at most {MAX_RANKS:,}. fix: check the axis sizes (a typo?)")
        if ranks is None:
            return tuple(range(size))
        if hasattr(ranks, "tolist"):
            ranks = ranks.tolist()
        flat: list[int] = []
        shape = _nested_shape(ranks, flat)
        if shape != self._sizes and not (len(shape) == 1 and shape[0] == size):
            # self is half built here (no _ranks yet), so its repr cannot be used.
            axes = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._sizes))
            raise ShapeError(
                f"ranks= has shape {shape} but Mesh({axes}) needs shape {self._sizes}"
                f" (or a flat list of {size} ranks)"
            )
        if len(set(flat)) != len(flat) or any(r < 0 for r in flat):
            raise ShapeError(f"ranks= must hold distinct non-negative ranks, got {flat}")
        return tuple(flat)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        """The Mesh of a torch DeviceMesh: its dim names, sizes and rank grid (read, never bound).

        >>> dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
        >>> Mesh.from_device_mesh(dm)                                            # doctest: +SKIP
        Mesh(dp=2, tp=2)

        Duck-typed: anything with `.mesh` (a tensor or nested list of global ranks) and
        `.mesh_dim_names` works. A slice such as `dm["tp"]` gives the mesh of this rank's
        slice only (its `.mesh`), so it can differ between ranks.

        Axis names: a DeviceMesh without `mesh_dim_names` (what `init_device_mesh("cuda",
        (2, 4))` gives) has axes `d0`, `d1`, ... (its dim indices); a dim name that is not
        a Python identifier (`"mesh-0"`) becomes `d<its index>` too (`device_axis_names`).

        >>> from types import SimpleNamespace
        >>> Mesh.from_device_mesh(SimpleNamespace(mesh=[[0, 1], [2, 3]], mesh_dim_names=None))
        Mesh(d0=2, d1=2)
        """
        grid = device_mesh.mesh
        grid = grid.tolist() if hasattr(grid, "tolist") else grid
        shape = _nested_shape(grid, [])
        names = device_axis_names(getattr(device_mesh, "mesh_dim_names", None), len(shape))
        return cls(dict(zip(names, shape)), ranks=grid)

    # -- value behaviour -------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return other is self or (
            isinstance(other, Mesh)
            and self._hash == other._hash
            and self._names == other._names
            and self._sizes == other._sizes
            and self._ranks == other._ranks
        )

    def __hash__(self) -> int:
        return self._hash

    def __contains__(self, rank: object) -> bool:
        """Whether global rank `rank` is in the mesh (one dict lookup)."""
        return rank in self._where

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._sizes))
        if self._ranks != tuple(range(len(self._ranks))):
            return f"Mesh({axes}, ranks={list(self._ranks)})"
        return f"Mesh({axes})"

    def __str__(self) -> str:
        return " ".join(f"{n}={s}" for n, s in zip(self._names, self._sizes))

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_hash"):
            raise AttributeError("Mesh is immutable")
        object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (dict(self.axes), self._ranks))

    # -- queries ------------------------------------------------------------
    @property
    def axes(self) -> dict[AxisName, int]:
        """Ordered mapping of axis name to size (a fresh dict)."""
        return dict(zip(self._names, self._sizes))

    @property
    def axis_names(self) -> tuple[AxisName, ...]:
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks in row-major mesh order."""
        return self._ranks

    def axis_size(self, axis: AxisName) -> int:
        return self._sizes[self._axis_index(axis)]

    def group_size(self, axes: AxisName | Iterable[AxisName]) -> int:
        """The number of ranks in a group over `axes`: the product of their sizes (1 for none).

        >>> mesh = Mesh("dp=2 tp=4")
        >>> mesh.group_size(("dp", "tp")), mesh.group_size("tp"), mesh.group_size(())
        (8, 4, 1)

        `axes` is one axis name or any iterable of them (a tuple, list, set, generator).
        """
        if isinstance(axes, str):
            return self._sizes[self._axis_index(axes)]
        size = 1
        for axis in axes:
            size *= self._sizes[self._axis_index(axis)]
        return size

    def _axis_index(self, axis: AxisName) -> int:
        try:
            return self._names.index(axis)
        except ValueError:
            from .errors import did_you_mean

            hint = did_you_mean(axis, self._names)
            raise MeshAxisError(
                f'"{axis}" is not an axis of {self!r}; axes are {", ".join(self._names)}'
                + (f"\n  fix: {hint}" if hint else "")
            ) from None

    def position(self, rank: int) -> int:
        """Index of global `rank` in row-major mesh order."""
        pos = self._where.get(rank)
        if pos is None:
            raise ShapeError(f"rank {rank} is not in {self!r} (its ranks are {list(self._ranks)})")
        return pos

    def coords(self, rank: int) -> dict[AxisName, int]:
        """Mesh coordinates of global `rank`, one per axis."""
        return dict(zip(self._names, _unravel(self.position(rank), self._sizes)))

    def rank_at(self, **coords: int) -> int:
        """Global rank at the given coordinates (every axis must be named)."""
        missing = [n for n in self._names if n not in coords]
        extra = [n for n in coords if n not in self._names]
        if missing or extra:
            raise MeshAxisError(
                f"rank_at({', '.join(f'{k}={v}' for k, v in coords.items())}) on {self!r}:"
                + (f" missing {missing}" if missing else "")
                + (f" unknown {extra}" if extra else "")
            )
        pos = 0
        for name, size in zip(self._names, self._sizes):
            c = coords[name]
            if not 0 <= c < size:
                raise ShapeError(f"coordinate {name}={c} is out of range 0..{size - 1}")
            pos = pos * size + c
        return self._ranks[pos]

    def slice(self, axis: AxisName, index: int) -> Mesh:
        """The mesh of the other axes where `axis` is `index`, over those ranks in order: a
        pipeline stage's mesh on a `pp` axis. A mesh of that one axis gives a one-rank mesh
        of it (size 1).

        >>> Mesh("pp=2 dp=2 tp=2").slice("pp", 1)
        Mesh(dp=2, tp=2, ranks=[4, 5, 6, 7])
        >>> Mesh("pp=4").slice("pp", 2)
        Mesh(pp=1, ranks=[2])
        """
        size = self.axis_size(axis)
        if not (isinstance(index, int) and 0 <= index < size):
            raise ShapeError(f"Mesh.slice({axis!r}, {index!r}): expected an index in 0..{size - 1}")
        rest = {a: n for a, n in zip(self._names, self._sizes) if a != axis} or {axis: 1}
        ranks = [r for r in self._ranks if self.coords(r)[axis] == index]
        return Mesh(rest, ranks=ranks)

    def groups(self, *axes: AxisName) -> tuple[tuple[int, ...], ...]:
        """Rank groups of a collective over `axes` (several = one flat group, first axis major)."""
        return _groups(self, tuple(axes))

    def members(self, rank: int, *axes: AxisName) -> tuple[int, ...]:
        """The global ranks of `rank`'s group over `axes`, in group order (first axis major):
        its entry of `groups(*axes)`, found with plain arithmetic on the rank's coordinates
        (no table, so it traces under torch.compile too).

        >>> Mesh("dp=2 tp=2").members(3, "dp"), Mesh("dp=2 tp=2").members(1, "tp", "dp")
        ((1, 3), (0, 2, 1, 3))
        """
        sizes, grid = self._sizes, self._ranks
        coords = _unravel(self.position(rank), sizes)
        idx = [self._names.index(a) for a in axes]
        count = 1
        for i in idx:
            count *= sizes[i]
        out = []
        for inner in range(count):
            at, rest = list(coords), inner
            for i in reversed(idx):
                at[i], rest = rest % sizes[i], rest // sizes[i]
            spot = 0
            for i in range(len(sizes)):
                spot = spot * sizes[i] + at[i]
            out.append(grid[spot])
        return tuple(out)

    def group_index(self, rank: int, *axes: AxisName) -> tuple[int, int]:
        """(which group, position in that group) of `rank` for a collective over `axes`."""
        coords = self.coords(rank)
        pos = 0
        for a in axes:
            pos = pos * self.axis_size(a) + coords[a]
        for g, group in enumerate(self.groups(*axes)):
            if rank in group:
                return g, pos
        raise AssertionError(f"rank {rank} in no group of {axes}")


def _rebuild(axes: dict[str, int], ranks: tuple[int, ...]) -> Mesh:
    return Mesh(axes, ranks=list(ranks))


def _nested_shape(value: Any, flat: list[int]) -> tuple[int, ...]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        shapes = {_nested_shape(v, flat) for v in value}
        if len(shapes) > 1:
            raise ShapeError(f"ranks= is ragged: {value!r}")
        inner = shapes.pop() if shapes else ()
        return (len(value), *inner)
    flat.append(int(value))
    return ()


def _unravel(pos: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(sizes):
        out.append(pos % size)
        pos //= size
    return tuple(reversed(out))


@functools.lru_cache(maxsize=1024)
def _groups(mesh: Mesh, axes: tuple[AxisName, ...]) -> tuple[tuple[int, ...], ...]:
    idx = [mesh._axis_index(a) for a in axes]
    if len(set(idx)) != len(idx):
        raise MeshAxisError(f"axes {list(axes)} name an axis twice")
    rest = [i for i in range(len(mesh.shape)) if i not in idx]
    grid = torch.arange(mesh.size).reshape(mesh.shape).permute(rest + idx)
    ranks = mesh.ranks
    return tuple(tuple(ranks[p] for p in row)
                 for row in grid.reshape(-1, mesh.group_size(axes)).tolist())


def device_axis_names(names: Sequence[str] | None, ndim: int) -> tuple[AxisName, ...]:
    """meshcomm's axis names for a DeviceMesh's dim names: each name that is an identifier
    stays; a missing or other name is `d<dim index>`.

    >>> device_axis_names(None, 2), device_axis_names(("dp", "mesh-0"), 2)
    (('d0', 'd1'), ('dp', 'd1'))
    """
    given = list(names) if names else [None] * ndim
    out = tuple(n if isinstance(n, str) and n.isidentifier() else f"d{i}"
                for i, n in enumerate(given))
    if len(set(out)) != len(out):
        raise MeshAxisError(
            f"DeviceMesh dim names {tuple(given)!r} give meshcomm axis names {out!r}, which"
            " repeat (a name that is not an identifier becomes d<its index>); fix: name the"
            " dims with distinct identifiers, e.g. mesh_dim_names=('dp', 'tp')")
    return out
