"""Check mode's watch on replicated parameters (meshcomm/nn/drift.py): after `parallelize`,
the gradients of the parameters left replicated over tp are compared across tp after every
backward, and the first step where they differ raises ReplicaDriftError on every rank.

On 4 gloo ranks: a toy module with a per-head norm between a colwise and a rowwise layer
(on tp=4, and on dp=2 x tp=2 under fully_shard), and transformers' Qwen3 (per-head
`q_norm`/`k_norm`) under a hand-written plan, on dp=2 x tp=2 under fully_shard. A plan that
leaves the norm's gradient unsummed raises at step 1 naming it; the same plan with the
norm under "sp_params" trains silently, equal to one process; without check mode nothing
is installed and a step makes only tensor parallelism's own collectives. The digest is
tested in this process.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import torch
from conftest import outcome, ranks_fixture, scaled
from torch import nn

import meshcomm as mc
from meshcomm.executors.distributed import wire
from meshcomm.nn.drift import COMPARED, WATCH_ATTR, Watch, digest
from meshcomm.nn.parallel import STYLES
from meshcomm.runtime.checks import Disagreement

HIDDEN, HEADS, HEAD_DIM, BATCH, SEQ, STEPS = 8, 4, 3, 4, 6, 3
UNSUMMED = {"up": "colwise", "down": "rowwise"}
SUMMED = {**UNSUMMED, "norm": "sp_params"}


# -- the digest, in this process -----------------------------------------------------------------
def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(digest(a)[:COMPARED], digest(b)[:COMPARED])


def test_equal_values_digest_alike_and_any_change_shows() -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert same(x, x.clone())
    assert same(torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([-0.0, -float("nan"), 1.0]))
    assert not same(x, x.flip(0))                       # the same values, elsewhere
    assert not same(x, torch.cat([x[1:2], x[:1], x[2:]]))   # two swapped
    bumped = x.clone()
    bumped[17] = torch.nextafter(bumped[17], torch.tensor(1e9))   # one ulp
    assert not same(x, bumped)
    assert not same(x.to(torch.bfloat16), bumped.to(torch.bfloat16) * 2)
    assert same(None, None) and not same(None, torch.zeros(3))
    assert digest(None)[0] == 0 and digest(x)[0] == 1
    total = digest(x)[3:].view(torch.float64).item()
    assert total == pytest.approx(float(x.double().sum()))


def test_a_sharded_modules_shards_are_not_compared_as_copies() -> None:
    """A ShardedModule (ColumnParallelLinear) registers its local shard as a plain parameter:
    split over tp, it differs by design and is not watched over tp; a norm beside it is."""
    from meshcomm.nn.drift import replicated

    bound = mc.nn.planning_mesh("fsdp=2 tp=2")
    model = nn.Sequential(nn.LayerNorm(16),
                          mc.nn.ColumnParallelLinear(bound, "fsdp_tp", torch.zeros(16, 32)))
    watched = [name for name, _ in replicated(model, bound, "tp")]
    assert watched == ["0.weight", "0.bias"]
    assert [name for name, _ in replicated(model, bound, "fsdp")] == ["0.weight", "0.bias"]


def test_the_message_names_the_first_parameter_a_few_others_and_the_fix() -> None:
    bound = mc.BoundMesh(mc.Mesh("dp=2 tp=2"), "gloo", torch.device("cpu"), 3, {}, True)
    watch = Watch(nn.Linear(1, 1), bound, "tp", ["replicated_grad_sum", "sp_params"])
    watch.passes = 2
    names = [f"layers.{i}.attn.q_norm.weight" for i in range(6)] + ["scale"]
    total = torch.tensor([0.5], dtype=torch.float64).view(torch.int64).item()
    found = Disagreement((1, 2, 3, 4, 5, 6), ((2,), (3,)), ((1, 7, 8, total), (0, 0, 0, 0)))
    assert watch.message(names, found) == (
        "check mode: at step 2 (backward pass 2 through Linear since parallelize), the"
        " gradient of layers.1.attn.q_norm.weight, which is replicated over tp, differs"
        " between the ranks that hold its copies (ranks 2, 3): rank 2: gradient sum 0.5;"
        " rank 3: no gradient; 5 more differ: layers.2.attn.q_norm.weight,"
        " layers.3.attn.q_norm.weight, layers.4.attn.q_norm.weight and 2 more. The optimizer"
        " would make the copies drift apart.\n"
        "  fix: sum its gradient over tp: give layers.1.attn.q_norm a style that does"
        ' ("replicated_grad_sum" or "sp_params") in the parallelize plan, e.g.'
        ' {"layers.*.attn.q_norm": "replicated_grad_sum"}. A parameter used on activations'
        " split over tp (a per-head norm between colwise and rowwise layers, a norm on"
        " sequence-split activations) gets only this rank's part of its gradient")
    root = watch.message(names, found._replace(items=(6,)))
    assert "the gradient of scale," in root and "fix: sum its gradient over tp: move it into" \
        ' a submodule and give that a style that does ("replicated_grad_sum" or "sp_params")' \
        " in the parallelize plan. A parameter" in root, root


# -- the toy module ------------------------------------------------------------------------------
class HeadNorm(nn.Module):
    """A per-head scale: one weight of HEAD_DIM, applied to every head this rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Toy(nn.Module):
    def __init__(self, out_bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.norm = HeadNorm()
        self.down = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.out = nn.LayerNorm(HIDDEN, bias=out_bias)   # replicated outside the region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.norm(h.unflatten(-1, (-1, HEAD_DIM))).flatten(-2)   # this rank's heads
        return self.out(x + self.down(torch.tanh(h)))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN,
                                                                      generator=g)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, halves: bool = False
          ) -> list[float]:
    """SGD steps on the mean squared error; `halves`: two forwards (one per half of the
    batch) into each backward, the same loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        if halves:
            n = len(x) // 2
            loss = (((model(x[:n]) - y[:n]) ** 2).mean() + ((model(x[n:]) - y[n:]) ** 2).mean()) / 2
        else:
            loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full(p: Any) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def run_toy(mesh: str, plan: dict[str, str], check: bool, odd_rank: int = -1,
            halves: bool = False, noise: dict[str, float] | None = None,
            rtol: float = 0.0, inf_on: str | None = None) -> dict[str, Any]:
    """Train the toy under `plan` (and fully_shard over dp where the mesh has it); its
    outcome, losses, parameters, the backward passes checked and the collectives of the
    last step. Rank `odd_rank` builds it without one parameter. `noise`: parameter name ->
    f, its gradient times 1 + rank * f on each rank (as a nondeterministic kernel's last
    bits); `rtol`: the check's tolerance; `inf_on`: a parameter whose gradient's first value is
    inf on rank 1 only."""
    bound = mc.init_mesh(mesh, check=check, timeout_s=scaled(120))
    model = mc.nn.parallelize(Toy(out_bias=bound.rank != odd_rank), bound, plan, axis="tp",
                              drift_rtol=rtol)
    for name, f in (noise or {}).items():
        model.get_parameter(name).register_hook(lambda g, f=f: g * (1 + bound.rank * f))
    if inf_on is not None and bound.rank == 1:
        model.get_parameter(inf_on).register_hook(
            lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("inf")).view_as(g))
    dp = bound.mesh.axis_size("dp") if "dp" in bound.mesh.axis_names else 1
    if dp > 1:
        mc.nn.fully_shard(model, bound, axis="dp")
    share = BATCH // dp
    me = bound.coords.get("dp", 0)
    x, y = (t[me * share:(me + 1) * share] for t in data())
    losses: list[float] = []
    with wire.recording() as heard:
        ran = outcome(lambda: losses.extend(train(model, x, y, halves)))
    calls = [(w.kind, w.numel_in) for w, _ in heard]
    watch = getattr(model, WATCH_ATTR, None)
    return {"outcome": ran, "losses": losses, "watched": watch is not None,
            "passes": None if watch is None else watch.passes,
            "calls_per_step": len(calls) / STEPS, "calls": calls[:len(calls) // STEPS],
            "params": {k: full(p) for k, p in model.named_parameters()}}


def toy_worker(rank: int, world: int) -> dict[str, Any]:
    return {"tp unsummed": run_toy("tp=4", UNSUMMED, True),
            "tp summed": run_toy("tp=4", SUMMED, True),
            "tp unsummed, check off": run_toy("tp=4", UNSUMMED, False),
            "tp summed, check off": run_toy("tp=4", SUMMED, False),
            "fsdp unsummed": run_toy("dp=2 tp=2", UNSUMMED, True),
            "fsdp summed": run_toy("dp=2 tp=2", SUMMED, True),
            "tp summed, two forwards a pass": run_toy("tp=4", SUMMED, True, halves=True),
            "tp other parameters": run_toy("tp=4", SUMMED, True, odd_rank=3),
            # nondeterministic last bits: exact raises, a tolerance lets them pass and still
            # catches what differs by more (the first differing parameter tolerated)
            "noisy": run_toy("tp=4", SUMMED, True, noise=NEAR),
            "noisy, tolerated": run_toy("tp=4", SUMMED, True, noise=NEAR, rtol=1e-5),
            "noisy and far, tolerated": run_toy("tp=4", SUMMED, True, rtol=1e-5,
                                                noise={**NEAR, "out.weight": 1e-2}),
            "unsummed, tolerated": run_toy("tp=4", UNSUMMED, True, rtol=1e-5),
            "inf on one rank, tolerated": run_toy("tp=4", SUMMED, True, rtol=1e-5,
                                                  noise=NEAR, inf_on="out.weight"),
            "tolerances differ": run_toy("tp=4", SUMMED, True, noise=NEAR,
                                         rtol=1e-5 if rank != 2 else 2e-5),
            "a negative tolerance": outcome(lambda: mc.nn.parallelize(
                Toy(), mc.init_mesh("tp=4", check=True), SUMMED, drift_atol=-1e-6))}


NEAR = {"norm.weight": 1e-6}     # float32 gradients: 8 ulps or so apart


toy = ranks_fixture(toy_worker, 4)


def drift_message(step: int, name: str, group: str, module: str) -> str:
    return (f"ReplicaDriftError: check mode: at step {step} (backward pass {step} through"
            f" {module} since parallelize), the gradient of {name}, which is replicated over"
            f" tp, differs between the ranks that hold its copies ({group}): ")


TP_GROUPS = {"tp unsummed": ["ranks 0-3"] * 4,                        # tp=4
             "fsdp unsummed": ["ranks 0, 1"] * 2 + ["ranks 2, 3"] * 2}  # dp=2 tp=2


@pytest.mark.parametrize("case, groups", list(TP_GROUPS.items()))
def test_an_unsummed_per_head_norm_raises_at_step_1_on_every_rank(
        toy: list[dict[str, Any]], case: str, groups: list[str]) -> None:
    for rank, got in enumerate(toy):
        text = got[case]["outcome"]
        assert text.startswith(drift_message(1, "norm.weight", groups[rank], "Toy")), text
        fix = re.search(r'fix: sum its gradient over tp: give norm a style that does \((.*)\)'
                        r' in the parallelize plan, e\.g\. \{"norm": "(\w+)"\}', text)
        assert fix is not None and '"sp_params"' in fix[1].split(" or "), text
        assert STYLES[fix[2]].grad_sum and STYLES[fix[2]].split is None, text
        assert re.search(r"\): rank \d: gradient sum [-\d.e]+; rank \d: gradient sum", text), text
        assert got[case]["losses"] == [], "raised in the first backward, before any step"
    # the ranks of a group report the same message
    assert len({got[case]["outcome"] for got, g in zip(toy, groups) if g == groups[0]}) == 1


@pytest.mark.parametrize("case", ["tp summed", "fsdp summed", "tp summed, two forwards a pass"])
def test_a_summed_plan_trains_silently_as_in_one_process(toy: list[dict[str, Any]],
                                                         case: str) -> None:
    ref = Toy()
    want = train(ref, *data())
    assert all(got[case]["outcome"] == "ran" for got in toy)
    assert all(got[case]["passes"] == STEPS for got in toy)     # one check per backward
    # each dp rank's loss is its share's mean: their mean is the batch's
    losses = torch.tensor([got[case]["losses"] for got in toy]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want), rtol=1e-5, atol=1e-6)
    for key, p in ref.named_parameters():
        for got in toy:
            torch.testing.assert_close(got[case]["params"][key], p.detach(), rtol=1e-5,
                                       atol=1e-6, msg=lambda m, key=key: f"{case} {key}: {m}")


def test_ranks_that_hold_other_parameters_raise_a_mismatch(toy: list[dict[str, Any]]) -> None:
    """Nothing to compare: every rank raises check mode's CollectiveMismatchError."""
    head = ("CollectiveMismatchError: gradients of replicated parameters over tp: rank 3 asked"
            " for gradients of replicated parameters over tp items=4, names=")
    fix = ("  fix: the ranks compare different items (their count or names differ): build the"
           " same model, the same way, on every rank of the group")
    for got in toy:
        text = got["tp other parameters"]["outcome"]
        assert text.startswith(head) and text.endswith(fix), text
        # (the items: the replicated parameters and the drift tolerance)
        assert "but ranks 0-2 asked for gradients of replicated parameters over tp items=5" \
            in text, text


