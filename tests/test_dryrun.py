"""mc.dryrun and `meshcomm dryrun`: one process as one rank of a larger job (torch's fake
process group, meta tensors). The bytes and memory it prints are checked against hand
calculations; each case runs in a fresh interpreter (the fake group is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import in_fresh_interpreter, scaled

ROOT = Path(__file__).resolve().parents[1]


def fsdp_steps() -> list[dict[str, Any]]:
    """Two SGD steps of 2 x Linear(64, 64, bias=False), each a fully_shard unit, on dp=8."""
    import torch
    from torch import nn

    import meshcomm as mc

    def train() -> None:
        bound = mc.init_mesh("dp=8")
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
        for block in model:
            mc.nn.fully_shard(block, bound)
        mc.nn.fully_shard(model, bound)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.empty(4, 64, device="meta")
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    _, report = mc.dryrun.run(train, world_size=8, rank=3)
    return [{"kinds": [(c.kind, c.group, c.size, c.sent_bytes, c.received_bytes)
                       for c in s.collectives]} for s in report.steps]


def tp_and_memory() -> dict[str, Any]:
    """A colwise / rowwise MLP on dp=2 tp=4 (one forward and backward), and one reshard."""
    import torch
    from torch import nn

    import meshcomm as mc

    def tp() -> None:
        bound = mc.init_mesh("dp=2 tp=4")
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        mc.nn.parallelize(model, bound, {"0": "colwise", "2": "rowwise"})
        x = torch.empty(2, 4, 16, device="meta", requires_grad=True)
        model(x).sum().backward()

    def gather() -> None:
        bound = mc.init_mesh("dp=2 tp=4")
        x = torch.empty(8, 16, device="meta")                  # (64, 16) "(dp tp a) b"
        mc.reshard(x, bound, "(dp tp a) b", "a b")

    _, tp_report = mc.dryrun.run(tp, world_size=8, rank=5)
    _, mem_report = mc.dryrun.run(gather, world_size=8, rank=5)
    return {"tp": [(c.kind, c.group, c.size, c.sent_bytes, c.received_bytes)
                   for c in tp_report.steps[0].collectives],
            "peak": mem_report.steps[0].peak_bytes, "text": str(mem_report)}


def run_in_fresh_interpreter(name: str) -> Any:
    return in_fresh_interpreter("test_dryrun", name)


def test_fsdp_bytes_match_a_hand_calculation() -> None:
    # Each weight (64, 64) float32 is 8 rows per rank of 8: a 2,048 B shard. Per step: 2
    # forward gathers, 2 backward regathers (each sends its shard to 7 ranks and receives
    # 7 shards: 14,336 B both ways) and 2 reduce_scatters (16,384 B in, 2,048 B out: sends
    # 14,336 B, receives 7 x 2,048 B). The root holds no parameter: no collective.
    steps = run_in_fresh_interpreter("fsdp_steps")
    assert len(steps) == 2
    for step in steps:
        kinds = [tuple(c) for c in step["kinds"]]
        assert sorted(kinds) == sorted([("all_gather", "world", 8, 14336, 14336)] * 4
                                       + [("reduce_scatter", "world", 8, 14336, 14336)] * 2)


def test_tp_all_reduce_bytes_and_reshard_memory_match_a_hand_calculation() -> None:
    got = run_in_fresh_interpreter("tp_and_memory")
    # rowwise output (2, 4, 16) float32 = 512 B summed over tp=4 (ring: 2 x 512 x 3/4 sent
    # and received), and the colwise input's gradient in backward, the same size
    assert [tuple(c) for c in got["tp"]] == [("all_reduce", "tp", 4, 768, 768)] * 2
    # the (8, 16) float32 shard (512 B) and the gathered (64, 16) tensor (4,096 B) are live
    # together; nothing else is held
    assert got["peak"] == 512 + 4096
    assert "peak memory 4.5 KiB" in got["text"]
    assert "all_gather      world (8)" in got["text"]     # (dp, tp) is the whole world


def test_cli_runs_the_llama_example_dry() -> None:
    proc = subprocess.run([sys.executable, "-m", "meshcomm", "dryrun", "-n", "8", "--rank", "3",
                           "examples/train_llama.py", "--mesh", "dp=4 tp=2", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "dry run: rank 3 of 8 (fake process group)" in out
    assert "step 1:" in out and "step 2:" in out and "step 3:" not in out
    assert "all_gather      dp (4)" in out and "all_reduce      tp (2)" in out
    assert "reduce_scatter  dp (4)" in out


@pytest.mark.parametrize("more", [[], ["--sequence-parallel"]])
def test_cli_runs_the_llama_example_dry_with_context_parallelism(more: list[str]) -> None:
    """A cp axis splits the sequence: 2 layers gather K and V over cp (allgather strategy)
    and reduce-scatter dK, dV back; the parameters' gradients are averaged over cp too.
    With sequence parallelism over tp as well (the norms' activations split over tp) the
    same cp calls run (shapes only: a dry run checks no values)."""
    proc = subprocess.run([sys.executable, "-m", "meshcomm", "dryrun", "-n", "16", "--rank",
                           "5", "examples/train_llama.py", "--mesh", "dp=2 cp=4 tp=2",
                           "--steps", "1", "--cp-strategy", "allgather", *more],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "4 x all_gather      cp (4)" in out and "4 x reduce_scatter  cp (4)" in out
    assert "all_reduce      cp (4)" in out and "all_gather      dp (2)" in out


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_the_dry_run_counts_a_rings_point_to_point_messages(split: str) -> None:
    """The ring strategy's shifts are p2p batches: 2 * 4 per layer on cp=4 (3 forward; 5
    backward: each step's block with the dK/dV buffer of the step before, and the last
    buffer's hop home), each K and V block 512 B here (one kv head of 8
    tokens x 16 float32 per tp rank): 10 KiB per layer. A zigzag split moves the same blocks
    (each rank's tokens are selected locally from its batch: no extra collective)."""
    proc = subprocess.run([sys.executable, "-m", "meshcomm", "dryrun", "-n", "16", "--rank",
                           "5", "examples/train_llama.py", "--mesh", "dp=2 cp=4 tp=2",
                           "--steps", "1", "--cp-strategy", "ring", "--cp-split", split],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "16 x p2p             cp (4)           sent   20.0 KiB  received   20.0 KiB" \
        in proc.stdout


@pytest.mark.parametrize("rank, stage", [(5, 0), (9, 1)])
def test_the_llama_example_runs_a_pipeline_dry(rank: int, stage: int) -> None:
    """`--pp 2` on dp=4 tp=2 (16 ranks): the tiny model's 2 layers as 2 stages of
    `mc.nn.Pipeline` under 1F1B, 4 microbatches. Each rank runs its own stage: the rank in
    stage 0 (rank 5) sends 4 activations of (1, 32, 64) float32 (8 KiB) and stage 1 (rank 9)
    sends their 4 gradients back; the printout has the hand-off bytes from the plans and the
    simulated step of both pipeline ranks from the cost model."""
    proc = subprocess.run([sys.executable, "-m", "meshcomm", "dryrun", "-n", "16", "--rank",
                           str(rank), "examples/train_llama.py", "--mesh", "dp=4 tp=2",
                           "--pp", "2", "--schedule", "1f1b", "--microbatches", "4",
                           "--steps", "1", "--width", "100"],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(300),
                          env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert (f"pipeline: 2 layers in 2 stages on Mesh(pp=2, dp=4, tp=2), 1f1b, 4 microbatches"
            f" of 1 x 32 tokens per dp rank; rank {rank} is pipeline rank {stage}: stage"
            f" {stage} (layers {stage}-{stage})") in out
    sent, got = ("8.0 KiB", "0 B") if stage == 0 else ("0 B", "8.0 KiB")
    assert (f"hand-off stage 0 -> 1 per microbatch, this rank: activations sent {sent},"
            f" received {got}; gradients sent {got}, received {sent}") in out
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert [line.split("│")[0] for line in rows] == ["rank 0 ", "rank 1 "]
    assert "1f1b: 2 ranks, 2 stages, 4 microbatches" in out and "step " in out
    assert "dry run: rank %d of 16 (fake process group)" % rank in out
    assert "4 x p2p             world (16)       sent   32.0 KiB" in out
    assert "all_gather      dp (4)" in out and "all_reduce      tp (2)" in out
