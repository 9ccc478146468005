"""One attention call, resolved: the layouts, global shapes, which dims are batch, heads,
sequence and head dim, the mesh axes that split the sequence, and this rank's token
positions. Everything here is computed from the arguments, locally (no communication);
bad arguments raise before any strategy runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ...core.errors import ShapeError
from ...core.layout import Layout, Shape
from ...core.mesh import AxisName, Mesh
from ...core.positions import as_positions
from ...runtime.bind import BoundMesh
from .blocks import Mask

ROLES = ("b", "h", "s", "d")      # batch, heads, sequence, head dim (the canonical order)


@dataclass(frozen=True)
class Call:
    """An attention call on this rank. `q_layout` / `kv_layout` are the user's layouts;
    `order` the user's dims in canonical `b h s d` order (batch may be absent: -1);
    `seq_axes` the mesh axes splitting the sequence (the same for q and kv). `unfolded`:
    set on a call a strategy makes over the contiguous twin of a zigzag split (the hybrid's
    ring): the user's layout and shape, whose twin order relabels this call's positions."""

    bound: BoundMesh
    q_layout: Layout
    kv_layout: Layout
    q_shape: Shape
    kv_shape: Shape
    order: tuple[int, int, int, int]
    seq_axes: tuple[AxisName, ...]
    mask: Mask
    scale: float
    unfolded: tuple[Layout, Shape] | None = None

    @property
    def mesh(self) -> Mesh:
        return self.bound.mesh

    @property
    def q_twin(self) -> Layout:
        """The layout the strategies' plans move q in: `q_layout` with a zigzag sequence read
        as its contiguous twin (`Layout.without_zigzag`; the tokens' order is in
        `seq_order`)."""
        return self.q_layout.without_zigzag()

    @property
    def kv_twin(self) -> Layout:
        """`kv_layout` as `q_twin` reads it."""
        return self.kv_layout.without_zigzag()

    @property
    def seq_dim(self) -> int:
        return self.order[2]

    @property
    def head_dim_index(self) -> int:
        return self.order[1]

    def positions(self, layout: Layout, shape: Shape, rank: int) -> Sequence[int]:
        """The global sequence positions `rank` holds under `layout`, in local order (a
        `range` where they are one run: `core.positions.as_positions`)."""
        if self.unfolded is None:
            return _positions(layout, self.mesh, shape, rank, self.seq_dim)
        return _relabelled(layout, *self.unfolded, self.mesh, shape[self.seq_dim], rank,
                           self.seq_dim)

    def seq_order(self, layout: Layout, shape: Shape) -> Sequence[int]:
        """The global positions of the sequence gathered whole from `layout`'s twin
        (`q_twin`): range(length), or for a zigzag split its permuted order."""
        return _seq_order(layout, self.mesh, shape, self.seq_dim)

    def canonical(self, x: Tensor) -> Tensor:
        """A local tensor in the user's dim order as `b h s d` (a view; a missing batch dim
        becomes size 1)."""
        b, h, s, d = self.order
        if b < 0:
            return x.permute(h, s, d).unsqueeze(0)
        return x.permute(b, h, s, d)

    def user(self, x: Tensor) -> Tensor:
        """Undo `canonical`: a `b h s d` tensor in the user's dim order."""
        b, h, s, d = self.order
        dims: tuple[int, ...] = (b, h, s, d)
        if b < 0:
            x, dims = x.squeeze(0), (h, s, d)
        inverse = sorted(range(len(dims)), key=lambda i: dims[i])
        return x.permute(*inverse)


@functools.lru_cache(maxsize=256)
def _positions(layout: Layout, mesh: Mesh, shape: Shape, rank: int,
               dim: int) -> Sequence[int]:
    return as_positions(layout.indices(mesh, shape, rank)[dim])


@functools.lru_cache(maxsize=256)
def _relabelled(layout: Layout, user: Layout, user_shape: Shape, mesh: Mesh, length: int,
                rank: int, dim: int) -> Sequence[int]:
    """`rank`'s positions under `layout` (over the twin of `user`'s zigzag sequence, of
    `length` tokens) as positions of the user's sequence."""
    shape = tuple(length if i == dim else n for i, n in enumerate(user_shape))
    order = _seq_order(user, mesh, shape, dim)
    return as_positions([order[i] for i in layout.indices(mesh, shape, rank)[dim]])


@functools.lru_cache(maxsize=256)
def _seq_order(layout: Layout, mesh: Mesh, shape: Shape, dim: int) -> Sequence[int]:
    return as_positions(layout.zigzag_order(mesh, shape, dim))


