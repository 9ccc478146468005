"""Pipeline schedules as values: PyTorch's action notation both ways, the checks of
`Schedule.of`, the standard schedules against their textbook step times, bubbles and memory,
and the simulator's deadlock check (pure: no processes)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from meshcomm.errors import ScheduleError
from meshcomm.planner.pipeline import (
    Action,
    Schedule,
    StageCosts,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_v,
)


# -- notation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0F0", "12B3", "1I0", "1W10", "0SEND_F1", "3RECV_B0",
                                  "2UNSHARD", "0RESHARD", "1REDUCE_GRAD"])
def test_actions_round_trip_and_read_as_torch_reads_them(text):
    a = Action.parse(text)
    assert str(a) == text
    theirs = torch_schedules._Action.from_str(text)
    assert (theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index) == (
        a.stage, a.kind, a.microbatch)


@pytest.mark.parametrize("text,needle", [("F0", "<stage><kind><microbatch>"),
                                         ("0X1", "kind one of"), ("0F", "takes a microbatch"),
                                         ("0UNSHARD1", "takes no microbatch")])
def test_bad_actions_name_the_cell_and_the_form(text, needle):
    with pytest.raises(ScheduleError, match=needle):
        Action.parse(text)


def test_empty_cells_are_idle_slots():
    assert Action.parse("  ") is None
    s = Schedule.of([["0F0", "", "0B0"], [None, "1F0", "1B0"]])
    assert [len(row) for row in s.rows] == [2, 2]


@pytest.mark.parametrize("rows,needle", [
    ([["0F0", "0B0"], ["0F1", "0B1"]], "stage 0 has actions on ranks 0 and 1"),
    ([["0F0", "0B0", "0F1"]], "microbatch 1 runs F 1x, B 0x"),
    ([["0B0", "0F0"]], "runs 0B0 before 0F0"),
    ([["0F0", "0W0", "0I0"]], "runs 0W0 before 0I0"),
    ([["0F0", "0B0", "0I0", "0W0"]], "B once or I and W once"),
    ([["0F0", "0B0"], ["2F0", "2B0"]], "stages \\[1\\] have no action"),
])
def test_schedules_that_cannot_run_are_refused(rows, needle):
    with pytest.raises(ScheduleError, match=needle):
        Schedule.of(rows)


# -- CSV, both ways with torch ------------------------------------------------------------------
NAMED = [gpipe(4, 6), one_f_one_b(4, 6), interleaved_1f1b(2, 4, 2), interleaved_1f1b(4, 8, 3),
         zero_bubble(4, 6), zero_bubble_v(2, 4)]


@pytest.mark.parametrize("s", NAMED, ids=lambda s: s.name)
@pytest.mark.parametrize("comms", [False, True])
def test_csv_round_trips_and_torch_validates_ours(s, comms):
    text = s.to_csv(comms=comms)
    back = Schedule.from_csv(text)
    assert back.compute_only().rows == s.compute_only().rows
    if comms:
        assert back.rows == s.with_comms().rows
    actions = {r: [torch_schedules._Action.from_str(c) for c in line.split(",")]
               for r, line in enumerate(s.to_csv().splitlines())}
    stage_rank = torch_schedules._validate_schedule(actions, s.n_ranks, s.n_stages,
                                                    s.n_microbatches)
    assert tuple(stage_rank[k] for k in range(s.n_stages)) == s.stage_rank


def test_hand_offs_sit_beside_the_compute_they_serve():
    rows = one_f_one_b(2, 2).with_comms().rows
    assert [str(a) for a in rows[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0",
                                         "0B0", "0RECV_B1", "0B1"]
    assert [str(a) for a in rows[1]] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1",
                                         "1F1", "1B1", "1SEND_B1"]


def test_hand_offs_that_disagree_with_the_compute_order_are_refused():
    text = one_f_one_b(2, 2).to_csv(comms=True)
    with pytest.raises(ScheduleError, match="rank 0 has 0SEND_F1 before 0F1"):
        Schedule.from_csv(text.replace("0F1,0SEND_F1", "0SEND_F1,0F1"))
    with pytest.raises(ScheduleError, match="rank 1 runs 1F1 before 1RECV_F1"):
        Schedule.from_csv(text.replace("1RECV_F1,1F1", "1F1,1RECV_F1"))
    with pytest.raises(ScheduleError, match="rank 0's hand-offs are not the ones its compute"
                                            " order implies: missing 0SEND_F1"):
        Schedule.from_csv(text.replace("0F1,0SEND_F1", "0F1"))
    with pytest.raises(ScheduleError, match="extra 0SEND_B1"):
        Schedule.from_csv(text.replace("0F1,0SEND_F1", "0F1,0SEND_F1,0SEND_B1"))


def test_hand_offs_may_sit_anywhere_between_their_computes():
    """A receive posted early (as PyTorch's DualPipeV does) reads as the same schedule."""
    text = one_f_one_b(2, 2).to_csv(comms=True)
    assert "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1" in text
    early = text.replace("1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1",
                         "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0")
    assert Schedule.from_csv(early).compute_only() == Schedule.from_csv(text).compute_only()


class _MockStage:
    """What torch's schedule constructors read off a stage (no process group)."""

    def __init__(self, index: int, n: int, rank: int, group: int) -> None:
        self.stage_index, self.num_stages = index, n
        self.group_rank, self.group_size = rank, group
        self.submod = torch.nn.Linear(1, 1)
        self.is_first, self.is_last = index == 0, index == n - 1
        self.has_backward, self.dw_builder, self.scale_grads = True, None, True


@pytest.mark.parametrize("kind", ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                                  "ScheduleLoopedBFS"])
def test_torch_made_schedules_read_check_and_simulate_here(kind):
    p, v, m = 2, 2, 4
    cls = getattr(torch_schedules, kind)
    theirs = cls([_MockStage(r + c * p, p * v, 0, p) for c, r in ((0, 0), (1, 0))], m)
    text = "".join(",".join("" if a is None else str(a) for a in theirs.pipeline_order[r])
                   + "\n" for r in range(p))
    ours = Schedule.from_csv(text, name=kind)
    assert (ours.n_stages, ours.n_microbatches, ours.stage_rank) == (4, 4, (0, 1, 0, 1))
    t = simulate(ours, StageCosts.uniform(4, 1.0, 2.0, 1.0 if ours.split_backward else 0.0))
    assert t.step_time >= m * 3 * v