def test_without_check_mode_the_copies_drift_silently(toy: list[dict[str, Any]]) -> None:
    """What check mode catches: the same unsummed plan runs, and the norm's copies part."""
    case = "tp unsummed, check off"
    assert all(got[case]["outcome"] == "ran" for got in toy)
    norms = [got[case]["params"]["norm.weight"] for got in toy]
    assert not any(torch.equal(norms[0], n) for n in norms[1:])
    want = train(Toy(), *data())
    assert toy[0][case]["losses"][0] == pytest.approx(want[0], rel=1e-5)   # equal until a step
    assert toy[0][case]["losses"][-1] != pytest.approx(want[-1], rel=1e-5)


def test_without_check_mode_nothing_is_installed_and_nothing_extra_is_sent(
        toy: list[dict[str, Any]]) -> None:
    off, on = toy[0]["tp summed, check off"], toy[0]["tp summed"]
    assert not off["watched"] and not toy[0]["tp unsummed, check off"]["watched"]
    assert on["watched"]
    # tensor parallelism's own: the rowwise sum, the norm's gradient sum (sp_params); the
    # input is data, so no gradient of it is summed
    assert off["calls"] == [("all_reduce", BATCH * SEQ * HIDDEN), ("all_reduce", HEAD_DIM)]
    assert toy[0]["tp unsummed, check off"]["calls"] == off["calls"][:1]
    # check mode: a 4-int probe before each of those, and one after backward for the
    # replicated gradients (all equal: nothing else is sent)
    probe = ("all_reduce", 4)
    assert [c for c in on["calls"] if c != probe] == off["calls"]
    assert on["calls"].count(probe) == len(off["calls"]) + 1 and on["calls"][-1] == probe


