"""Mesh: construction, errors, coordinates, rank groups (vs torch's convention), value behaviour."""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import re

import pytest
import torch

from meshcomm import Mesh
from meshcomm.errors import MeshAxisError, MeshcommError, ShapeError


# -- construction -----------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: Mesh("dp=2 tp=4"),
    lambda: Mesh("dp=2, tp=4"),
    lambda: Mesh("  dp = 2   tp=4 "),
    lambda: Mesh(dp=2, tp=4),
    lambda: Mesh({"dp": 2, "tp": 4}),
    lambda: Mesh("dp=2 tp=4", ranks=list(range(8))),
    lambda: Mesh("dp=2 tp=4", ranks=[[0, 1, 2, 3], [4, 5, 6, 7]]),
    lambda: Mesh(dp=2, tp=4, ranks=torch.arange(8).reshape(2, 4)),
], ids=["text", "commas", "spaces", "keywords", "mapping", "flat-ranks", "nested-ranks",
        "tensor-ranks"])
def test_construction_forms_are_equal(make):
    mesh = make()
    assert mesh == Mesh(dp=2, tp=4)
    assert hash(mesh) == hash(Mesh(dp=2, tp=4))
    assert mesh.size == 8
    assert mesh.shape == (2, 4)
    assert mesh.axes == {"dp": 2, "tp": 4}
    assert list(mesh.axes) == ["dp", "tp"]
    assert mesh.axis_names == ("dp", "tp")
    assert mesh.ranks == tuple(range(8))
    assert repr(mesh) == "Mesh(dp=2, tp=4)"
    assert str(mesh) == "dp=2 tp=4"


def test_axis_order_matters():
    assert Mesh("dp=2 tp=4") != Mesh("tp=4 dp=2")
    assert Mesh("dp=2 tp=4") != Mesh("dp=4 tp=2")
    assert Mesh("dp=2 tp=4") != "dp=2 tp=4"


def test_one_axis_and_size_one_axes():
    mesh = Mesh("world=1")
    assert (mesh.size, mesh.shape, mesh.groups("world")) == (1, (1,), ((0,),))
    mesh = Mesh("dp=1 tp=3")
    assert mesh.groups("dp") == ((0,), (1,), (2,))
    assert mesh.groups("tp") == ((0, 1, 2),)


def test_axes_is_a_fresh_dict():
    mesh = Mesh("dp=2 tp=4")
    mesh.axes["dp"] = 99
    assert mesh.axes == {"dp": 2, "tp": 4}


# -- construction errors -------------------------------------------------------------
MESH_ERRORS = [
    (lambda: Mesh("dp=2 tp=x"), MeshAxisError,
     'cannot parse mesh "dp=2 tp=x"\n'
     "    dp=2 tp=x\n"
     "         ^^^^ expected NAME=SIZE, e.g. dp=2\n"
     '  fix: write the axes as "dp=2 tp=4"'),
    (lambda: Mesh("dp:2"), MeshAxisError,
     'cannot parse mesh "dp:2"\n'
     "    dp:2\n"
     "    ^^^^ expected NAME=SIZE, e.g. dp=2\n"
     '  fix: write the axes as "dp=2 tp=4"'),
    (lambda: Mesh("dp=2 tp=4 dp=2"), MeshAxisError,
     "mesh axis \"dp\" appears 2 times in ['dp', 'tp', 'dp']; fix: give each axis a distinct"
     " name"),
    (lambda: Mesh("dp=0"), MeshAxisError,
     'mesh axis "dp" has size 0; sizes are positive integers'),
    (lambda: Mesh(dp=2, tp=0), MeshAxisError,
     'mesh axis "tp" has size 0; sizes are positive integers'),
    (lambda: Mesh(dp=2.0), MeshAxisError,
     'mesh axis "dp" has size 2.0; sizes are positive integers'),
    (lambda: Mesh(""), MeshAxisError, 'a mesh needs at least one axis, e.g. Mesh("dp=2")'),
    (lambda: Mesh("dp=2", tp=2), MeshAxisError,
     "Mesh('dp=2', tp=2): give the axes once, either as a string \"dp=2 tp=4\" or as"
     " keywords dp=2, tp=4"),
    (lambda: Mesh({"1x": 2}), MeshAxisError, 'mesh axis name "1x" is not an identifier'),
    (lambda: Mesh(3), MeshAxisError,
     'Mesh(3): expected a string like "dp=2 tp=4", a mapping or keywords'),
    (lambda: Mesh("dp=2 tp=2", ranks=[[0, 1, 2], [3, 4, 5]]), ShapeError,
     "ranks= has shape (2, 3) but Mesh(dp=2, tp=2) needs shape (2, 2) (or a flat list of 4"
     " ranks)"),
    (lambda: Mesh("dp=2 tp=2", ranks=[0, 1, 2]), ShapeError,
     "ranks= has shape (3,) but Mesh(dp=2, tp=2) needs shape (2, 2) (or a flat list of 4"
     " ranks)"),
    (lambda: Mesh("dp=2 tp=2", ranks=[[0, 1], [2]]), ShapeError,
     "ranks= is ragged: [[0, 1], [2]]"),
    (lambda: Mesh("dp=2 tp=2", ranks=[[0, 1], [1, 3]]), ShapeError,
     "ranks= must hold distinct non-negative ranks, got [0, 1, 1, 3]"),
    (lambda: Mesh("dp=2", ranks=[-1, 0]), ShapeError,
     "ranks= must hold distinct non-negative ranks, got [-1, 0]"),
]


