"""Layout math: local shards vs the einops definition, uneven shards vs torch.chunk and
DTensor, layout errors, and hypothesis properties (gather(scatter(x)) == x, coverage)."""

from __future__ import annotations

import math
import re

import einops
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm import Layout, Mesh
from meshcomm.errors import MeshAxisError, MeshcommError, ShapeError
from meshcomm.executors import sim


# -- references -----------------------------------------------------------------------
def einops_local(x: torch.Tensor, mesh: Mesh, layout: Layout, rank: int) -> torch.Tensor:
    """The definition: rearrange the global tensor to (sharding axes..., local dims...) and
    index it at the rank's mesh coordinates (even sizes only)."""
    sizes: dict[str, int] = {}
    lhs, rhs, used = [], [], set()
    for dim, n in zip(layout.dims, x.shape):
        free = None
        known = 1
        for f in dim.factors:
            if f.name in mesh.axes:
                sizes[f.name] = mesh.axes[f.name]
                used.add(f.name)
            elif f.size is not None:
                sizes[f.name] = f.size
            else:
                free = f.name
                continue
            known *= sizes[f.name]
        if free is not None:
            sizes[free] = n // known
        lhs.append("(" + " ".join(f.name for f in dim.factors) + ")")
        rhs.append("(" + " ".join(f.name for f in dim.factors if f.name not in mesh.axes) + ")")
    axes = [a for a in mesh.axis_names if a in used]
    y = einops.rearrange(x, f"{' '.join(lhs)} -> {' '.join(axes)} {' '.join(rhs)}", **sizes)
    coords = mesh.coords(rank)
    return y[tuple(coords[a] for a in axes)]


def chunk_local(x: torch.Tensor, dim: int, axes: list[str], mesh: Mesh, rank: int) -> torch.Tensor:
    """torch.chunk applied axis by axis, major first; a missing chunk is empty."""
    coords = mesh.coords(rank)
    for axis in axes:
        pieces = torch.chunk(x, mesh.axes[axis], dim)
        c = coords[axis]
        x = pieces[c] if c < len(pieces) else x.narrow(dim, x.shape[dim], 0)
    return x


def arange(shape) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape)


# -- local shards vs einops --------------------------------------------------------------
MESH_24 = Mesh("dp=2 tp=4")
MESH_222 = Mesh("pp=2 dp=2 tp=2")
MESH_PERM = Mesh("dp=2 tp=2", ranks=[[3, 1], [0, 2]])
EINOPS_CASES = [
    (MESH_24, (8, 16, 32), "(dp b) s (tp h)"),
    (MESH_24, (8, 16, 32), "(dp tp b) s h"),
    (MESH_24, (8, 16, 32), "(tp dp b) s h"),
    (MESH_24, (8, 16, 32), "(b dp) s (h tp)"),
    (MESH_24, (8, 16, 32), "(b dp tp) s h"),
    (MESH_24, (8, 16, 32), "(b tp dp) s h"),
    (MESH_24, (8, 16, 32), "(dp b tp) s h"),
    (MESH_24, (8, 16, 32), "(x=2 tp b) s h"),
    (MESH_24, (8, 16, 32), "(dp x=2 b) s (tp h)"),
    (MESH_24, (8, 16, 32), "(x=4 dp b) s h"),
    (MESH_24, (16, 16, 32), "(tp b x=2) (dp s) h"),
    (MESH_24, (8, 16, 32), "(dp tp) s h"),
    (MESH_24, (8, 2, 32), "b dp (tp h)"),
    (MESH_24, (8, 16, 32), "b s h"),
    (MESH_24, (8, 16, 32), "(dp b) s h | sum(tp)"),
    (MESH_24, (8, 16, 32), "b s h | avg(dp, tp)"),
    (MESH_24, (6, 4, 5), "(x=3 b) (y=2 z=2) h"),
    (MESH_222, (8, 4, 6), "(pp b) (tp s) (dp h)"),
    (MESH_222, (16, 4, 6), "(tp pp dp b) s h"),
    (MESH_222, (16, 4, 6), "(b dp) (tp s) h | max(pp)"),
    (MESH_PERM, (4, 6), "(dp b) (h tp)"),
    (Mesh("dp=3"), (9,), "(b dp)"),
    (Mesh("dp=3"), (), ""),
]


