"""Pipeline parallelism on gloo against one process (float64, losses and parameters after 3
SGD steps), every schedule:

- four processes, one rank per stage: gpipe, 1f1b and zero_bubble over 4 stages,
  interleaved_1f1b and zero_bubble_v over 8 (two stages a rank), and schedules read from
  PyTorch's own ScheduleInterleaved1F1B and ScheduleDualPipeV (8 microbatches) as CSV; each
  rank's recorded step (`record=True`) is its row, in causal order;
- eight processes, stages on meshes of other shapes and layouts: stage 0 on "dp=2 tp=2"
  (columns of its weight over tp, FSDP over dp: "(dp b) i" -> "(dp b) (tp h)"), stage 1 on
  "tp=4" (rows over tp, all-reduced: "b (tp h)" -> "b o"); each hand-off moves exactly its
  plan's bytes, which equal the lower bound;
- four processes, a data-parallel last stage ("dp=2" with FSDP, "(dp b) h") behind two
  single-rank stages, with gradient accumulation over two steps, and loss_reduction="sum";
- bad input: a wrong output shape raises before its hand-off; a schedule whose ranks differ
  is refused in check mode before the first send.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import outcome, ranks_fixture
from torch import nn

import meshcomm as mc
from meshcomm.executors.distributed import wire
from meshcomm.nn.pipeline import Pipeline, Stage

B, H, M, STEPS, LR = 8, 8, 4, 3, 0.2
F64 = torch.float64
SINGLE = [("gpipe", 4), ("1f1b", 4), ("zero_bubble", 4), ("interleaved_1f1b", 8),
          ("zero_bubble_v", 8)]


def data(n: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": [torch.randn(H, H, generator=g, dtype=F64) / H ** 0.5 for _ in range(n)],
            "x": torch.randn(STEPS, B, H, generator=g, dtype=F64),
            "t": torch.randn(STEPS, B, H, generator=g, dtype=F64)}


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def sse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).sum()


class Block(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


def reference(n: int, loss_fn: Any = mse, accumulate: int = 1) -> dict[str, Any]:
    d = data(n)
    blocks = [Block(w) for w in d["w"]]
    losses = []
    for step, (x, t) in enumerate(zip(d["x"], d["t"])):
        y = x
        for b in blocks:
            y = b(y)
        loss = loss_fn(y, t)
        loss.backward()
        losses.append(loss.item())
        if (step + 1) % accumulate == 0:
            with torch.no_grad():
                for b in blocks:
                    b.w -= LR * b.w.grad
                    b.w.grad = None
    return {"losses": losses, "w": [b.w.detach() for b in blocks]}


def sgd(params: list[nn.Parameter]) -> None:
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


# -- four processes, one rank per stage ------------------------------------------------------
def _single(rank: int, world: int, schedule: Any, n: int, m: int = M) -> dict[str, Any]:
    v_shape = schedule == "zero_bubble_v" or "OVERLAP_F_B" in str(schedule)
    where = [min(s, 2 * world - 1 - s) if v_shape else s % world for s in range(n)]
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in where]
    d = data(n)
    stages = [Stage(meshes[s], "b h", "b h", Block(d["w"][s]) if meshes[s].in_mesh else None)
              for s in range(n)]
    pipe = Pipeline(stages, schedule, microbatches=m, shapes=(B // m, H), dtype=F64,
                    loss_fn=mse, record=True)
    losses = []
    for x, t in zip(d["x"], d["t"]):
        loss = pipe.step(x if 0 in pipe.mine else None, t if n - 1 in pipe.mine else None)
        if loss is not None:
            losses.append(loss.item())
        sgd([stages[s].module.w for s in pipe.mine])   # type: ignore[union-attr]
    events = [(e.rank, str(e.action), pipe.started + e.start, pipe.started + e.end)
              for e in pipe.events]                    # the last step's, clock of the machine
    return {"losses": losses, "w": {s: stages[s].module.w.detach()   # type: ignore[union-attr]
                                    for s in pipe.mine},
            "events": events, "schedule": pipe.schedule.to_csv()}


def _torch_interleaved_csv(p: int, v: int, m: int) -> str:
    from torch.distributed.pipelining import schedules as ts

    class Mock:
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_rank, self.group_size = (
                index, p * v, 0, p)
            self.submod, self.is_first, self.is_last = nn.Linear(1, 1), index == 0, False
            self.has_backward, self.dw_builder, self.scale_grads = True, None, True

    order = ts.ScheduleInterleaved1F1B([Mock(c * p) for c in range(v)], m).pipeline_order
    return "".join(",".join("" if a is None else str(a) for a in order[r]) + "\n"
                   for r in range(p))


def _torch_dual_pipe_v_csv(p: int, m: int) -> str:
    from torch.distributed.pipelining import schedules as ts

    class Mock:
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_rank, self.group_size = (
                index, 2 * p, 0, p)
            self.submod, self.is_first, self.is_last = nn.Linear(1, 1), index == 0, False
            self.has_backward, self.dw_builder, self.scale_grads = True, None, True

    order = ts.ScheduleDualPipeV([Mock(0), Mock(2 * p - 1)], m).pipeline_order
    return "".join(",".join("" if a is None else str(a) for a in order[r]) + "\n"
                   for r in range(p))


def four_single(rank: int, world: int) -> dict[str, Any]:
    out = {name: _single(rank, world, name, n) for name, n in SINGLE}
    out["torch_csv"] = _single(rank, world, _torch_interleaved_csv(world, 2, M), 8)
    out["torch_dualpipev"] = _single(rank, world, _torch_dual_pipe_v_csv(world, 8), 8, m=8)
    return out


four = ranks_fixture(four_single, 4)


@pytest.mark.parametrize("name,n", SINGLE + [("torch_csv", 8), ("torch_dualpipev", 8)])
def test_every_schedule_trains_as_one_process(four, name, n):
    ref = reference(n)
    got = [r[name] for r in four]
    losses = [v for r in got for v in r["losses"]]
    assert losses == pytest.approx(ref["losses"], rel=1e-12)
    w = {s: t for r in got for s, t in r["w"].items()}
    assert sorted(w) == list(range(n))
    for s in range(n):
        torch.testing.assert_close(w[s], ref["w"][s], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,n", SINGLE + [("torch_dualpipev", 8)])
def test_a_recorded_step_is_each_ranks_row_in_causal_order(four, name, n):
    """record=True: every rank's events are its row's compute actions in order, one after the
    other; a stage's forward starts after the previous stage's forward of that microbatch
    began (its input had to be made first), a backward after the next stage's; the
    measured Timeline of all ranks' events spans them all."""
    from meshcomm.nn.pipeline import Action, Event, Schedule, timeline

    schedule = Schedule.from_csv(four[0][name]["schedule"])
    events = [Event(r, Action.parse(a), t0, t1) for got in four
              for r, a, t0, t1 in got[name]["events"]]
    start = {}
    for r, row in enumerate(schedule.compute_only().rows):
        mine = [e for e in events if e.rank == r]
        assert [e.action for e in mine] == list(row)
        for e, after in zip(mine, mine[1:]):
            assert e.start <= e.end <= after.start
        start.update({(e.action.stage, e.action.kind, e.action.microbatch): e.start
                      for e in mine})
    split = schedule.split_pairs()
    for (s, kind, mb), t in start.items():
        if kind == "F" and s > 0:
            assert t >= start[(s - 1, "F", mb)]
        if kind in ("B", "I") and s < n - 1:
            assert t >= start[(s + 1, "I" if (s + 1, mb) in split else "B", mb)]
    measured = timeline(schedule, events)
    assert measured.step_time == pytest.approx(max(e.end for e in events)
                                               - min(e.start for e in events))
    assert all(0 < b <= measured.step_time for b in measured.busy)
    assert 0 <= measured.bubble_fraction < 1


