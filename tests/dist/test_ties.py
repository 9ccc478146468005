"""Tied weights and padding_idx under fully_shard and parallelize, 4 gloo ranks (dp=2 tp=2),
against the same model trained in one process (these were silently wrong: ties came apart,
and the embedding style passed the global padding_idx to each shard).

- one fully_shard unit holding both ends of a tie (GPT-2's wte / lm_head): kept tied;
- parallelize with the tied embedding and output layer split alike (embedding / colwise),
  then fully_shard: kept tied;
- padding_idx 0 of 8 rows over tp=2: only global row 0 gets no gradient; global row 4 (tp
  rank 1's local row 0, which the global index froze) trains;
- a tie split across two units, or split by the plan in one place only: refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import meshcomm as mc

from conftest import outcome, ranks_fixture
from test_parallel import losses_of

class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 6, padding_idx=padding_idx)
        self.up = nn.Linear(6, 16)
        self.down = nn.Linear(16, 6)
        self.head = nn.Linear(6, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.down(F.relu(self.up(h)))
        return self.head(h)


def data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (8, 6), generator=g)
    x[:, 0], x[:, 1] = 4, 0      # rows 4 and 0 (padding_idx 0 in the padding case) in use
    return x, torch.randint(0, vocab, (8, 6), generator=g)


def full(p: Any) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def run_case(bound: mc.BoundMesh, case: str, world: int) -> dict[str, Any]:
    vocab, pad = (8, 0) if case == "padding" else (11, None)
    m = TiedLM(vocab, pad)
    x, y = data(vocab)
    if case in ("tp", "tp+fsdp", "padding"):
        plan = {"emb": "embedding", "head": "colwise_gather"} if case != "padding" else \
            {"emb": "embedding"}
        if case == "padding":        # untied: the padding row alone is the point here
            m.head.weight = nn.Parameter(m.emb.weight.detach().clone())
        mc.nn.parallelize(m, bound, plan)
    if case in ("fsdp", "tp+fsdp"):
        mc.nn.fully_shard(m, bound, axis="dp")
        dp = bound.coords["dp"]
        x, y = x[dp * 4:(dp + 1) * 4], y[dp * 4:(dp + 1) * 4]
    # under FSDP each dp half of the batch: the mean over all ranks is the whole batch's loss
    losses = losses_of(m, x, y, world if case in ("fsdp", "tp+fsdp") else 1)
    return {"losses": losses, "tied": m.emb.weight is m.head.weight,
            "params": {n: full(p) for n, p in m.named_parameters(remove_duplicate=False)}}


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 tp=2")
    out = {case: run_case(bound, case, world) for case in ("fsdp", "tp", "tp+fsdp", "padding")}

    def across_units() -> None:
        m = TiedLM()
        mc.nn.fully_shard(m.emb, bound, axis="dp")
        mc.nn.fully_shard(m, bound, axis="dp")

    def split_once() -> None:
        mc.nn.parallelize(TiedLM(), bound, {"emb": "embedding"})

    out["errors"] = {"across_units": outcome(across_units), "split_once": outcome(split_once)}
    return out


four = ranks_fixture(worker, 4)


def reference(case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    vocab, pad = (8, 0) if case == "padding" else (11, None)
    m = TiedLM(vocab, pad)
    if case == "padding":
        m.head.weight = nn.Parameter(m.emb.weight.detach().clone())
    x, y = data(vocab)
    losses = losses_of(m, x, y, 1)
    return losses, {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)}


def test_tied_weights_stay_tied_and_train_as_one_process(four: list[dict[str, Any]]) -> None:
    for case in ("fsdp", "tp", "tp+fsdp"):
        want, params = reference(case)
        got = four[0][case]
        assert got["tied"], case
        assert max(abs(a - b) / b for a, b in zip(got["losses"], want)) < 1e-5, (case, got)
        for name, p in params.items():
            assert torch.allclose(got["params"][name], p, rtol=1e-4, atol=1e-6), (case, name)


def test_padding_idx_is_this_shard_s_own_row(four: list[dict[str, Any]]) -> None:
    want, params = reference("padding")
    got = four[0]["padding"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], want)) < 1e-5
    start = TiedLM(8, 0).emb.weight.detach()
    trained = got["params"]["emb.weight"]
    assert torch.equal(trained[0], start[0])              # the padding row never moves
    assert not torch.equal(trained[4], start[4])          # tp rank 1's local row 0 trains
    assert torch.allclose(trained, params["emb.weight"], rtol=1e-4, atol=1e-6)


def test_ties_that_would_come_apart_are_refused(four: list[dict[str, Any]]) -> None:
    errors = four[0]["errors"]
    assert errors["across_units"].startswith(
        "ShapeError: fully_shard: parameter head.weight is the same tensor as emb.weight,"
        " which another fully_shard unit manages already (tied weights across units)")
    assert errors["split_once"] == (
        "ShapeError: parallelize: emb.weight is one tensor held in several places (tied"
        ' weights) that the plan would split differently: emb.weight ("(tp d0) d1"),'
        " head.weight (not split). fix: give every module that holds it a style that splits"
        " it alike (an output layer tied to an `embedding` takes `colwise` or"
        " `colwise_gather`), or untie them first")