@pytest.mark.parametrize("mesh, shape, text", EINOPS_CASES, ids=lambda v: str(v))
def test_local_shards_match_einops_definition(mesh, shape, text):
    layout = Layout(text)
    x = arange(shape)
    plain = Layout(text.split("|")[0])
    locals_ = sim.scatter(x, mesh, plain)
    for pos, rank in enumerate(mesh.ranks):
        want = einops_local(x, mesh, layout, rank) if shape else x
        assert torch.equal(locals_[pos], want), rank
        assert layout.local_shape(mesh, shape, rank) == tuple(want.shape)
        assert torch.equal(sim.take(x, layout.indices(mesh, shape, rank)), want)


def test_indices_examples():
    mesh = Mesh("dp=2 tp=2")
    assert Layout("(dp b) h").indices(mesh, (4, 3), 2) == ((2, 3), (0, 1, 2))
    assert Layout("(b dp) h").indices(mesh, (4, 3), 2) == ((1, 3), (0, 1, 2))
    assert Layout("(dp tp b)").indices(mesh, (8,), 1) == ((2, 3),)
    assert Layout("(tp dp b)").indices(mesh, (8,), 1) == ((4, 5),)
    assert Layout("(b dp tp)").indices(mesh, (8,), 1) == ((1, 5),)
    assert Layout("(x=2 tp b)").indices(mesh, (8,), 1) == ((2, 3, 6, 7),)
    assert Layout("(dp b) h").local_shape(mesh, (4, 3), 3) == (2, 3)


# -- uneven shards -----------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 9, 10, 13])
@pytest.mark.parametrize("text, axes", [("(dp b)", ["dp"]), ("(tp b)", ["tp"]),
                                        ("(dp tp b)", ["dp", "tp"]), ("(tp dp b)", ["tp", "dp"])])
def test_uneven_follows_torch_chunk_axis_by_axis(size, text, axes):
    mesh = Mesh("dp=2 tp=3")
    x = torch.arange(size)
    layout = Layout(text)
    for pos, rank in enumerate(mesh.ranks):
        want = chunk_local(x, 0, axes, mesh, rank)
        assert layout.indices(mesh, (size,), rank) == (tuple(want.tolist()),)
        assert torch.equal(sim.scatter(x, mesh, layout)[pos], want)
    assert torch.equal(sim.gather(sim.scatter(x, mesh, layout), mesh, layout, (size,)), x)


def test_uneven_single_axis_is_torch_chunk():
    mesh = Mesh("dp=4")
    assert [Layout("(dp b)").local_shape(mesh, (10,), r) for r in range(4)] == [(3,), (3,), (3,), (1,)]
    assert [len(c) for c in torch.chunk(torch.arange(10), 4)] == [3, 3, 3, 1]


def test_empty_shards():
    mesh = Mesh("dp=4")
    layout = Layout("(dp b) h")
    assert [layout.local_shape(mesh, (2, 3), r) for r in range(4)] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert layout.indices(mesh, (2, 3), 3) == ((), (0, 1, 2))
    x = arange((2, 3))
    xs = sim.scatter(x, mesh, layout)
    assert [tuple(t.shape) for t in xs] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert torch.equal(sim.gather(xs, mesh, layout, (2, 3)), x)
    # a (dp tp b) group can leave a whole dp block empty and a tp rank inside a block empty
    mesh = Mesh("dp=4 tp=2")
    shapes = [Layout("(dp tp b)").local_shape(mesh, (7,), r)[0] for r in mesh.ranks]
    assert shapes == [1, 1, 1, 1, 1, 1, 1, 0]
    assert [Layout("(dp b)").local_shape(mesh, (0,), r) for r in (0, 7)] == [(0,), (0,)]


def dtensor_placements(mesh: Mesh, layout: Layout):
    from torch.distributed.tensor import Replicate, Shard
    placements = [Replicate()] * len(mesh.axis_names)
    for d, dim in enumerate(layout.dims):
        for f in dim.factors:
            if f.name in mesh.axes:
                placements[mesh.axis_names.index(f.name)] = Shard(d)
    return placements


