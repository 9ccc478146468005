"""Plans: the cheapest exact sequence of collectives between two layouts.

This module never communicates. `plan()` searches the move set of
`meshcomm.planner.moves` (Dijkstra with Pareto labels over planner states) for the
path of least modelled time under a `CostModel`; ties go to the lower peak
memory, then to fewer steps. Plans are frozen values, cached on their inputs,
and every rank computes the same one.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import PlanError
from ..core.layout import Layout, Shape, as_layout
from ..core.mesh import Mesh
from ..core.untraced import untraced
from . import crossmesh, search, zigzag
from .memo import PlanMemos
from .values import CostModel, Plan

_DEFAULT_COST = CostModel()


def plan(mesh: Mesh, shape: Shape, src: str | Layout, dst: str | Layout,
         dtype: torch.dtype | None = None, cost_model: CostModel | None = None,
         dst_mesh: Mesh | None = None) -> Plan:
    """Cheapest exact sequence of collectives that turns layout `src` into `dst`.

    `dtype` (default float32) sets the bytes a plan moves; `cost_model` (default
    `CostModel()`, NCCL's figures; `CostModel(backend="gloo")` for gloo's) the time it
    models. With `dst_mesh`, `dst` lives on that other mesh
    (disjoint, overlapping or nested): see `meshcomm.planner.crossmesh`. `mesh` and
    `dst_mesh` may be BoundMeshes (anything whose `.mesh` is a Mesh): the plan is made for
    their mesh.

    >>> p = plan(Mesh("dp=2 tp=4"), (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)")
    >>> [step.kind for step in p.steps]
    ['all_to_all']

    A call repeated with the same arguments is a few dict lookups in the mesh's memo (the
    mesh is never hashed; strings hash once); see `plan_cache_info`.
    """
    try:
        # the mesh's `PlanMemo`, read inline: a method call would double the time of a hit
        if cost_model is None and dst_mesh is None:
            return mesh._plans.plain[dtype][src][dst][shape]  # type: ignore[no-any-return]
        return mesh._plans.options[dtype, cost_model, dst_mesh][src][dst][shape]  # type: ignore[no-any-return]
    except (KeyError, TypeError, AttributeError):   # new, unhashable, no memo yet, not a Mesh
        pass                                        # (outside the handler: errors unchained)
    return _plan_and_memo(mesh, shape, src, dst, dtype, cost_model, dst_mesh)


# Every mesh's memo of plans (`Mesh._plans`, a `PlanMemo`), bounded together. Only checked
# dtypes key a memo: a call with bad arguments raises before anything is remembered.
_MEMOS = PlanMemos()


def _plan_and_memo(mesh: Any, shape: Any, src: Any, dst: Any, dtype: Any, cost_model: Any,
                   dst_mesh: Any) -> Plan:
    """`plan` past the memo: normalized arguments look again; else plan and remember."""
    given = (mesh, shape, dst_mesh)
    if type(shape) is not tuple:
        shape = _as_shape(shape)
    if type(mesh) is not Mesh:
        mesh = _unbound(mesh)
    if dst_mesh is not None and type(dst_mesh) is not Mesh:
        dst_mesh = _unbound(dst_mesh)
    if type(mesh) is Mesh and (mesh, shape, dst_mesh) != given:   # e.g. a BoundMesh, a list
        return plan(mesh, shape, src, dst, dtype, cost_model, dst_mesh)
    _MEMOS.misses += 1
    found = _fresh_plan(mesh, shape, src, dst, dtype, cost_model, dst_mesh)
    try:
        _MEMOS.insert(mesh, found, shape, src, dst, dtype, cost_model, dst_mesh)
    except TypeError:                             # an unhashable argument: not kept
        pass
    return found


def _unbound(mesh: object) -> Mesh:
    """The Mesh of a BoundMesh (duck-typed: the planner knows no process groups)."""
    inner = getattr(mesh, "mesh", None)
    return inner if isinstance(inner, Mesh) else mesh  # type: ignore[return-value]


def _as_shape(shape: object) -> Shape:
    try:
        return tuple(shape)  # type: ignore[arg-type, call-overload, no-any-return, unused-ignore]
    except TypeError:
        raise PlanError(
            f"shape must be a sequence of ints such as (8, 16), got {shape!r}") from None


def _fresh_plan(mesh: Mesh, shape: Shape, src: str | Layout, dst: str | Layout,
                dtype: torch.dtype | None, cost_model: CostModel | None,
                dst_mesh: Mesh | None) -> Plan:
    """`plan` on checked arguments; the search below caches on the normalized layouts."""
    if dtype is None:
        dtype = torch.float32
    if cost_model is None:
        cost_model = _DEFAULT_COST
    for name, value in (("mesh", mesh), ("dst_mesh", dst_mesh)):
        if value is not None and not isinstance(value, Mesh):
            raise PlanError(f"{name} must be a meshcomm Mesh, got {type(value).__name__};"
                            ' fix: mc.Mesh("dp=2 tp=4")')
    if mesh is None:
        raise PlanError('mesh must be a meshcomm Mesh, got None; fix: mc.Mesh("dp=2 tp=4")')
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(cost_model, CostModel):
        raise PlanError(f"cost_model must be a meshcomm CostModel, got {cost_model!r};"
                        " fix: mc.CostModel(latency_s=..., bandwidth=...)")
    bad = [s for s in shape if isinstance(s, bool) or not isinstance(s, int)]
    if bad and not all(hasattr(s, "__index__") and not isinstance(s, bool) for s in bad):
        raise PlanError(f"shape must hold ints, got {tuple(shape)!r} ({bad[0]!r} is a"
                        f" {type(bad[0]).__name__}); fix: pass sizes such as (8, 16)")
    shape = tuple(int(s) for s in shape)
    src_l, dst_l = as_layout(src, "src"), as_layout(dst, "dst")
    if src_l.zigzag_dims or dst_l.zigzag_dims:
        if dst_mesh is not None and dst_mesh != mesh:
            zz = src_l if src_l.zigzag_dims else dst_l
            raise PlanError(f'plan between meshes from "{src_l}" to "{dst_l}": a zigzag dim'
                            " moves on one mesh only; fix: reshard to its contiguous twin"
                            f' "{zz.without_zigzag()}" first, then between the meshes')
        return zigzag.zigzag_plan(mesh, shape, dtype, src_l, dst_l, cost_model)
    if dst_mesh is not None and dst_mesh != mesh:
        return crossmesh.cross_plan(mesh, dst_mesh, shape, dtype, src_l, dst_l, cost_model)
    return search.single_plan(mesh, shape, dtype, src_l, dst_l, cost_model)


DEFAULT_PLAN_CACHE_SIZE = 4096


def set_plan_cache_size(size: int) -> None:
    """Bound the plan caches at `size` entries each (default 4096), emptying them.

    `plan()` remembers its results twice: in a memo on each mesh, keyed on the arguments
    as given, and in one cache keyed on the normalized layouts (`search.single_plan`).
    Where the memos hold `size` plans in all, they empty before they take another; the
    cache drops its least recently used plan beyond `size`.
    `size=0` turns caching off (every call plans again). Process-wide: call it once at
    start-up, on every rank.

    >>> set_plan_cache_size(256); plan_cache_info()["maxsize"]
    256
    >>> set_plan_cache_size(DEFAULT_PLAN_CACHE_SIZE)
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PlanError(f"plan cache size must be an int >= 0, got {size!r};"
                        f" fix: e.g. set_plan_cache_size({DEFAULT_PLAN_CACHE_SIZE})")
    _MEMOS.bound = size
    clear_memos()
    search.set_cache_size(size)