# -- eight processes, stages of other mesh shapes ---------------------------------------------
class ColumnTanh(nn.Module):
    """tanh(x @ w[:, my tp columns]): "(dp b) i" -> "(dp b) (tp h)"."""

    def __init__(self, w: torch.Tensor, bound: mc.BoundMesh) -> None:
        super().__init__()
        tp, k = bound.coords["tp"], H // bound.mesh.axis_size("tp")
        self.w = nn.Parameter(w[:, tp * k:(tp + 1) * k].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class RowSum(nn.Module):
    """tanh(x @ w[my tp rows], all-reduced over tp): "b (tp h)" -> "b o"."""

    def __init__(self, w: torch.Tensor, bound: mc.BoundMesh) -> None:
        super().__init__()
        self.bound = bound
        tp, k = bound.coords["tp"], H // bound.mesh.axis_size("tp")
        self.w = nn.Parameter(w[tp * k:(tp + 1) * k].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(mc.reshard(x @ self.w, self.bound, "b o | sum(tp)", "b o"))


def _two_meshes(rank: int, world: int, schedule: str) -> dict[str, Any]:
    s0 = mc.init_mesh(mc.Mesh("dp=2 tp=2"))
    s1 = mc.init_mesh(mc.Mesh("tp=4", ranks=[4, 5, 6, 7]))
    d = data(2)
    m0 = m1 = None
    if s0.in_mesh:
        m0 = mc.nn.fully_shard(ColumnTanh(d["w"][0], s0), s0, axis="dp")
    else:
        m1 = RowSum(d["w"][1], s1)
    pipe = Pipeline([Stage(s0, "(dp b) i", "(dp b) (tp h)", m0, averaged=("dp",)),
                     Stage(s1, "b (tp h)", "b o", m1)],
                    schedule, microbatches=M, shapes=(B // M, H), dtype=F64, loss_fn=mse)
    losses, p2p = [], []
    for x, t in zip(d["x"], d["t"]):
        with wire.recording() as heard:
            loss = pipe.step(mc.distribute(x, s0, "(dp b) i").local if s0.in_mesh else None,
                             t if s1.in_mesh else None)
        p2p.append(sum(w.sent * size for w, size in heard if w.kind == "p2p"))
        if loss is not None:
            losses.append(loss.item())
        sgd([(m0 or m1).w])                               # type: ignore[union-attr]
    if s0.in_mesh:
        w = full(m0.w)                                    # type: ignore[union-attr]
    else:
        w = m1.w.detach()                                 # type: ignore[union-attr]
    f, b = pipe.forward_plans[0], pipe.backward_plans[0]
    at = f.ranks.index(rank)
    planned = M * (f.steps[-1].send_bytes[at] if s0.in_mesh else 0) + M * (
        b.steps[-1].send_bytes[b.ranks.index(rank)] if s1.in_mesh else 0)
    return {"losses": losses, "w": w, "sent": p2p, "planned": planned,
            "bound": (f.bound_ratio, b.bound_ratio), "stage": 0 if s0.in_mesh else 1}


def eight_meshes(rank: int, world: int) -> dict[str, Any]:
    return {name: _two_meshes(rank, world, name) for name in ("gpipe", "1f1b", "zero_bubble")}


eight = ranks_fixture(eight_meshes, 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_stages_on_meshes_of_other_shapes_train_as_one_process(eight, name):
    ref = reference(2)
    got = [r[name] for r in eight]
    for r in got[4:]:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-12)
    w0 = torch.cat([got[0]["w"], got[1]["w"]], dim=1)   # tp = 0, 1 of dp row 0
    torch.testing.assert_close(w0, ref["w"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[2]["w"], got[0]["w"])  # dp row 1 holds the same columns
    w1 = torch.cat([r["w"] for r in got[4:]], dim=0)
    torch.testing.assert_close(w1, ref["w"][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_hand_offs_move_their_plans_bytes_at_the_bound(eight, name):
    for r in (r[name] for r in eight):
        assert r["bound"] == (1.0, 1.0)
        assert r["sent"] == [r["planned"]] * STEPS
        assert r["planned"] > 0


# -- four processes, a data-parallel last stage, accumulation ---------------------------------
def _dp_last(rank: int, world: int, schedule: str, loss_fn: Any, accumulate: int,
             reduction: str) -> dict[str, Any]:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[0])), mc.init_mesh(mc.Mesh("x=1", ranks=[1])),
              mc.init_mesh(mc.Mesh("dp=2", ranks=[2, 3]))]
    d = data(3)
    mods = [Block(d["w"][s]) if meshes[s].in_mesh else None for s in range(3)]
    if mods[2] is not None:
        mc.nn.fully_shard(mods[2], meshes[2])
    stages = [Stage(meshes[0], "b h", "b h", mods[0]), Stage(meshes[1], "b h", "b h", mods[1]),
              Stage(meshes[2], "(dp b) h", "(dp b) h", mods[2], averaged=("dp",))]
    pipe = Pipeline(stages, schedule, microbatches=2, shapes=(B // 2, H), dtype=F64,
                    loss_fn=loss_fn, loss_reduction=reduction)
    losses = []
    for step, (x, t) in enumerate(zip(d["x"], d["t"])):
        loss = pipe.step(x if 0 in pipe.mine else None,
                         mc.distribute(t, meshes[2], "(dp b) h").local if 2 in pipe.mine
                         else None)
        if loss is not None:
            losses.append(loss.item())
        if (step + 1) % accumulate == 0:
            sgd([mods[s].w for s in pipe.mine])           # type: ignore[union-attr]
    return {"losses": losses, "w": {s: full(mods[s].w) for s in pipe.mine}}  # type: ignore


DP_CASES = [("1f1b", "mean", 1), ("zero_bubble", "mean", 1), ("gpipe", "mean", 2),
            ("1f1b", "sum", 1)]


def four_dp_last(rank: int, world: int) -> dict[str, Any]:
    return {case: _dp_last(rank, world, case[0], mse if case[1] == "mean" else sse, case[2],
                           case[1]) for case in DP_CASES}


four_dp = ranks_fixture(four_dp_last, 4)


@pytest.mark.parametrize("case", DP_CASES, ids=lambda c: f"{c[0]}-{c[1]}-accumulate{c[2]}")
def test_a_data_parallel_last_stage_trains_as_one_process(four_dp, case):
    name, reduction, accumulate = case
    ref = reference(3, mse if reduction == "mean" else sse, accumulate)
    got = [r[case] for r in four_dp]
    # the last stage's ranks each report the loss of their half of the batch
    halves = [(a + b) / (2 if reduction == "mean" else 1)
              for a, b in zip(got[2]["losses"], got[3]["losses"])]
    assert halves == pytest.approx(ref["losses"], rel=1e-12)
    w = {s: t for r in got for s, t in r["w"].items()}
    for s in range(3):
        torch.testing.assert_close(w[s], ref["w"][s], rtol=1e-11, atol=1e-12)


# -- bad input --------------------------------------------------------------------------------
class Wrong(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :-1]


def _shape(rank: int, world: int) -> str:
    """Two stages on this one rank (a V of one rank): the first gives the wrong shape."""
    mesh = mc.init_mesh(mc.Mesh("x=1"))
    x = torch.zeros(4, H, dtype=F64)
    stages = [Stage(mesh, "b h", "b h", Wrong()),
              Stage(mesh, "b h", "b h", Block(torch.eye(H, dtype=F64)))]
    pipe = Pipeline(stages, "zero_bubble_v", microbatches=2, shapes=(2, H), dtype=F64,
                    loss_fn=mse)
    return outcome(lambda: pipe.step(x, x))


def test_a_wrong_output_shape_is_named_before_its_hand_off():
    from conftest import run_scaled

    got = run_scaled(_shape, 1, timeout_s=60)[0]
    assert got.startswith("ShapeError: pipeline stage 0 on rank 0 gave an output of shape"
                          " (2, 7) and dtype torch.float64, but its layout \"b h\" of the"
                          " declared shape (2, 8) puts (2, 8)"), got
    assert "fix: Pipeline(shapes=..., dtype=...)" in got


def _mismatch(rank: int, world: int) -> str:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in range(world)]
    stages = [Stage(meshes[s], "b h", "b h", Block(torch.eye(H, dtype=F64))
                    if s == rank else None) for s in range(world)]
    return outcome(lambda: Pipeline(stages, "gpipe" if rank == 1 else "1f1b", microbatches=2,
                                    shapes=(2, H), dtype=F64, loss_fn=mse, check=True))


def test_ranks_with_different_schedules_are_refused_before_the_first_send():
    from conftest import run_scaled

    for got in run_scaled(_mismatch, 2, timeout_s=120):
        assert got.startswith("CollectiveMismatchError: Pipeline of 2 stages"), got
        assert "1f1b" in got and "gpipe" in got


# -- tied first and last weights, clipping over every stage ----------------------------------
V, CLIP = 10, 0.5


class Embed(nn.Module):
    def __init__(self, e: torch.Tensor) -> None:
        super().__init__()
        self.e = nn.Parameter(e.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.e                                  # (b, V) -> (b, H)


class Head(nn.Module):
    def __init__(self, w: torch.Tensor, e: torch.Tensor) -> None:
        super().__init__()
        self.w, self.e = nn.Parameter(w.clone()), nn.Parameter(e.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) @ self.e.T            # (b, H) -> (b, V)


def tie_data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"e": torch.randn(V, H, generator=g, dtype=F64) / V ** 0.5,
            "w": [torch.randn(H, H, generator=g, dtype=F64) / H ** 0.5 for _ in range(3)],
            "x": torch.randn(STEPS, B, V, generator=g, dtype=F64),
            "t": torch.randn(STEPS, B, V, generator=g, dtype=F64)}


def tie_reference(blocks: int) -> dict[str, Any]:
    d = tie_data()
    e = nn.Parameter(d["e"].clone())
    ws = [nn.Parameter(w.clone()) for w in d["w"][:blocks + 1]]
    losses, norms = [], []
    for x, t in zip(d["x"], d["t"]):
        y = x @ e
        for w in ws[:-1]:
            y = torch.tanh(y @ w)
        loss = mse(torch.tanh(y @ ws[-1]) @ e.T, t)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([e, *ws], CLIP)))
        sgd([e, *ws])
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "e": e.detach(), "w": [w.detach() for w in ws]}


def _tied(rank: int, world: int, schedule: str) -> dict[str, Any]:
    d = tie_data()
    if schedule == "zero_bubble_v":        # 4 stages on ranks 0 1 1 0: the tie is local
        meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in (0, 1, 1, 0)]
        last_layout, averaged = "v h", ()
    else:                                   # 3 stages: ranks 0, 1 and dp=2 (FSDP) on 2-3
        meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[0])),
                  mc.init_mesh(mc.Mesh("x=1", ranks=[1])),
                  mc.init_mesh(mc.Mesh("dp=2", ranks=[2, 3]))]
        last_layout, averaged = "(dp v) h", ("dp",)
    n = len(meshes)
    mods: list[nn.Module | None] = [None] * n
    if meshes[0].in_mesh:
        mods[0] = Embed(d["e"])
    for s in range(1, n - 1):
        if meshes[s].in_mesh:
            mods[s] = Block(d["w"][s - 1])
    if meshes[-1].in_mesh:
        mods[-1] = Head(d["w"][n - 2], d["e"])
        if averaged:
            mc.nn.fully_shard(mods[-1], meshes[-1])
    io = ["b h"] * n
    stages = [Stage(meshes[s], "b v" if s == 0 else io[s], io[s], mods[s]) for s in range(n - 1)]
    stages.append(Stage(meshes[-1], "(dp b) h" if averaged else "b h",
                        "(dp b) v" if averaged else "b v", mods[-1], averaged=averaged))
    tie = mc.nn.Tie((0, n - 1), ("e", "e"), ("v h", last_layout), (V, H))
    pipe = Pipeline(stages, schedule, microbatches=2, shapes=(B // 2, H), dtype=F64,
                    loss_fn=mse, ties=[tie])
    losses, norms = [], []
    for x, t in zip(d["x"], d["t"]):
        target = None
        if n - 1 in pipe.mine:
            target = mc.distribute(t, meshes[-1], "(dp b) v").local if averaged else t
        loss = pipe.step(x if 0 in pipe.mine else None, target)
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        if loss is not None:
            losses.append(loss.item())
        sgd([q for s in pipe.mine for q in mods[s].parameters()])  # type: ignore[union-attr]
    return {"losses": losses, "norms": norms,
            "params": {s: {k: full(q) for k, q in mods[s].named_parameters()}  # type: ignore
                       for s in pipe.mine}}


def four_tied(rank: int, world: int) -> dict[str, Any]:
    return _tied(rank, world, "1f1b")


def two_tied(rank: int, world: int) -> dict[str, Any]:
    return _tied(rank, world, "zero_bubble_v")


tied = ranks_fixture(four_tied, 4)
tied_v = ranks_fixture(two_tied, 2)


def test_a_tied_fsdp_head_and_plain_embedding_train_as_one_process_with_clipping(tied):
    ref = tie_reference(1)
    got = tied
    halves = [(a + b) / 2 for a, b in zip(got[2]["losses"], got[3]["losses"])]
    assert halves == pytest.approx(ref["losses"], rel=1e-12)
    for r in got:                                   # the same norm on every rank
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-12)
    assert ref["norms"][0] > CLIP                   # clipping did happen
    torch.testing.assert_close(got[0]["params"][0]["e"], ref["e"], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(got[2]["params"][2]["e"], ref["e"], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(got[1]["params"][1]["w"], ref["w"][0], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(got[3]["params"][2]["w"], ref["w"][1], rtol=1e-11, atol=1e-12)


def test_a_tie_between_stages_of_one_rank_sums_locally(tied_v):
    ref = tie_reference(2)
    got = tied_v
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-12)
    assert got[1]["norms"] == pytest.approx(ref["norms"], rel=1e-12)
    for s in (0, 3):
        torch.testing.assert_close(got[0]["params"][s]["e"], ref["e"], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(got[1]["params"][1]["w"], ref["w"][0], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(got[0]["params"][3]["w"], ref["w"][2], rtol=1e-11, atol=1e-12)


# -- eight processes: two stages a rank, on meshes of other shapes over the same ranks --------
BIG = 16


def _two_per_rank(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """Four stages on two groups of four ranks, each stage FSDP over its own dp axis: the
    stages of one group sit on meshes of other shapes over the same ranks."""
    a1, a2 = mc.Mesh("dp=4"), mc.Mesh("dp=2 tp=2")                     # ranks 0-3
    b1, b2 = mc.Mesh("dp=2 x=2", ranks=[4, 5, 6, 7]), mc.Mesh("dp=4", ranks=[4, 5, 6, 7])
    order = (a1, b1, a2, b2) if schedule == "interleaved_1f1b" else (a1, b1, b2, a2)  # a V
    meshes = [mc.init_mesh(m) for m in order]
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(H, H, generator=g, dtype=F64) / H ** 0.5 for _ in range(4)]
    xs = torch.randn(STEPS, BIG, H, generator=g, dtype=F64)
    ts = torch.randn(STEPS, BIG, H, generator=g, dtype=F64)
    mods: list[nn.Module | None] = []
    for s, b in enumerate(meshes):
        mods.append(mc.nn.fully_shard(Block(ws[s]), b, axis="dp") if b.in_mesh else None)
    stages = [Stage(b, "(dp b) h", "(dp b) h", mods[s], averaged=("dp",))
              for s, b in enumerate(meshes)]
    pipe = Pipeline(stages, schedule, microbatches=4, shapes=(BIG // 4, H), dtype=F64,
                    loss_fn=mse)
    losses = []
    for x, t in zip(xs, ts):
        loss = pipe.step(mc.distribute(x, meshes[0], "(dp b) h").local if 0 in pipe.mine
                         else None,
                         mc.distribute(t, meshes[3], "(dp b) h").local if 3 in pipe.mine
                         else None)
        if loss is not None:
            losses.append(loss.item())
        sgd([mods[s].w for s in pipe.mine])                  # type: ignore[union-attr]
    ref = [Block(w) for w in ws]
    ref_losses = []
    for x, t in zip(xs, ts):
        y = x
        for blk in ref:
            y = blk(y)
        loss = mse(y, t)
        loss.backward()
        ref_losses.append(loss.item())
        sgd([blk.w for blk in ref])
    return {"losses": losses, "ref_losses": ref_losses,
            "w": {s: full(mods[s].w) for s in pipe.mine},   # type: ignore[union-attr]
            "ref_w": [blk.w.detach() for blk in ref]}


def eight_two_per_rank(rank: int, world: int) -> dict[str, Any]:
    return {name: _two_per_rank(rank, world, name)
            for name in ("interleaved_1f1b", "zero_bubble_v")}


eight_v = ranks_fixture(eight_two_per_rank, 8)


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zero_bubble_v"])
def test_two_stages_a_rank_on_meshes_of_other_shapes_train_as_one_process(eight_v, name):
    got = [r[name] for r in eight_v]
    last = [r for r in got if r["losses"]]
    assert len(last) == 4                               # the last stage's dp=4 ranks
    mean = [sum(v) / 4 for v in zip(*(r["losses"] for r in last))]
    assert mean == pytest.approx(got[0]["ref_losses"], rel=1e-12)
    w = {s: t for r in got for s, t in r["w"].items()}
    assert sorted(w) == [0, 1, 2, 3]
    for s in range(4):
        torch.testing.assert_close(w[s], got[0]["ref_w"][s], rtol=1e-11, atol=1e-12)
