"""DTensors on 2-D slices of a larger DeviceMesh (where HSDP + TP parameters live), 8 gloo ranks.

A slice such as `dm["b", "c"]` of a (2, 2, 2) mesh is a different mesh on different ranks
(ranks 0-3 see [[0, 1], [2, 3]], ranks 4-7 [[4, 5], [6, 7]]). Plans over both axes need a
flattened group; `torch.distributed.new_group` must be called by every rank of the world
alike, so meshcomm creates the groups of every slice, in one order, on every rank. These
reshards hung before that. Every reshard here is compared with `DTensor.redistribute` of
the same DTensor (placements, local tensor, shape); data are integers, so every reduction
order gives the same bits. A hang fails the test at the run's timeout.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import pytest
import torch

import meshcomm as mc

from conftest import dtensor_placements, run_scaled

PLACEMENTS = ["S0 S1", "S1 S0", "S0 S0", "R S0", "S0 R", "R R"]
PARTIAL = ["Psum S0", "S1 Psum"]
# (mesh shape, mesh dim names, the slice's dims)
SLICES = [((2, 2, 2), ("a", "b", "c"), ("b", "c")),       # the HSDP + TP slice
          ((2, 2, 2), ("a", "b", "c"), ("a", "c")),       # not adjacent
          ((2, 2, 1, 2), ("p", "q", "r", "s"), ("p", "s")),   # 2-D slice of a 4-D mesh
          ((2, 2, 1, 2), ("p", "q", "r", "s"), ("r", "s"))]   # with a size-1 axis


def make(x: torch.Tensor, sub: Any, text: str) -> Any:
    """A DTensor on `sub` with `text` placements: DTensor's own split of `x`; a Partial one
    holds its shard times (1 + the rank's coordinate on the partial axis)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    placements = dtensor_placements(text)
    if "P" not in text:
        return distribute_tensor(x, sub, placements, src_data_rank=None)
    plain = [dtensor_placements("R")[0] if p.is_partial() else p for p in placements]
    local = distribute_tensor(x, sub, plain, src_data_rank=None).to_local()
    axis = next(i for i, p in enumerate(placements) if p.is_partial())
    local = local * (1 + sub.get_coordinate()[axis])
    stride = tuple(math.prod(x.shape[i + 1:]) for i in range(x.ndim))
    return DTensor.from_local(local, sub, placements, run_check=False, shape=x.shape,
                              stride=stride)


def reshard_on_slice(shape: tuple[int, ...], names: tuple[str, ...],
                     dims: tuple[str, ...]) -> tuple[list[str], int]:
    """Every source in PLACEMENTS + PARTIAL to every destination in PLACEMENTS, on the slice:
    problems as text, and the number of reshards compared."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    sub = init_device_mesh("cpu", shape, mesh_dim_names=names)[dims]
    x = torch.arange(48.0).reshape(8, 6)
    problems, compared = [], 0
    for src, dst in itertools.product(PLACEMENTS + PARTIAL, PLACEMENTS):
        where = f"{dims} of {dict(zip(names, shape))}: [{src}] -> [{dst}]"
        dt = make(x, sub, src)
        got = mc.reshard(dt, dtensor_placements(dst))
        want = dt.redistribute(sub, dtensor_placements(dst))
        compared += 1
        if tuple(got.placements) != tuple(want.placements) or got.shape != want.shape or \
                not torch.equal(got.to_local(), want.to_local()):
            problems.append(f"{where}: {got.placements} {tuple(got.to_local().shape)} differs"
                            f" from redistribute's {want.placements}")
    # The groups are made once: the same reshards again make none.
    before = len(c10d._world.pg_group_ranks)
    for src in PLACEMENTS:
        mc.reshard(make(x, sub, src), dtensor_placements("R R"))
    if len(c10d._world.pg_group_ranks) != before:
        problems.append(f"{dims}: repeated reshards made"
                        f" {len(c10d._world.pg_group_ranks) - before} more groups")
    return problems, compared


def slice_family() -> list[str]:
    """`slice_meshes` lists every slice, the same on every rank, this rank's own among them."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshcomm.interop.runtime import slice_meshes

    dm = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    got = [m.ranks for m in slice_meshes(dm["b", "c"])]
    problems = [] if got == [(0, 1, 2, 3), (4, 5, 6, 7)] else [f"b, c slices: {got}"]
    got = [m.ranks for m in slice_meshes(dm["a", "c"])]
    if got != [(0, 1, 4, 5), (2, 3, 6, 7)]:
        problems.append(f"a, c slices: {got}")
    if slice_meshes(dm) != (mc.Mesh.from_device_mesh(dm),):
        problems.append("the root mesh is not its own only slice")
    own = mc.Mesh.from_device_mesh(dm["b", "c"])
    if own not in slice_meshes(dm["b", "c"]):
        problems.append(f"this rank's slice {own!r} is not listed")
    return problems


def unnamed(folder: str) -> list[str]:
    """An unnamed DeviceMesh (axes d0, d1): dims read as dim0, dim1; reshards equal
    redistribute; a checkpoint of its DTensor saves and loads (its dims were named d0, d1,
    the axes' names, and saving raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dm = init_device_mesh("cpu", (2, 4))
    x = torch.arange(48.0).reshape(8, 6)
    dt = distribute_tensor(x, dm, dtensor_placements("S0 S1"), src_data_rank=None)
    layout = mc.dtensor.from_dtensor(dt).layout
    problems = [] if str(layout) == "(d0 dim0) (d1 dim1)" else [f"unnamed: read as {layout}"]
    for dst in ("S1 S0", "R S0", "S0 S0"):
        got = mc.reshard(dt, dtensor_placements(dst))
        want = dt.redistribute(dm, dtensor_placements(dst))
        if not torch.equal(got.to_local(), want.to_local()):
            problems.append(f"unnamed: [S0 S1] -> [{dst}] differs from redistribute")
    # fully_shard on it: parameter dims are named dim0, dim1, not the axes d0, d1
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 8)
    model = torch.nn.Linear(6, 8)
    model.load_state_dict(ref.state_dict())
    mc.nn.fully_shard(model, dm, axis="d1")
    if not torch.equal(model(x), ref(x)):
        problems.append("unnamed: fully_shard over d1 computes another output")
    mc.nn.save_checkpoint({"w": dt}, folder)
    target = {"w": distribute_tensor(torch.zeros(8, 6), dm, dtensor_placements("S1 S0"),
                                     src_data_rank=None)}
    mc.nn.load_checkpoint(target, folder)
    if not torch.equal(target["w"].full_tensor(), x):
        problems.append("unnamed: checkpoint [S0 S1] loaded as [S1 S0] differs")
    return problems


def eight_ranks(rank: int, world: int, folder: str) -> dict[str, Any]:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    report: dict[str, Any] = {"family": slice_family(), "problems": [], "compared": 0,
                              "unnamed": unnamed(folder)}
    for shape, names, dims in SLICES:
        problems, compared = reshard_on_slice(shape, names, dims)
        report["problems"] += problems
        report["compared"] += compared
    return report


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_scaled(eight_ranks, 8, str(tmp_path_factory.mktemp("ck")), timeout_s=240)


def test_slice_meshes_are_the_same_on_every_rank(eight: list[dict[str, Any]]) -> None:
    assert [r["family"] for r in eight] == [[]] * 8


def test_reshard_on_2d_slices_equals_redistribute_and_never_hangs(
        eight: list[dict[str, Any]]) -> None:
    problems = [p for r in eight for p in r["problems"]]
    assert not problems, "\n".join(problems[:10])
    assert [r["compared"] for r in eight] == [len(SLICES) * 8 * 6] * 8


def test_unnamed_mesh_dims_reshards_and_checkpoints(eight: list[dict[str, Any]]) -> None:
    assert [r["unnamed"] for r in eight] == [[]] * 8