def _torch_dual_pipe_v(p: int, m: int, comms: bool) -> str:
    theirs = torch_schedules.ScheduleDualPipeV([_MockStage(0, 2 * p, 0, p),
                                                _MockStage(2 * p - 1, 2 * p, 0, p)], m)
    order = theirs.pipeline_order_with_comms if comms else theirs.pipeline_order
    return "".join(",".join("" if a is None else str(a) for a in order[r]) + "\n"
                   for r in range(p))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_torch_dual_pipe_v_reads_its_overlapped_pairs_and_simulates(p, m):
    """PyTorch's DualPipeV order: two stages a rank in a V, some backwards split (I, W) and
    some whole (B), forward-backward pairs as `(0F7;7B3)OVERLAP_F_B` cells, read as the two
    actions in turn; its comms form (receives posted early) reads as the same schedule."""
    text = _torch_dual_pipe_v(p, m, comms=False)
    assert "OVERLAP_F_B" in text
    ours = Schedule.from_csv(text, name="dualpipev")
    assert ours.stage_rank == tuple(list(range(p)) + list(range(p))[::-1])
    assert 0 < len(ours.split_pairs()) < 2 * p * m          # both kinds of backward
    assert Schedule.from_csv(_torch_dual_pipe_v(p, m, comms=True)).compute_only().rows == \
        ours.rows
    f, b, w = 1.0, 2.0, 1.0
    t = simulate(ours, StageCosts.uniform(2 * p, f, b, w))
    work = m * 2 * (f + b)                 # every rank: two stages' forwards and backwards
    same_model = simulate(one_f_one_b(p, m), StageCosts.uniform(p, 2 * f, 2 * b))
    assert work <= t.step_time < same_model.step_time    # 1F1B on p ranks, two layers each
    assert all(abs(x - t.busy[0]) < 1e-9 for x in t.busy)