@pytest.mark.parametrize("make, kind, message", MESH_ERRORS)
def test_construction_errors(make, kind, message):
    with pytest.raises(kind, match=re.escape(message)) as info:
        make()
    assert str(info.value) == message
    assert isinstance(info.value, MeshcommError)
    assert isinstance(info.value, ValueError)


# -- coordinates --------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["tp=4", "dp=2 tp=4", "pp=2 dp=3 tp=2", "a=1 b=2 c=1"])
def test_coords_rank_at_round_trip(spec):
    mesh = Mesh(spec)
    expected = torch.arange(mesh.size).reshape(mesh.shape)
    for rank in mesh.ranks:
        coords = mesh.coords(rank)
        assert list(coords) == list(mesh.axis_names)
        assert mesh.rank_at(**coords) == rank
        assert int(expected[tuple(coords.values())]) == rank   # row-major, last axis fastest
    seen = {mesh.rank_at(**dict(zip(mesh.axis_names, c)))
            for c in itertools.product(*(range(s) for s in mesh.shape))}
    assert seen == set(range(mesh.size))


def test_coords_example():
    mesh = Mesh("dp=2 tp=4")
    assert mesh.coords(5) == {"dp": 1, "tp": 1}
    assert mesh.rank_at(dp=1, tp=3) == 7
    assert mesh.rank_at(tp=2, dp=0) == 2


