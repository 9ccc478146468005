"""Layouts <-> DTensor placements without processes: the mapping table, exactness against
DTensor's own split code (`Shard._split_tensor`, `_StridedShard._split_tensor`, applied
left to right over the mesh dims as DTensor does), and the error messages."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

import meshcomm as mc
from meshcomm.interop.runtime import is_dtensor
from meshcomm.interop.placements import dtensor_indices
from meshcomm.executors.sim.shards import take
from meshcomm.testing import random_layout

from conftest import dtensor_placements as pl

M4 = mc.Mesh("dp=2 tp=2")
M8 = mc.Mesh("a=2 b=2 c=2")
M6 = mc.Mesh("dp=2 tp=3")


# (mesh, shape, layout, placements): both directions, dims named "b h" / "x y z".
TABLE = [
    (M4, (8, 6), "b h", "R R"),
    (M4, (8, 6), "(dp b) h", "S0 R"),
    (M4, (8, 6), "(tp b) h", "R S0"),
    (M4, (8, 6), "(dp b) (tp h)", "S0 S1"),
    (M4, (8, 6), "(tp b) (dp h)", "S1 S0"),
    (M4, (8, 6), "(dp tp b) h", "S0 S0"),
    (M4, (8, 6), "(tp dp b) h", "SS0.2 S0"),            # shard order tp, dp
    (M4, (8, 6), "b (tp dp h)", "SS1.2 S1"),
    (M4, (7, 5), "(tp dp b) h", "SS0.2 S0"),            # uneven, same chunks as DTensor
    (M4, (7, 5), "(dp b) (tp h)", "S0 S1"),
    (M4, (8, 6), "(b dp) h", "SS0.4 R"),                 # cyclic
    (M4, (8, 6), "(x=2 dp b) h", "SS0.2 R"),             # sized factor
    (M4, (8, 6), "(b dp) (tp h)", "SS0.4 S1"),
    (M4, (24, 6), "(x=4 tp b) h", "R SS0.4"),
    (M4, (8, 6), "(dp b) h | sum(tp)", "S0 Psum"),
    (M4, (8, 6), "b h | avg(dp, tp)", "Pavg Pavg"),
    (M4, (8, 6), "b (tp h) | max(dp)", "Pmax S1"),
    (M4, (8, 6), "(b dp) h | min(tp)", "SS0.4 Pmin"),
    (M6, (12, 6), "(tp dp b) h", "SS0.3 S0"),
    (M8, (8, 4, 6), "(c b a x) y z", "SS0.4 SS0.2 S0"),
    (M8, (8, 4, 6), "(b x) (c a y) z", "SS1.2 S0 S1"),
    (M8, (7, 5, 3), "(b c a x) y z", "SS0.4 S0 S0"),
    (M8, (8, 4, 6), "(x a) (c y) (b z)", "SS0.4 S2 S1"),
    (M8, (4, 2, 3), "(b x) y z | sum(a, c)", "Psum S0 Psum"),
]


def names(mesh: mc.Mesh) -> str:
    return "x y z" if mesh is M8 else "b h"


@pytest.mark.parametrize(("mesh", "shape", "layout", "placements"), TABLE)
def test_mapping_table_both_ways(mesh: mc.Mesh, shape: tuple[int, ...], layout: str,
                                 placements: str) -> None:
    assert mc.dtensor.to_placements(mesh, shape, layout) == pl(placements)
    back = mc.dtensor.from_placements(mesh, shape, pl(placements), names=names(mesh))
    assert back == mc.Layout(layout)


def dtensor_shard(x: torch.Tensor, mesh: mc.Mesh, placements: tuple[Any, ...],
                  rank: int) -> torch.Tensor:
    """The shard DTensor's own split code gives `rank` (what distribute_tensor computes)."""
    coords = mesh.coords(rank)
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, (Shard, _StridedShard)):
            pieces, _ = p._split_tensor(x, mesh.axis_size(axis), with_padding=False)
            x = pieces[coords[axis]]
    return x