# -- transformers' Qwen3: per-head q_norm / k_norm -----------------------------------------------
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install -e"
                                        " '.[test]' installs it)")
VOCAB = 64
_L = "model.layers.*."
QWEN3_UNSUMMED = {"model.embed_tokens": "embedding",       # test_hf.py's LLAMA_TP
                  _L + "self_attn.[qkv]_proj": "colwise", _L + "self_attn.o_proj": "rowwise",
                  _L + "mlp.gate_proj": "colwise", _L + "mlp.up_proj": "colwise",
                  _L + "mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}
QWEN3_PLANS: dict[str, dict[str, str] | str] = {
    "unsummed": QWEN3_UNSUMMED,
    "summed": {**QWEN3_UNSUMMED, _L + "self_attn.[qk]_norm": "replicated_grad_sum"},
    "auto": "auto",                                          # the model's own plan
}


def qwen3() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
        attn_implementation="eager")
    return transformers.Qwen3ForCausalLM(config)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def train_lm(model: Any, x: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def qwen3_worker(rank: int, world: int) -> dict[str, Any]:
    """Qwen3 on dp=2 x tp=2 in check mode, parallelized then fully_shard'ed (each block,
    then the root), under each plan."""
    out = {}
    for case, plan in QWEN3_PLANS.items():
        bound = mc.init_mesh("dp=2 tp=2", check=True, timeout_s=scaled(120))
        model = mc.nn.parallelize(qwen3(), bound, plan, axis="tp")
        for block in model.model.layers:
            mc.nn.fully_shard(block, bound, axis="dp")
        mc.nn.fully_shard(model, bound, axis="dp")
        share = BATCH // 2
        me = bound.coords["dp"]
        losses: list[float] = []
        ran = outcome(lambda: losses.extend(train_lm(model, tokens()[me * share:(me + 1) * share])))
        out[case] = {"outcome": ran, "losses": losses,
                     "params": {k: full(p) for k, p in model.named_parameters()}}
    return out


four_qwen3 = ranks_fixture(qwen3_worker, 4, timeout_s=400)


@needs_transformers
def test_qwen3_with_unsummed_per_head_norms_raises_at_step_1(
        four_qwen3: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(four_qwen3):
        text = got["unsummed"]["outcome"]
        group = "ranks 0, 1" if rank < 2 else "ranks 2, 3"
        assert text.startswith(drift_message(1, "model.layers.0.self_attn.q_norm.weight", group,
                                             "Qwen3ForCausalLM")), text
        assert "model.layers.0.self_attn.k_norm.weight" in text    # the next that differ
        assert 'e.g. {"model.layers.*.self_attn.q_norm": "' in text, text
        assert got["unsummed"]["losses"] == []


@needs_transformers
@pytest.mark.parametrize("case", ["summed", "auto"])
def test_qwen3_with_summed_norms_trains_silently_as_in_one_process(
        four_qwen3: list[dict[str, Any]], case: str) -> None:
    ref = qwen3()
    want = train_lm(ref, tokens())
    assert all(got[case]["outcome"] == "ran" for got in four_qwen3), four_qwen3[0][case]
    losses = torch.tensor([got[case]["losses"] for got in four_qwen3]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want), rtol=1e-5, atol=1e-6)
    for key, p in ref.named_parameters():
        for got in four_qwen3:
            torch.testing.assert_close(got[case]["params"][key], p.detach(), rtol=1e-4,
                                       atol=1e-5, msg=lambda m, key=key: f"{case} {key}: {m}")


def test_a_tolerance_lets_last_bits_differ_and_still_catches_more(
        toy: list[dict[str, Any]]) -> None:
    """Bit for bit by default: gradients a few ulps apart raise (as nondeterministic kernels
    may make them); with drift_rtol they train, and a parameter further apart, or a plan
    that forgot a sum, still raises, named as without a tolerance."""
    for rank, got in enumerate(toy):
        assert got["noisy"]["outcome"].startswith(
            drift_message(1, "norm.weight", "ranks 0-3", "Toy")), got["noisy"]["outcome"]
        assert got["noisy, tolerated"]["outcome"] == "ran"
        assert got["noisy, tolerated"]["passes"] == STEPS
        assert got["noisy and far, tolerated"]["outcome"].startswith(
            drift_message(1, "out.weight", "ranks 0-3", "Toy")), \
            got["noisy and far, tolerated"]["outcome"]
        assert got["unsummed, tolerated"]["outcome"].startswith(
            drift_message(1, "norm.weight", "ranks 0-3", "Toy"))
        # an infinity on one rank is never within a tolerance (it passed before)
        assert got["inf on one rank, tolerated"]["outcome"].startswith(
            drift_message(1, "out.weight", "ranks 0-3", "Toy")), \
            got["inf on one rank, tolerated"]["outcome"]
        # ranks with other tolerances would decide differently whether to compare values
        assert got["tolerances differ"]["outcome"] == (
            f"ReplicaDriftError: check mode: parallelize's drift_rtol="
            f"{2e-5 if rank == 2 else 1e-5} and drift_atol=0.0 on rank {rank} are not those of"
            " every rank holding copies over tp (ranks 0-3); fix: pass the same tolerance to"
            " parallelize on every rank"), got["tolerances differ"]["outcome"]
        assert got["a negative tolerance"] == (
            "StyleError: parallelize(drift_atol=-1e-06): a tolerance is a finite number >= 0"
            " (0, the default: gradients compared bit for bit)")
    # what the tolerance costs where digests differ: the names' and the digests' gathers
    # (as an exact check that raises), and one all_reduce(max) of the differing gradients
    # (norm.weight: HEAD_DIM values, HEAD_DIM NaN flags, one presence; and their negatives)
    tolerated, exact = toy[0]["noisy, tolerated"]["calls"], toy[0]["tp summed"]["calls"]
    extra = list(tolerated)
    for call in exact:
        extra.remove(call)
    assert [kind for kind, _ in extra] == ["all_gather", "all_gather", "all_reduce"], extra
    assert extra[-1][1] == 2 * (1 + 2 * HEAD_DIM), extra
