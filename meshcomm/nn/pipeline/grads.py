"""Gradients across stages: tied weights (one weight used by two stages, on two meshes) and
gradient clipping by the norm over every stage.

A tie's two copies start equal and must stay equal, so after a step each copy's gradient is
the sum of both. The sum is two planned reshards: the first stage's gradient to the second
stage's mesh and layout (added there), and the sum back (`Tie` says each copy's layout).

Clipping needs the norm of all gradients of all stages: each rank adds the squares of its
gradients' elements, each divided by how many ranks hold that same element, and one
all_reduce of that one number over the world gives the total (the only collective of
`clip_grad_norm_`, in its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...core.errors import ScheduleError
from ...core.layout import Layout
from ...executors.distributed import Prepared, prepare
from ...planner.plan import plan as make_plan

Pipeline = Any     # a meshcomm.nn.pipeline.Pipeline (runner.py imports this module)


@dataclass(frozen=True)
class Tie:
    """A weight two stages share: parameter `names[k]` of stage `stages[k]`'s module, whose
    local tensor (its `.grad`; a DTensor's local shard) is layout `layouts[k]` of the weight's
    global `shape` on that stage's mesh. Declare it on every rank.

    >>> Tie((0, 3), ("embed.w", "head.w"), ("v h", "v h"), (32000, 4096))  # doctest: +SKIP
    """

    stages: tuple[int, int]
    names: tuple[str, str]
    layouts: tuple[str, str]
    shape: tuple[int, ...]


class TiedGrads:
    """The ties of a pipeline, prepared on this rank: `sum()` after each step."""

    def __init__(self, pipe: Pipeline, ties: Sequence[Tie]) -> None:
        self.jobs: list[tuple[Tie, Prepared | None, Prepared | None, Any, Any]] = []
        n = len(pipe.stages)
        for tie in ties:
            a, b = tie.stages
            if not (0 <= a < n and 0 <= b < n and a != b):
                raise ScheduleError(f"Tie(stages={tie.stages}): expected two different stages"
                                    f" of 0..{n - 1}")
            sa, sb = pipe.stages[a], pipe.stages[b]
            la, lb = Layout.parse(tie.layouts[0]), Layout.parse(tie.layouts[1])
            shape = tuple(tie.shape)
            pa = _param(pipe, a, tie.names[0]) if a in pipe.mine else None
            pb = _param(pipe, b, tie.names[1]) if b in pipe.mine else None
            if not (sa.mesh.in_mesh or sb.mesh.in_mesh):
                self.jobs.append((tie, None, None, None, None))
                continue
            dtype = (pa if pa is not None else pb).dtype      # type: ignore[union-attr]
            there = _prepare(make_plan(sa.mesh.mesh, shape, la, lb, dtype=dtype,
                                       dst_mesh=_other(sa, sb)), sa, sb)
            back = _prepare(make_plan(sb.mesh.mesh, shape, lb, la, dtype=dtype,
                                      dst_mesh=_other(sb, sa)), sb, sa)
            self.jobs.append((tie, there, back, pa, pb))

    def sum(self) -> None:
        """Make both copies' gradients of every tie their sum."""
        for _, there, back, pa, pb in self.jobs:
            if there is None or back is None:
                continue
            got = there.issue([None if pa is None else _grad_local(pa)]).wait()[0]
            total = None
            if pb is not None:
                assert got is not None
                mine = _grad_local(pb)
                mine.add_(got)
                total = mine
            home = back.issue([total]).wait()[0]
            if pa is not None:
                assert home is not None
                _grad_local(pa).copy_(home)


def _other(src: Any, dst: Any) -> Any:
    return None if src.mesh.mesh == dst.mesh.mesh else dst.mesh.mesh


def _prepare(p: Any, src: Any, dst: Any) -> Prepared:
    if p.dst_mesh is None:
        return prepare([p], src.mesh)
    return prepare([p], src.mesh, dst=dst.mesh)


def _param(pipe: Pipeline, s: int, name: str) -> nn.Parameter:
    module: nn.Module | None = pipe.stages[s].module
    assert module is not None
    params = dict(module.named_parameters(remove_duplicate=False))
    if name not in params:
        raise ScheduleError(f"Tie: stage {s}'s module has no parameter {name!r}; it has"
                            f" {sorted(params)[:8]}")
    return params[name]


def _grad_local(p: Tensor | None) -> Tensor:
    assert p is not None
    g = p.grad
    if g is None:
        raise ScheduleError("Tie: a tied parameter has no gradient after the step (is it"
                            " used by its stage?)")
    return g.to_local() if hasattr(g, "to_local") else g


# -- clipping ----------------------------------------------------------------------------------
def clip_grad_norm_(pipe: Pipeline, max_norm: float,
                    param_layouts: dict[tuple[int, str], tuple[str, Sequence[int]]] | None = None
                    ) -> Tensor:
    """Scale every stage's gradients so that their total 2-norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` on the whole model in one process; returns the total
    norm (before clipping), the same on every rank. Call it on every rank after `step()`.

    A DTensor parameter (`fully_shard`, `parallelize`) says which ranks hold copies of each
    element; a plain one counts as a full copy on every rank of its stage's mesh, unless
    `param_layouts[(stage, name)] = (layout, global shape)` says how it is split. A tied
    weight (`Tie`) counts once. One all_reduce of one float64 over the world."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    grads: list[Tensor] = []
    layouts = param_layouts or {}
    skip = {(t.stages[1], t.names[1]) for t, *_ in (pipe.ties.jobs if pipe.ties else [])}
    for s in pipe.mine:
        module = pipe.stages[s].module
        assert module is not None
        mesh = pipe.stages[s].mesh.mesh
        for name, p in module.named_parameters():
            if p.grad is None:
                continue
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads.append(local)
            if (s, name) in skip:
                continue
            copies = _copies(p, mesh, layouts.get((s, name)))
            total += local.detach().double().pow(2).sum() / copies
    if dist.is_initialized():
        dist.all_reduce(total)
    norm = total.sqrt()
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return norm


def _copies(p: Tensor, mesh: Any, declared: tuple[str, Sequence[int]] | None) -> int:
    """How many ranks of `mesh` hold each element of `p`'s local tensor."""
    if declared is not None:
        layout = Layout.parse(declared[0])
        return math.prod(mesh.axis_size(a) for a in layout.replicated_axes(mesh))
    placements = getattr(p, "placements", None)
    device_mesh = getattr(p, "device_mesh", None)
    if placements is None or device_mesh is None:
        return int(mesh.size)
    out = 1
    for placement, size in zip(placements, device_mesh.shape):
        if placement.is_replicate():
            out *= size
    return out