def shard_order_placements(mesh: mc.Mesh, layout: mc.Layout, shape: tuple[int, ...]
                           ) -> tuple[Any, ...]:
    """Reference: each axis split by the factors before it, less axes on earlier mesh dims."""
    out: list[Any] = [Replicate()] * len(mesh.axis_names)
    for d, dim in enumerate(layout.placements(mesh, shape)):
        for i, part in enumerate(dim.parts):
            if part.axis:
                me = mesh.axis_names.index(part.name)
                split = 1
                for p in dim.parts[:i]:
                    if not (p.axis and mesh.axis_names.index(p.name) < me):
                        split *= p.size
                out[me] = Shard(d) if split == 1 else _StridedShard(d, split_factor=split)
    return tuple(out)


def blocks_or_one_axis(mesh: mc.Mesh, layout: mc.Layout, shape: tuple[int, ...]) -> bool:
    """Every dim is "(axes... rest)" or holds one axis: the layouts meshcomm maps."""
    for dim in layout.placements(mesh, shape):
        axes = [i for i, p in enumerate(dim.parts) if p.axis]
        if len(axes) > 1 and any(not p.axis and p.size != 1 for p in dim.parts[:axes[-1]]):
            return False
    return True


@pytest.mark.parametrize("mesh", [M4, M6, M8], ids=str)
def test_placements_give_every_rank_its_shard(mesh: mc.Mesh) -> None:
    rng = random.Random(5)
    mapped = refused_uneven = 0
    for _ in range(250):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 12, 24)) for _ in range(ndim))
        # axes either side of a dim's name, sized factors, partial axes
        layout = mc.Layout(random_layout(rng, mesh, ndim, ("sum",), "ijk", name_inside=0.4,
                                         sized=0.2))
        try:
            layout.placements(mesh, shape)
        except mc.errors.ShapeError:
            continue
        x = torch.arange(torch.Size(shape).numel()).reshape(shape)
        try:
            placements = mc.dtensor.to_placements(mesh, shape, layout)
        except mc.errors.InteropError as exc:
            uneven = "splits it differently" in str(exc)
            assert uneven or not blocks_or_one_axis(mesh, layout, shape), (layout, shape, exc)
            if uneven:    # DTensor's split of the shard-order placements really differs
                refused_uneven += 1
                natural = shard_order_placements(mesh, layout, shape)
                assert any(not torch.equal(dtensor_shard(x, mesh, natural, r),
                                           take(x, layout.indices(mesh, shape, r)))
                           for r in mesh.ranks), (layout, shape)
            continue
        assert blocks_or_one_axis(mesh, layout, shape), (layout, shape)
        mapped += 1
        for rank in mesh.ranks:     # the held indices (a partial layout's too)
            want = take(x, layout.indices(mesh, shape, rank))
            assert torch.equal(dtensor_shard(x, mesh, placements, rank), want), (layout, shape)
        back = mc.dtensor.from_placements(mesh, shape, placements)
        assert [back.indices(mesh, shape, r) for r in mesh.ranks] == \
            [layout.indices(mesh, shape, r) for r in mesh.ranks], (layout, back)
    assert mapped > 60
    if mesh is M4:
        assert refused_uneven == 0      # on 2x2 DTensor's uneven strided split always agrees


@pytest.mark.parametrize("mesh", [M4, M6, M8], ids=str)
def test_layout_of_random_placements_is_exact(mesh: mc.Mesh) -> None:
    rng = random.Random(7)
    described = 0
    for _ in range(300):
        ndim = rng.randint(1, 2)
        shape = tuple(rng.choice((2, 3, 4, 6, 7, 8, 12, 16)) for _ in range(ndim))
        words = []
        for _axis in mesh.axis_names:
            kind = rng.choice("RSSP")
            d = rng.randrange(ndim)
            split = rng.choice((1, 2, 3, 4))
            words.append({"R": "R", "P": "Psum"}.get(kind) or
                         (f"S{d}" if split == 1 else f"SS{d}.{split}"))
        placements = pl(" ".join(words))
        x = torch.arange(torch.Size(shape).numel()).reshape(shape)
        try:
            layout = mc.dtensor.from_placements(mesh, shape, placements)
        except mc.errors.InteropError:
            continue
        described += 1
        for rank in mesh.ranks:
            got = take(x, layout.indices(mesh, shape, rank))
            assert torch.equal(got, dtensor_shard(x, mesh, placements, rank)), (words, layout)
    assert described > 100


