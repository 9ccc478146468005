"""The engine of issued plans (`meshcomm.executors.distributed.execute`) on 8 gloo ranks:
`prepare` once, `issue` now, `Handle.wait()` later; a chain of issued reshards overlaps a
slow wire with compute; permutes are point-to-point; a hand-off between two meshes trains,
its gradients equal to one process. One spawn of 8 processes runs every case.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.core.errors import ShapeError
from meshcomm.executors.distributed import Handle, prepare, wire
from meshcomm.executors.distributed.rows import misfit, rows_of
from meshcomm.executors.sim import execute as sim_execute
from meshcomm.executors.sim import scatter
from meshcomm.planner.values import CostModel
from meshcomm.runtime.bind import BoundMesh

from conftest import ints, ranks_fixture, slow_wire

MESH = mc.Mesh("dp=2 tp=4")
STAGE0 = mc.Mesh("dp=2 tp=2")                      # ranks 0-3
STAGE1 = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])       # ranks 4-7
CHAIN = [((8, 12), "(dp b) (tp h)", "b (tp h)"), ((8, 12), "(dp b) h", "b h"),
         ((16, 4), "(tp dp b) h", "(dp tp b) h"), ((8, 8), "b h | sum(tp)", "(tp b) h"),
         ((8, 12), "(tp b) h | avg(dp)", "b (tp h)")]
DELAY_S = 0.25          # the slow wire: a collective lands this long after it is issued
N_OVERLAP = 4


def check_issue_and_wait(bound: BoundMesh) -> list[str]:
    """Several plans issued together (one bucket where they share a shape), waited once: each
    output equals the simulator's; a second wait gives the same tensors."""
    problems = []
    plans = [mc.plan(MESH, shape, src, dst) for shape, src, dst in CHAIN]
    xs = [ints(shape, k) for k, (shape, _, _) in enumerate(CHAIN)]
    locals_ = [scatter(x, MESH, p.src)[bound.rank] for x, p in zip(xs, plans)]
    handle = prepare(plans, bound).issue(locals_)
    if not isinstance(handle, Handle):
        problems.append(f"issue gave a {type(handle).__name__}")
    outs = handle.wait()
    for p, x, out in zip(plans, xs, outs):
        want = sim_execute(p, scatter(x, MESH, p.src)).outputs[bound.rank]
        if out is None or not torch.equal(out, want):
            problems.append(f'"{p.src}" -> "{p.dst}": differs from sim')
    if any(a is not b for a, b in zip(outs, handle.wait())):
        problems.append("a second wait gave other tensors")
    return problems


def check_permute_is_point_to_point(bound: BoundMesh) -> list[str]:
    """A collective_permute sends one message to each destination and receives one: a p2p
    call of at most 2 messages per rank (it was a masked all_to_all over the whole group)."""
    p = mc.plan(MESH, (16, 4), "(dp tp b) h", "(tp dp b) h")
    if [s.kind for s in p.collectives] != ["collective_permute"]:
        return [f"expected one permute: {p}"]
    x = ints((16, 4), 3)
    with wire.recording() as heard:
        got = mc.executors.distributed.execute(p, scatter(x, MESH, p.src)[bound.rank], bound)
    problems = [] if torch.equal(got, scatter(x, MESH, p.dst)[bound.rank]) else ["wrong shard"]
    kinds = [(w.kind, w.group) for w, _ in heard]
    if len(kinds) != 1 or kinds[0][0] != "p2p" or kinds[0][1] > 2:
        problems.append(f"rank {bound.rank} made {kinds}")
    if sum(w.received * size for w, size in heard) != p.recv_bytes[bound.rank]:
        problems.append("received bytes differ from the plan's")
    return problems