@pytest.mark.parametrize("shape", [(7, 5), (8, 6), (3, 2), (1, 9), (0, 4), (13, 1)])
@pytest.mark.parametrize("text", ["(dp b) h", "(dp tp b) h", "(dp b) (tp h)", "b (dp tp h)",
                                  "(tp b) h", "b h"])
def test_uneven_matches_dtensor_shard(shape, text):
    """Groups with axes in mesh order are DTensor's (Shard(d), ...) placements, bit for bit."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    compute = getattr(utils, "_compute_local_shape_and_global_offset", None)
    if compute is None:
        pytest.skip("this torch has no _compute_local_shape_and_global_offset")
    mesh = Mesh("dp=2 tp=3")
    layout = Layout(text)
    placements = dtensor_placements(mesh, layout)
    for rank in mesh.ranks:
        coord = list(mesh.coords(rank).values())
        local_shape, offset = compute(shape, mesh.shape, coord, placements)
        index = layout.indices(mesh, shape, rank)
        assert layout.local_shape(mesh, shape, rank) == tuple(local_shape), rank
        for ix, start in zip(index, offset):
            if ix:   # DTensor shards are contiguous; an empty shard has no meaningful offset
                assert ix == tuple(range(start, start + len(ix))), rank


# -- errors ------------------------------------------------------------------------------
LAYOUT_ERRORS = [
    ("(b dp) s", Mesh("dp=4 tp=2"), (10, 16), ShapeError,
     'layout "(b dp) s" does not fit dim 0 of size 10: (b dp) needs a multiple of 4; only'
     ' "(axes... name)" groups allow uneven shards. fix: use "(dp b)", or pad dim 0 to 12'),
    ("(x=2 dp b) s", Mesh("dp=2 tp=2"), (7, 4), ShapeError,
     'layout "(x=2 dp b) s" does not fit dim 0 of size 7: (x=2 dp b) needs a multiple of 4;'
     ' only "(axes... name)" groups allow uneven shards. fix: use "(dp b)", or pad dim 0 to 8'),
    ("(x=3 b)", Mesh("dp=2"), (7,), ShapeError,
     'layout "(x=3 b)" does not fit dim 0 of size 7: (x=3 b) needs a multiple of 3; only'
     ' "(axes... name)" groups allow uneven shards. fix: use "b", or pad dim 0 to 9'),
    ("(dp b) s", Mesh("dp=2 tp=4"), (8, 16, 32), ShapeError,
     'layout "(dp b) s" has 2 dims but the shape (8, 16, 32) has 3. fix: name one dim per'
     ' tensor dim, e.g. "a b c"'),
    ("(dp b) s", Mesh("dp=2"), (-1, 2), ShapeError,
     'layout "(dp b) s": shape (-1, 2) has a negative size; sizes are >= 0'),
    ("(dq b) s (tp h)", Mesh("dp=2 tp=4"), (8, 16, 32), MeshAxisError,
     'layout "(dq b) s (tp h)" on Mesh(dp=2, tp=4): "dq" is not a mesh axis\n'
     "    (dq b) s (tp h)\n"
     "     ^^ a group is one dim name plus mesh axes (dp, tp) or sized factors (x=2)\n"
     '  fix: did you mean "dp"?'),
    ("(tqa b) s | sum(tq)", Mesh("dp=2 tp=4"), (8, 16), MeshAxisError,
     'layout "(tqa b) s | sum(tq)" on Mesh(dp=2, tp=4): "tq" is not a mesh axis\n'
     "    (tqa b) s | sum(tq)\n"
     "                    ^^ a pending reduction is over mesh axes (dp, tp)\n"
     '  fix: did you mean "tp"?'),
    ("(dp tp) s", Mesh("dp=2 tp=4"), (16, 16), ShapeError,
     'layout "(dp tp) s" does not fit dim 0 of size 16: its factors (dp tp) multiply to 8.'
     ' fix: give the dim a name that takes the rest, e.g. "(dp tp x)"'),
    ("x=2", Mesh("dp=2"), (3,), ShapeError,
     'layout "x=2" does not fit dim 0 of size 3: its factors x=2 multiply to 2. fix: give the'
     ' dim a name that takes the rest, e.g. "(x=2 y)"'),
    ("(dp=4 b) s", Mesh("dp=2 tp=4"), (16, 16), ShapeError,
     'layout "(dp=4 b) s": "dp=4" in dim 0 gives mesh axis dp size 4, but Mesh(dp=2, tp=4) has'
     " dp=2. fix: write dp alone"),
]


@pytest.mark.parametrize("text, mesh, shape, kind, message", LAYOUT_ERRORS)
def test_layout_errors(text, mesh, shape, kind, message):
    layout = Layout(text)
    calls = [lambda: layout.placements(mesh, shape), lambda: layout.local_shape(mesh, shape, 0),
             lambda: layout.indices(mesh, shape, 0)]
    if min(shape) >= 0:
        calls.append(lambda: sim.scatter(torch.zeros(shape), mesh, layout))
    for call in calls:
        with pytest.raises(kind, match=re.escape(message)) as info:
            call()
        assert str(info.value) == message


def test_sized_factor_equal_to_mesh_axis_size_is_the_axis():
    mesh = Mesh("dp=2 tp=4")
    assert Layout("(dp=2 b) s").indices(mesh, (8, 2), 4) == Layout("(dp b) s").indices(mesh, (8, 2), 4)


def test_check_local():
    mesh = Mesh("dp=2 tp=4")
    Layout("(dp b) s").check_local(mesh, (8, 16), 0, (4, 16))
    message = ('local tensor on rank 0 has shape (4, 15), but layout "(dp b) s" of global shape'
               " (8, 16) on Mesh(dp=2, tp=4) gives it shape (4, 16). fix: pass the shard this"
               " rank holds, or the right global shape/layout")
    with pytest.raises(ShapeError, match=re.escape(message)):
        Layout("(dp b) s").check_local(mesh, (8, 16), 0, (4, 15))


def test_gather_errors():
    mesh = Mesh("dp=2 tp=2")
    x = arange((4, 3)).float()
    xs = sim.scatter(x, mesh, "(dp b) h")
    with pytest.raises(ShapeError, match=re.escape(
            "gather got 3 local tensors for Mesh(dp=2, tp=2) of 4 ranks")):
        sim.gather(xs[:3], mesh, "(dp b) h", (4, 3))
    bad = [*xs[:1], xs[1] + 1, *xs[2:]]
    with pytest.raises(ShapeError, match=re.escape(
            'gather: rank 1 disagrees with another replica of layout "(dp b) h" at 6'
            " element(s); replicas must hold equal values")):
        sim.gather(bad, mesh, "(dp b) h", (4, 3))


def test_partial_scatter_is_spread_not_on_one_rank():
    mesh = Mesh("dp=2 tp=2")
    x = arange((4, 3)).float() + 1
    xs = sim.scatter(x, mesh, "(dp b) h | sum(tp)")
    assert all(bool((t != 0).any()) for t in xs)
    assert torch.equal(xs[0] + xs[1], x[:2]) and torch.equal(xs[2] + xs[3], x[2:])
    xs = sim.scatter(x, mesh, "b h | max(dp, tp)")
    assert torch.equal(torch.stack(xs).amax(0), x)
    assert all(bool(torch.isfinite(t).any()) for t in xs)


# -- hypothesis properties ---------------------------------------------------------------
AXIS_NAMES = ("dp", "tp", "cp")


@st.composite
def cases(draw):
    """(mesh, shape, layout): 1-3 axes, <= 16 ranks, 0-3 dims, uneven sizes where allowed."""
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        sizes.append(draw(st.integers(1, min(4, 16 // math.prod(sizes)))))
    names = draw(st.permutations(AXIS_NAMES))[:len(sizes)]
    mesh = Mesh(dict(zip(names, sizes)))
    ndim = draw(st.integers(0, 3))
    order = draw(st.permutations(names))
    role = {a: draw(st.sampled_from(["rep", "partial", *range(ndim)])) for a in names}
    dims, shape = [], []
    for d in range(ndim):
        axes = [a for a in order if role[a] == d]
        known = math.prod(mesh.axes[a] for a in axes)
        kind = draw(st.sampled_from(["block", "cyclic", "mixed", "sized", "axes-only"]))
        factors = list(axes)
        if kind == "axes-only" and axes:
            dims.append(f"({' '.join(factors)})")
            shape.append(known)
            continue
        if kind == "sized":
            k = draw(st.integers(1, 3))
            factors.insert(draw(st.integers(0, len(factors))), f"x{d}={k}")
            known *= k
        name = f"b{d}"
        if kind == "block":
            factors.append(name)
            size = draw(st.integers(0, 12))          # any size: uneven follows torch.chunk
        else:
            at = 0 if kind == "cyclic" else draw(st.integers(0, len(factors)))
            factors.insert(at, name)
            size = known * draw(st.integers(0, 4))
        dims.append(f"({' '.join(factors)})" if len(factors) > 1 else factors[0])
        shape.append(size)
    text = " ".join(dims)
    partial = [a for a in order if role[a] == "partial"]
    if partial:
        text += f" | {draw(st.sampled_from(['sum', 'avg', 'max', 'min']))}({', '.join(partial)})"
    return mesh, tuple(shape), Layout(text)


def not_sharding(mesh: Mesh, layout: Layout) -> int:
    return math.prod(s for a, s in mesh.axes.items() if a not in layout.sharded_axes(mesh))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([torch.float32, torch.float64, torch.int64]), st.data())
def test_gather_scatter_round_trip(case, dtype, data):
    mesh, shape, layout = case
    if layout.reduce_op == "avg" and not dtype.is_floating_point:
        dtype = torch.float32
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    locals_ = sim.scatter(x, mesh, layout)
    assert len(locals_) == mesh.size
    for rank, local in zip(mesh.ranks, locals_):
        assert tuple(local.shape) == layout.local_shape(mesh, shape, rank)
        assert local.dtype == dtype
    back = sim.gather(locals_, mesh, layout, shape)
    group = math.prod(mesh.axes[a] for a in layout.partial_axes)
    if layout.reduce_op == "avg" and group & (group - 1):
        assert torch.allclose(back, x, rtol=1e-6, atol=1e-4)
    else:
        assert torch.equal(back, x)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_shards_cover_every_element_as_often_as_replication_says(case):
    mesh, shape, layout = case
    counts = torch.zeros(shape, dtype=torch.long)
    for rank in mesh.ranks:
        index = layout.indices(mesh, shape, rank)
        assert all(len(set(ix)) == len(ix) for ix in index)
        if index:
            counts[torch.meshgrid(*[torch.tensor(ix, dtype=torch.long) for ix in index],
                                  indexing="ij")] += 1
        else:
            counts += 1
    expected = not_sharding(mesh, layout)
    if layout.reduce_op is None:
        assert expected == math.prod(mesh.axes[a] for a in layout.replicated_axes(mesh))
    assert bool((counts == expected).all())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_indices_match_einops_or_torch_chunk(case):
    mesh, shape, layout = case
    placed = layout.placements(mesh, shape)
    x = arange(shape)
    for rank in mesh.ranks:
        index = layout.indices(mesh, shape, rank)
        if not any(p.uneven for p in placed):
            if shape:
                assert torch.equal(sim.take(x, index), einops_local(x, mesh, layout, rank))
            continue
        for d, p in enumerate(placed):
            if p.uneven:
                want = chunk_local(torch.arange(p.size), 0, list(p.axes), mesh, rank)
                assert index[d] == tuple(want.tolist())


def test_every_error_is_a_meshcomm_error():
    with pytest.raises(MeshcommError):
        Layout("(b dp)").placements(Mesh("dp=4"), (10,))


@pytest.mark.parametrize("text, placements", [
    ("(b dp) h", lambda S, SS, R: [SS(0, split_factor=4), R()]),
    ("(x=2 dp b) h", lambda S, SS, R: [SS(0, split_factor=2), R()]),
    ("(tp dp b) h", lambda S, SS, R: [SS(0, split_factor=2), S(0)]),
    ("(dp tp b) h", lambda S, SS, R: [S(0), S(0)]),
    ("(dp b) (tp h)", lambda S, SS, R: [S(0), S(1)]),
])
def test_dtensor_strided_shard_mapping(text, placements):
    """The DTensor column of docs/notation.md: each mesh dim's split, applied in mesh order."""
    types = pytest.importorskip("torch.distributed.tensor.placement_types")
    strided = getattr(types, "_StridedShard", None)
    if strided is None or not hasattr(strided, "_split_tensor"):
        pytest.skip("this torch has no _StridedShard._split_tensor")
    mesh = Mesh("dp=2 tp=2")
    x = arange((8, 4))
    layout = Layout(text)
    spec = placements(types.Shard, strided, types.Replicate)
    for pos, rank in enumerate(mesh.ranks):
        local = x
        for p, size, c in zip(spec, mesh.shape, mesh.coords(rank).values()):
            if not isinstance(p, types.Replicate):
                local = p._split_tensor(local, size, with_padding=False)[0][c]
        assert torch.equal(sim.scatter(x, mesh, layout)[pos], local), rank


