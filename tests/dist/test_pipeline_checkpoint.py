"""A pipeline checkpoint saved from one stage split loads into another (float64, against one
process doing 3 SGD steps on the 4-layer model, 1e-12):

- saved on 4 ranks after 2 steps from 2 stages of 2 layers: stage 0 FSDP over "dp=2" (ranks
  0-1, "(dp o) i"), stage 1 over "tp=2" (ranks 2-3: rows "(tp h) o" all-reduced, then a
  layer whole on both ranks);
- loaded on 4 ranks into 4 single-rank stages of one layer each, and on 3 ranks into a plain
  stage of one layer and an FSDP stage of three over "dp=2" (ranks 1-2); each trains a third
  step. Every parameter starts as NaN there, so every element was read from the checkpoint;
- the index that rank 0 wrote describes the stages it does not run (their placeholders);
- bad input: a global name the checkpoint lacks and another global shape are refused on
  every rank before any file is read (the parameters stay as they were); an undeclared
  parameter, one the module lacks, a stage that does not exist, a declaration of another
  local shape and one of another layout than an FSDP DTensor's are refused where the stage
  runs, before any communication.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import outcome, run_scaled
from test_pipeline import Block, RowSum, full, mse, sgd
from torch import nn

import meshcomm as mc
from meshcomm.nn.pipeline import Pipeline, Stage, StageParam, load_state_dict, state_dict

B, H, M, LAYERS = 8, 8, 4, 4    # B, H as test_pipeline's (its Block, RowSum, sgd)
F64 = torch.float64
NAN = torch.full((H, H), float("nan"), dtype=F64)


def data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": [torch.randn(H, H, generator=g, dtype=F64) / H ** 0.5 for _ in range(LAYERS)],
            "x": torch.randn(3, B, H, generator=g, dtype=F64),
            "t": torch.randn(3, B, H, generator=g, dtype=F64)}


def reference() -> dict[str, Any]:
    d = data()
    ws = [nn.Parameter(w.clone()) for w in d["w"]]
    losses = []
    for x, t in zip(d["x"], d["t"]):
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        loss = mse(y, t)
        loss.backward()
        sgd(ws)
        losses.append(loss.item())
    return {"losses": losses, "w": [w.detach() for w in ws]}


def pipeline(stages: list[Stage]) -> Pipeline:
    return Pipeline(stages, "1f1b", microbatches=M, shapes=(B // M, H), dtype=F64, loss_fn=mse)


def train(pipe: Pipeline, steps: range, first: str, last: str) -> list[float]:
    """`steps` of the data; the first stage takes x in layout `first`, the last t in `last`."""
    d, n = data(), len(pipe.stages)
    losses = []
    for i in steps:
        x = mc.distribute(d["x"][i], pipe.stages[0].mesh, first).local if 0 in pipe.mine else None
        t = (mc.distribute(d["t"][i], pipe.stages[-1].mesh, last).local if n - 1 in pipe.mine
             else None)
        loss = pipe.step(x, t)
        if loss is not None:
            losses.append(loss.item())
        sgd([q for s in pipe.mine for q in pipe.stages[s].module.parameters()])  # type: ignore
    return losses


def params_of(pipe: Pipeline) -> dict[tuple[int, str], torch.Tensor]:
    return {(s, k): full(q) for s in pipe.mine
            for k, q in pipe.stages[s].module.named_parameters()}   # type: ignore[union-attr]


# -- saved from 2 stages: FSDP over dp=2, then tensor parallel over tp=2 ----------------------
SAVED = {"layers.0.w": StageParam(0, "0.w", (H, H), "(dp o) i"),
         "layers.1.w": StageParam(0, "1.w", (H, H), "(dp o) i"),
         "layers.2.w": StageParam(1, "0.w", (H, H), "(tp h) o"),
         "layers.3.w": StageParam(1, "1.w", (H, H))}


def save_two_stages(rank: int, world: int, folder: str) -> dict[str, Any]:
    s0 = mc.init_mesh(mc.Mesh("dp=2", ranks=[0, 1]))
    s1 = mc.init_mesh(mc.Mesh("tp=2", ranks=[2, 3]))
    w = data()["w"]
    m0 = m1 = None
    if s0.in_mesh:
        m0 = mc.nn.fully_shard(nn.Sequential(Block(w[0]), Block(w[1])), s0)
    else:
        m1 = nn.Sequential(RowSum(w[2], s1), Block(w[3]))
    pipe = pipeline([Stage(s0, "(dp b) h", "(dp b) h", m0, averaged=("dp",)),
                     Stage(s1, "b (tp h)", "b o", m1)])
    losses = train(pipe, range(2), "(dp b) h", "b h")
    mc.nn.save_checkpoint(state_dict(pipe, SAVED), folder)
    return {"losses": losses}


# -- loaded into 4 single-rank stages, and into a plain stage and an FSDP stage ---------------
def load_four(rank: int, world: int, folder: str) -> dict[str, Any]:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in range(4)]
    pipe = pipeline([Stage(meshes[s], "b h", "b h", Block(NAN) if s == rank else None)
                     for s in range(4)])
    params = {f"layers.{i}.w": StageParam(i, "w", (H, H)) for i in range(4)}
    read = load_state_dict(pipe, params, folder)
    loaded = params_of(pipe)
    losses = train(pipe, range(2, 3), "b h", "b h")
    return {"losses": losses, "loaded": loaded, "w": params_of(pipe), "files": read.files}


def load_fsdp(rank: int, world: int, folder: str) -> dict[str, Any]:
    s0 = mc.init_mesh(mc.Mesh("x=1", ranks=[0]))
    s1 = mc.init_mesh(mc.Mesh("dp=2", ranks=[1, 2]))
    m0 = Block(NAN) if s0.in_mesh else None
    m1 = mc.nn.fully_shard(nn.Sequential(*[Block(NAN) for _ in range(3)]), s1) if s1.in_mesh \
        else None
    pipe = pipeline([Stage(s0, "b h", "b h", m0),
                     Stage(s1, "(dp b) h", "(dp b) h", m1, averaged=("dp",))])
    params = {"layers.0.w": StageParam(0, "w", (H, H)),
              **{f"layers.{i}.w": StageParam(1, f"{i - 1}.w", (H, H), "(dp o) i")
                 for i in (1, 2, 3)}}
    read = load_state_dict(pipe, params, folder)
    loaded = params_of(pipe)
    losses = train(pipe, range(2, 3), "b h", "(dp b) h")
    return {"losses": losses, "loaded": loaded, "w": params_of(pipe), "files": read.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("pipeline_checkpoint"))
    return {"folder": folder,
            "saved": run_scaled(save_two_stages, 4, folder, timeout_s=240),
            "four": run_scaled(load_four, 4, folder, timeout_s=240),
            "fsdp": run_scaled(load_fsdp, 3, folder, timeout_s=240)}


def test_two_saving_stages_train_as_one_process(runs):
    ref = reference()
    for r in runs["saved"][2:]:                    # the tp stage's ranks each see the loss
        assert r["losses"] == pytest.approx(ref["losses"][:2], rel=1e-12)


def test_rank_0_indexes_the_stage_it_does_not_run(runs):
    index = json.loads((Path(runs["folder"]) / "meshcomm.json").read_text())["tensors"]
    assert index["layers.0.w"]["ranks"] == [0, 1]      # FSDP: one writer per shard
    assert index["layers.2.w"] == {"mesh": {"tp": 2}, "ranks": [2, 3], "layout": "(tp d0) d1",
                                   "shape": [H, H], "dtype": "float64"}
    assert index["layers.3.w"] == {"mesh": {"one": 1}, "ranks": [2], "layout": "d0 d1",
                                   "shape": [H, H], "dtype": "float64"}   # whole: one writer


def test_four_single_rank_stages_load_and_train_on(runs):
    ref, mid = reference(), reference_after(2)
    got = runs["four"]
    assert got[3]["losses"] == pytest.approx(ref["losses"][2:], rel=1e-12)
    for s, r in enumerate(got):
        torch.testing.assert_close(r["loaded"][s, "w"], mid[s], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["w"][s, "w"], ref["w"][s], rtol=1e-12, atol=1e-12)
    assert [r["files"] for r in got] == [(0, 1), (0, 1), (2, 3), (2,)]


def test_a_plain_and_an_fsdp_stage_on_three_ranks_load_and_train_on(runs):
    ref, mid = reference(), reference_after(2)
    got = runs["fsdp"]
    halves = (got[1]["losses"][0] + got[2]["losses"][0]) / 2   # each dp rank: its half
    assert halves == pytest.approx(ref["losses"][2], rel=1e-12)
    torch.testing.assert_close(got[0]["loaded"][0, "w"], mid[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0]["w"][0, "w"], ref["w"][0], rtol=1e-12, atol=1e-12)
    for r in got[1:]:
        for i in (1, 2, 3):
            torch.testing.assert_close(r["loaded"][1, f"{i - 1}.w"], mid[i], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(r["w"][1, f"{i - 1}.w"], ref["w"][i], rtol=1e-12,
                                       atol=1e-12)


def reference_after(steps: int) -> list[torch.Tensor]:
    """The reference's weights after `steps` steps (what the checkpoint holds)."""
    d = data()
    ws = [nn.Parameter(w.clone()) for w in d["w"]]
    for x, t in list(zip(d["x"], d["t"]))[:steps]:
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        mse(y, t).backward()
        sgd(ws)
    return [w.detach() for w in ws]