def check_overlap(bound: BoundMesh) -> dict[str, float]:
    """N all_gathers each followed by DELAY_S of compute: issued and waited at once they
    take N (comm + compute); with each next one issued before this one's compute, about
    N max(comm, compute)."""
    p = mc.plan(MESH, (8, 12), "(dp b) (tp h)", "b (tp h)")
    x = scatter(ints((8, 12), 1), MESH, p.src)[bound.rank]
    ready = prepare([p], bound)
    mp = pytest.MonkeyPatch()
    try:
        slow_wire(mp, DELAY_S)
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(N_OVERLAP):
            ready.issue([x]).wait()
            time.sleep(DELAY_S)                   # compute
        serial = time.perf_counter() - start
        torch.distributed.barrier()
        start = time.perf_counter()
        handle = ready.issue([x])
        for i in range(N_OVERLAP):
            y = handle.wait()[0]
            if i + 1 < N_OVERLAP:
                handle = ready.issue([x])         # the next one travels while this computes
            time.sleep(DELAY_S)                   # compute on y
        overlapped = time.perf_counter() - start
    finally:
        mp.undo()
    assert y is not None
    return {"serial": serial, "overlapped": overlapped}


# -- padded rows: FSDP2's flat buffer -------------------------------------------------------
ROWS_MESH = mc.Mesh("rep=2 dp=4")
# (shape, split dim): even, uneven, empty positions; dim 1 as a row-parallel weight's
ROWS = [((8, 6), 0), ((10, 3), 0), ((3, 10), 1), ((3, 5), 0), ((2, 7), 0), ((1, 4), 0),
        ((6,), 0), ((2, 3, 6), 1)]


FSDP_LIKE = CostModel(trees=False, latency_s=0.0)


def _rows_plans(src_of: Any, dst_of: Any) -> list[Any]:
    out = []
    for shape, d in ROWS:
        use = mc.Layout(" ".join(f"a{i}" for i in range(len(shape))))
        out.append(mc.plan(ROWS_MESH, shape, src_of(use, d), dst_of(use, d),
                           dtype=torch.float64,
                           cost_model=FSDP_LIKE))   # as FSDP's plans: no trees, on bytes
    return out


def check_padded_rows(bound: BoundMesh) -> list[str]:
    """Gather and scatter of mixed even and uneven dim-0 shards as one padded buffer each: one
    collective per step for the whole bucket, each output equal to the simulator's; float32
    inputs are cast into the float64 buffer; `steps=1` leaves HSDP's all_reduce to
    `advance()`."""
    problems = []
    gathers = _rows_plans(lambda u, d: u.split(d, "dp"), lambda u, d: u)
    xs = [ints(p.shape, k, torch.float64) for k, p in enumerate(gathers)]
    locals_ = [scatter(x, ROWS_MESH, p.src)[bound.rank].float() for x, p in zip(xs, gathers)]
    with wire.recording() as heard:
        outs = prepare(gathers, bound, pad_rows=True).issue(locals_).wait()
    if [w.kind for w, _ in heard] != ["all_gather"]:
        problems.append(f"gather: calls {[w.kind for w, _ in heard]}")
    for p, x, out in zip(gathers, xs, outs):
        if out is None or out.dtype != torch.float64 or not torch.equal(out, x):
            problems.append(f'gather "{p.src}" -> "{p.dst}" {p.shape}: wrong output')
    reduces = _rows_plans(lambda u, d: u.pending("avg", ["dp", "rep"]),
                          lambda u, d: u.split(d, "dp"))
    grads = [ints(p.shape, 10 + k + bound.rank, torch.float64) for k, p in enumerate(reduces)]
    outs = prepare(reduces, bound, pad_rows=True).issue(grads).wait()
    # the planner reduces (2, 7) and (1, 4) otherwise (all_to_alls, an all_reduce): those
    # run their own plans in buckets of their own; the others share one padded buffer
    fits = [p for p in reduces if misfit(p) is None]
    if [p.shape for p in fits] != [(8, 6), (10, 3), (3, 10), (3, 5), (6,), (2, 3, 6)]:
        problems.append(f"fitting: {[p.shape for p in fits]}")
    # one reduce_scatter over dp for them all; their all_reduce over rep waits for advance()
    with wire.recording() as heard:
        handle = prepare(fits, bound, pad_rows=True).issue(
            [g for g, p in zip(grads, reduces) if p in fits], steps=1)
        first = [(w.kind, w.group) for w, _ in heard]
        more = handle.advance()
        second = [(w.kind, w.group) for w, _ in heard[len(first):]]
        handle.wait()
    if first != [("reduce_scatter", 4)] or second != [("all_reduce", 2)] or more:
        problems.append(f"reduce: calls {first} then {second}")
    for k, (p, out) in enumerate(zip(reduces, outs)):
        total = sum(ints(p.shape, 10 + k + r, torch.float64) for r in range(8)) / 8
        want = scatter(total, ROWS_MESH, p.dst)[bound.rank]
        if out is None or not torch.equal(out, want):
            problems.append(f'reduce "{p.src}" -> "{p.dst}" {p.shape}: wrong output')
    return problems