@pytest.mark.parametrize("call, kind, message", [
    (lambda m: m.coords(8), ShapeError,
     "rank 8 is not in Mesh(dp=2, tp=4) (its ranks are [0, 1, 2, 3, 4, 5, 6, 7])"),
    (lambda m: m.rank_at(dp=1), MeshAxisError,
     "rank_at(dp=1) on Mesh(dp=2, tp=4): missing ['tp']"),
    (lambda m: m.rank_at(dp=1, tp=0, cp=0), MeshAxisError,
     "rank_at(dp=1, tp=0, cp=0) on Mesh(dp=2, tp=4): unknown ['cp']"),
    (lambda m: m.rank_at(dp=1, tp=4), ShapeError, "coordinate tp=4 is out of range 0..3"),
    (lambda m: m.groups("dq"), MeshAxisError,
     '"dq" is not an axis of Mesh(dp=2, tp=4); axes are dp, tp\n  fix: did you mean "dp"?'),
    (lambda m: m.groups("dp", "dp"), MeshAxisError, "axes ['dp', 'dp'] name an axis twice"),
    (lambda m: m.group_size(("dp", "tq")), MeshAxisError,
     '"tq" is not an axis of Mesh(dp=2, tp=4); axes are dp, tp\n  fix: did you mean "tp"?'),
    (lambda m: m.group_size("dq"), MeshAxisError,
     '"dq" is not an axis of Mesh(dp=2, tp=4); axes are dp, tp\n  fix: did you mean "dp"?'),
])
def test_query_errors(call, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        call(Mesh("dp=2 tp=4"))


# -- groups ----------------------------------------------------------------------------
def test_group_size_is_the_product_of_the_axis_sizes_and_the_size_of_each_group():
    mesh = Mesh("dp=2 tp=4 cp=3")
    assert mesh.group_size(()) == mesh.group_size([]) == 1
    assert mesh.group_size("tp") == mesh.group_size(["tp"]) == 4
    assert mesh.group_size(("dp", "cp")) == mesh.group_size({"cp", "dp"}) == 6
    assert mesh.group_size(a for a in mesh.axis_names) == mesh.size == 24
    for r in range(1, len(mesh.axis_names) + 1):
        for axes in itertools.permutations(mesh.axis_names, r):
            assert mesh.group_size(axes) == len(mesh.groups(*axes)[0]) == math.prod(
                mesh.axis_size(a) for a in axes)


def test_groups_hand_written():
    mesh = Mesh("dp=2 tp=4")
    assert mesh.groups("tp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.groups("dp", "tp") == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert mesh.groups("tp", "dp") == ((0, 4, 1, 5, 2, 6, 3, 7),)   # first-named axis major
    assert mesh.groups() == tuple((r,) for r in range(8))


def test_groups_three_axes_hand_written():
    mesh = Mesh("pp=2 dp=2 tp=2")
    assert mesh.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.groups("dp", "tp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh.groups("tp", "dp") == ((0, 2, 1, 3), (4, 6, 5, 7))
    assert mesh.groups("pp", "tp") == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert mesh.groups("tp", "pp") == ((0, 4, 1, 5), (2, 6, 3, 7))
    assert mesh.groups("tp", "pp", "dp") == ((0, 2, 4, 6, 1, 3, 5, 7),)


def torch_groups(grid: torch.Tensor, names: tuple[str, ...], axes: tuple[str, ...]):
    """torch's convention: move the group's axes last (in the order named), one group per row."""
    idx = [names.index(a) for a in axes]
    moved = grid.movedim(idx, list(range(grid.dim() - len(idx), grid.dim())))
    return tuple(tuple(row) for row in moved.reshape(-1, math.prod(grid.shape[i] for i in idx))
                 .tolist())


def all_axis_tuples(names):
    for k in range(1, len(names) + 1):
        yield from itertools.permutations(names, k)


@pytest.mark.parametrize("spec", ["tp=4", "dp=2 tp=4", "dp=3 tp=2", "pp=2 dp=3 tp=2",
                                  "a=2 b=1 c=3"])
def test_groups_match_torch_convention(spec):
    mesh = Mesh(spec)
    grid = torch.arange(mesh.size).reshape(mesh.shape)
    for axes in all_axis_tuples(mesh.axis_names):
        groups = mesh.groups(*axes)
        assert groups == torch_groups(grid, mesh.axis_names, axes), axes
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))


@pytest.mark.parametrize("spec", ["dp=2 tp=4", "pp=2 dp=3 tp=2"])
def test_single_axis_groups_match_device_mesh_construction(spec):
    # DeviceMesh builds the groups of mesh dim d as mesh.swapdims(-1, d).reshape(-1, size).
    mesh = Mesh(spec)
    grid = torch.arange(mesh.size).reshape(mesh.shape)
    for d, axis in enumerate(mesh.axis_names):
        rows = grid.swapdims(-1, d).reshape(-1, mesh.shape[d]).tolist()
        assert set(mesh.groups(axis)) == {tuple(r) for r in rows}


def test_group_index():
    mesh = Mesh("dp=2 tp=4")
    for rank in mesh.ranks:
        for axes in all_axis_tuples(mesh.axis_names):
            g, pos = mesh.group_index(rank, *axes)
            assert mesh.groups(*axes)[g][pos] == rank


# -- explicit ranks ---------------------------------------------------------------------
def test_explicit_ranks_permutation():
    grid = [[5, 7, 1], [3, 0, 2]]
    mesh = Mesh("dp=2 tp=3", ranks=grid)
    assert mesh.ranks == (5, 7, 1, 3, 0, 2)
    assert mesh.size == 6
    assert repr(mesh) == "Mesh(dp=2, tp=3, ranks=[5, 7, 1, 3, 0, 2])"
    assert mesh != Mesh("dp=2 tp=3")
    assert mesh.coords(0) == {"dp": 1, "tp": 1}
    assert mesh.coords(5) == {"dp": 0, "tp": 0}
    assert mesh.rank_at(dp=0, tp=2) == 1
    assert mesh.position(3) == 3
    assert mesh.groups("tp") == ((5, 7, 1), (3, 0, 2))
    assert mesh.groups("dp") == ((5, 3), (7, 0), (1, 2))
    assert mesh.groups("tp", "dp") == ((5, 3, 7, 0, 1, 2),)
    tensor = torch.tensor(grid)
    for axes in all_axis_tuples(mesh.axis_names):
        assert mesh.groups(*axes) == torch_groups(tensor, mesh.axis_names, axes)
    with pytest.raises(ShapeError, match=re.escape("rank 4 is not in Mesh(dp=2, tp=3, ranks=")):
        mesh.coords(4)


def test_explicit_ranks_subset_of_world():
    mesh = Mesh("dp=2", ranks=torch.tensor([4, 6]))
    assert mesh.ranks == (4, 6)
    assert mesh.groups("dp") == ((4, 6),)
    assert mesh.rank_at(dp=1) == 6
    assert Mesh("dp=2", ranks=[4, 6]) == mesh


# -- value behaviour -----------------------------------------------------------------------
def test_frozen():
    mesh = Mesh("dp=2 tp=4")
    with pytest.raises(AttributeError):
        mesh._sizes = (4, 2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        mesh.extra = 1  # type: ignore[attr-defined]
    assert mesh == Mesh("dp=2 tp=4")


def test_hash_and_eq_as_dict_keys():
    table = {Mesh("dp=2 tp=4"): "a", Mesh("tp=4 dp=2"): "b", Mesh("dp=2 tp=4", ranks=range(8)): "c"}
    assert len(table) == 2
    assert table[Mesh(dp=2, tp=4)] == "c"


@pytest.mark.parametrize("mesh", [Mesh("dp=2 tp=4"), Mesh("x=3"),
                                  Mesh("dp=2 tp=2", ranks=[[3, 2], [1, 0]])], ids=repr)
def test_pickle_copy_and_repr_round_trip(mesh):
    for clone in (pickle.loads(pickle.dumps(mesh)), copy.deepcopy(mesh), copy.copy(mesh)):
        assert clone == mesh and hash(clone) == hash(mesh)
        assert clone.groups(mesh.axis_names[0]) == mesh.groups(mesh.axis_names[0])
    assert eval(repr(mesh), {"Mesh": Mesh}) == mesh


def test_torch_without_sort_ranks_takes_sorted_groups_and_refuses_others(monkeypatch) -> None:
    """Before torch 2.12 new_group sorts a group's ranks; a group whose mesh order is not
    sorted would then hold its blocks in the wrong order, so init_mesh refuses it first."""
    from meshcomm.runtime import bind

    monkeypatch.setattr(bind, "_SORT_RANKS", False)
    mesh = Mesh("dp=2 tp=2", ranks=[0, 2, 1, 3])
    assert bind._unsorted(mesh, ("dp",), (0, 1)) == {}
    with pytest.raises(MeshcommError, match=r"ranks \[2, 1\].*upgrade torch"):
        bind._unsorted(mesh, ("tp",), (2, 1))
    monkeypatch.setattr(bind, "_SORT_RANKS", True)
    assert bind._unsorted(mesh, ("tp",), (2, 1)) == {"sort_ranks": False}


def test_a_mesh_too_large_to_list_is_refused_clearly() -> None:
    """A typo'd size (tp=99999999999999) is a clear error, not a MemoryError."""
    with pytest.raises(MeshAxisError, match=r'Mesh\("tp=99999999999999"\) has'
                       r" 99,999,999,999,999 ranks; .* at most 4,194,304\. fix: check the axis"):
        Mesh("tp=99999999999999")
    assert Mesh("dp=4096 tp=1024").size == 1 << 22


@pytest.mark.parametrize("spec", ["dp=2 tp=3 cp=2", "a=3 b=1 c=4"])
def test_members_is_the_group_of_groups_for_every_rank_and_axis_order(spec: str) -> None:
    """`Mesh.members` (plain arithmetic; the one way executors and mc.collectives find a
    rank's group) agrees with the table of `Mesh.groups`, axes in any order, on a mesh
    whose ranks are not in order."""
    mesh = Mesh(spec, ranks=list(reversed(range(Mesh(spec).size))))
    for k in range(1, len(mesh.axis_names) + 1):
        for axes in itertools.permutations(mesh.axis_names, k):
            for rank in mesh.ranks:
                which, pos = mesh.group_index(rank, *axes)
                assert mesh.members(rank, *axes) == mesh.groups(*axes)[which]
                assert mesh.members(rank, *axes).index(rank) == pos