def resolve(q: Tensor, k: Tensor, v: Tensor, bound: BoundMesh, layout: str | Layout,
            kv_layout: str | Layout | None, dims: str, shape: Sequence[int] | None,
            kv_shape: Sequence[int] | None, mask: Mask, scale: float | None) -> Call:
    """The call's `Call`, every argument checked (raises ShapeError naming it)."""
    q_layout, kv = Layout.parse(layout), Layout.parse(kv_layout or layout)
    names = dims.split()
    if len(names) != 4 or len(set(names)) != 4:
        raise ShapeError(f'attention(dims="{dims}"): expected four names, for batch, heads,'
                         ' sequence and head dim, e.g. dims="b h s d"')
    mesh = bound.mesh
    order = _order(q_layout, mesh, names, "layout")
    if _order(kv, mesh, names, "kv_layout") != order:
        raise ShapeError(f'attention: kv_layout "{kv}" orders the dims differently from'
                         f' layout "{q_layout}"; fix: write both in one dim order')
    for lay, arg in ((q_layout, "layout"), (kv, "kv_layout")):
        if lay.reduce_op is not None:
            raise ShapeError(f'attention({arg}="{lay}"): q, k and v cannot be pending sums;'
                             " fix: reduce them first (mc.reshard)")
    seq = q_layout.dim_axes(order[2], mesh)
    if kv.dim_axes(order[2], mesh) != seq:
        other = list(kv.dim_axes(order[2], mesh))
        raise ShapeError(f'attention: the sequence is split over {list(seq)} in layout'
                         f' "{q_layout}" but over {other} in kv_layout "{kv}"; fix: split both'
                         " the same way")
    if q_layout.dims[order[2]].zigzag != kv.dims[order[2]].zigzag:
        raise ShapeError(f'attention: the sequence of layout "{q_layout}" and of kv_layout'
                         f' "{kv}" must both be zigzag or neither; fix: split both the same way')
    if q.dim() != q_layout.ndim or k.dim() != kv.ndim or v.dim() != kv.ndim:
        raise ShapeError(f"attention: q, k, v have {q.dim()}, {k.dim()}, {v.dim()} dims;"
                         f' layout "{q_layout}" has {q_layout.ndim}, kv_layout "{kv}"'
                         f" {kv.ndim}")
    if k.shape != v.shape:
        raise ShapeError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in"
                         " shape; fix: pass keys and values of one shape")
    q_shape = _global(q, q_layout, mesh, shape, "shape")
    kv_shape = _global(k, kv, mesh, kv_shape, "kv_shape")
    for lay, x, sh, arg in ((q_layout, q, q_shape, "q"), (kv, k, kv_shape, "k")):
        lay.check_local(mesh, sh, bound.rank, tuple(x.shape), arg)
    b, h, _, d = order
    if q_shape[d] != kv_shape[d] or (b >= 0 and q_shape[b] != kv_shape[b]):
        raise ShapeError(f"attention: q {q_shape} and k {kv_shape} must share batch and head"
                         " dim")
    if q_shape[h] % kv_shape[h]:
        raise ShapeError(f"attention: {q_shape[h]} query heads are not a multiple of"
                         f" {kv_shape[h]} key/value heads (GQA needs a whole number of query"
                         " heads per key head)")
    return Call(bound, q_layout, kv, q_shape, kv_shape, order, seq, mask,
                q_shape[d] ** -0.5 if scale is None else float(scale))


def _order(layout: Layout, mesh: Mesh, names: list[str], arg: str
           ) -> tuple[int, int, int, int]:
    have = layout.dim_names(mesh)
    out = []
    for role, name in zip(ROLES, names):
        if name not in have:
            if role == "b" and layout.ndim == 3:
                out.append(-1)
                continue
            raise ShapeError(f'attention({arg}="{layout}"): no dim named "{name}" (the'
                             f' {("batch", "heads", "sequence", "head dim")[ROLES.index(role)]});'
                             f' its dims are {list(have)}. fix: name the dims, or pass'
                             ' dims="<batch> <heads> <seq> <head dim>"')
        out.append(have.index(name))
    if layout.ndim != 4 - (out[0] < 0):
        raise ShapeError(f'attention({arg}="{layout}"): {layout.ndim} dims; expected batch'
                         " (optional), heads, sequence and head dim")
    return out[0], out[1], out[2], out[3]


def _global(x: Tensor, layout: Layout, mesh: Mesh, shape: Sequence[int] | None,
            arg: str) -> Shape:
    if shape is not None:
        return tuple(int(n) for n in shape)
    out = []
    for dim, n in zip(layout.dims, x.shape):
        axes = [f.name for f in dim.factors if f.name in mesh.axis_names]
        out.append(int(n) * mesh.group_size(axes))
    return tuple(out)