# -- a hand-off between two meshes trains -----------------------------------------------------
def _stage_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 6, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64))


def _batch() -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def one_process_grads() -> dict[str, torch.Tensor]:
    """The two-stage model on the whole batch in one process."""
    w0, w1 = (w.clone().requires_grad_() for w in _stage_weights())
    x = _batch().requires_grad_()
    h = torch.tanh(x @ w0)
    (torch.tanh(h) @ w1).pow(2).sum().backward()
    return {"w0": w0.grad, "w1": w1.grad, "x": x.grad}


def check_handoff(a: BoundMesh, b: BoundMesh) -> dict[str, Any]:
    """Stage 0 on ranks 0-3 ("(dp b) h", replicated over tp), stage 1 on ranks 4-7 ("(tp b)
    h"): activations cross by `reshard(..., dst_mesh=b)`, gradients come back by its reverse
    plan. Each rank's gradients (summed over ranks after) must equal one process."""
    w0, w1 = (w.clone().requires_grad_() for w in _stage_weights())
    shape, dtype = (8, 6), torch.float64
    if a.in_mesh:
        x = scatter(_batch(), STAGE0, "(dp b) h")[a.rank].clone().requires_grad_()
        h = torch.tanh(x @ w0)
        token = mc.reshard(h, a, "(dp b) h", "(tp b) h", dst_mesh=b)
        assert token is not None and token.numel() == 0 and token.requires_grad
        token.sum().backward()                  # receives h's gradient from stage 1
        return {"w0": w0.grad, "x": x.grad, "tp": STAGE0.coords(a.rank)["tp"]}
    y = mc.reshard(None, a, "(dp b) h", "(tp b) h", dst_mesh=b, shape=shape, dtype=dtype,
                   requires_grad=True)
    assert y is not None and y.requires_grad
    (torch.tanh(y) @ w1).pow(2).sum().backward()   # sends y's gradient back to stage 0
    return {"w1": w1.grad}


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH)
    a, b = mc.init_mesh(STAGE0), mc.init_mesh(STAGE1)
    return {"issue": check_issue_and_wait(bound),
            "permute": check_permute_is_point_to_point(bound),
            "overlap": check_overlap(bound),
            "rows": check_padded_rows(mc.init_mesh(ROWS_MESH)),
            "handoff": check_handoff(a, b)}


eight = ranks_fixture(eight_ranks, 8)


def test_issued_plans_equal_the_simulator(eight: list[dict[str, Any]]) -> None:
    problems = [p for r in eight for p in r["issue"]]
    assert not problems, "\n".join(problems[:10])


def test_padded_rows_run_one_collective_per_step_and_equal_the_simulator(
        eight: list[dict[str, Any]]) -> None:
    problems = [p for r in eight for p in r["rows"]]
    assert not problems, "\n".join(problems[:10])


