"""Run a plan between two meshes on this rank (see `meshcomm.planner.crossmesh`).

Executor layer. It mirrors `meshcomm.executors.sim.execute.execute_cross` step for step. A step
on one mesh runs with the handlers of `meshcomm.executors.distributed.execute` on that mesh's
ranks (the others skip it). The transfer step runs on every rank of either mesh as one
`batch_isend_irecv`: one message per (sender, receiver) pair, so all transfers
overlap. A sender packs with `pack` (blocks in transfer order, grouped by
receiver) and sends each receiver its slice; a receiver receives each sender's
message straight into its slice of one flat buffer, which `unpack` reads. So the
bytes and their order are the simulator's. What a rank in both meshes keeps is a
local copy and moves no bytes. Ranks in neither mesh do nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.errors import MeshMismatchError, ShapeError
from ...planner.values import Plan, Step
from ..local import pack, rank_transfers, recv_splits, unpack
from . import wire
from .execute import HANDLERS, ByteTrace, Run
from .groups import Groups, require_bound


def check_cross(plan: Plan, local: Tensor | None, src: Groups, dst: Groups) -> None:
    """Raise before any communication if `local`, `src` or `dst` do not fit the plan here."""
    if plan.dst_mesh is None:
        raise MeshMismatchError(
            f"execute_cross runs plans between two meshes, but this plan stays on"
            f" {plan.mesh!r}. fix: run it with"
            " mc.executors.distributed.execute(plan, local, bound)")
    for word, bound, mesh in (("source", src, plan.mesh), ("destination", dst, plan.dst_mesh)):
        require_bound(bound, "execute_cross", f"the {word} mesh")
        if bound.mesh != mesh:
            raise MeshMismatchError(
                f"plan's {word} mesh is {mesh!r} but the bound {word} mesh is {bound.mesh!r}."
                " fix: plan with the bound meshes, mc.plan(src.mesh, ..., dst_mesh=dst.mesh)")
    if src.rank != dst.rank:
        raise MeshMismatchError(f"the source and destination meshes were bound on different"
                                f" processes (ranks {src.rank} and {dst.rank})")
    rank = src.rank
    if rank not in plan.ranks:
        return                                  # in neither mesh: it does nothing
    if rank not in plan.mesh.ranks:
        if local is not None:
            raise ShapeError(
                f"rank {rank} is not in the source mesh {plan.mesh!r}, so it has no input,"
                f" but it got a {type(local).__name__}. fix: pass None on ranks"
                f" {[r for r in plan.ranks if r not in plan.mesh.ranks]}")
        return
    if not isinstance(local, Tensor):
        raise ShapeError(f"local tensor of rank {rank} is a {type(local).__name__}, not a"
                         f" Tensor; ranks {list(plan.mesh.ranks)} of the source mesh pass"
                         " their shard")
    if local.dtype != plan.dtype:
        raise ShapeError(f"local tensor of rank {rank} has dtype {local.dtype} but the plan was"
                         f" made for {plan.dtype}; fix: mc.plan(..., dtype={local.dtype})")
    plan.src.check_local(plan.mesh, plan.shape, rank, tuple(local.shape), "local tensor")


def execute_cross(plan: Plan, local: Tensor | None, src: Groups, dst: Groups, *,
                  trace: ByteTrace | None = None) -> Tensor | None:
    """This rank's output of a plan between meshes: its shard on the destination mesh, or
    None on a rank outside it (call it on every rank of the world).

    `local` is this rank's shard on the source mesh, None on a rank outside it. `trace`
    records one call per step this rank takes part in, the transfer's bytes counted from
    the messages it posts.

    >>> p = mc.plan(a.mesh, (8, 16), "(dp b) s", "(tp b) s", dst_mesh=b.mesh)  # doctest: +SKIP
    >>> y = execute_cross(p, x if a.in_mesh else None, a, b)                    # doctest: +SKIP
    """
    check_cross(plan, local, src, dst)
    rank = src.rank
    if rank not in plan.ranks:
        return None
    bounds = {plan.mesh: src, dst.mesh: dst}
    x = local
    for step in plan.steps:
        if step.dst_mesh is not None:
            x = _transfer(step, x, plan, dst, trace)
            continue
        bound = bounds[step.mesh or plan.mesh]
        if bound.in_mesh:
            assert x is not None, f"rank {rank} runs {step} without a tensor"
            x = HANDLERS[step.kind](step, x, Run(bound, plan.shape, trace))
    return x if dst.in_mesh else None


def _transfer(step: Step, x: Tensor | None, plan: Plan, dst: Groups,
              trace: ByteTrace | None) -> Tensor | None:
    """The send_recv between meshes: one batch of isend/irecv, one message per pair."""
    ranks, rank = plan.ranks, dst.rank
    me = ranks.index(rank)
    held = x if x is not None else torch.empty(0, dtype=plan.dtype, device=dst.device)
    mine = rank_transfers(step, rank)     # this rank's blocks only
    flat, send_splits = pack(mine, ranks, rank, held)
    wanted = recv_splits(mine, ranks, rank)
    out = flat.new_empty(sum(wanted))
    sends = torch.split(flat, send_splits)
    recvs = torch.split(out, wanted)
    to = [(sends[j], peer) for j, peer in enumerate(ranks) if j != me and send_splits[j]]
    back = [(recvs[j], peer) for j, peer in enumerate(ranks) if j != me and wanted[j]]
    works = wire.post_p2p(to, back)
    recvs[me].copy_(sends[me])    # what this rank keeps, while the messages travel
    for work in works:
        work.wait()
    if trace is not None:
        trace.add(step.kind, step.axes, sum(t.nbytes for t, _ in to),
                  sum(t.nbytes for t, _ in back))
    if not dst.in_mesh:
        return None
    return unpack(mine, ranks, rank, out,
                      step.after.local_shape(dst.mesh, plan.shape, rank), step.op)