def test_dtensor_indices_follow_left_to_right_splits() -> None:
    assert dtensor_indices(8, [(2, 1, 4)]) == (1, 3, 5, 7)
    assert dtensor_indices(7, [(2, 0, 2), (2, 1, 1)]) == (4, 5)      # (tp dp b): dp0 tp1
    assert dtensor_indices(3, [(2, 1, 1), (2, 1, 1)]) == ()          # an empty shard
    rng = random.Random(3)
    for _ in range(300):      # against DTensor's own split code, uneven sizes included
        n = rng.randint(0, 30)
        steps = [(rng.randint(1, 3), 0, rng.choice((1, 1, 2, 3, 4))) for _ in range(3)]
        steps = [(k, rng.randrange(k), split) for k, _, split in steps]
        x = torch.arange(n)
        for k, c, split in steps:
            p = Shard(0) if split == 1 else _StridedShard(0, split_factor=split)
            x = p._split_tensor(x, k, with_padding=False)[0][c]
        assert dtensor_indices(n, steps) == tuple(x.tolist()), (n, steps)


def test_from_placements_names_dims_and_sized_factors() -> None:
    assert str(mc.dtensor.from_placements(M4, (16, 6), pl("SS0.2 SS0.2"))) == "(x=2 dp tp d0) d1"
    assert str(mc.dtensor.from_placements(M4, (8, 6), pl("SS0.2 SS0.2"))) == "(d0 dp tp) d1"
    assert mc.dtensor.to_placements(M4, (24, 6), "(b tp y=3) h") == pl("R SS0.4")  # = "(x=4 tp b) h"
    assert str(mc.dtensor.from_placements(M4, (4,), pl("S0 S0"))) == "(dp tp d0)"
    assert str(mc.dtensor.from_placements(mc.Mesh("d0=2"), (4,), pl("S0"))) == "(d0 dim0)"
    assert str(mc.dtensor.from_placements(M4, (8, 6), pl("S0 SS0.2"), names=("b", "h"))) == \
        "(dp b tp) h"


def msg(text: str) -> str:
    return "^" + re.escape(text) + "$"


def test_error_several_axes_after_a_local_factor() -> None:
    with pytest.raises(mc.errors.InteropError, match=msg(
            'layout "(dp b tp) h" on Mesh(dp=2, tp=2) has no DTensor placements: dim 0 "(dp b tp)"'
            ' has the local factor "b" before mesh axis "tp" while 2 axes (dp, tp) shard it\n'
            "    (dp b tp) h\n"
            '        ^ DTensor writes a dim over several axes only as blocks, "(axes... name)"'
            " in any axis order\n"
            '  fix: use "(dp tp b) h" (mc.reshard to it first)')):
        mc.dtensor.to_placements(M4, (8, 6), "(dp b tp) h")
    with pytest.raises(mc.errors.InteropError, match='fix: use "s \\(dp tp b\\) \\| sum\\(cp\\)"'):
        mc.dtensor.to_placements(mc.Mesh("dp=2 tp=2 cp=2"), (4, 16), "s (x=2 dp tp b) | sum(cp)")


def test_error_uneven_strided_split_that_differs() -> None:
    mesh = mc.Mesh("a=2 b=3 c=2")
    with pytest.raises(mc.errors.InteropError, match=msg(
            'layout "(c b n)" of shape (7,) on Mesh(a=2, b=3, c=2) has no DTensor placements:'
            " dim 0 has 7 elements, not a multiple of 6, and DTensor's uneven _StridedShard"
            ' splits it differently from "(c b n)". fix: use "(b c n)" (mesh order: plain'
            " Shard), or pad dim 0 to 8")):
        mc.dtensor.to_placements(mesh, (7,), "(c b n)")
    assert mc.dtensor.to_placements(mesh, (8,), "(c b n)") == pl("R SS0.2 S0")   # uneven
    assert mc.dtensor.to_placements(mesh, (12,), "(c b n)") == pl("R SS0.2 S0")


