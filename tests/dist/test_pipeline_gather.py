"""FSDP inside a pipeline stage, `Stage(gather=...)`, on gloo against one process (float64,
losses and parameters after 3 SGD steps, 1e-12).

Four processes, three stages: a plain block on rank 0, an FSDP stage of three units over
"dp=2" (ranks 1 and 2, "(dp b) h"), a plain block on rank 3; 1f1b and zero_bubble, 4
microbatches, each unit with and without reshard_after_forward. Per step and per FSDP rank
the all_gathers are counted and their bytes summed: with gather="microbatch" each unit
gathers for every microbatch's forward (and again in its backward when it reshards after
forward), with gather="step" once; either way each unit reduce_scatters once per step. After
a step no unit holds gathered parameters and every gathered buffer is freed. An unknown
policy is refused; in check mode, ranks that declare different policies are refused.
"""

from __future__ import annotations

import gc
import re
import weakref
from typing import Any

import pytest
import torch
from conftest import ranks_fixture
from test_pipeline import Block, full, mse, sgd
from torch import nn

import meshcomm as mc
from meshcomm.executors.distributed import wire
from meshcomm.nn.fsdp.param import UNIT_ATTR
from meshcomm.nn.pipeline import Pipeline, Stage

B, H, M, STEPS = 8, 8, 4, 3   # B, H as test_pipeline's (its Block, RowSum, sgd)
UNITS, BLOCKS = 3, 5                      # stage 1 holds blocks 1-3, one unit each
F64 = torch.float64
SCHEDULES = ("1f1b", "zero_bubble")
CASES = [(name, gather, reshard) for name in SCHEDULES for gather in ("microbatch", "step")
         for reshard in (True, False)]


def data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": [torch.randn(H, H, generator=g, dtype=F64) / H ** 0.5 for _ in range(BLOCKS)],
            "x": torch.randn(STEPS, B, H, generator=g, dtype=F64),
            "t": torch.randn(STEPS, B, H, generator=g, dtype=F64)}


def reference() -> dict[str, Any]:
    d = data()
    blocks = [Block(w) for w in d["w"]]
    losses = []
    for x, t in zip(d["x"], d["t"]):
        y = x
        for b in blocks:
            y = b(y)
        loss = mse(y, t)
        loss.backward()
        losses.append(loss.item())
        sgd([b.w for b in blocks])
    return {"losses": losses, "w": [b.w.detach() for b in blocks]}