def test_pad_rows_buckets_the_plans_that_fit_and_checks_shapes() -> None:
    """Rows plans share one padded bucket; another plan gets a bucket of its own (its own
    plan runs); an input of the wrong shape is refused before any communication."""
    bound = BoundMesh(MESH, "gloo", torch.device("cpu"), 1, {("dp",): "g-dp", ("tp",): "g-tp"})
    plans = [mc.plan(MESH, (8, 4), "(dp b) h", "b h"),
             mc.plan(MESH, (8, 4), "(dp b) h", "b (tp h)"),      # also splits h: not rows
             mc.plan(MESH, (6,), "(dp b)", "b"),
             mc.plan(MESH, (8, 4), "(tp dp b) h", "(dp b) h")]    # a send_recv: not rows
    assert [misfit(p) is None for p in plans] == [True, False, True, False]
    assert misfit(mc.plan(MESH, (8, 4), "b (dp h)", "b h")) is None     # rows of dim 1
    ready = prepare(plans, bound, pad_rows=True)
    assert [b for b, r in zip(ready.buckets, ready.rows) if r is not None] == [(0, 2)]
    assert sorted(b for b, r in zip(ready.buckets, ready.rows) if r is None) == [(1,), (3,)]
    assert [c.kind for c in ready.calls()][:1] == ["all_gather"]
    with pytest.raises(ShapeError, match=r"tensor 0 .* this rank holds \(4, 4\)"):
        ready.issue([torch.zeros(3, 4), torch.zeros(4, 1), torch.zeros(3), torch.zeros(8, 2)])
    with pytest.raises(ValueError, match="cannot run as padded rows: its first step"):
        rows_of([plans[3]], bound)
    with pytest.raises(ValueError, match="cannot run as padded rows: .*2 axes, not one"):
        rows_of([mc.plan(MESH, (8, 4), "(dp tp b) h", "b h")], bound)


def test_a_permute_is_two_point_to_point_messages_at_most(eight: list[dict[str, Any]]) -> None:
    problems = [p for r in eight for p in r["permute"]]
    assert not problems, "\n".join(problems[:10])


def test_issued_reshards_overlap_a_slow_wire_with_compute(eight: list[dict[str, Any]]) -> None:
    """Serial: N (delay + compute) = 2 s; overlapped: about (N + 1) max = 1.25 s."""
    for r in eight:
        serial, overlapped = r["overlap"]["serial"], r["overlap"]["overlapped"]
        assert serial >= 2 * N_OVERLAP * DELAY_S * 0.95, r["overlap"]
        assert overlapped < 0.75 * serial, r["overlap"]


def test_a_handoff_between_meshes_trains_as_one_process(eight: list[dict[str, Any]]) -> None:
    want = one_process_grads()
    stage0, stage1 = eight[:4], [r["handoff"] for r in eight[4:]]
    # w0: each stage-0 rank holds its dp half of the batch (twice: tp replicas)
    w0 = sum(r["handoff"]["w0"] for r in stage0 if r["handoff"]["tp"] == 0)
    torch.testing.assert_close(w0, want["w0"])
    torch.testing.assert_close(sum(r["w1"] for r in stage1), want["w1"])
    for r in stage0:
        rank = eight.index(r)
        torch.testing.assert_close(r["handoff"]["x"],
                                   scatter(want["x"], STAGE0, "(dp b) h")[rank])


def test_issue_checks_its_tensors_before_communicating() -> None:
    """A bound mesh with no process groups: any communication would fail, the checks don't."""
    bound = BoundMesh(MESH, "gloo", torch.device("cpu"), 1, {})
    ready = prepare([mc.plan(MESH, (8, 12), "(dp b) (tp h)", "b (tp h)")], bound)
    with pytest.raises(ShapeError, match=re.escape(
            'local tensor on rank 1 has shape (2, 3), but layout "(dp b) (tp h)" of global'
            " shape (8, 12) on Mesh(dp=2, tp=4) gives it shape (4, 3)")):
        ready.issue([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=re.escape("issue: 2 tensors for 1 prepared plans")):
        ready.issue([torch.zeros(4, 3), torch.zeros(4, 3)])
