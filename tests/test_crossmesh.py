"""Plans between two meshes, executed on simulated ranks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.planner.crossmesh import _contributors_only
from meshcomm.executors.landing import partials
from meshcomm.executors.sim import execute, gather, scatter

A = mc.Mesh("dp=2 tp=2")                              # ranks 0-3
PAIRS = [
    (A, mc.Mesh("tp=4", ranks=[4, 5, 6, 7])),          # disjoint, 4 -> 4
    (A, mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5])),       # overlapping
    (mc.Mesh("p=4"), mc.Mesh("q=2", ranks=[1, 2])),    # nested, 4 -> 2
    (mc.Mesh("q=2", ranks=[6, 7]), mc.Mesh("p=4")),    # 2 -> 4
    (mc.Mesh("p=3"), mc.Mesh("a=2 b=2", ranks=[3, 4, 5, 6])),  # 3 -> 4
    (mc.Mesh("a=2 b=2 c=2"), mc.Mesh("tp=4", ranks=[0, 2, 4, 6])),
]


def _outputs(plan: mc.Plan, res: mc.sim.SimResult) -> list[torch.Tensor]:
    assert plan.dst_mesh is not None
    return [res.outputs[plan.ranks.index(r)] for r in plan.dst_mesh.ranks]


def _run(src_mesh, dst_mesh, shape, src, dst, cost_model=None) -> mc.Plan:
    p = mc.plan(src_mesh, shape, src, dst, dst_mesh=dst_mesh, cost_model=cost_model)
    x = torch.randn(shape)
    res = execute(p, scatter(x, src_mesh, src))
    assert res.send_bytes == p.send_bytes and res.recv_bytes == p.recv_bytes
    outs = _outputs(p, res)
    if p.dst.reduce_op:
        assert torch.equal(gather(outs, dst_mesh, p.dst, shape), x)
    else:
        for got, want in zip(outs, scatter(x, dst_mesh, dst)):
            assert torch.equal(got, want)
    for r in p.ranks:
        if r not in dst_mesh.ranks:
            assert res.outputs[p.ranks.index(r)] is None
    return p


def test_disjoint_meshes_with_other_parallel_degrees():
    b = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    p = _run(A, b, (8, 16), "(dp b) (tp s)", "b (tp s)")
    assert [s.kind for s in p.steps] == ["send_recv"]
    assert p.ranks == tuple(range(8))
    assert p.recv_bytes == p.lower_bound_bytes == (0, 0, 0, 0) + (8 * 4 * 4,) * 4
    assert p.send_bytes[4:] == (0,) * 4


def test_a_rank_in_both_meshes_keeps_what_it_holds():
    b = mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5])
    p = _run(A, b, (8, 16), "(dp b) s", "(x b) s")
    # rank 2 (dp=1 in A, x=0 in B) needs rows 0:4, which it does not hold; rank 3 neither.
    assert all(r >= lb for r, lb in zip(p.recv_bytes, p.lower_bound_bytes))
    assert p.recv_bytes == p.lower_bound_bytes


def test_replicated_sources_share_the_sending():
    src_mesh = mc.Mesh("dp=4")                          # every rank holds the whole tensor
    dst_mesh = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    p = _run(src_mesh, dst_mesh, (16, 4), "b s", "(tp b) s")
    sends = p.send_bytes[:4]
    assert max(sends) == min(sends) == 16 * 4 * 4 // 4   # one block each: perfectly balanced


def test_a_replicated_destination_of_a_partial_source_is_reduced_on_the_source_mesh_first():
    # every destination rank needs the whole sum: its two partials straight from the
    # holders would be 1 KiB each, reducing first and then sending the sum is 512 B (on
    # bytes alone: with NCCL's default latency, worth 1 MB, the one step would win)
    b = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    p = _run(A, b, (8, 16), "b s | sum(tp)", "b s", mc.CostModel(latency_s=0.0))
    kinds = [s.kind for s in p.collectives]
    assert kinds[0] in ("reduce_scatter", "all_reduce") and kinds[-1] == "send_recv"
    assert p.steps[0].mesh == A and p.steps[-1].dst_mesh == b
    assert max(p.recv_bytes) == 8 * 16 * 4


def test_a_sharded_destination_of_a_partial_source_takes_the_partials_directly():
    # each destination rank takes its 2 rows from a holder of each of the 2 partials and
    # adds them: one step of 256 B each way, where reduce_scatter + transfer is two steps
    b = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    p = _run(A, b, (8, 16), "b s | sum(tp)", "(tp b) s")
    (step,) = p.steps
    assert (step.kind, step.action, step.dst_mesh) == ("send_recv", "direct", b)
    assert p.recv_bytes == (0,) * 4 + (2 * 2 * 16 * 4,) * 4
    assert max(p.send_bytes) == 2 * 2 * 16 * 4


def test_a_pending_sum_destination_is_sent_once_per_group():
    b = mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5])
    p = _run(A, b, (8, 16), "(dp b) s", "(x b) s | sum(y)")
    assert [s.kind for s in p.steps] == ["send_recv"]
    # ranks 3 and 5 (y=1) hold zeros: only the y=0 rank of each group receives its rows
    got = dict(zip(p.ranks, p.recv_bytes))
    assert got[3] == got[5] == 0 and got[4] == 4 * 16 * 4
    assert p.recv_bytes == p.lower_bound_bytes


def test_a_pending_avg_destination_is_delivered_to_all_then_marked():
    b = mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5])
    p = _run(A, b, (8, 16), "(dp b) s", "(x b) s | avg(y)")
    assert (p.steps[-1].kind, p.steps[-1].action) == ("local", "mark_partial")


def test_cross_plans_explain_both_meshes():
    b = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    text = mc.plan(A, (8, 16), "(dp b) (tp s)", "b (tp s)", dst_mesh=b).explain()
    assert "on Mesh(tp=4, ranks=[4, 5, 6, 7])" in text and "send_recv" in text


def test_same_mesh_as_dst_mesh_is_a_plain_plan():
    assert mc.plan(A, (8, 16), "(dp b) s", "b s", dst_mesh=A) is mc.plan(A, (8, 16), "(dp b) s", "b s")


def test_bad_dst_mesh():
    with pytest.raises(mc.errors.PlanError, match="dst_mesh must be a meshcomm Mesh"):
        mc.plan(A, (8, 16), "(dp b) s", "b s", dst_mesh="tp=4")
    with pytest.raises(mc.errors.MeshAxisError, match='"dp" is not a mesh axis'):
        mc.plan(A, (8, 16), "(dp b) s", "(dp b) s", dst_mesh=mc.Mesh("tp=4", ranks=[4, 5, 6, 7]))


@st.composite
def cases(draw):
    src_mesh, dst_mesh = draw(st.sampled_from(PAIRS))
    if draw(st.booleans()):
        src_mesh, dst_mesh = dst_mesh, src_mesh
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([4, 6, 8, 5, 7, 12])) for _ in range(ndim))

    def layout(mesh: mc.Mesh, partial_ok: bool) -> str:
        dims: list[list[str]] = [[] for _ in range(ndim)]
        partial = []
        for axis in mesh.axis_names:
            where = draw(st.sampled_from(["rep", "partial"] + list(range(ndim))))
            if where == "partial" and partial_ok:
                partial.append(axis)
            elif isinstance(where, int):
                dims[where].append(axis)
        text = " ".join(f"({' '.join(a + ['d' + str(i)])})" if a else f"d{i}"
                        for i, a in enumerate(dims))
        op = draw(st.sampled_from(["sum", "max", "min"]))
        return text + (f" | {op}({', '.join(partial)})" if partial else "")

    src, dst = layout(src_mesh, True), layout(dst_mesh, True)
    try:
        mc.Layout(src).placements(src_mesh, shape)
        mc.Layout(dst).placements(dst_mesh, shape)
    except mc.errors.ShapeError:
        assume(False)
    return src_mesh, dst_mesh, shape, src, dst


def received(step, p, rank):
    """The transfers `rank` receives in a step between meshes (listed in the plan, or
    computed for the rank when it runs)."""

    return [t for t in step.rank_transfers(rank) if t.dst == rank]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_every_cross_plan_is_exact(case):
    src_mesh, dst_mesh, shape, src, dst = case
    p = _run(src_mesh, dst_mesh, shape, src, dst)
    transfer = next(s for s in p.steps if s.dst_mesh is not None)
    # Every destination element arrives exactly once.
    idle = set(_contributors_only(dst_mesh, transfer.after))
    for r in dst_mesh.ranks:
        got = torch.zeros(transfer.after.local_shape(dst_mesh, shape, r), dtype=torch.long)
        for t in received(transfer, p, r):
            if t.dst == r and t.dst_index:
                got[torch.meshgrid(*[torch.tensor(ix) for ix in t.dst_index], indexing="ij")] += 1
            elif t.dst == r:
                got += 1
        # ranks past the first of a pending sum/max/min group hold the identity: no data;
        # a direct delivery brings every element once from each partial
        want = 0 if r in idle else partials(transfer)
        assert bool((got == want).all()), f"rank {r} gets some elements twice or never"
    if mc.Layout(src).reduce_op is None:
        assert p.recv_bytes == p.lower_bound_bytes
    assert math.isfinite(p.bound_ratio)
    assert p.bound_ratio >= 1.0, p.explain()      # a bound no plan can beat, ours included


def test_a_partial_source_on_a_rank_in_both_meshes_is_at_its_bound() -> None:
    """Rank 0 holds one of the two parts and needs the whole sum: it must receive the other
    part (88 elements), which the plan does (a reduce_scatter, then the other half); the
    bound no longer adds a share of the reduction on top of that need (it printed 0.67x)."""
    p = mc.plan(mc.Mesh("tp=2"), (8, 11), "a b | sum(tp)", "a b", dtype=torch.float64,
                dst_mesh=mc.Mesh("tp=1", ranks=[0]))
    assert p.lower_bound_bytes[0] == 88 * 8 and max(p.recv_bytes) == 88 * 8
    assert "1.00x of the lower bound" in p.explain()


def test_a_replicated_block_is_split_over_its_holders():
    # Every source rank holds the whole tensor; each of the 2 receivers needs half of it.
    p = _run(mc.Mesh("dp=4"), mc.Mesh("q=2", ranks=[4, 5]), (8, 4), "b s", "(q b) s")
    sends = p.send_bytes[:4]
    total = sum(p.recv_bytes)
    assert max(sends) == total // 4 == min(sends)      # the ideal: total / number of senders


# -- one receiver's blocks (checkpoint loading): the plan's transfers, for one rank -----------
RECEIVER_CASES = [   # (saved mesh, saved layout, loading mesh, loading layout, shape)
    ("dp=2 tp=2", "(dp a) (tp b)", "tp=4", "a (tp b)", (6, 10)),           # uneven
    ("dp=4", "(dp a) b", "x=2 y=2", "(y x a) b", (7, 3)),                   # uneven, 2 axes
    ("dp=4", "(a dp) b", "tp=2", "(tp a) b", (8, 4)),                       # strided source
    ("dp=3", "(dp a) b", "tp=2", "a (tp b)", (0, 5)),                       # size-0 dim
    ("dp=1 tp=2", "a (tp b)", "one=1", "a b", (3, 5)),                     # size-1 axis, plain
    ("a=2 b=1 c=2 d=1 e=2", "(a c a0) (e b0) c0", "p=2 q=3", "(q a0) (p b0) c0", (9, 4, 3)),
    ("one=1", "a b", "dp=2 tp=2", "(dp a) (tp b)", (5, 5)),                 # one file
]


@pytest.mark.parametrize("case", RECEIVER_CASES, ids=[c[0] + " -> " + c[2] for c in RECEIVER_CASES])
def test_receiver_transfers_are_the_plan_s_for_that_rank(case):
    from meshcomm.executors.local import grid, take
    from meshcomm.planner.states import from_layout
    from meshcomm.planner.rank_transfers import receiver_transfers

    saved_text, src, here_text, dst, shape = case
    saved, here = mc.Mesh(saved_text), mc.Mesh(here_text)
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    shards = {r: take(x, mc.Layout(src).indices(saved, shape, r)) for r in saved.ranks}
    first = max(saved.ranks) + 1                    # the plan needs the receivers numbered apart
    renumbered = mc.Mesh(dict(here.axes), ranks=[first + p for p in range(here.size)])
    p = mc.plan(saved, shape, src, dst, dst_mesh=renumbered, dtype=torch.float64)
    by_plan = execute(p, [shards[r] for r in saved.ranks])
    a = from_layout(mc.Layout(src), saved, shape)
    b = from_layout(mc.Layout(dst), here, shape)
    for k, r in enumerate(here.ranks):
        mine = receiver_transfers(a, saved, b, here, r)
        out = torch.full(mc.Layout(dst).local_shape(here, shape, r), -1.0, dtype=torch.float64)
        for t in mine:
            out[grid(t.dst_index)] = take(shards[t.src], t.src_index)
        assert torch.equal(out, take(x, mc.Layout(dst).indices(here, shape, r)))
        assert torch.equal(out, by_plan.outputs[p.ranks.index(first + k)])
        # the same senders with the same element counts as the plan's step
        (step,) = p.steps
        planned: dict[int, int] = {}
        for t in received(step, p, first + k):
            if t.dst == first + k:
                planned[t.src] = planned.get(t.src, 0) + t.numel
        assert {t.src: t.numel for t in mine if t.numel} == planned


def test_receiver_transfers_refuse_a_replicated_or_pending_source():
    from meshcomm.planner.states import from_layout
    from meshcomm.planner.rank_transfers import receiver_transfers

    mesh, here = mc.Mesh("dp=2 tp=2"), mc.Mesh("tp=2")
    b = from_layout(mc.Layout("a b"), here, (4, 4))
    for src in ("(dp a) b", "a (tp b) | sum(dp)"):
        a = from_layout(mc.Layout(src), mesh, (4, 4))
        with pytest.raises(ValueError, match="every element needs one holder"):
            receiver_transfers(a, mesh, b, here, 0)


def test_receiver_transfers_at_production_scale_cost_no_element_count():
    """1,024 saved ranks, vocab 50257 x hidden 8192 loaded onto dp=32 x tp=16: one rank's
    blocks without planning the other 511 ranks (the full cross-mesh plan takes minutes)."""
    from meshcomm.planner.states import from_layout
    from meshcomm.planner.rank_transfers import receiver_transfers

    saved, here, shape = mc.Mesh("dp=1024"), mc.Mesh("dp=32 tp=16"), (50257, 8192)
    a = from_layout(mc.Layout("(dp v) e"), saved, shape)
    b = from_layout(mc.Layout("(tp v) (dp e)"), here, shape)
    # rank 17 is dp 1, tp 1: rows 3142..6283 (3142 a tp shard), columns 256..511; the files
    # hold 50 rows each (torch.chunk of 50257 over 1024), so files 62..125 (rows 3100..6299)
    mine = receiver_transfers(a, saved, b, here, 17)
    assert [t.src for t in mine] == list(range(62, 126))
    assert sum(t.numel for t in mine) == 3142 * 256
    assert tuple(mine[0].src_index[0]) == tuple(range(42, 50))   # rows 3142..3149 of file 62
    assert tuple(mine[0].dst_index[1]) == tuple(range(256))


# -- plans counted, not listed: every element with one holder --------------------------------
LAZY_CASES = [   # (source mesh, layout, destination mesh, layout, destination's first rank)
    ("dp=1024", "(dp v) e", "dp=128 tp=8", "(tp v) e", 1024),       # disjoint meshes
    ("dp=1024", "(dp v) e", "dp=128 tp=8", "v (tp dp e)", 0),        # the same 1,024 ranks
    ("a=4 b=8", "(b v) (a e)", "c=2 d=16", "(d e) (c v)", 16),       # overlapping, both dims
]


@pytest.mark.parametrize("case", LAZY_CASES, ids=[f"{c[0]} -> {c[2]}" for c in LAZY_CASES])
def test_a_one_holder_move_is_counted_and_each_rank_lists_its_own_blocks(case):

    src_text, src, dst_text, dst, first = case
    shape, itemsize = (50257, 8192), 4
    saved = mc.Mesh(src_text)
    here = mc.Mesh(dict(mc.Mesh(dst_text).axes), ranks=range(first, first + saved.size))
    p = mc.plan(saved, shape, src, dst, dst_mesh=here)
    (step,) = p.steps
    assert step.transfers == ()                     # nothing listed: counted
    assert p.recv_bytes == p.lower_bound_bytes
    pos = {r: i for i, r in enumerate(p.ranks)}
    picks = sorted({saved.ranks[0], saved.ranks[-1], here.ranks[0], here.ranks[-1],
                    here.ranks[here.size // 2 + 3]})
    lists = {r: step.rank_transfers(r) for r in picks}
    for r, mine in lists.items():       # a rank's own blocks add up to its counted bytes
        sent = sum(t.numel for t in mine if t.src == r and t.dst != r) * itemsize
        got = sum(t.numel for t in mine if t.dst == r and t.src != r) * itemsize
        assert (sent, got) == (p.send_bytes[pos[r]], p.recv_bytes[pos[r]]), r
    for s, sends in lists.items():      # a sender and a receiver name the same blocks
        for r, gets in lists.items():
            if s != r:
                assert ([t for t in sends if t.src == s and t.dst == r]
                        == [t for t in gets if t.src == s and t.dst == r])


def test_a_counted_move_runs_exactly_in_the_simulator():
    """Small meshes go through the same counted path: every rank's output is its block."""
    saved = mc.Mesh("a=2 b=3")
    here = mc.Mesh("c=3 d=2", ranks=[3, 4, 5, 6, 7, 8])          # ranks 3-5 in both
    shape = (7, 10)
    x = torch.arange(70.0).reshape(shape)
    p = mc.plan(saved, shape, "(b v) (a e)", "(c e) (d v)", dst_mesh=here)
    assert p.steps[-1].transfers == ()
    out = execute(p, mc.sim.scatter(x, saved, "(b v) (a e)")).outputs
    for r in here.ranks:
        want = mc.sim.scatter(x, here, "(c e) (d v)")[here.ranks.index(r)]
        assert torch.equal(out[p.ranks.index(r)], want)
