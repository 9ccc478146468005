"""meshcomm.executors.sim.collectives: each collective vs a hand-written reference and its byte formula."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshcomm.core.errors import MeshAxisError, ShapeError
from meshcomm.core.mesh import Mesh
from meshcomm.core.reduce_ops import REDUCE_OPS, chunk_sizes, op_reduce
from meshcomm.executors.sim.collectives import (SimResult, all_gather, all_reduce, all_to_all,
                                                broadcast, collective_permute, reduce_scatter,
                                                send_recv)
from meshcomm.planner import Transfer


def whole(src: int, dst: int, x: torch.Tensor) -> Transfer:
    """The Transfer of all of rank `src`'s tensor `x` to `dst`."""
    return Transfer(src, dst, tuple(tuple(range(n)) for n in x.shape))

MESH = Mesh("dp=2 tp=2")
TP, DP, FLAT = MESH.groups("tp"), MESH.groups("dp"), MESH.groups("dp", "tp")
GROUPS = pytest.mark.parametrize("groups", [TP, DP, FLAT], ids=["tp", "dp", "flat"])


def ranks(shape: tuple[int, ...] = (4, 2), n: int = 4, dtype=torch.float32) -> list[torch.Tensor]:
    """Rank r holds arange + 100 r, so every element says where it came from."""
    numel = torch.Size(shape).numel()
    return [(torch.arange(numel) + 100 * r).reshape(shape).to(dtype) for r in range(n)]


def same(a: list[torch.Tensor] | tuple[torch.Tensor, ...], b) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_groups_come_from_the_mesh() -> None:
    assert (TP, DP, FLAT) == (((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2, 3),))


# -- all_gather -------------------------------------------------------------------------


@GROUPS
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_matches_cat_in_group_order(groups, dim) -> None:
    xs = ranks()
    r = all_gather(xs, groups, dim)
    for group in groups:
        for rank in group:
            assert torch.equal(r.outputs[rank], torch.cat([xs[m] for m in group], dim))
    g = len(groups[0])
    assert r.send_bytes == r.recv_bytes == ((g - 1) * 32,) * 4  # 8 float32 per rank


def test_all_gather_literal_bytes() -> None:
    r = all_gather([torch.zeros(4), torch.ones(4)], [(0, 1)])
    assert r.send_bytes == (16, 16) and r.recv_bytes == (16, 16)


def test_all_gather_v_form() -> None:
    xs = [torch.full((n, 2), float(n)) for n in (1, 2, 3)]
    r = all_gather(xs, [(2, 0, 1)], dim=0)
    want = torch.tensor([[3.0] * 2] * 3 + [[1.0] * 2] + [[2.0] * 2] * 2)
    assert same(r.outputs, [want] * 3)
    # blocks of 8, 16, 24 bytes: send (g-1) L_i, receive the others' blocks
    assert r.send_bytes == (16, 32, 48) and r.recv_bytes == (40, 32, 24)


def test_ranks_in_no_group_pass_through() -> None:
    xs = ranks(n=3)
    r = all_gather(xs, [(0, 1)])
    assert torch.equal(r.outputs[2], xs[2]) and r.outputs[2] is not xs[2]
    assert r.send_bytes[2] == r.recv_bytes[2] == 0


# -- reduce_scatter / all_reduce / op_reduce ------------------------------------------------


