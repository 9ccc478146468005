"""The zigzag (head-tail) split "zigzag(cp s)": its notation, which indices each rank holds,
and plans to and from it, exact against the global tensor in simulation with their bytes
counted (tests/dist/test_reshard.py runs some on gloo; tests/dist/test_attention.py runs
attention over it)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.core.errors import (
    InteropError,
    LayoutSyntaxError,
    MeshAxisError,
    PlanError,
    ShapeError,
)
from meshcomm.executors.sim import execute, gather, scatter
from meshcomm.nn.attention.balance import imbalance, pairs_per_rank


# -- notation ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,canonical", [
    ("zigzag(cp s) d", "zigzag(cp s) d"), ("b zigzag( dp  cp s ) d|sum(tp)",
                                           "b zigzag(dp cp s) d | sum(tp)"),
    ("zigzag (cp s)", "zigzag(cp s)")])
def test_zigzag_parses_and_prints_back(text: str, canonical: str) -> None:
    layout = mc.Layout(text)
    assert str(layout) == canonical and mc.Layout(str(layout)) == layout
    assert layout != mc.Layout(canonical.replace("zigzag", ""))
    assert layout.zigzag_dims == (canonical.split().index(
        next(w for w in canonical.split() if w.startswith("zigzag"))),)


def test_a_dim_named_zigzag_is_still_a_name() -> None:
    assert mc.Layout("zigzag s").zigzag_dims == () and mc.Layout("zigzag s").ndim == 2


@pytest.mark.parametrize("text,why", [
    ("zigzag(s)", "mesh axes and one dim name"), ("zigzag(cp x=2 s)", "the name last"),
    ("(zigzag(cp s))", "cannot open inside"), ("zigzag(cp (s))", "cannot open inside")])
def test_bad_zigzag_groups_fail_to_parse(text: str, why: str) -> None:
    with pytest.raises(LayoutSyntaxError, match=why.replace("(", r"\(")):
        mc.Layout(text)


def test_a_zigzag_of_local_names_or_ending_in_an_axis_fails_on_the_mesh() -> None:
    mesh = mc.Mesh("cp=2 tp=2")
    with pytest.raises(MeshAxisError, match="zigzag"):
        mc.Layout("zigzag(cq s)").placements(mesh, (8,))
    with pytest.raises(ShapeError, match="the dim's own name"):
        mc.Layout("zigzag(cp tp)").placements(mesh, (8,))


# -- which indices each rank holds --------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_an_even_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r(cp: int) -> None:
    mesh, n = mc.Mesh(f"cp={cp}"), 2 * cp * 3
    for rank in mesh.ranks:
        got = mc.Layout("zigzag(cp s)").indices(mesh, (n,), rank)[0]
        assert got == (*range(3 * rank, 3 * rank + 3),
                       *range(3 * (2 * cp - 1 - rank), 3 * (2 * cp - rank)))


@pytest.mark.parametrize("spec,layout", [
    ("cp=4", "zigzag(cp s) d"), ("dp=2 cp=3", "zigzag(dp cp s) d"),
    ("dp=2 cp=3", "zigzag(cp dp s) d"), ("one=1 cp=4", "zigzag(one cp s) d"),
    ("a=2 b=1 c=2 d=1 e=2", "zigzag(e a s) (c x)")])
@pytest.mark.parametrize("n", [0, 1, 5, 13, 24, 31])
def test_any_length_is_a_permutation_with_the_twins_local_shapes(spec: str, layout: str,
                                                                 n: int) -> None:
    mesh, lay = mc.Mesh(spec), mc.Layout(layout)
    twin = lay.without_zigzag()
    shape = (n, 4)
    seen: list[int] = []
    for group in mesh.groups(*[f.name for f in lay.dims[0].factors[:-1]]):
        held = [lay.indices(mesh, shape, r)[0] for r in group]
        seen = [i for ix in held for i in ix]
        assert sorted(seen) == list(range(n))
        for r in group:
            assert lay.local_shape(mesh, shape, r) == twin.local_shape(mesh, shape, r)
            assert len(lay.indices(mesh, shape, r)[0]) == lay.local_shape(mesh, shape, r)[0]
    # the twin's order: the ranks' blocks in group order, each as the rank holds it
    order = lay.zigzag_order(mesh, shape, 0)
    assert sorted(order) == list(range(n))
    assert twin.zigzag_order(mesh, shape, 0) == tuple(range(n))


def test_zigzag_has_no_dtensor_placement_and_names_the_twin() -> None:
    with pytest.raises(InteropError, match=r'"\(cp s\) d"'):
        mc.dtensor.to_placements(mc.Mesh("cp=2"), (8, 2), "zigzag(cp s) d")


# -- plans ----------------------------------------------------------------------------------
FORMS = ["zigzag(cp s) d", "(cp s) d", "s d", "zigzag(cp s) (tp d)", "(cp s) (tp d)",
         "zigzag(tp cp s) d", "zigzag(cp tp s) d", "(tp s) d", "s d | sum(tp)",
         "zigzag(cp s) d | sum(tp)", "(cp s) d | sum(tp)", "zigzag(cp s) d | max(tp)"]


def check_exact(mesh: mc.Mesh, shape: tuple[int, ...], src: str, dst: str,
                dtype: torch.dtype = torch.float64) -> mc.Plan:
    """The plan's outputs equal the destination's shards of the global tensor (a pending
    destination: they reduce to it), and its bytes equal what the simulation moved."""
    p = mc.plan(mesh, shape, src, dst, dtype=dtype)
    x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(len(src)))
    res = execute(p, scatter(x, mesh, src))
    assert res.send_bytes == p.send_bytes and res.recv_bytes == p.recv_bytes, str(p)
    if p.dst.reduce_op:
        torch.testing.assert_close(gather(list(res.outputs), mesh, p.dst, shape), x,
                                   rtol=1e-12, atol=1e-12)
    else:
        for got, want in zip(res.outputs, scatter(x, mesh, dst)):
            assert torch.equal(got, want), str(p)
    assert max(p.lower_bound_bytes, default=0) <= max(p.recv_bytes, default=0)   # bound_ratio >= 1
    return p


def _compatible(src: str, dst: str) -> bool:
    ops = {mc.Layout(src).reduce_op, mc.Layout(dst).reduce_op} - {None}
    return len(ops) <= 1 and not (mc.Layout(dst).reduce_op and not mc.Layout(src).reduce_op
                                  and "max" in dst)


@pytest.mark.parametrize("n", [16, 13, 3, 0])
def test_every_pair_of_forms_is_exact(n: int) -> None:
    mesh = mc.Mesh("cp=4 tp=2")
    for src, dst in itertools.permutations(FORMS, 2):
        if _compatible(src, dst):
            check_exact(mesh, (n, 6), src, dst)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["cp=4", "one=1 cp=3 tp=2", "tp=2 cp=2 x=2", "a=2 b=1 cp=2 c=1 e=2"]),
       st.integers(0, 40), st.integers(1, 3), st.data())
def test_drawn_plans_are_exact(spec: str, n: int, width: int, data: st.DataObject) -> None:
    mesh = mc.Mesh(spec)
    axes = [a for a in mesh.axis_names]
    seq_axes = data.draw(st.lists(st.sampled_from(axes), min_size=1, max_size=2, unique=True))
    other = [a for a in axes if a not in seq_axes]

    def form() -> str:
        kind = data.draw(st.sampled_from(["zigzag", "contiguous", "whole"]))
        split = " ".join(seq_axes)
        first = {"zigzag": f"zigzag({split} s)", "contiguous": f"({split} s)",
                 "whole": "s"}[kind]
        second = data.draw(st.sampled_from(["h"] + [f"({a} h)" for a in other]))
        return f"{first} {second}"
    src, dst = form(), form()
    try:
        mc.Layout(src).placements(mesh, (n, 2 * width))
        mc.Layout(dst).placements(mesh, (n, 2 * width))
    except ShapeError:
        return
    check_exact(mesh, (n, 2 * width), src, dst)


def test_to_and_from_the_twin_is_one_exchange_at_the_lower_bound() -> None:
    mesh = mc.Mesh("dp=2 cp=4")
    for src, dst in (("(dp b) (cp s) d", "(dp b) zigzag(cp s) d"),
                     ("(dp b) zigzag(cp s) d", "(dp b) (cp s) d")):
        p = check_exact(mesh, (2, 16, 3), src, dst)
        assert [(s.kind, s.axes) for s in p.steps] == [("send_recv", ("cp",))]
        assert p.recv_bytes == p.lower_bound_bytes and p.bound_ratio == 1.0


def test_from_a_whole_dim_is_a_local_select_and_alike_dims_plan_as_twins() -> None:
    mesh = mc.Mesh("cp=4 tp=2")
    p = check_exact(mesh, (13, 4), "s d", "zigzag(cp s) d")
    assert [(s.kind, s.action) for s in p.steps] == [("local", "select")]
    p = check_exact(mesh, (13, 4), "zigzag(cp s) (tp d)", "zigzag(cp s) d")
    assert [s.kind for s in p.steps] == ["all_gather"]
    assert p.steps[0].before == mc.Layout("(cp s) (tp d)")        # planned on the twins


@pytest.mark.parametrize("n", [16, 13, 3, 0])
def test_to_a_whole_dim_is_the_twins_gather_then_a_local_select(n: int) -> None:
    mesh = mc.Mesh("cp=4 tp=2")
    for src, dst in itertools.product([f for f in FORMS if f.startswith("zigzag")],
                                      ["s d", "s d | sum(tp)"]):
        if not _compatible(src, dst):
            continue
        p = check_exact(mesh, (n, 6), src, dst)
        twin = mc.plan(mesh, (n, 6), mc.Layout(src).without_zigzag(), dst, dtype=torch.float64)
        assert (p.send_bytes, p.recv_bytes) == (twin.send_bytes, twin.recv_bytes), str(p)
        assert [s.kind for s in p.collectives] == [s.kind for s in twin.collectives]
        # a select where the gathered order is not the dim's (3 tokens on 4 ranks: it is)
        in_order = [s for s in p.steps if s.action == "select" and s.before == s.after]
        assert in_order == (list(p.steps[-1:]) if n > 4 else []), str(p)
        assert p.lower_bound_bytes == twin.lower_bound_bytes, str(p)   # the twins' bound
        assert p.bound_ratio == (1.0 if dst == "s d" and not p.src.reduce_op
                                 else twin.bound_ratio), str(p)


def test_zigzag_to_whole_moves_the_bytes_of_a_plain_all_gather() -> None:
    mesh, shape = mc.Mesh("cp=4"), (2, 16, 8)
    p = check_exact(mesh, shape, "b zigzag(cp s) h", "b s h", dtype=torch.float32)
    plain = mc.plan(mesh, shape, "b (cp s) h", "b s h")
    assert [(s.kind, s.action) for s in p.steps] == [("all_gather", ""), ("local", "select")]
    assert p.send_bytes == p.recv_bytes == plain.recv_bytes == (768,) * 4   # 3 blocks of 256 B
    assert p.bound_ratio == 1.0
    assert p.steps[1].before == p.steps[1].after == mc.Layout("b s h")
    # one block a rank, kept whole: at 131072 tokens planning lists no index
    big = mc.plan(mc.Mesh("dp=8 cp=16 tp=8"), (8, 131072, 32, 128),
                  "(dp b) zigzag(cp s) (tp h) d", "(dp b) s (tp h) d")
    assert [s.kind for s in big.steps] == ["all_gather", "local"]
    assert big.recv_bytes == big.lower_bound_bytes
    (kept,) = big.steps[1].rank_transfers(5)
    assert kept.src == kept.dst == 5 and kept.dst_index[1] == range(131072)


def test_plans_at_1024_ranks_follow_the_group_not_the_world() -> None:
    mesh = mc.Mesh("dp=8 cp=16 tp=8")
    shape = (8, 131072, 32, 128)
    p = mc.plan(mesh, shape, "(dp b) (cp s) (tp h) d", "(dp b) zigzag(cp s) (tp h) d")
    assert [s.kind for s in p.steps] == ["send_recv"]
    assert p.recv_bytes == p.lower_bound_bytes
    # 8192 tokens a rank, 32 / 8 heads of 128, float32: at most the whole block is received
    assert max(p.recv_bytes) <= 8192 * 4 * 128 * 4
    transfers = p.steps[0].rank_transfers(5)
    assert {t.src for t in transfers} | {t.dst for t in transfers} <= set(
        mesh.members(5, "cp"))


def test_between_meshes_a_zigzag_must_move_to_its_twin_first() -> None:
    with pytest.raises(PlanError, match=r'"\(cp s\) d"'):
        mc.plan(mc.Mesh("cp=2"), (8, 2), "zigzag(cp s) d", "(cp s) d",
                dst_mesh=mc.Mesh("cp=2", ranks=[2, 3]))


# -- load balance ----------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [4, 8, 16])
@pytest.mark.parametrize("extra", [0, 7])
def test_zigzag_balances_causal_work_for_any_length(cp: int, extra: int) -> None:
    mesh, seq = mc.Mesh(f"cp={cp}"), 256 * cp + extra
    assert imbalance(pairs_per_rank(mesh, "zigzag(cp s)", seq)) <= 1.05
    assert imbalance(pairs_per_rank(mesh, "(cp s)", seq)) > 1.7           # about 2 - 1/cp
