"""Layout: how a global tensor is spread over a mesh, and the math of its shards.

This module never communicates. A layout names every tensor dim; the names in a
dim's group that are axes of the mesh shard it, the others stay local, and mesh
axes named nowhere replicate it. The shard of a rank is, by definition, what
`einops.rearrange` gives for the pattern indexed at the rank's mesh coordinates;
groups of the form "(axes... name)" whose size does not divide follow
`torch.chunk` axis by axis, major first (DTensor's uneven sharding).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import notation
from .errors import MeshAxisError, PlanError, ShapeError, caret, did_you_mean
from .mesh import AxisName, Mesh
from .names import fresh_names, positional_names
from .notation import Dim

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Part:
    """A resolved factor: its name, its size, and whether it is a mesh axis."""

    name: str
    size: int
    axis: bool


@dataclass(frozen=True, slots=True)
class DimPlacement:
    """One dim on one mesh: its global size and factors, major to minor.

    `uneven` is True for a "(axes... name)" group whose size does not divide; its
    parts then hold the mesh axes and the name with size 0 (sizes vary by rank).
    `zigzag`: a "zigzag(axes... name)" dim; its parts are those of its contiguous twin
    "(axes... name)", whose blocks it lays out head and tail (`zigzag_spans`).
    """

    size: int
    parts: tuple[Part, ...]
    uneven: bool
    zigzag: bool = False

    @property
    def axes(self) -> tuple[AxisName, ...]:
        return tuple(p.name for p in self.parts if p.axis)


class Layout:
    """A parsed, canonical layout pattern (frozen, hashable, cached).

    >>> Layout("(dp  b) s | sum(tp)")
    Layout('(dp b) s | sum(tp)')
    """

    __slots__ = ("pattern", "_text", "_hash")
    pattern: notation.Pattern
    _text: str
    _hash: int

    def __new__(cls, text: str | Layout) -> Layout:
        if isinstance(text, Layout):
            return text
        return _parse_layout(text)

    @classmethod
    def parse(cls, text: str | Layout) -> Layout:
        """The layout for `text` (cached: parsing the same text twice is a dict lookup)."""
        return cls(text)

    @classmethod
    def _from_pattern(cls, pattern: notation.Pattern) -> Layout:
        self = object.__new__(cls)
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "_text", str(pattern))
        object.__setattr__(self, "_hash", hash(pattern))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Layout is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Layout, (self._text,))

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash
                                 and self.pattern == other.pattern)

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"Layout({self._text!r})"

    # -- structure (no mesh needed) --------------------------------------------
    @property
    def dims(self) -> tuple[Dim, ...]:
        return self.pattern.dims

    @property
    def ndim(self) -> int:
        return len(self.pattern.dims)

    @property
    def reduce_op(self) -> str | None:
        """The pending reduction ("sum", "avg", "max", "min") or None."""
        return self.pattern.reduce_op

    @property
    def partial_axes(self) -> tuple[AxisName, ...]:
        """Mesh axes with pending partial results, as written."""
        return self.pattern.reduce_axes

    def local_names(self, mesh: Mesh | None = None) -> tuple[str | None, ...]:
        """Per dim, its minor local (unsized, non-axis) factor's name, or None where it has none.

        Without `mesh` every unsized name counts as local; with it, mesh axes do not.
        """
        axes = set(mesh.axis_names) if mesh is not None else set()
        out = []
        for dim in self.dims:
            local = [f.name for f in dim.factors if f.size is None and f.name not in axes]
            out.append(local[-1] if local else None)
        return tuple(out)

    def dim_names(self, mesh: Mesh | None = None) -> tuple[str, ...]:
        """A name per dim: its local factor, else its positional name (`positional_names`:
        d0, d1, ..., or dim0, ... where those are taken), never a mesh axis or another name
        in the layout.

        >>> Layout("(tp x=2) s").dim_names(Mesh("tp=2"))
        ('d0', 's')
        >>> Layout("(d0 x=2) s").dim_names(Mesh("d0=2"))     # d0 is an axis: dim0
        ('dim0', 's')
        """
        local = self.local_names(mesh)
        if None not in local:
            return tuple(n for n in local if n is not None)
        taken = {f.name for dim in self.dims for f in dim.factors}
        axes = mesh.axis_names if mesh is not None else ()
        spare = positional_names(self.ndim, axes, taken)
        return tuple(n if n is not None else spare[i] for i, n in enumerate(local))

    # -- derivations: new layouts from this one (each checked as if parsed) -----------------
    @classmethod
    def of_names(cls, names: Sequence[str]) -> Layout:
        """The layout whose dims are the plain `names`: held whole by every rank.

        >>> Layout.of_names(["d0", "d1"])
        Layout('d0 d1')
        """
        return _from_parts(tuple(Dim((notation.Factor(n),)) for n in names), None, ())

    @classmethod
    def of_dims(cls, dims: Sequence[Sequence[str]], op: str | None = None,
                axes: Sequence[AxisName] = ()) -> Layout:
        """The layout whose dim i is made of the names `dims[i]`, major to minor, with a
        pending `op` over `axes` (none without them).

        >>> Layout.of_dims([["dp", "b"], ["s"]], "sum", ["tp"])
        Layout('(dp b) s | sum(tp)')
        """
        return _from_parts(tuple(Dim(tuple(notation.Factor(n) for n in names)) for names in dims),
                           op if axes else None, tuple(axes))

    def without_reduction(self) -> Layout:
        """This layout with its pending reduction dropped (its axes then replicate).

        >>> Layout("(dp b) s | sum(tp)").without_reduction()
        Layout('(dp b) s')
        """
        if self.reduce_op is None:
            return self
        return _from_parts(self.dims, None, ())

    def pending(self, op: str, axes: Sequence[AxisName]) -> Layout:
        """This layout with a pending `op` over `axes` as well (after any it has already;
        one op per layout). No axes: the layout itself.

        >>> Layout("b h").pending("sum", ["tp"]), Layout("b h | avg(dp)").pending("avg", ["cp"])
        (Layout('b h | sum(tp)'), Layout('b h | avg(dp, cp)'))
        """
        if not axes:
            return self
        if self.reduce_op not in (None, op):
            raise PlanError(f'layout "{self}" already has a pending {self.reduce_op}; it cannot'
                            f" also have a pending {op} (one reduction per layout). fix: resolve"
                            " the first one before marking the other")
        return _from_parts(self.dims, op, (*self.partial_axes, *axes))

    @property
    def zigzag_dims(self) -> tuple[int, ...]:
        """The dims split head-tail ("zigzag(cp s)"), ascending."""
        return tuple(i for i, d in enumerate(self.dims) if d.zigzag)

    def without_zigzag(self, dims: Sequence[int] | None = None) -> Layout:
        """This layout with its zigzag dims (or those of `dims`) written contiguous:
        "zigzag(cp s)" -> "(cp s)". Every rank's local tensor keeps its shape; the global
        order of the dim differs (`zigzag_order` maps one to the other).

        >>> Layout("b zigzag(cp s) d").without_zigzag()
        Layout('b (cp s) d')
        """
        chosen = self.zigzag_dims if dims is None else tuple(dims)
        if not any(self.dims[d].zigzag for d in chosen):
            return self
        out = tuple(Dim(d.factors) if i in chosen else d for i, d in enumerate(self.dims))
        return _from_parts(out, self.reduce_op, self.partial_axes)

    def zigzag_order(self, mesh: Mesh, shape: Shape, dim: int) -> tuple[int, ...]:
        """The global index of dim `dim` at each position of its contiguous twin
        (`without_zigzag`): the ranks' blocks in rank order, each as the rank holds it.
        For a dim that is not zigzag, range(size).

        >>> Layout("zigzag(cp s)").zigzag_order(Mesh("cp=2"), (8,), 0)
        (0, 1, 6, 7, 2, 3, 4, 5)
        """
        placed = self.placements(mesh, shape)[dim]
        if not placed.zigzag:
            return tuple(range(placed.size))
        return tuple(i for head, tail in zigzag_spans(placed)
                     for lo, n in (head, tail) for i in range(lo, lo + n))

    def split(self, dim: int, axis: AxisName) -> Layout:
        """This layout with dim `dim` (negative: from the end) also split over `axis`, as its
        most minor axis (just before the dim's own name).

        >>> Layout("(dp a) b").split(0, "fsdp"), Layout("a b").split(-1, "tp")
        (Layout('(dp fsdp a) b'), Layout('a (tp b)'))
        """
        i = range(self.ndim)[dim]
        factors = self.dims[i].factors
        dims = list(self.dims)
        dims[i] = Dim((*factors[:-1], notation.Factor(axis), factors[-1]), self.dims[i].zigzag)
        return _from_parts(tuple(dims), self.reduce_op, self.partial_axes)

    def with_dim(self, dim: int, name: str) -> Layout:
        """This layout with dim `dim` (negative: from the end) whole, named `name`.

        >>> Layout("b s (tp v)").with_dim(-1, "v")
        Layout('b s v')
        """
        dims = list(self.dims)
        dims[range(self.ndim)[dim]] = Dim((notation.Factor(name),))
        return _from_parts(tuple(dims), self.reduce_op, self.partial_axes)

    def without_axes(self, dim: int, axes: Sequence[AxisName]) -> Layout:
        """This layout with the factors named in `axes` taken out of dim `dim`.

        >>> Layout("b (dp cp s) d").without_axes(1, ["cp"])
        Layout('b (dp s) d')
        """
        i = range(self.ndim)[dim]
        dims = list(self.dims)
        dims[i] = Dim(tuple(f for f in dims[i].factors if f.name not in axes), dims[i].zigzag)
        return _from_parts(tuple(dims), self.reduce_op, self.partial_axes)

    def dim_from(self, dim: int, other: Layout) -> Layout:
        """This layout with dim `dim` as `other` has it.

        >>> Layout("s (tp d) | sum(dp)").dim_from(0, Layout("zigzag(cp s) d"))
        Layout('zigzag(cp s) (tp d) | sum(dp)')
        """
        dims = list(self.dims)
        dims[range(self.ndim)[dim]] = other.dims[range(other.ndim)[dim]]
        return _from_parts(tuple(dims), self.reduce_op, self.partial_axes)

    def renamed(self, names: Mapping[str, str]) -> Layout:
        """This layout with each name in `names` (a dim's name or a mesh axis) replaced by
        its value, all at once ("d1 d0" renames safely).

        >>> Layout("(tp b) h").renamed({"b": "d0", "h": "d1"})
        Layout('(tp d0) d1')
        """
        dims = tuple(Dim(tuple(notation.Factor(names.get(f.name, f.name), f.size)
                               for f in d.factors), d.zigzag) for d in self.dims)
        return _from_parts(dims, self.reduce_op,
                           tuple(names.get(a, a) for a in self.partial_axes))

    # -- math on a mesh --------------------------------------------------------
    def placements(self, mesh: Mesh, shape: Shape) -> tuple[DimPlacement, ...]:
        """Each dim resolved on `mesh` for a global `shape`; raises if it does not fit."""
        return _resolve(self, mesh, tuple(int(s) for s in shape))

    def sharded_axes(self, mesh: Mesh) -> tuple[AxisName, ...]:
        """Mesh axes that shard some dim, in mesh order."""
        names = {f.name for d in self.dims for f in d.factors}
        return tuple(a for a in mesh.axis_names if a in names)

    def dim_axes(self, dim: int, mesh: Mesh) -> tuple[AxisName, ...]:
        """The mesh axes splitting dim `dim`, as written (major to minor).

        >>> Layout("b (tp cp s)").dim_axes(1, Mesh("cp=2 tp=2"))
        ('tp', 'cp')
        """
        return tuple(f.name for f in self.dims[dim].factors if f.name in mesh.axis_names)

    def replicated_axes(self, mesh: Mesh) -> tuple[AxisName, ...]:
        """Mesh axes named nowhere in the layout, in mesh order."""
        used = set(self.sharded_axes(mesh)) | set(self.partial_axes)
        return tuple(a for a in mesh.axis_names if a not in used)

    def indices(self, mesh: Mesh, shape: Shape, rank: int) -> tuple[tuple[int, ...], ...]:
        """Per dim, the global indices `rank` holds, in the order of its local tensor."""
        placed = self.placements(mesh, shape)
        return _indices(placed, tuple(sorted(mesh.coords(rank).items())))

    def local_shape(self, mesh: Mesh, shape: Shape, rank: int) -> Shape:
        """Shape of the local tensor of `rank` (counted, never enumerated)."""
        placed = self.placements(mesh, shape)
        return _local_shape(placed, tuple(sorted(mesh.coords(rank).items())))

    def check_local(self, mesh: Mesh, shape: Shape, rank: int, local_shape: Shape,
                    argument: str = "local tensor") -> None:
        """Raise ShapeError if `local_shape` is not what `rank` holds under this layout."""
        want = self.local_shape(mesh, shape, rank)
        if tuple(local_shape) != want:
            raise ShapeError(
                f"{argument} on rank {rank} has shape {tuple(local_shape)}, but layout"
                f' "{self}" of global shape {tuple(shape)} on {mesh!r} gives it shape {want}.'
                " fix: pass the shard this rank holds, or the right global shape/layout"
            )


def as_layout(value: str | Layout, argument: str = "layout") -> Layout:
    """A Layout from a pattern string or Layout (raises a meshcomm error otherwise)."""
    if isinstance(value, (str, Layout)):
        return Layout(value)
    raise ShapeError(f"{argument} must be a layout string or Layout, got {type(value).__name__}")


@functools.lru_cache(maxsize=4096)
def _parse_layout(text: str) -> Layout:
    return Layout._from_pattern(notation.parse(text))


def _from_parts(dims: tuple[Dim, ...], op: str | None, axes: tuple[AxisName, ...]) -> Layout:
    """A derived layout, checked by the parser as if it had been written (a name used
    twice, a bad op): the pattern's text is the one canonical spelling."""
    return Layout(str(notation.Pattern(dims, op, axes)))


@functools.lru_cache(maxsize=8192)
def _resolve(layout: Layout, mesh: Mesh, shape: Shape) -> tuple[DimPlacement, ...]:
    text = str(layout)
    if len(shape) != layout.ndim:
        raise ShapeError(
            f'layout "{text}" has {layout.ndim} dims but the shape {shape} has {len(shape)}.'
            f" fix: name one dim per tensor dim, e.g. \"{_suggest(len(shape), mesh)}\""
        )
    if any(s < 0 for s in shape):
        raise ShapeError(f'layout "{text}": shape {shape} has a negative size; sizes are >= 0')
    for axis in layout.partial_axes:
        if axis not in mesh.axis_names:
            raise _axis_error(text, axis, mesh, "a pending reduction is over mesh axes ({axes})")
    return tuple(_place_dim(text, i, dim, shape[i], mesh) for i, dim in enumerate(layout.dims))


def _suggest(ndim: int, mesh: Mesh) -> str:
    names = fresh_names("abcdefgh", mesh.axis_names)
    return " ".join(next(names) for _ in range(ndim))


def _axis_error(text: str, name: str, mesh: Mesh, why: str) -> MeshAxisError:
    # names are unique in a layout, so the whole-word match is the token ("tq", not "tqa")
    found = re.search(rf"\b{re.escape(name)}\b", text)
    at = found.start() if found else text.find(name)
    hint = did_you_mean(name, mesh.axis_names)
    return MeshAxisError(
        f'layout "{text}" on {mesh!r}: "{name}" is not a mesh axis\n'
        + caret(text, at, at + len(name), why.format(axes=", ".join(mesh.axis_names)))
        + (f"\n  fix: {hint}" if hint else "")
    )


def _place_dim(text: str, i: int, dim: Dim, size: int, mesh: Mesh) -> DimPlacement:
    if dim.zigzag:
        strays = [f.name for f in dim.factors[:-1] if f.name not in mesh.axis_names]
        if strays or dim.factors[-1].name in mesh.axis_names:
            name = strays[0] if strays else dim.factors[-1].name
            why = ("zigzag(...) splits over mesh axes ({axes})" if strays
                   else "zigzag(...) ends with the dim's own name, not a mesh axis")
            raise _axis_error(text, name, mesh, why) if strays else ShapeError(
                f'layout "{text}": dim {i} {dim}: {why}; fix: write e.g. "zigzag(cp s)"')
        twin = _place_dim(text, i, Dim(dim.factors), size, mesh)
        return DimPlacement(twin.size, twin.parts, twin.uneven, True)
    axes = set(mesh.axis_names)
    for f in dim.factors:
        if f.name in axes and f.size is not None and f.size != mesh.axis_size(f.name):
            raise ShapeError(
                f'layout "{text}": "{f}" in dim {i} gives mesh axis {f.name} size {f.size}, but'
                f" {mesh!r} has {f.name}={mesh.axis_size(f.name)}. fix: write {f.name} alone"
            )
    free = [f for f in dim.factors if f.name not in axes and f.size is None]
    if len(free) > 1 and len(dim.factors) > 1:
        bad = next((f.name for f in free if did_you_mean(f.name, axes)), free[0].name)
        raise _axis_error(text, bad, mesh, "a group is one dim name plus mesh axes ({axes})"
                          " or sized factors (x=2)")
    known = math.prod(mesh.axis_size(f.name) if f.name in axes else (f.size or 1)
                      for f in dim.factors)
    parts_known = [Part(f.name, mesh.axis_size(f.name) if f.name in axes else (f.size or 0),
                        f.name in axes) for f in dim.factors]
    if not free:
        if known != size:
            raise ShapeError(
                f'layout "{text}" does not fit dim {i} of size {size}: its factors {dim} multiply'
                f" to {known}. fix: give the dim a name that takes the rest, e.g."
                f" \"({' '.join(map(str, dim.factors))} {_fresh_name(text, mesh)})\""
            )
        return DimPlacement(size, tuple(parts_known), False)
    if size % known == 0:
        parts = tuple(Part(p.name, size // known, False) if p.size == 0 and not p.axis else p
                      for p in parts_known)
        return DimPlacement(size, parts, False)
    chunk_form = all(f.name in axes for f in dim.factors[:-1]) and dim.factors[-1] is free[0]
    if not chunk_form:
        raise ShapeError(
            f'layout "{text}" does not fit dim {i} of size {size}: {dim} needs a multiple of'
            f" {known}; only \"(axes... name)\" groups allow uneven shards."
            f" fix: use \"{_chunk_form(dim, mesh, free[0].name)}\""
            f", or pad dim {i} to {-(-size // known) * known}"
        )
    return DimPlacement(size, tuple(parts_known), True)


def _fresh_name(text: str, mesh: Mesh) -> str:
    """A dim name used neither in `text` nor as a mesh axis (for fix suggestions)."""
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)) | set(mesh.axis_names)
    return next(fresh_names("xyz", used))


def _chunk_form(dim: Dim, mesh: Mesh, name: str) -> str:
    """The "(axes... name)" group of `dim`'s mesh axes, or `name` alone when it has none."""
    axes = [a for a in mesh.axis_names if a in {f.name for f in dim.factors}]
    return f"({' '.join(axes)} {name})" if axes else name


def chunk_range(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """`torch.chunk` of [start, start+length) into `parts`: the (start, length) of chunk `index`."""
    step = -(-length // parts) if length else 0
    lo = min(index * step, length)
    hi = min((index + 1) * step, length)
    return start + lo, hi - lo


def _chunk_span(dim: DimPlacement, where: dict[str, int]) -> tuple[int, int]:
    """(start, length) of an uneven dim's nested `torch.chunk` at coordinates `where`."""
    start, length = 0, dim.size
    for part in dim.parts:
        if part.axis:
            start, length = chunk_range(start, length, part.size, where[part.name])
    return start, length


def group_position(dim: DimPlacement, where: Mapping[str, int]) -> int:
    """The flat position (row-major over the dim's axes, as written) of coordinates `where`."""
    out = 0
    for part in dim.parts:
        if part.axis:
            out = out * part.size + where[part.name]
    return out


@functools.lru_cache(maxsize=4096)
def chunk_spans(dim: DimPlacement) -> tuple[tuple[int, int], ...]:
    """Per group position (`group_position`), the (start, length) block of a "(axes... name)"
    dim (nested `torch.chunk`; a zigzag dim: its contiguous twin's)."""
    sizes = [p.size for p in dim.parts if p.axis]
    names = [p.name for p in dim.parts if p.axis]
    out = []
    for flat in range(math.prod(sizes)):
        where, rest = {}, flat
        for name, n in zip(reversed(names), reversed(sizes)):
            rest, where[name] = divmod(rest, n)
        out.append(_chunk_span(dim, where))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def zigzag_spans(dim: DimPlacement) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    """Per group position of a zigzag dim, its (start, length) head and tail: the twin's
    block (nested `torch.chunk`, as "(axes... name)") cut in two by `torch.chunk`, heads
    laid out in group order from the start of the dim, tails after them in reverse group
    order. An even split of 2g chunks gives position p chunks p and 2g-1-p."""
    lengths = [n for _, n in chunk_spans(dim)]
    heads = [-(-n // 2) for n in lengths]
    tails = [n - h for n, h in zip(lengths, heads)]
    out, head_at, tail_end = [], 0, dim.size
    for h, t in zip(heads, tails):
        out.append(((head_at, h), (tail_end - t, t)))
        head_at, tail_end = head_at + h, tail_end - t
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _indices(placed: tuple[DimPlacement, ...],
             coords: tuple[tuple[str, int], ...]) -> tuple[tuple[int, ...], ...]:
    where = dict(coords)
    out = []
    for dim in placed:
        if dim.zigzag:
            (h0, hn), (t0, tn) = zigzag_spans(dim)[group_position(dim, where)]
            out.append((*range(h0, h0 + hn), *range(t0, t0 + tn)))
            continue
        if dim.uneven:
            start, length = _chunk_span(dim, where)
            out.append(tuple(range(start, start + length)))
            continue
        out.append(_even_indices(dim.parts, where))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _local_shape(placed: tuple[DimPlacement, ...],
                 coords: tuple[tuple[str, int], ...]) -> Shape:
    where = dict(coords)
    return tuple(_chunk_span(dim, where)[1] if dim.uneven or dim.zigzag
                 else math.prod(p.size for p in dim.parts if not p.axis) for dim in placed)


def _even_indices(parts: tuple[Part, ...], where: dict[str, int]) -> tuple[int, ...]:
    strides = []
    stride = 1
    for part in reversed(parts):
        strides.append(stride)
        stride *= part.size
    strides.reverse()
    offset = sum(where[p.name] * s for p, s in zip(parts, strides) if p.axis)
    local = [(p.size, s) for p, s in zip(parts, strides) if not p.axis]
    idx = [offset]
    for size, s in local:
        idx = [base + k * s for base in idx for k in range(size)]
    return tuple(idx)