def reduce_by_hand(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    if op in ("max", "min"):
        stacked = torch.stack(tensors)
        return stacked.amax(0) if op == "max" else stacked.amin(0)
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total / len(tensors) if op == "avg" else total


@GROUPS
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_scatter_every_op(groups, op) -> None:
    xs = [x * (-1) ** r for r, x in enumerate(ranks((8, 3)))]
    r = reduce_scatter(xs, groups, 0, op)
    for group in groups:
        c = 8 // len(group)
        for j, rank in enumerate(group):
            want = reduce_by_hand([xs[m][j * c:(j + 1) * c] for m in group], op)
            assert torch.equal(r.outputs[rank], want)
    g, total = len(groups[0]), 8 * 3 * 4
    own = total // g
    assert r.send_bytes == (total - own,) * 4 and r.recv_bytes == ((g - 1) * own,) * 4


def test_reduce_scatter_uneven_chunks_follow_torch_chunk() -> None:
    xs = [torch.arange(5.0) * (r + 1) for r in range(4)]
    r = reduce_scatter(xs, FLAT, 0, "sum")
    assert [o.tolist() for o in r.outputs] == [[0.0, 10.0], [20.0, 30.0], [40.0], []]
    # T = 20 bytes, own chunks C = (8, 8, 4, 0): send T - C, receive 3 C
    assert r.send_bytes == (12, 12, 16, 20) and r.recv_bytes == (24, 24, 12, 0)
    assert chunk_sizes(5, 4) == (2, 2, 1, 0) and len(torch.arange(5).chunk(4)) == 3


def test_reduce_scatter_explicit_splits_along_dim_1() -> None:
    xs = ranks((2, 4), n=2)
    r = reduce_scatter(xs, [(1, 0)], dim=1, op="max", splits=[3, 1])
    assert torch.equal(r.outputs[1], xs[1][:, :3]) and torch.equal(r.outputs[0], xs[1][:, 3:])
    assert r.send_bytes == (24, 8) and r.recv_bytes == (8, 24)  # T = 32, C = (8, 24)


@GROUPS
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_all_reduce_every_op(groups, op) -> None:
    xs = [x * (-1) ** r for r, x in enumerate(ranks())]
    r = all_reduce(xs, groups, op)
    for group in groups:
        want = reduce_by_hand([xs[m] for m in group], op)
        assert all(torch.equal(r.outputs[m], want) for m in group)
    g = len(groups[0])
    assert r.send_bytes == r.recv_bytes == (2 * (g - 1) * 32 // g,) * 4


def test_all_reduce_ring_bytes_uneven() -> None:
    r = all_reduce([torch.ones(5)] * 4, FLAT)
    # T = 20, C = (8, 8, 4, 0): (T - C) + 3 C each way
    assert r.send_bytes == r.recv_bytes == (36, 36, 28, 20)
    assert all_reduce([torch.ones(4)] * 2, [(0, 1)]).send_bytes == (16, 16)


def test_op_reduce_runs_left_to_right() -> None:
    big = [torch.tensor([1e20]), torch.tensor([-1e20]), torch.tensor([1.0])]
    assert op_reduce(big, "sum").item() == 1.0
    assert op_reduce(big[::-1], "sum").item() == 0.0  # floats are not associative
    r = all_reduce(big, [(0, 1, 2)])
    assert [o.item() for o in r.outputs] == [1.0] * 3
    assert op_reduce([torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])], "avg").tolist() == [
        2.0, 3.5]


def test_op_reduce_returns_a_new_tensor() -> None:
    x = torch.ones(3)
    out = op_reduce([x], "max")
    out += 1
    assert x.tolist() == [1.0] * 3


# -- all_to_all -------------------------------------------------------------------------


