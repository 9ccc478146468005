"""A pipeline stage as declared data: its mesh, the layouts of what it takes and gives, and
(on the ranks that run it) its module. Everything here is checked when the pipeline is built,
before any communication."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ...core.errors import ScheduleError
from ...core.layout import Layout
from ...core.mesh import Mesh
from ...runtime.bind import BoundMesh
from ..fsdp.param import UNIT_ATTR

GATHER = ("microbatch", "step")     # Stage.gather: per microbatch's use, or once per step


@dataclass(frozen=True, eq=False)
class Stage:
    """One pipeline stage: `mesh` (a BoundMesh: `mc.init_mesh`) runs `module` on activations
    in layout `input` and gives its output in layout `output` (both on `mesh`, in the notation
    of `mc.plan`). `module` is None on ranks outside `mesh`: every rank declares every stage,
    only a stage's own ranks hold its module.

    `averaged`: the mesh axes over which the stage's gradients are averaged (FSDP's shard
    axis and HSDP's replicate axes: `("dp",)` for `fully_shard(module, mesh, axis="dp")`).
    Declare it on every rank: the neighbouring stages scale the gradients they hand over by
    it. A module whose `fully_shard` units average over other axes is refused.

    `gather`: when the module's `fully_shard` units gather their parameters. "microbatch"
    (default): around every microbatch's forward (and again in its backward with
    `reshard_after_forward`). "step": once, at each unit's first use in the step, kept
    gathered until the step ends (more memory, fewer all_gathers). Declare it on every rank
    of the stage."""

    mesh: BoundMesh
    input: str | Layout
    output: str | Layout
    module: nn.Module | None = None
    averaged: Sequence[str] = ()
    gather: str = "microbatch"

    def __post_init__(self) -> None:
        if self.gather not in GATHER:
            raise ScheduleError(f"Stage(gather={self.gather!r}): expected one of {GATHER}"
                                " (when its fully_shard units gather their parameters)")

    def layouts(self) -> tuple[Layout, Layout]:
        return (Layout.parse(str(self.input)), Layout.parse(str(self.output)))


def stage_meshes(mesh: Mesh, axis: str = "pp") -> tuple[Mesh, ...]:
    """The meshes of the stages on a pipeline axis: `mesh.slice(axis, i)` for each index i
    (bind each with `mc.init_mesh` on every rank)."""
    if axis not in mesh.axis_names:
        raise ScheduleError(f"stage_meshes(axis={axis!r}): {mesh!r} has no such axis; its axes"
                            f" are {list(mesh.axis_names)}")
    return tuple(mesh.slice(axis, i) for i in range(mesh.axis_size(axis)))


def averaged_axes(stage: Stage, index: int) -> tuple[str, ...]:
    """The axes stage `index`'s gradients are averaged over (`Stage.averaged`), checked
    against its module's `fully_shard` units where this rank holds it."""
    axes = tuple(stage.averaged) if not isinstance(stage.averaged, str) else (stage.averaged,)
    if stage.module is not None:
        units = [getattr(m, UNIT_ATTR) for m in stage.module.modules() if hasattr(m, UNIT_ATTR)]
        for found in sorted({(u.axis, *u.replicate) for u in units}):
            if set(found) != set(axes):
                raise ScheduleError(
                    f"pipeline stage {index} on {stage.mesh.mesh!r}: its fully_shard units"
                    f" average gradients over {found}, but the Stage declares averaged={axes};"
                    f" fix: Stage(..., averaged={found}) on every rank (the other stages scale"
                    " the gradients they hand over by it)")
    for a in axes:
        if a not in stage.mesh.mesh.axis_names:
            raise ScheduleError(f"Stage(averaged={axes!r}): {a!r} is not an axis of"
                                f" {stage.mesh.mesh!r}")
    return axes


def grad_scale(stage: Stage, layout: Layout, axes: Sequence[str]) -> int:
    """How many times the true gradient a stage's averaged gradients need where they enter or
    leave through `layout`: the size of the averaged axes that split it (module docstring of
    `meshcomm.nn.pipeline.runner`)."""
    mesh = stage.mesh.mesh
    split = set(layout.sharded_axes(mesh))
    return math.prod(mesh.axis_size(a) for a in axes if a in split)