def clear_memos(keep_misses: bool = False) -> None:
    """Empty every mesh's memo of plans (the search's cache stays; see `set_plan_cache_size`)."""
    _MEMOS.clear(keep_misses)


def plan_cache_info() -> dict[str, int]:
    """The plan caches' bound and fill, as plain data.

    `maxsize` bounds each cache (the meshes' memos together, and the search's); `plans` counts the
    distinct plans the search holds (`search.single_plan`), `calls` the argument spellings
    the meshes' memos hold, and `misses` the `plan()` calls since the caches were last
    emptied that no memo answered. (A memo hit is one dict lookup and counts nothing.)

    >>> sorted(plan_cache_info())
    ['calls', 'maxsize', 'misses', 'plans']
    """
    return {"maxsize": _MEMOS.bound, "plans": search.single_plan.cache_info().currsize,
            "calls": _MEMOS.fill(), "misses": _MEMOS.misses}


# -- autograd: the plan a reshard's backward runs ---------------------------------------------
def plan_untraced(*args: Any, **kwargs: Any) -> Plan:
    """`plan(...)`, run outside any active dispatch mode (fake tensors while torch.compile
    traces): the planner computes with small real tensors, and a plan holds none."""
    return untraced(plan, *args, **kwargs)


def backward_plan(forward: Plan, dtype: torch.dtype) -> Plan:
    """The plan the backward of `forward` runs: the output gradient from the destination
    layout without its pending reduction to the source's (see `grad_scale` and the module
    doc of `meshcomm.executors.distributed.autograd`). A pending max or min in the source
    has no gradient: PlanError.

    >>> fwd = plan(Mesh("dp=2"), (8, 4), "(dp b) h", "b h | sum(dp)")
    >>> str(backward_plan(fwd, torch.float32).src), str(backward_plan(fwd, torch.float32).dst)
    ('b h', '(dp b) h')
    """
    op = forward.src.reduce_op
    if op in ("max", "min"):
        raise PlanError(
            f'reshard from "{forward.src}" has no gradient: a pending {op} over'
            f" {', '.join(forward.src.partial_axes)} is not differentiable here."
            f" fix: reduce it first (reshard to \"{forward.src.without_reduction()}\") and"
            " differentiate from there, or detach the input")
    across = forward.dst_mesh is not None and forward.dst_mesh != forward.mesh
    # between meshes the gradient starts on the destination mesh and ends on the source
    return plan_untraced(forward.dst_mesh if across else forward.mesh, forward.shape,
                         forward.dst.without_reduction(), forward.src.without_reduction(),
                         dtype=dtype, cost_model=forward.cost_model,
                         dst_mesh=forward.mesh if across else None)