def _run(rank: int, world: int, schedule: str, gather: str, reshard: bool) -> dict[str, Any]:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[0])), mc.init_mesh(mc.Mesh("dp=2", ranks=[1, 2])),
              mc.init_mesh(mc.Mesh("x=1", ranks=[3]))]
    d = data()
    mods: list[nn.Module | None] = [None] * 3
    blocks: list[Block] = []
    if meshes[0].in_mesh:
        blocks = [Block(d["w"][0])]
        mods[0] = blocks[0]
    if meshes[1].in_mesh:
        blocks = [Block(d["w"][i]) for i in range(1, 1 + UNITS)]
        mods[1] = nn.Sequential(*blocks)
        for b in blocks:
            mc.nn.fully_shard(b, meshes[1], reshard_after_forward=reshard)
        mc.nn.fully_shard(mods[1], meshes[1])   # the root: one recorded order, prefetch
    if meshes[2].in_mesh:
        blocks = [Block(d["w"][BLOCKS - 1])]
        mods[2] = blocks[0]
    stages = [Stage(meshes[0], "b h", "b h", mods[0]),
              Stage(meshes[1], "(dp b) h", "(dp b) h", mods[1], averaged=("dp",),
                    gather=gather),
              Stage(meshes[2], "b h", "b h", mods[2])]
    pipe = Pipeline(stages, schedule, microbatches=M, shapes=(B // M, H), dtype=F64,
                    loss_fn=mse)
    units = [getattr(m, UNIT_ATTR) for m in mods[1].modules()] if mods[1] is not None else []
    gathered = _watch(units)
    losses, gathers, gather_bytes, reduces = [], [], [], []
    for x, t in zip(d["x"], d["t"]):
        with wire.recording() as heard:
            loss = pipe.step(x if 0 in pipe.mine else None, t if 2 in pipe.mine else None)
        gathers.append(sum(w.kind == "all_gather" for w, _ in heard))
        gather_bytes.append(sum(w.sent * size for w, size in heard if w.kind == "all_gather"))
        reduces.append(sum(w.kind == "reduce_scatter" for w, _ in heard))
        if loss is not None:
            losses.append(loss.item())
        sgd([b.w for b in blocks])
    gc.collect()
    return {"losses": losses, "w": [full(b.w) for b in blocks], "gathers": gathers,
            "gather_bytes": gather_bytes, "reduces": reduces,
            "held": [(u.holding, u.held is not None, u.kept is not None) for u in units],
            "alive": sum(ref() is not None for ref in gathered)}


def _watch(units: list[Any]) -> list[weakref.ref[Any]]:
    """A weak reference to the storage of every tensor the units gather (a storage's Python
    object lives as long as the storage does): which gathered buffers are still alive."""
    refs: list[weakref.ref[Any]] = []
    for unit in units:
        def finish(issued: Any, unit: Any = unit, inner: Any = unit.finish_gather) -> Any:
            out = inner(issued)
            refs.extend(weakref.ref(t.untyped_storage()) for t in out)
            return out
        unit.finish_gather = finish
    return refs


def four_ranks(rank: int, world: int) -> dict[Any, Any]:
    return {case: _run(rank, world, *case) for case in CASES}


four = ranks_fixture(four_ranks, 4)


def _id(case: tuple[str, str, bool]) -> str:
    return f"{case[0]}-{case[1]}-reshard{case[2]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_an_fsdp_stage_trains_as_one_process_under_either_policy(four, case):
    ref = reference()
    got = [r[case] for r in four]
    assert got[3]["losses"] == pytest.approx(ref["losses"], rel=1e-12)
    w = [*got[0]["w"], *got[1]["w"], *got[3]["w"]]
    for s in range(BLOCKS):
        torch.testing.assert_close(w[s], ref["w"][s], rtol=1e-12, atol=1e-12)
    for i in range(UNITS):                  # both FSDP ranks hold the same full weights
        torch.testing.assert_close(got[2]["w"][i], got[1]["w"][i], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_all_gathers_per_step_follow_the_policy(four, case):
    _, gather, reshard = case
    per_unit = 1 if gather == "step" else M * (2 if reshard else 1)
    shard_bytes = H // 2 * H * 8            # each rank sends its 4 rows of 8 float64
    for r in (four[1][case], four[2][case]):
        assert r["gathers"] == [UNITS * per_unit] * STEPS
        assert r["gather_bytes"] == [UNITS * per_unit * shard_bytes] * STEPS
        assert r["reduces"] == [UNITS] * STEPS       # once per unit per step, either way
        # the step is over: nothing gathered is held (the root unit has no parameters)
        assert r["held"] == [(False, False, False)] * (UNITS + 1)
        assert r["alive"] == 0              # and every gathered buffer is freed
    for r in (four[0][case], four[3][case]):
        assert r["gathers"] == [0] * STEPS


def test_an_unknown_gather_policy_is_refused():
    msg = ("Stage(gather='once'): expected one of ('microbatch', 'step') (when its"
           " fully_shard units gather their parameters)")
    with pytest.raises(mc.errors.ScheduleError, match=re.escape(msg)):
        Stage(None, "b h", "b h", gather="once")     # type: ignore[arg-type]


def _mismatch(rank: int, world: int) -> str:
    from conftest import outcome

    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in range(world)]
    stages = [Stage(meshes[s], "b h", "b h", Block(torch.eye(H, dtype=F64)) if s == rank
                    else None, gather="step" if rank == 1 else "microbatch")
              for s in range(world)]
    return outcome(lambda: Pipeline(stages, "1f1b", microbatches=2, shapes=(2, H), dtype=F64,
                                    loss_fn=mse, check=True))


def test_ranks_with_different_gather_policies_are_refused_in_check_mode():
    from conftest import run_scaled

    for got in run_scaled(_mismatch, 2, timeout_s=120):
        assert got.startswith("CollectiveMismatchError: Pipeline of 2 stages"), got
        assert "gather=microbatch,microbatch" in got, got       # rank 0's
        assert "gather=step,step" in got, got                   # rank 1's
