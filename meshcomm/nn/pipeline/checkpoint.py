"""A pipeline's parameters as one model's state dict, keyed by global names, so that a
checkpoint saved from one stage split loads into another (other stages, meshes, layouts,
FSDP or not, another world size).

Every rank builds the same keys: each global name is declared (`StageParam`) as one stage's
module parameter, the layout of its local tensor on that stage's mesh and its global shape
and dtype. A rank that runs the stage puts its parameter there (as a `mc.Sharded` over the
parameter's own storage, so a load writes into it); every other rank puts a placeholder, an
`mc.Sharded` with an empty local tensor on the same mesh, layout, shape and dtype, which
`save_checkpoint` indexes and `load_checkpoint` skips. Nothing is communicated to build it:
the declarations say everything, and on the stage's own ranks they are checked against the
parameters (local shape, dtype, a DTensor's placements) before any checkpoint call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...core.errors import CheckpointError, MeshcommError, ShapeError
from ...core.layout import Layout
from ...core.mesh import Mesh
from ...core.names import positional_names
from ...interop.placements import from_placements
from ...interop.runtime import device_mesh_of, global_shape, is_dtensor, local_of, placements_of
from ...sharded import Sharded
from ..checkpoint import CheckpointRead, load_checkpoint

if TYPE_CHECKING:
    from .runner import Pipeline


@dataclass(frozen=True)
class StageParam:
    """Where one global parameter lives in a pipeline: parameter `name` of stage `stage`'s
    module, whose local tensor is layout `layout` of the global `shape` on that stage's mesh
    ("" = whole on every rank of the mesh; FSDP's `fully_shard(m, mesh, axis="dp")` stores
    "(dp o) i"), in `dtype` (None: the pipeline's). Declare it on every rank.

    >>> StageParam(1, "0.w", (4096, 4096), "(dp o) i")        # doctest: +SKIP
    """

    stage: int
    name: str
    shape: tuple[int, ...]
    layout: str = ""
    dtype: torch.dtype | None = None


def state_dict(pipe: Pipeline, params: Mapping[str, StageParam]) -> dict[str, Sharded]:
    """The whole model's parameters by global name, the same keys on every rank: this rank's
    own parameters as `mc.Sharded` over their storage, the other stages' as placeholders
    with no data (module docstring). Save it with `mc.nn.save_checkpoint` on every rank.

    >>> params = {f"layers.{i}.w": StageParam(i // 2, f"{i % 2}.w", (8, 8)) for i in range(4)}
    >>> mc.nn.save_checkpoint(state_dict(pipe, params), "ckpt")   # doctest: +SKIP

    Raises, before any communication, where a declaration does not fit: a stage or layout
    that does not exist, a parameter the stage's module lacks or has in another local shape
    or dtype, and (on a stage's ranks) a module parameter no declaration names.
    """
    out: dict[str, Sharded] = {}
    seen: dict[tuple[int, str], str] = {}
    for key, spec in params.items():
        where = _where(pipe, key, spec)
        if (spec.stage, spec.name) in seen:
            raise CheckpointError(f"{where}: declared twice, as {seen[spec.stage, spec.name]!r}"
                                  f" and {key!r}; fix: one global name per parameter")
        seen[spec.stage, spec.name] = key
        out[key] = _leaf(pipe, key, spec, where)
    _check_covered(pipe, seen)
    return out


def load_state_dict(pipe: Pipeline, params: Mapping[str, StageParam],
                    folder: str | os.PathLike[str], *, strict: bool = True) -> CheckpointRead:
    """Fill this rank's parameters of `pipe` in place from a checkpoint of the same global
    names (saved from any stage split: `mc.nn.save_checkpoint(state_dict(pipe, params))`);
    `mc.nn.load_checkpoint(state_dict(pipe, params), folder)`. Nothing is communicated;
    every key and global shape is checked against the checkpoint's index before any file
    is read. Call it on every rank, before the next `step()`."""
    return load_checkpoint(state_dict(pipe, params), folder, strict=strict)


# -- one declaration -------------------------------------------------------------------------
def _where(pipe: Pipeline, key: str, spec: StageParam) -> str:
    if not isinstance(spec, StageParam):
        raise CheckpointError(f"pipeline state_dict: {key!r} maps to a"
                              f" {type(spec).__name__}; fix: StageParam(stage, name, shape,"
                              " layout)")
    n = len(pipe.stages)
    if not 0 <= spec.stage < n:
        raise CheckpointError(f"pipeline state_dict: {key!r} is declared on stage {spec.stage},"
                              f" but the pipeline has stages 0..{n - 1}")
    return f"pipeline state_dict: {key!r} (stage {spec.stage}'s {spec.name!r})"


def _layout(spec: StageParam, mesh: Mesh, where: str) -> Layout:
    """The declared layout, checked to fit the shape on the stage's mesh."""
    shape = tuple(spec.shape)
    try:
        layout = (Layout.parse(spec.layout) if spec.layout.strip()
                  else Layout.of_names(positional_names(len(shape), mesh.axis_names)))
        if len(layout.dim_names(mesh)) != len(shape):
            raise ShapeError(f'layout "{layout}" has {len(layout.dim_names(mesh))} dims, the'
                             f" shape {shape} {len(shape)}")
        layout.local_shape(mesh, shape, mesh.ranks[0])
    except MeshcommError as err:
        raise type(err)(f"{where} on {mesh!r}: {err}") from None
    if layout.partial_axes:
        raise ShapeError(f'{where}: layout "{layout}" is a pending reduction; a parameter is'
                         " a value. fix: a layout without \"| sum(...)\"")
    return layout


def _leaf(pipe: Pipeline, key: str, spec: StageParam, where: str) -> Sharded:
    stage = pipe.stages[spec.stage]
    bound = stage.mesh
    layout = _layout(spec, bound.mesh, where)
    shape = tuple(int(s) for s in spec.shape)
    dtype = spec.dtype or pipe.dtype
    if not bound.in_mesh or stage.module is None:
        return Sharded(torch.empty(0, dtype=dtype, device=bound.device), bound, layout, shape)
    local = _local(stage.module, spec, bound.mesh, layout, shape, where)
    want = layout.local_shape(bound.mesh, shape, bound.rank)
    if tuple(local.shape) != tuple(want) or local.dtype != dtype:
        raise ShapeError(f'{where} on rank {bound.rank}: layout "{layout}" of {shape} puts a'
                         f" local {tuple(want)} {dtype} here, but the parameter's local tensor"
                         f" is {tuple(local.shape)} {local.dtype}; fix: StageParam(shape=...,"
                         " layout=..., dtype=...) as the stage's module holds it")
    return Sharded(local, bound, layout, shape)


def _local(module: nn.Module, spec: StageParam, mesh: Mesh, layout: Layout,
           shape: tuple[int, ...], where: str) -> Tensor:
    """The parameter's local tensor, sharing its storage. A DTensor of the declared global
    shape on the stage's mesh (fully_shard, parallelize) must have the declared layout; one
    of another shape is a view local to a tensor-parallel split the declaration describes."""
    found = dict(module.named_parameters(remove_duplicate=False))
    if spec.name not in found:
        raise CheckpointError(f"{where}: the stage's module has no such parameter; it has"
                              f" {sorted(found)[:8]}")
    p = found[spec.name]
    if not is_dtensor(p):
        return p.detach()
    if (global_shape(p) == shape
            and Mesh.from_device_mesh(device_mesh_of(p)) == mesh):
        names = positional_names(len(shape), mesh.axis_names)
        placed = from_placements(mesh, shape, placements_of(p), names=names)
        declared = layout.renamed(dict(zip(layout.dim_names(mesh), names)))
        if placed != declared:
            raise ShapeError(f'{where}: declared layout "{spec.layout or layout}", but the'
                             f' parameter is a DTensor in "{placed}"; fix:'
                             f' StageParam(layout="{placed}")')
    return local_of(p.detach())


def _check_covered(pipe: Pipeline, seen: Mapping[tuple[int, str], str]) -> None:
    """Every parameter of every stage this rank runs has a global name."""
    for s, stage in enumerate(pipe.stages):
        if stage.module is None or not stage.mesh.in_mesh:
            continue
        missing = [n for n, _ in stage.module.named_parameters() if (s, n) not in seen]
        if missing:
            raise CheckpointError(f"pipeline state_dict: stage {s}'s parameters {missing[:5]}"
                                  f"{' ...' if len(missing) > 5 else ''} have no global name;"
                                  " fix: declare each as StageParam(stage, name, shape, layout)"
                                  " under the name the checkpoint gives it")