def test_error_placements_without_a_layout() -> None:
    with pytest.raises(mc.errors.InteropError, match=msg(
            "dim 0 of shape (7,) on Mesh(dp=2, tp=2) is split unevenly (dp: _StridedShard(0,"
            ' split_factor=3)) in a way no layout describes: only "(axes... name)" groups may'
            " be uneven, split with torch.chunk axis by axis. fix: pad dim 0 to 12 (the smallest"
            " size from 7 on that a layout describes), or redistribute it to Shard placements"
            " in mesh order")):
        mc.dtensor.from_placements(M4, (7,), pl("SS0.3 R"))
    # The padding it suggests is accepted (the split factor counts, not only the axis size).
    assert mc.dtensor.from_placements(M4, (12,), pl("SS0.3 R")) == mc.Layout("(x=3 dp d0)")
    with pytest.raises(mc.errors.InteropError, match=msg(
            "placements [Partial(sum), Partial(max)] mix reductions ['max', 'sum']; a layout"
            " holds one pending reduction. fix: redistribute all but one op to Replicate()")):
        mc.dtensor.from_placements(M4, (7,), pl("Psum Pmax"))
    for bad in (Partial("product"), _MaskPartial(), Shard(2)):
        with pytest.raises(mc.errors.InteropError, match=re.escape(
                f"placement {bad!r} on mesh axis dp has no meshcomm layout")):
            mc.dtensor.from_placements(M4, (7, 3), (bad, Replicate()))
    with pytest.raises(mc.errors.InteropError, match=re.escape("1 placements [Replicate()] for")):
        mc.dtensor.from_placements(M4, (7,), [Replicate()])
    with pytest.raises(mc.errors.InteropError, match=re.escape("names='b': give 2 distinct dim names")):
        mc.dtensor.from_placements(M4, (7, 3), pl("R R"), names="b")


def test_negative_shard_dims_are_normalized() -> None:
    assert str(mc.dtensor.from_placements(M4, (8, 6), (Shard(-1), Replicate()))) == "d0 (dp d1)"


def test_mesh_from_device_mesh_duck_typed() -> None:
    class FakeDeviceMesh:
        mesh = torch.tensor([[3, 1], [0, 2]])
        mesh_dim_names = ("dp", "tp")

    assert mc.Mesh.from_device_mesh(FakeDeviceMesh()) == mc.Mesh("dp=2 tp=2", ranks=[3, 1, 0, 2])

    class Unnamed:
        mesh = ((0, 1), (2, 3))
        mesh_dim_names = None

    # Unnamed dims (init_device_mesh("cuda", (2, 2))) are d0, d1, ...
    assert mc.Mesh.from_device_mesh(Unnamed()) == mc.Mesh("d0=2 d1=2")

    class OddNames:
        mesh = torch.arange(8).reshape(2, 2, 2)
        mesh_dim_names = ("mesh-0", "tp", "2nd")

    # Names that are not identifiers become d<index>; identifiers stay.
    assert mc.Mesh.from_device_mesh(OddNames()) == mc.Mesh("d0=2 tp=2 d2=2")

    class Clash:
        mesh = ((0, 1), (2, 3))
        mesh_dim_names = ("d1", "mesh-1")

    with pytest.raises(mc.errors.MeshAxisError, match=msg(
            "DeviceMesh dim names ('d1', 'mesh-1') give meshcomm axis names ('d1', 'd1'), which"
            " repeat (a name that is not an identifier becomes d<its index>); fix: name the dims"
            " with distinct identifiers, e.g. mesh_dim_names=('dp', 'tp')")):
        mc.Mesh.from_device_mesh(Clash())