# -- derivations: layouts made by methods, never by joining strings -----------------------------
def test_of_names_and_of_dims_build_what_the_text_would() -> None:
    assert Layout.of_names(["d0", "d1"]) == Layout("d0 d1")
    assert Layout.of_names([]) == Layout("")
    assert Layout.of_dims([["dp", "b"], ["s"]], "sum", ["tp"]) == Layout("(dp b) s | sum(tp)")
    assert Layout.of_dims([["b"]], "sum", []) == Layout("b")       # no axes: nothing pending


def test_pending_adds_axes_of_one_op_and_refuses_a_second_op() -> None:
    assert Layout("b h").pending("sum", ["tp"]) == Layout("b h | sum(tp)")
    assert Layout("b h | avg(dp)").pending("avg", ["cp"]) == Layout("b h | avg(dp, cp)")
    assert Layout("b h").pending("sum", []) == Layout("b h")
    with pytest.raises(mc.errors.PlanError, match="already has a pending sum"):
        Layout("b h | sum(dp)").pending("max", ["tp"])


def test_without_reduction_drops_only_the_pending_part() -> None:
    assert Layout("(dp b) s | sum(tp, cp)").without_reduction() == Layout("(dp b) s")
    layout = Layout("(dp b) s")
    assert layout.without_reduction() is layout