@GROUPS
@pytest.mark.parametrize("split_dim,concat_dim", [(0, 0), (0, 1), (1, 0), (-1, -1)])
def test_all_to_all_equal_form(groups, split_dim, concat_dim) -> None:
    xs = ranks((4, 4))
    r = all_to_all(xs, groups, split_dim, concat_dim)
    g = len(groups[0])
    for group in groups:
        for j, rank in enumerate(group):
            want = torch.cat([xs[m].chunk(g, split_dim)[j] for m in group], concat_dim)
            assert torch.equal(r.outputs[rank], want)
    assert r.send_bytes == r.recv_bytes == ((g - 1) * 64 // g,) * 4


def test_all_to_all_v_form_shared_splits() -> None:
    xs = [torch.arange(3.0), torch.arange(3.0) + 10]
    r = all_to_all(xs, [(0, 1)], input_splits=[1, 2])
    assert [o.tolist() for o in r.outputs] == [[0.0, 10.0], [1.0, 2.0, 11.0, 12.0]]
    assert r.send_bytes == (8, 4) and r.recv_bytes == (4, 8)


def test_all_to_all_v_form_per_rank_splits() -> None:
    xs = [torch.arange(3.0), torch.arange(2.0) + 10, torch.arange(4.0) + 20]
    splits = [[0, 3], [], [1, 3]]  # rank 1 is in no group
    r = all_to_all(xs, [(0, 2)], input_splits=splits, output_splits=[[0, 1], [], [3, 3]])
    assert [o.tolist() for o in r.outputs] == [[20.0], [10.0, 11.0], [0, 1, 2, 21, 22, 23]]
    assert r.send_bytes == (12, 0, 4) and r.recv_bytes == (4, 0, 12)


def test_all_to_all_output_splits_mismatch_names_rank_and_position() -> None:
    xs = [torch.arange(3.0), torch.arange(3.0)]  # each sends 1 to position 0, 2 to position 1
    msg = ("all_to_all: output_splits for rank 0 is [1, 2] but position 1 (rank 1) sends it 1,"
           " not 2; fix: use [1, 1] (what input_splits sends it)")
    with pytest.raises(ShapeError, match=re.escape(msg)):
        all_to_all(xs, [(0, 1)], input_splits=[1, 2], output_splits=[[1, 2], [2, 2]])
    with pytest.raises(ShapeError, match=re.escape("rank 1 is [2] but it has 1 sizes for 2")):
        all_to_all(xs, [(0, 1)], input_splits=[1, 2], output_splits=[[1, 1], [2]])
    with pytest.raises(ShapeError, match=re.escape("rank 1 is [1, 1] but position 0 (rank 0)")):
        all_to_all(xs, [(0, 1)], input_splits=[1, 2], output_splits=[1, 1])  # shared form


# -- collective_permute / broadcast -----------------------------------------------------------


@GROUPS
def test_permute_shift(groups) -> None:
    xs = ranks()
    r = collective_permute(xs, groups, shift=1)
    for group in groups:
        g = len(group)
        for i, rank in enumerate(group):
            assert torch.equal(r.outputs[group[(i + 1) % g]], xs[rank])
    assert r.send_bytes == r.recv_bytes == (32,) * 4


def test_permute_pairs_idle_positions_get_zeros() -> None:
    xs = ranks((2,), n=4)
    r = collective_permute(xs, FLAT, [(0, 2), (1, 1), (0, 3)])
    assert same(r.outputs, [torch.zeros(2), xs[1], xs[0], xs[0]])
    assert r.send_bytes == (16, 0, 0, 0) and r.recv_bytes == (0, 0, 8, 8)


def test_permute_positions_are_per_group() -> None:
    r = collective_permute(ranks((1,)), DP, [(1, 0)])
    assert [o.item() for o in r.outputs] == [200.0, 300.0, 0.0, 0.0]


@pytest.mark.parametrize("src,send,recv", [(0, (8, 8, 8, 0), (0, 8, 8, 8)),
                                           (2, (8, 0, 8, 8), (8, 8, 0, 8))])
def test_broadcast_chain_bytes(src, send, recv) -> None:
    xs = ranks((2,))
    r = broadcast(xs, FLAT, src)
    assert same(r.outputs, [xs[src]] * 4)
    assert r.send_bytes == send and r.recv_bytes == recv


def test_broadcast_per_group() -> None:
    r = broadcast(ranks((1,)), TP, src=1)
    assert [o.item() for o in r.outputs] == [100.0, 100.0, 300.0, 300.0]
    assert r.send_bytes == (0, 4, 0, 4) and r.recv_bytes == (4, 0, 4, 0)


# -- send_recv / SimResult ----------------------------------------------------------------


def test_send_recv_blocks_and_bytes() -> None:
    xs = ranks((2, 4), n=2)
    ts = [Transfer(0, 1, ((0, 1), (1, 2))), Transfer(1, 1, ((0,), (0, 1, 2, 3))),
          whole(1, 0, xs[1])]
    r = send_recv(xs, ts)
    assert same(r.received[0], [xs[1]])
    assert same(r.received[1], [xs[0][:, 1:3], xs[1][:1]])
    assert r.send_bytes == (16, 32) and r.recv_bytes == (32, 16)
    trace = SimResult.noop(xs).then(SimResult(xs, r.send_bytes, r.recv_bytes))
    assert trace.send_bytes == (16, 32)


def test_then_sums_bytes_and_keeps_the_last_outputs() -> None:
    xs = ranks((2,), n=2)
    a = all_gather(xs, [(0, 1)])
    b = reduce_scatter(a.outputs, [(0, 1)], op="avg")
    t = a.then(b)
    assert same(t.outputs, b.outputs) and same(t.outputs, xs)
    assert t.send_bytes == (8 + 8, 8 + 8) and t.recv_bytes == (16, 16)
    with pytest.raises(ShapeError, match="this result has 2 ranks but the next has 4"):
        a.then(all_gather(ranks(), TP))


COLLECTIVES = {
    "all_gather": lambda xs: all_gather(xs, TP, 1),
    "reduce_scatter": lambda xs: reduce_scatter(xs, FLAT, 0, "avg"),
    "all_reduce": lambda xs: all_reduce(xs, DP, "max"),
    "all_to_all": lambda xs: all_to_all(xs, FLAT, 0, 1),
    "permute": lambda xs: collective_permute(xs, TP, [(0, 0)]),
    "broadcast": lambda xs: broadcast(xs, DP, 1),
    "send_recv": lambda xs: SimResult(
        [b for (b,) in send_recv(xs, [whole(r, r, xs[r]) for r in range(4)]).received],
        (0,) * 4, (0,) * 4),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_outputs_are_fresh_and_inputs_untouched(name) -> None:
    xs = ranks()
    before = [x.clone() for x in xs]
    r = COLLECTIVES[name](xs + [])
    for out in r.outputs:
        out.add_(1000)
    assert same(xs, before)
    ptrs = [o.untyped_storage().data_ptr() for o in r.outputs if o.numel()]
    assert len(set(ptrs)) == len(ptrs)


# -- errors -----------------------------------------------------------------------------


ERRORS = [
    (lambda: all_gather(ranks(), [(0, 1), (1, 2)]), MeshAxisError,
     "all_gather: rank 1 is in groups[1] = (1, 2) and in groups[0]; groups must be disjoint."),
    (lambda: all_gather(ranks(), [(0, 4)]), MeshAxisError,
     "all_gather: groups[0] = (0, 4) names rank 4 but xs has 4 ranks (0..3); fix: build groups"),
    (lambda: all_reduce(ranks(), [(0, 0)]), MeshAxisError, "rank 0 is in groups[0] = (0, 0) twice"),
    (lambda: all_gather([torch.ones(2, 3), torch.ones(2, 4)], [(0, 1)], 0), ShapeError,
     "all_gather: in groups[0] rank 1 has shape (2, 4) but rank 0 has (2, 3); shapes may differ"
     " only along dim=0"),
    (lambda: all_gather([torch.ones(2), torch.ones(2, dtype=torch.int64)], [(0, 1)]), ShapeError,
     "all_gather: groups[0] mixes torch.float32 on cpu (rank 0) with torch.int64 on cpu (rank 1)"),
    (lambda: all_gather([torch.tensor(1.0)] * 2, [(0, 1)]), ShapeError,
     "all_gather: dim=0 is not a dim of a 0-d tensor (valid: none, the tensor is 0-d)"),
    (lambda: all_gather(torch.ones(2), [(0, 1)]), ShapeError,
     "all_gather: xs must be a list of per-rank tensors, got Tensor"),
    (lambda: reduce_scatter(ranks(), TP, 0, "summ"), ShapeError,
     "reduce_scatter: unknown reduce op 'summ'; ops are sum, avg, max, min\n"
     '  fix: did you mean "sum"?'),
    (lambda: all_reduce(ranks(dtype=torch.int64), TP, "avg"), ShapeError,
     "all_reduce: op 'avg' needs a floating dtype, got torch.int64"),
    (lambda: reduce_scatter(ranks(), TP, 0, splits=[1, 2]), ShapeError,
     "reduce_scatter: splits=[1, 2] for groups[0] sums to 3; expected 2 sizes, one per group"
     " position, that sum to the dim size 4"),
    (lambda: reduce_scatter(ranks(), TP, 0, splits=[4]), ShapeError,
     "reduce_scatter: splits=[4] for groups[0] is not 2 sizes >= 0; expected 2 sizes"),
    (lambda: reduce_scatter([torch.ones(2), torch.ones(3)], [(0, 1)]), ShapeError,
     "every rank of a group needs the same shape"),
    (lambda: all_to_all(ranks((3,)), TP), ShapeError,
     "all_to_all: rank 0 has size 3 along split_dim=0, not divisible by the size 2 of groups[0];"
     " fix: pad dim 0 to a multiple of 2, or pass input_splits"),
    (lambda: all_to_all(ranks((3,)), TP, input_splits=[1, 1]), ShapeError,
     "all_to_all: input_splits=[1, 1] for rank 0 sums to 2; expected 2 sizes, one per group"
     " position, that sum to the dim size 3"),
    (lambda: all_to_all([torch.ones(2, 2), torch.ones(2, 4)], [(0, 1)], 0, 0), ShapeError,
     "all_to_all: rank 0 would concatenate a block of shape (1, 2) from rank 0 with one of shape"
     " (1, 4) from rank 1 along concat_dim=0"),
    (lambda: all_to_all(ranks((4,)), TP, input_splits=[[1, 3], 2]), ShapeError,
     "is neither one list of sizes shared by every rank nor one list per rank (4 ranks)"),
    (lambda: collective_permute(ranks(), TP, [(0, 1)], shift=1), ShapeError,
     "collective_permute: give exactly one of pairs=[(src, dst), ...] or shift=k"),
    (lambda: collective_permute(ranks(), TP, [(0, 1), (1, 1)]), ShapeError,
     "collective_permute: position 1 is the destination of more than one pair"),
    (lambda: collective_permute(ranks(), TP, [(0, 2)]), MeshAxisError,
     "collective_permute: pair (0, 2) is not (src, dst) with positions in 0..1 of groups[0]"),
    (lambda: broadcast(ranks(), TP, src=2), MeshAxisError,
     "broadcast: src=2 is not a position of groups[0] = (0, 1) (0..1)"),
    (lambda: send_recv(ranks(), [Transfer(0, 4, ((0,),), ())]), MeshAxisError,
     "send_recv: transfers[0] = Transfer(src=0, dst=4, src_index=((0,),), dst_index=()) is not a"
     " Transfer between ranks of xs (0..3)"),
    (lambda: send_recv(ranks((2,)), [Transfer(0, 1, ((0,), (0,)), ())]), ShapeError,
     "send_recv: transfers[0] = Transfer(src=0, dst=1, src_index=((0,), (0,)), dst_index=()) does"
     " not index rank 0's tensor of shape (2,): src_index needs one tuple of positions per dim"),
    (lambda: send_recv(ranks((2,)), [Transfer(0, 1, ((2,),), ())]), ShapeError,
     "each in 0..size-1"),
    (lambda: op_reduce([torch.ones(2), torch.ones(3)], "sum"), ShapeError,
     "op_reduce: tensors[1] is torch.float32 (3,) on cpu but tensors[0] is torch.float32 (2,)"),
]


@pytest.mark.parametrize("call,kind,msg", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors(call, kind, msg) -> None:
    with pytest.raises(kind, match=re.escape(msg)):
        call()


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        broadcast(ranks(), TP, src=-1)


# -- properties -------------------------------------------------------------------------


@st.composite
def rank_lists(draw, min_g: int = 1):
    """A flat rank list with random groups (a random split of a random permutation)."""
    n = draw(st.integers(min_g, 6))
    perm = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    groups = [tuple(perm[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
    shape = (draw(st.integers(0, 3)), draw(st.integers(1, 3)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randint(-50, 50, shape, generator=gen).float() for _ in range(n)]
    return xs, groups


def tile(xs: list[torch.Tensor], groups, dim: int) -> list[torch.Tensor]:
    """Each rank's tensor repeated g times along `dim`, so it splits into g equal blocks."""
    g_of = {r: len(g) for g in groups for r in g}
    return [torch.cat([x] * g_of.get(r, 1), dim) for r, x in enumerate(xs)]


@settings(max_examples=60, deadline=None)
@given(rank_lists(), st.integers(0, 1))
def test_all_gather_then_reduce_scatter_avg_is_identity(case, dim) -> None:
    xs, groups = case
    gathered = all_gather(xs, groups, dim).outputs
    back = reduce_scatter(gathered, groups, dim, "sum")
    g_of = {r: len(g) for g in groups for r in g}
    assert same([o / g_of[r] for r, o in enumerate(back.outputs)], xs)
    assert same(reduce_scatter(gathered, groups, dim, "avg").outputs, xs)


@settings(max_examples=60, deadline=None)
@given(rank_lists(), st.integers(0, 1), st.integers(0, 1), st.data())
def test_all_to_all_inverse_is_identity(case, split_dim, concat_dim, data) -> None:
    xs, groups = case
    xs = tile(xs, groups, split_dim)
    there = all_to_all(xs, groups, split_dim, concat_dim)
    back = all_to_all(there.outputs, groups, concat_dim, split_dim)
    assert same(back.outputs, xs)
    assert there.send_bytes == back.recv_bytes


NAMES = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "v_all_to_all", "permute",
         "broadcast", "send_recv"]


@settings(max_examples=80, deadline=None)
@given(rank_lists(), st.sampled_from(NAMES), st.data())
def test_bytes_sent_equal_bytes_received(case, name, data) -> None:
    xs, groups = case
    n, draw = len(xs), data.draw
    if name == "v_all_to_all":
        splits = [[0]] * n
        for g in groups:
            for r in g:
                splits[r] = draw(st.lists(st.integers(0, 2), min_size=len(g), max_size=len(g)))
        r = all_to_all([torch.arange(float(sum(s))) for s in splits], groups, input_splits=splits)
    elif name == "send_recv":
        pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                                        st.integers(0, 3))))
        ts = [Transfer(s, d, (tuple(range(min(k, xs[s].shape[0]))),)
                       + tuple(tuple(range(m)) for m in xs[s].shape[1:]), ()) for s, d, k in pairs]
        r = send_recv(xs, ts)
    else:
        r = {"all_gather": lambda: all_gather(xs, groups, 0),
             "reduce_scatter": lambda: reduce_scatter(xs, groups, 1, "min"),
             "all_reduce": lambda: all_reduce(xs, groups, "sum"),
             "all_to_all": lambda: all_to_all(tile(xs, groups, 1), groups, 1, 0),
             "permute": lambda: collective_permute(xs, groups, shift=draw(st.integers(-3, 3))),
             "broadcast": lambda: broadcast(xs, groups, 0)}[name]()
    assert sum(r.send_bytes) == sum(r.recv_bytes)
    assert all(b >= 0 for b in r.send_bytes + r.recv_bytes)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_avg_divides_the_real_and_imaginary_parts(dtype: torch.dtype) -> None:
    """avg over 28 ranks: the left-fold sum, then each part divided by 28 (torch's complex
    division by a real number rounds otherwise, and every executor divides part by part)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=gen, dtype=dtype) * 1000 for _ in range(28)]
    got = all_reduce(xs, [tuple(range(28))], op="avg").outputs[5]
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    want = torch.view_as_complex(torch.view_as_real(total) / 28)
    assert torch.equal(got, want)
    assert not torch.equal(total / 28, want)      # the rounding this test is about
