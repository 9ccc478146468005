"""Run a plan between two meshes on simulated ranks (see `meshcomm.crossmesh`).

Inputs are in source-mesh order; outputs and byte traces are in the order of
`plan.ranks` (both meshes' ranks, ascending), with None for a rank outside the
destination mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import p2p
from ..mesh import Mesh
from ..plan import Plan, Step
from . import collectives as coll
from .collectives import SimResult


def execute_cross(plan: Plan, locals_: Sequence[Tensor]) -> SimResult:
    """Each rank's output of a cross-mesh `plan` and the bytes every step moved."""
    from .execute import check_locals, run_step

    check_locals(plan, locals_)
    ranks = plan.ranks
    held: dict[int, Tensor] = dict(zip(plan.mesh.ranks, locals_))
    send, recv = [0] * len(ranks), [0] * len(ranks)
    for step in plan.steps:
        if step.dst_mesh is not None:
            held, res = _transfer(step, plan, held)
            sent, got = res.send_bytes, res.recv_bytes
        else:
            mesh = step.mesh or plan.mesh
            res = run_step(step, mesh, [held[r] for r in mesh.ranks], plan.shape)
            held = dict(zip(mesh.ranks, res.outputs))
            sent, got = _spread(mesh, ranks, res.send_bytes), _spread(mesh, ranks, res.recv_bytes)
        send = [a + b for a, b in zip(send, sent)]
        recv = [a + b for a, b in zip(recv, got)]
    outputs = tuple(held.get(r) if plan.dst_mesh and r in plan.dst_mesh.ranks else None
                    for r in ranks)
    return SimResult(outputs, tuple(send), tuple(recv))  # type: ignore[arg-type]


def _spread(mesh: Mesh, ranks: tuple[int, ...], values: tuple[int, ...]) -> tuple[int, ...]:
    where = dict(zip(mesh.ranks, values))
    return tuple(where.get(r, 0) for r in ranks)


def _transfer(step: Step, plan: Plan, held: dict[int, Tensor]) -> tuple[dict[int, Tensor], SimResult]:
    """The send_recv between meshes, simulated as one uneven all_to_all over both meshes."""
    ranks = plan.ranks
    empty = torch.empty(0, dtype=plan.dtype)
    packed = [p2p.pack(step.transfers, ranks, r, held.get(r, empty)) for r in ranks]
    res = coll.all_to_all([p[0] for p in packed], (tuple(range(len(ranks))),),
                          input_splits=[p[1] for p in packed])
    dst_mesh = step.dst_mesh
    assert dst_mesh is not None, f"a transfer step needs dst_mesh: {step}"
    out = {r: p2p.unpack(step.transfers, ranks, r, res.outputs[ranks.index(r)],
                         step.after.local_shape(dst_mesh, plan.shape, r), step.op)
           for r in dst_mesh.ranks}
    return out, res