def test_plain_tensors_are_not_dtensors() -> None:
    assert not is_dtensor(torch.zeros(2))
    with pytest.raises(mc.errors.InteropError, match="from_dtensor needs a torch DTensor, got Tensor"):
        mc.dtensor.from_dtensor(torch.zeros(2))


# -- padding suggestions are the smallest size that works -------------------------------------
def _maps(mesh: mc.Mesh, n: int, placements: tuple[Any, ...]) -> bool:
    try:
        mc.dtensor.from_placements(mesh, (n,), placements)
        return True
    except mc.errors.InteropError:
        return False


# (mesh, placements, rows): uneven _StridedShard splits no layout describes at that size;
# the size used to be rounded up to a multiple of every axis size times its split factor
# (64, 512), far above the smallest size that maps, or a size that does not map at all.
PAD_CASES = [
    (mc.Mesh("dp=4 tp=2"), "SS0.4 SS0.2", 13),      # 64 suggested before, 16 maps
    (mc.Mesh("dp=4 tp=2"), "SS0.2 SS0.4", 13),      # 64 before
    (mc.Mesh("dp=4 tp=2"), "SS0.8 SS0.8", 32),      # 512 before, 64 maps
    (mc.Mesh("a=2 b=2 c=2"), "SS0.2 SS0.4 SS0.8", 32),
    (M4, "SS0.3 R", 7),
]


@pytest.mark.parametrize(("mesh", "text", "n"), PAD_CASES)
def test_suggested_padding_is_the_smallest_size_that_maps(mesh: mc.Mesh, text: str, n: int) -> None:
    placements = pl(text)
    with pytest.raises(mc.errors.InteropError) as info:
        mc.dtensor.from_placements(mesh, (n,), placements)
    pad = int(re.search(r"pad dim 0 to (\d+)", str(info.value)).group(1))  # type: ignore[union-attr]
    assert _maps(mesh, pad, placements)
    assert not any(_maps(mesh, m, placements) for m in range(n, pad))


def test_placements_no_size_maps_are_told_so() -> None:
    """dp: _StridedShard(0, 3), tp: _StridedShard(0, 4) on dp=4 tp=2: the factors do not nest,
    so no padding helps (it used to say "pad dim 0 to 96", and at 96 "pad to 192")."""
    mesh, placements = mc.Mesh("dp=4 tp=2"), pl("SS0.3 SS0.4")
    for n in (39, 96):
        with pytest.raises(mc.errors.InteropError, match=re.escape(
                f"fix: no size of dim 0 from {n} to 192 makes these placements a layout (their"
                " split factors do not nest); redistribute it to Shard placements in mesh"
                " order")):
            mc.dtensor.from_placements(mesh, (n, 2), placements)
    assert not any(_maps(mesh, m, placements) for m in range(39, 193))


def test_layout_padding_is_the_smallest_size_with_placements() -> None:
    mesh = mc.Mesh("a=2 b=3 c=2")
    for n in (7, 13, 25):
        with pytest.raises(mc.errors.InteropError) as info:
            mc.dtensor.to_placements(mesh, (n,), "(c b n)")
        pad = int(re.search(r"pad dim 0 to (\d+)$", str(info.value)).group(1))  # type: ignore[union-attr]
        fits = []
        for m in range(n, pad + 1):
            try:
                mc.dtensor.to_placements(mesh, (m,), "(c b n)")
                fits.append(m)
            except mc.errors.InteropError:
                pass
        assert fits and fits[0] == pad, (n, pad, fits)


def test_unnamed_mesh_dims_are_dim0_dim1() -> None:
    """An unnamed DeviceMesh's axes are d0, d1: its dims are named dim0, dim1 (not d0_)."""
    mesh = mc.Mesh("d0=2 d1=2")
    assert str(mc.dtensor.from_placements(mesh, (8, 6), pl("S0 S1"))) == "(d0 dim0) (d1 dim1)"
    assert str(mc.dtensor.from_placements(M4, (8, 6), pl("S0 S1"))) == "(dp d0) (tp d1)"
    assert mc.core.names.positional_names(3, ("d0", "dim1")) == ("t0", "t1", "t2")