def test_a_bad_overlapped_pair_is_named():
    with pytest.raises(ScheduleError, match="an OVERLAP_F_B pair holds two compute actions"):
        Schedule.from_csv("0F0,(0F1;0SEND_F0)OVERLAP_F_B\n")


# -- textbook figures -------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_gpipe_and_1f1b_step_and_bubble_are_the_textbook_ones(p, m):
    f, b = 1.5, 2.5
    costs = StageCosts.uniform(p, f, b, activation_bytes=10)
    for s, peak in ((gpipe(p, m), lambda r: m), (one_f_one_b(p, m), lambda r: min(m, p - r))):
        t = simulate(s, costs)
        assert t.step_time == pytest.approx((m + p - 1) * (f + b))
        assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert t.peak_bytes == tuple(10 * peak(r) for r in range(p))


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12),
                                   (8, 2, 16), (3, 4, 6)])
def test_interleaved_bubble_shrinks_by_its_stages_per_rank(p, v, m):
    t = simulate(interleaved_1f1b(p, m, v), StageCosts.uniform(p * v, 1.0, 2.0))
    assert t.step_time == pytest.approx(m * v * 3 + (p - 1) * 3)
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_zero_bubble_reaches_zb_h1s_step_in_bounded_memory(p, mult):
    m = p * mult
    f, i, w = 1.0, 1.0, 1.0
    t = simulate(zero_bubble(p, m), StageCosts.uniform(p, f, i + w, w, activation_bytes=1))
    assert t.step_time == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
    assert max(t.peak_bytes) <= min(m, 2 * p - 1)
    one = simulate(one_f_one_b(p, m), StageCosts.uniform(p, f, i + w))
    assert t.step_time < one.step_time


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zero_bubble_v_puts_the_last_stage_on_rank_0(p):
    s = zero_bubble_v(p, 2 * p)
    assert s.stage_rank[0] == s.stage_rank[-1] == 0
    t = simulate(s, StageCosts.uniform(2 * p, 1.0, 2.0, 1.0))
    assert t.step_time == pytest.approx(2 * p * 3 * 2 + p - 1)


def test_hand_off_time_delays_the_receiver_only():
    p, m, hop = 4, 8, 0.25
    t0 = simulate(gpipe(p, m), StageCosts.uniform(p, 1.0, 2.0))
    t1 = simulate(gpipe(p, m), StageCosts.uniform(p, 1.0, 2.0, send=hop))
    assert t1.step_time == pytest.approx(t0.step_time + 2 * (p - 1) * hop)   # one fill, one drain
    assert t1.busy == t0.busy
    f0 = simulate(one_f_one_b(p, m), StageCosts.uniform(p, 1.0, 2.0))
    f1 = simulate(one_f_one_b(p, m), StageCosts.uniform(p, 1.0, 2.0, send=hop))
    assert f1.step_time > f0.step_time + 2 * (p - 1) * hop    # 1F1B's steady state waits too


def test_stages_on_one_rank_hand_off_for_free():
    s = zero_bubble_v(2, 4)       # stages 1 and 2 share rank 1
    a = simulate(s, StageCosts.uniform(4, 1.0, 2.0, 1.0))
    b = simulate(s, StageCosts((1.0,) * 4, (2.0,) * 4, (1.0,) * 4, (0.0, 5.0, 0.0),
                               (0.0, 5.0, 0.0)))
    assert a.step_time == b.step_time


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v"]),
       st.integers(1, 6), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4))
