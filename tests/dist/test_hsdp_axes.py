"""HSDP over several replicate axes (`fully_shard(axis="dp", replicate=("rep", "cp"))`), on 8
gloo ranks, against the same model in one process:

- context parallelism with HSDP ("rep=2 dp=2 cp=2"): a causal attention block whose batch
  is split over (rep, dp) and sequence over cp, its parameters sharded over dp and
  replicated over rep and cp, trains as one process (losses and final parameters, float64,
  for each strategy); one all_reduce over rep x cp per unit after its reduce_scatter;
- plain HSDP with two replicate axes ("r1=2 r2=2 dp=2"): tests/dist/test_fsdp.py's Linear
  stack (uneven rows, three units and a root) trains as one process, sends the bytes of its
  formula, and saves a checkpoint once per distinct shard that loads onto "dp=8";
- bad `replicate=` values: the error names the argument and the fix, before any
  communication (the module is left as it was).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import outcome, run_scaled
from test_cp_training import Block
from test_fsdp import BATCH, data, model, reference
from test_hsdp import STEPS, sent, train, units
from torch import nn

import meshcomm as mc
from meshcomm.executors.sim import scatter
from meshcomm.nn.fsdp import UNIT_ATTR

B, S, E = 4, 10, 16                  # 4 rows over rep x dp = 4, 10 tokens over cp = 2
CP_STRATEGIES = ("allgather", "ulysses", "ring")


# -- CP with HSDP --------------------------------------------------------------------------
def _batch() -> torch.Tensor:
    return torch.randn(B, S, E, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def _attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return mc.nn.attention_reference(q, k, v, causal=True)


def cp_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    m = Block()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    losses = []
    for _ in range(STEPS):
        loss = m(_batch(), _attend_reference).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def cp_hsdp(rank: int) -> dict[str, Any]:
    bound = mc.init_mesh("rep=2 dp=2 cp=2")
    x = scatter(_batch(), bound.mesh, "(rep dp b) (cp s) e")[rank]
    out: dict[str, Any] = {}
    for strategy in CP_STRATEGIES:
        m = mc.nn.fully_shard(Block(), bound, axis="dp", replicate=("rep", "cp"))
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   strategy: str = strategy) -> torch.Tensor:
            return mc.nn.attention(q, k, v, bound, "(rep dp b) h (cp s) d", causal=True,
                                   strategy=strategy)
        losses, per_step = [], []
        for _ in range(STEPS):
            before = sent(m)
            loss = m(x, attend).pow(2).mean()       # this rank's tokens: as many on each
            opt.zero_grad()
            loss.backward()
            opt.step()
            per_step.append(sent(m) - before)
            whole = mc.reshard(loss.detach().reshape(1), bound, "a | avg(rep, dp, cp)", "a")
            losses.append(whole.item())
        out[strategy] = {"losses": losses, "sent": per_step,
                         "params": {n: p.full_tensor() for n, p in m.named_parameters()},
                         "local": {n: p.to_local().clone() for n, p in m.named_parameters()},
                         "placements": str(tuple(m.wq.placements)),
                         "replicate": units(m)[0].replicate,
                         "schedule": mc.nn.fsdp_schedule(m)}
    return out


# -- plain HSDP over two replicate axes ------------------------------------------------------
def linear_hsdp(rank: int, folder: str) -> dict[str, Any]:
    bound = mc.init_mesh("r1=2 r2=2 dp=2")
    m = model()
    for i in (0, 2, 4):
        mc.nn.fully_shard(m[i], bound, axis="dp", replicate=["r1", "r2"])   # any sequence
    mc.nn.fully_shard(m, bound, axis="dp", replicate=("r1", "r2"))
    x, y = data()
    losses, per_step = train(m, x[rank:rank + 1], y[rank:rank + 1])   # the batch of 8 over 8
    mc.nn.save_checkpoint(m.state_dict(), folder)
    flat = mc.init_mesh("dp=8")
    fresh = model(seed=1)
    for i in (0, 2, 4):
        mc.nn.fully_shard(fresh[i], flat)
    mc.nn.fully_shard(fresh, flat)
    mc.nn.load_checkpoint(fresh.state_dict(), folder)
    return {"losses": losses, "sent": per_step,
            "params": {n: p.full_tensor() for n, p in m.named_parameters()},
            "loaded": {n: p.full_tensor() for n, p in fresh.named_parameters()},
            "files": sorted(p.name for p in Path(folder).glob("rank*.pt")),
            "local": {n: p.to_local().clone() for n, p in m.named_parameters()},
            "placements": str(tuple(m[2].weight.placements)),
            "replicate": [u.replicate for u in units(m)],
            "schedule": mc.nn.fsdp_schedule(m)}


def errors() -> dict[str, Any]:
    bound = mc.init_mesh("r1=2 r2=2 dp=2")
    m = model()

    def shard(replicate: Any) -> str:
        return outcome(lambda: mc.nn.fully_shard(m, bound, axis="dp", replicate=replicate))
    out: dict[str, Any] = {
        "axis": shard(("r1", "dp")), "unknown": shard(["r1", "rr"]), "twice": shard(("r2", "r2")),
        "number": shard(2), "items": shard(("r1", 2)), "one": shard("dp")}
    out["untouched"] = not hasattr(m, UNIT_ATTR) and all(
        type(p) is nn.Parameter for p in m.parameters())
    one = mc.nn.fully_shard(model(), bound, axis="dp", replicate="r2")
    out["one axis"] = (getattr(one, UNIT_ATTR).replicate, str(tuple(one[0].weight.placements)))
    return out


def worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {"cp": cp_hsdp(rank), "linear": linear_hsdp(rank, folder), "errors": errors()}


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("hsdp_axes") / "checkpoint"
    return run_scaled(worker, 8, str(folder), timeout_s=240.0)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float,
          atol: float) -> bool:
    return all(torch.allclose(got[n], w, rtol=rtol, atol=atol) for n, w in want.items())


def test_cp_with_hsdp_over_rep_and_cp_trains_as_one_process(eight: list[Any]) -> None:
    want_losses, want = cp_reference()
    for strategy in CP_STRATEGIES:
        for r in eight:
            got = r["cp"][strategy]
            assert max(abs(a - b) / b for a, b in zip(got["losses"], want_losses)) < 1e-12
            assert close(got["params"], want, 1e-10, 1e-12), strategy
    got = eight[0]["cp"]["allgather"]
    assert got["replicate"] == ("rep", "cp")
    assert got["placements"] == "(Replicate(), Shard(dim=0), Replicate())"
    # rank 0 (rep 0, dp 0, cp 0) holds what ranks 1 (cp 1), 4 (rep 1) and 5 hold
    for other in (1, 4, 5):
        for n, t in got["local"].items():
            assert torch.equal(t, eight[other]["cp"]["allgather"]["local"][n]), (other, n)
    assert not torch.equal(got["local"]["wq"], eight[2]["cp"]["allgather"]["local"]["wq"])
    # one unit: all_gather, again in backward, reduce_scatter over dp (one shard each), then
    # one all_reduce over the 4 ranks of rep x cp (2 * 3/4 of a shard); 4 shards of 8 x 16
    assert got["schedule"].count("all_reduce(rep, cp)") == 1
    shard = 4 * 8 * 16 * 8
    assert got["sent"] == [shard * 3 + shard * 3 // 2] * STEPS


def test_hsdp_over_two_replicate_axes_trains_as_one_process(eight: list[Any]) -> None:
    assert BATCH == 8
    want_losses, want = reference(STEPS)
    for r in eight:
        got = r["linear"]
        assert max(abs(a - b) / b for a, b in zip(got["losses"], want_losses)) < 1e-5
        assert close(got["params"], want, 1e-4, 1e-6)
        assert close(got["loaded"], got["params"], 0, 0)       # the checkpoint, onto dp=8
    got = eight[0]["linear"]
    assert got["replicate"] == [("r1", "r2")] * 4
    assert got["placements"] == "(Replicate(), Replicate(), Shard(dim=0))"
    for other in (2, 4, 6):                  # r1, r2 differ; dp 0: the same shards
        for n, t in got["local"].items():
            assert torch.equal(t, eight[other]["linear"]["local"][n]), (other, n)
    assert got["files"] == ["rank0.pt", "rank1.pt"]     # r1 = r2 = 0 write, once per shard
    assert got["schedule"].count("all_reduce(r1, r2)") == 3    # the root owns no parameters
    # all_gather + all_gather in backward + reduce_scatter over dp=2: a padded shard each
    # (rows 5, 4, 2 of widths 6+1, 10+1, 7+1); then each unit's ring all_reduce over
    # r1 x r2 = 4, at position 0: its torch.chunk chunk c of the n elements, (n - c) + 3 c
    shards = (5 * 7, 4 * 11, 2 * 8)
    ring = sum((n - -(-n // 4)) + 3 * -(-n // 4) for n in shards)
    assert got["sent"] == [(sum(shards) * 3 + ring) * 4] * STEPS


def test_bad_replicate_values_raise_before_communicating(eight: list[Any]) -> None:
    e = eight[0]["errors"]
    mesh = "Mesh(r1=2, r2=2, dp=2)"
    assert e["axis"] == (f"MeshAxisError: fully_shard(replicate=('r1', 'dp')): not an axis of"
                         f" {mesh} other than axis='dp' ('dp'); fix: one of ['r1', 'r2']")
    assert e["unknown"] == (f"MeshAxisError: fully_shard(replicate=['r1', 'rr']): not an axis"
                            f" of {mesh} other than axis='dp' ('rr'); fix: one of ['r1', 'r2']")
    assert e["twice"] == ("MeshAxisError: fully_shard(replicate=('r2', 'r2')): names 'r2'"
                          " more than once; fix: name each axis once, replicate=('r2',)")
    for key, given in (("number", "2"), ("items", "('r1', 2)")):
        assert e[key] == (f"MeshAxisError: fully_shard(replicate={given}): takes a mesh axis"
                          " name or a sequence of them; fix: e.g. replicate=('r1', 'r2') (the"
                          f" axes of {mesh} other than axis='dp': ['r1', 'r2'])")
    assert e["one"] == (f"MeshAxisError: fully_shard(replicate='dp'): not an axis of {mesh}"
                        " other than axis='dp'; fix: one of ['r1', 'r2']")
    assert e["untouched"]
    assert e["one axis"] == (("r2",), "(Replicate(), Replicate(), Shard(dim=0))")