def test_split_adds_the_most_minor_axis_of_a_dim() -> None:
    assert Layout("(dp a) b").split(0, "fsdp") == Layout("(dp fsdp a) b")
    assert Layout("a b | sum(cp)").split(-1, "tp") == Layout("a (tp b) | sum(cp)")
    with pytest.raises(IndexError):
        Layout("a b").split(2, "tp")
    with pytest.raises(mc.errors.LayoutSyntaxError, match='"cp" appears twice'):
        Layout("a b | sum(cp)").split(0, "cp")


def test_with_dim_and_renamed() -> None:
    assert Layout("b s (tp v)").with_dim(-1, "v") == Layout("b s v")
    assert Layout("(tp b) h").renamed({"b": "d0", "h": "d1"}) == Layout("(tp d0) d1")
    assert Layout("d1 d0").renamed({"d0": "d1", "d1": "d0"}) == Layout("d0 d1")   # at once
    assert Layout("b h | sum(tp)").renamed({"tp": "cp"}) == Layout("b h | sum(cp)")


def test_no_layout_is_built_by_joining_strings_outside_the_parser() -> None:
    """Derived layouts come from the methods above: no `Layout(" ".join(...))` or
    `Layout(f"... | sum(...)")` in the package outside core/ (interop's placement
    translation writes the notation it reads, and is the one exception)."""
    import re
    from pathlib import Path

    package = Path(mc.__file__).parent
    pattern = re.compile(r'(Layout|logical|as_layout)\((f"|" "\.join|f\')|\| (sum|avg)\(\{')
    hits = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py")
            if p.parts[-2] != "core" and p.name != "placements.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and "raise" not in line and "f\" fix" not in line]
    assert not hits, hits