def test_every_named_schedule_finishes_and_respects_its_dependencies(name, p, k, v, times):
    m = p * k
    s = build(name, p, m, **({"v": v} if name == "interleaved_1f1b" else {}))
    n = s.n_stages
    costs = StageCosts((times[0],) * n, (times[1] + times[2],) * n, (times[2],) * n,
                       (times[3],) * (n - 1), (times[3],) * (n - 1))
    t = simulate(s, costs)
    when = {(e.action.stage, e.action.kind, e.action.microbatch): e for e in t.events}
    for (stage, kind, mb), e in when.items():
        if kind == "F" and stage > 0:
            assert e.start >= when[(stage - 1, "F", mb)].end - 1e-9
        if kind in ("B", "I") and stage < n - 1:
            assert e.start >= when[(stage + 1, kind, mb)].end - 1e-9
    per_rank = {}
    for e in sorted(t.events, key=lambda e: e.start):
        assert e.start >= per_rank.get(e.rank, 0.0) - 1e-9        # one action at a time
        per_rank[e.rank] = e.end
    assert sum(t.busy) == pytest.approx(m * sum(costs.forward) + m * sum(costs.backward))


def test_a_deadlock_is_found_and_named_before_anything_runs():
    s = Schedule.of([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]], name="bad")
    with pytest.raises(ScheduleError, match="bad deadlocks: rank 0 at 0B0 waits on 1B0;"
                                            " rank 1 at 1F1 waits on 0F1"):
        simulate(s, StageCosts.uniform(2))


def test_bad_costs_are_refused():
    with pytest.raises(ScheduleError, match="StageCosts.forward: 3 values .* 4 stages"):
        simulate(gpipe(4, 4), StageCosts((1.0,) * 3, (1.0,) * 4))


def test_bad_schedule_arguments_name_the_fix():
    with pytest.raises(ScheduleError, match="microbatches=8"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ScheduleError, match="expected one of gpipe, 1f1b"):
        build("dualpipe", 2, 2)
    with pytest.raises(ScheduleError, match="positive integers"):
        gpipe(0, 2)


def test_the_chrome_trace_has_one_track_per_rank_and_every_action(tmp_path):
    t = simulate(one_f_one_b(3, 4), StageCosts.uniform(3, 0.001, 0.002))
    trace = t.chrome_trace()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 2
    assert {e["tid"] for e in spans} == {0, 1, 2}
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(t.step_time * 1e6)


# -- balancing stages -------------------------------------------------------------------------
def _best(weights, stages):
    import itertools

    from meshcomm.planner.pipeline.balance import stage_sums
    n = len(weights)
    return min(max(stage_sums(weights, (0, *cuts)))
               for cuts in itertools.combinations(range(1, n), stages - 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.0, 40.0]), min_size=1, max_size=9),
       st.data())
def test_balance_finds_the_least_largest_stage(weights, data):
    from meshcomm.nn.pipeline import balance, stage_sums
    stages = data.draw(st.integers(1, len(weights)))
    starts = balance(weights, stages)
    assert len(starts) == stages and starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < len(weights)
    assert max(stage_sums(weights, starts)) == pytest.approx(_best(weights, stages))


def test_balance_gives_a_heavy_output_layer_a_lighter_stage():
    from meshcomm.nn.pipeline import balance, stage_sums
    weights = [1.0] * 80
    weights[-1] += 12.0                      # the output projection in the last layer
    starts = balance(weights, 8)
    assert max(stage_sums(weights, starts)) == pytest.approx(13.0)   # that layer alone
    assert starts[-1] == 79
    big = balance([float(i % 7) for i in range(10_000)], 64)       # 10,000 layers
    assert len(big) == 64


def test_balance_refuses_more_stages_than_layers():
    from meshcomm.nn.pipeline import balance
    with pytest.raises(ScheduleError, match="expected 1..3"):
        balance([1, 2, 3], 4)
