"""What users call: `fully_shard`, `set_requires_gradient_sync`, `init_shards`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...core.errors import MeshAxisError, MeshMismatchError, ShapeError
from ...core.layout import Layout
from ...executors.local import run_slice
from ...interop.placements import from_placements
from ...interop.runtime import (
    bind_device_mesh,
    device_mesh_of,
    global_shape,
    is_dtensor,
    local_of,
    placements_of,
)
from ...runtime.bind import BoundMesh, require_bound
from ..params import ShardedModule
from .param import UNIT_ATTR, MixedPrecision, owned_params, recipe_param, shard_param
from .schedule import Schedule
from .state import post_forward, pre_forward
from .unit import Unit


def fully_shard(module: nn.Module, mesh: Any, *, axis: str | None = None,
                reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecision | None = None, prefetch: bool = True,
                replicate: str | Sequence[str] | None = None) -> nn.Module:
    """Shard the parameters `module` owns over mesh axis `axis` and gather them around its
    forward (FSDP); returns `module` (changed in place), as FSDP2's `fully_shard`.

    >>> for block in model.layers:                                  # doctest: +SKIP
    ...     mc.nn.fully_shard(block, bound)
    >>> mc.nn.fully_shard(model, bound)                             # doctest: +SKIP

    `mesh`: a BoundMesh (`mc.init_mesh`) or a torch DeviceMesh. `axis`: the mesh axis to
    shard over (default: the mesh's only axis, else "dp" or "fsdp"). Apply it to inner
    modules first (each becomes one unit: one all_gather and one reduce_scatter), then to
    the root, which takes the parameters no unit took. `reshard_after_forward` (default:
    True, False for a module that holds other units) frees the gathered parameters after
    forward and gathers them again in backward. `mp_policy`: `MixedPrecision`. `prefetch`:
    issue the next unit's all_gather before computing this one (forward and backward).
    `replicate`: HSDP, a mesh axis (`"rep"`) or several (`("rep", "cp")`: HSDP with context
    parallelism) over which the shards are replicated and the gradients averaged too (one
    all_reduce of the shard over all of them, per unit, after its reduce_scatter).
    Parameters on the meta device stay on it (shard-sized): `model.to_empty(device=...)`
    then `mc.nn.init_shards(model, fn)` fills them.

    A recipe module (`mc.nn.ShardedModule`: `ColumnParallelLinear`, your own blocks) keeps
    its parameters as its recipe stores them: the unit runs each one's `ParamSpec` plans
    (stored -> use in forward, handed to `use(name)`; grad -> stored and its grad_scale in
    backward), bucketed with the unit's other parameters; `axis` and `replicate` do not
    change them.
    """
    bound = _bound(mesh)
    axis = _axis(bound, axis)
    replicas = _replicate(bound, axis, replicate)
    if not bound.in_mesh:
        raise MeshMismatchError(
            f"fully_shard: rank {bound.rank} is not in {bound.mesh!r} (its ranks are"
            f" {list(bound.mesh.ranks)}), so it holds no shard and cannot run the model;"
            " fix: build and shard the model on the mesh's ranks only (if bound.in_mesh: ...)")
    if hasattr(module, UNIT_ATTR):
        raise MeshMismatchError(f"fully_shard: {type(module).__name__} is already sharded;"
                                " fix: call fully_shard once per module")
    has_units = any(hasattr(m, UNIT_ATTR) for m in module.modules() if m is not module)
    if reshard_after_forward is None:
        reshard_after_forward = not has_units
    owned, tied = owned_params(module)
    params = [recipe_param(bound, m, attr, name, p, tied.get(id(p), ()))
              if isinstance(m, ShardedModule) and attr in m.specs else
              shard_param(bound, axis, m, attr, name, p, replicas, tied.get(id(p), ()), module)
              for m, attr, name, p in owned]
    unit = Unit(module, bound, axis, params, mp_policy or MixedPrecision(),
                reshard_after_forward, prefetch, Schedule(), replicas)
    setattr(module, UNIT_ATTR, unit)
    if has_units:   # the units below and this one: one model, one recorded order
        shared: Schedule[Unit] = Schedule()
        for m in module.modules():
            if hasattr(m, UNIT_ATTR):
                getattr(m, UNIT_ATTR).schedule = shared
    pre, post = _eager_hooks()
    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True, always_call=True)   # cleans up a raise
    return module


@functools.cache
def _eager_hooks() -> tuple[Any, Any]:
    """The forward hooks, run eagerly under torch.compile (as FSDP2's): a compiled module
    compiles its own forward, and the hooks' per-unit state (which unit, the recorded order)
    is never a guard that recompiles it for each unit. Made on first use: importing
    torch._dynamo costs seconds, and only fully_shard needs it."""
    disable: Any = torch.compiler.disable
    return disable(pre_forward), disable(post_forward)


def _bound(mesh: Any) -> BoundMesh:
    if isinstance(mesh, BoundMesh):
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return bind_device_mesh(mesh)
    return require_bound(mesh, "fully_shard", "a DeviceMesh or a mesh")


def _axis(bound: BoundMesh, axis: str | None) -> str:
    names = bound.mesh.axis_names
    if axis is None:
        found = names if len(names) == 1 else [a for a in ("dp", "fsdp") if a in names]
        if len(found) != 1:
            raise MeshAxisError(f"fully_shard: which axis of {bound.mesh!r} shards the"
                                f" parameters? fix: pass axis= one of {list(names)}")
        axis = found[0]
    if axis not in names:
        raise MeshAxisError(f"fully_shard(axis={axis!r}): not an axis of {bound.mesh!r};"
                            f" fix: one of {list(names)}")
    return axis


def _replicate(bound: BoundMesh, axis: str, replicate: Any) -> tuple[str, ...]:
    """`replicate` as a tuple of distinct mesh axes other than `axis` (None: no axes)."""
    if replicate is None:
        return ()
    others = [a for a in bound.mesh.axis_names if a != axis]
    one = isinstance(replicate, str)
    if not one and not (isinstance(replicate, Sequence)
                        and all(isinstance(a, str) for a in replicate)):
        raise MeshAxisError(f"fully_shard(replicate={replicate!r}): takes a mesh axis name or"
                            f" a sequence of them; fix: e.g. replicate={tuple(others[:2])}"
                            f" (the axes of {bound.mesh!r} other than axis={axis!r}:"
                            f" {others})")
    axes = (replicate,) if one else tuple(replicate)
    for a in axes:
        if a not in others:
            which = "" if one else f" ({a!r})"
            raise MeshAxisError(f"fully_shard(replicate={replicate!r}): not an axis of"
                                f" {bound.mesh!r} other than axis={axis!r}{which}; fix: one"
                                f" of {others}")
    twice = [a for a in dict.fromkeys(axes) if axes.count(a) > 1]
    if twice:
        raise MeshAxisError(f"fully_shard(replicate={replicate!r}): names {twice[0]!r} more"
                            " than once; fix: name each axis once, replicate="
                            f"{tuple(dict.fromkeys(axes))}")
    return axes


def set_requires_gradient_sync(module: nn.Module, requires: bool) -> nn.Module:
    """Turn gradient reduction of every fully_shard unit in `module` off or back on (as
    FSDP2's `set_requires_gradient_sync`): gradient accumulation over micro-batches.

    With `requires=False`, backward sends nothing: each unit adds its unsharded gradients to
    a buffer it keeps (the unit's full parameter size, per rank). The next backward with
    `requires=True` adds the buffer to its gradients and reduce_scatters the sum once, so
    `.grad` gets the average over ranks of the sum over micro-batches. Returns `module`.
    """
    units = [getattr(m, UNIT_ATTR) for m in module.modules() if hasattr(m, UNIT_ATTR)]
    if not units:
        raise MeshMismatchError(f"set_requires_gradient_sync: {type(module).__name__} has no"
                                " fully_shard units; fix: call mc.nn.fully_shard first")
    for unit in units:
        unit.sync = bool(requires)
    return module


# -- meta-device models: fill each rank's shards -----------------------------------------------
def init_shards(module: nn.Module, fn: Callable[[str, tuple[int, ...], tuple[slice, ...]], Tensor]
                ) -> nn.Module:
    """Fill every DTensor parameter's local shard with `fn(name, global_shape, index)`, where
    `index` is this rank's block of the global tensor as one slice per dim: the function
    computes only this rank's values (a model built on the meta device never exists whole).

    >>> mc.nn.init_shards(  # doctest: +SKIP
    ...     model, lambda name, shape, index: torch.zeros(shape)[index])

    Call it after `model.to_empty(device=...)`. Plain (unsharded) parameters get
    `fn(name, shape, full index)`. Returns `module`.
    """
    for name, p in module.named_parameters():
        if is_dtensor(p):
            mesh = type(_bound_mesh_of(p)).from_device_mesh(device_mesh_of(p))
            layout = from_placements(mesh, global_shape(p), placements_of(p))
            index = _block(layout, mesh, global_shape(p), _rank())
            local = local_of(p)
        else:
            index, local = tuple(slice(0, n) for n in p.shape), p
        values = fn(name, tuple(global_shape(p) if is_dtensor(p) else p.shape), index)
        if tuple(values.shape) != tuple(local.shape):
            raise ShapeError(f"init_shards: fn gave shape {tuple(values.shape)} for {name},"
                             f" whose block {index} has shape {tuple(local.shape)}; fix: return"
                             " the values of exactly that block")
        with torch.no_grad():
            local.copy_(values)
    return module


def _bound_mesh_of(p: Any) -> Any:
    from ...core.mesh import Mesh

    return Mesh.from_device_mesh(p.device_mesh)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _block(layout: Layout, mesh: Any, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """This rank's block of `layout` as slices (the layout's indices must be one run per dim)."""
    out = []
    for dim, ix in enumerate(layout.indices(mesh, shape, rank)):
        s = run_slice(ix)
        if s is None:
            raise ShapeError(f"init_shards: dim {dim} of \"{layout}\" gives rank {rank} rows"
                             " that are not one run; fn gets slices only for blocks")
        out.append(s)
    return tuple(out)