# -- bad input --------------------------------------------------------------------------------
def bad_loads(rank: int, world: int, folder: str) -> dict[str, Any]:
    meshes = [mc.init_mesh(mc.Mesh("x=1", ranks=[r])) for r in range(2)]
    wide = torch.zeros(H, 2 * H, dtype=F64)
    mods = [nn.Sequential(Block(NAN), Block(NAN)), nn.Sequential(Block(NAN), Block(wide))]
    pipe = pipeline([Stage(meshes[s], "b h", "b h", mods[s] if s == rank else None)
                     for s in range(2)])
    good = {f"layers.{i}.w": StageParam(i // 2, f"{i % 2}.w", (H, H)) for i in range(3)}
    renamed = {**good, "layer.3.w": StageParam(1, "1.w", (H, 2 * H))}
    wrong = {**good, "layers.3.w": StageParam(1, "1.w", (H, 2 * H))}
    return {"missing": outcome(lambda: load_state_dict(pipe, renamed, folder)),
            "shape": outcome(lambda: load_state_dict(pipe, wrong, folder)),
            "untouched": bool(torch.isnan(mods[rank][0].w).all())}


def test_a_missing_key_and_another_shape_are_refused_on_every_rank_before_a_write(runs):
    for r in run_scaled(bad_loads, 2, runs["folder"], timeout_s=120):
        assert r["missing"].startswith(
            "CheckpointError: load_checkpoint: 1 of the state dict's 4 key(s) are not in"), r
        assert "['layer.3.w']" in r["missing"] and "'layers.3.w'" in r["missing"]
        assert r["shape"].startswith(
            "ShapeError: load_checkpoint: layers.3.w has global shape (8, 16) here but (8, 8)"
            " in "), r
        assert r["untouched"]


def bad_declarations(rank: int, world: int) -> dict[str, str]:
    mesh = mc.init_mesh(mc.Mesh("x=1"))
    pipe = pipeline([Stage(mesh, "b h", "b h", nn.Sequential(Block(NAN), Block(NAN)))])
    dp = mc.init_mesh(mc.Mesh("dp=1"))
    fsdp = pipeline([Stage(dp, "(dp b) h", "(dp b) h", mc.nn.fully_shard(Block(NAN), dp),
                           averaged=("dp",))])
    return {"undeclared": outcome(lambda: state_dict(pipe, {"a": StageParam(0, "0.w", (H, H))})),
            "local": outcome(lambda: state_dict(pipe, {"a": StageParam(0, "0.w", (H, H)),
                                                       "b": StageParam(0, "1.w", (H, 4))})),
            "absent": outcome(lambda: state_dict(pipe, {"a": StageParam(0, "2.w", (H, H))})),
            "stage": outcome(lambda: state_dict(pipe, {"a": StageParam(1, "0.w", (H, H))})),
            "fsdp": outcome(lambda: state_dict(fsdp, {"a": StageParam(0, "w", (H, H))}))}


def test_declarations_that_do_not_fit_the_stage_are_named_where_it_runs():
    got = run_scaled(bad_declarations, 1, timeout_s=60)[0]
    assert got["undeclared"] == (
        "CheckpointError: pipeline state_dict: stage 0's parameters ['1.w'] have no global"
        " name; fix: declare each as StageParam(stage, name, shape, layout) under the name the"
        " checkpoint gives it")
    assert got["local"] == (
        "ShapeError: pipeline state_dict: 'b' (stage 0's '1.w') on rank 0: layout \"d0 d1\" of"
        " (8, 4) puts a local (8, 4) torch.float64 here, but the parameter's local tensor is"
        " (8, 8) torch.float64; fix: StageParam(shape=..., layout=..., dtype=...) as the"
        " stage's module holds it")
    assert got["absent"].startswith("CheckpointError: pipeline state_dict: 'a' (stage 0's"
                                    " '2.w'): the stage's module has no such parameter; it has"
                                    " ['0.w', '1.w']"), got["absent"]
    assert got["stage"] == ("CheckpointError: pipeline state_dict: 'a' is declared on stage 1,"
                            " but the pipeline has stages 0..0")
    assert got["fsdp"] == (
        "ShapeError: pipeline state_dict: 'a' (stage 0's 'w'): declared layout \"d0 d1\", but the"
        " parameter is a DTensor in \"(dp d0) d1\"; fix: StageParam(layout=\"(dp d0) d1\")")
