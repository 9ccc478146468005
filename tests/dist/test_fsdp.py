"""mc.nn.fully_shard on unmodified nn.Modules, on 4 gloo ranks (mesh dp=4), against the same
model trained in one process: losses, gradients, DTensor parameters, mixed precision,
meta-device construction with per-rank memory, and bad input before any communication.

Data parallel convention (as FSDP2): each rank's loss is the mean over its own quarter of
the batch, gradients are averaged over the ranks, so training equals one process on the
whole batch.
"""

from __future__ import annotations

import re
import resource
from typing import Any

import torch
import torch.nn.functional as F
from conftest import outcome, ranks_fixture
from torch import nn

import meshcomm as mc

BATCH = 8


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # uneven dim 0 on purpose: 10, 7 and 3 rows over 4 ranks (bias of 3: one rank holds none)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(),
                         nn.Linear(7, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    x, y = data()
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def sharded(bound: mc.BoundMesh, **options: Any) -> nn.Module:
    m = model()
    for i in (0, 2, 4):
        mc.nn.fully_shard(m[i], bound, **options)
    return mc.nn.fully_shard(m, bound)


def train(bound: mc.BoundMesh, m: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    x, y = data()
    q = BATCH // 4
    pos = bound.mesh.coords(bound.rank)["dp"]
    x, y = x[pos * q:(pos + 1) * q], y[pos * q:(pos + 1) * q]
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 4)
    return losses


def worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    bound = mc.init_mesh("dp=4")
    out: dict[str, Any] = {"runs": {}}
    for raf in (True, False):
        for prefetch in (True, False):
            m = sharded(bound, reshard_after_forward=raf, prefetch=prefetch)
            losses = train(bound, m, 4)
            params = {n: p.full_tensor() for n, p in m.named_parameters()}
            out["runs"][(raf, prefetch)] = (losses, params)
    m = sharded(bound)
    out["types"] = {n: (type(p).__name__, isinstance(p, nn.Parameter), tuple(p.placements),
                        tuple(p.to_local().shape))
                    for n, p in m.named_parameters() if isinstance(p, DTensor)}
    out["shard0"] = all(p.placements == (Shard(0),) for p in m.parameters())
    out["state_dict"] = sorted(type(v).__name__ for v in m.state_dict().values())
    train(bound, m, 1)
    x, y = data()
    F.cross_entropy(m(x[:2]), y[:2]).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    out["clip"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    out["schedule"] = mc.nn.fsdp_schedule(m)
    units = [getattr(x, mc.nn.fsdp.UNIT_ATTR) for x in (m, m[0], m[2], m[4])]
    out["shared"] = (len({id(u.schedule) for u in units}), len(units[0].schedule.order),
                     units[0].schedule.recording)
    out["in_flight"] = {prefetch: in_flight(bound, prefetch) for prefetch in (True, False)}
    out["mixed"] = mixed(bound)
    out["meta"] = meta(bound)
    out["errors"] = errors(bound)
    return out


def in_flight(bound: mc.BoundMesh, prefetch: bool) -> list[tuple[str, bool]]:
    """Per step, whether the next unit's all_gather was issued (and not yet used) while a
    unit computes: in forward while layer 0 runs (layer 2's gather), in backward when layer
    4's backward is done (layer 2's gather, issued at layer 4's first saved-tensor use)."""
    m = sharded(bound, prefetch=prefetch)
    unit = getattr(m[2], mc.nn.fsdp.UNIT_ATTR)
    seen: list[tuple[str, bool]] = []
    m[0].register_forward_hook(
        lambda *_: seen.append(("forward", id(unit) in unit.schedule.ahead)))
    m[4].register_full_backward_hook(
        lambda *_: seen.append(("backward", id(unit) in unit.schedule.ahead)))
    train(bound, m, 2)
    return seen


def mixed(bound: mc.BoundMesh) -> dict[str, Any]:
    """bfloat16 gathers and compute, float32 gradient reduction and storage."""
    policy = mc.nn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = sharded(bound, mp_policy=policy)
    base = sharded(bound)
    losses = train(bound, m, 3)
    unit = getattr(m[0], mc.nn.fsdp.UNIT_ATTR)
    unit_fp32 = getattr(base[0], mc.nn.fsdp.UNIT_ATTR)
    unit.sent_bytes = unit_fp32.sent_bytes = 0
    x, _ = data()
    with torch.no_grad():
        m(x)
        base(x)
    return {"losses": losses, "param_dtypes": sorted({str(p.dtype) for p in m.parameters()}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in m.parameters()
                                   if p.grad is not None}),
            "gather_bytes": (unit.sent_bytes, unit_fp32.sent_bytes)}


def value(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
    """A parameter's values as a function of the global index (any block, computed alone)."""
    seed = float(sum(map(ord, name)) % 97)
    out = torch.full([s.stop - s.start for s in index], seed)
    for k, s in enumerate(index):          # broadcast adds: no full-size temporaries
        view = [1] * len(index)
        view[k] = s.stop - s.start
        out += torch.arange(s.start, s.stop, dtype=torch.float32).view(view) * (k + 3)
    return out.sin_().div_(10)


def meta(bound: mc.BoundMesh) -> dict[str, Any]:
    """A model built on the meta device, sharded, then only this rank's shards allocated:
    128 MiB of float32 parameters over 4 ranks, under a per-process budget of 64 MiB."""
    width, layers = 2048, 8                    # 8 x 2048 x 2048 x 4 B = 128 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in big:
        mc.nn.fully_shard(layer, bound)
    mc.nn.fully_shard(big, bound)
    big.to_empty(device="cpu")
    mc.nn.init_shards(big, value)
    local_bytes = sum(p.to_local().numel() * 4 for p in big.parameters())
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    # the shards hold exactly what the full parameters would: check one block of layer 0
    w = big[0].weight
    rows = w.to_local().shape[0]
    start = bound.mesh.coords(bound.rank)["dp"] * rows
    want = value("0.weight", (width, width), (slice(start, start + rows), slice(0, width)))
    small_ok = torch.equal(w.to_local(), want)
    # and a small meta model, gathered whole, equals the same function on full tensors
    with torch.device("meta"):
        tiny = model()
    for i in (0, 2, 4):
        mc.nn.fully_shard(tiny[i], bound)
    tiny.to_empty(device="cpu")
    mc.nn.init_shards(tiny, value)
    full_ok = all(torch.equal(p.full_tensor(), value(n, tuple(p.shape),
                                                     tuple(slice(0, s) for s in p.shape)))
                  for n, p in tiny.named_parameters())
    return {"local_bytes": local_bytes, "total_bytes": 4 * width * width * layers,
            "grown": grown, "budget": 64 * 2**20, "block_ok": small_ok, "full_ok": full_ok}


def errors(bound: mc.BoundMesh) -> dict[str, str]:
    out = {}

    def attempt(name: str, fn: Any) -> None:
        out[name] = outcome(fn)

    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    attempt("tied", lambda: mc.nn.fully_shard(tied, bound))
    attempt("axis", lambda: mc.nn.fully_shard(nn.Linear(2, 2), bound, axis="tp"))
    m = nn.Linear(2, 2)
    mc.nn.fully_shard(m, bound)
    attempt("twice", lambda: mc.nn.fully_shard(m, bound))
    outer = nn.Sequential(nn.Linear(2, 2))
    mc.nn.fully_shard(outer, bound)
    attempt("root_first", lambda: mc.nn.fully_shard(outer[0], bound))
    attempt("mesh", lambda: mc.nn.fully_shard(nn.Linear(2, 2), mc.Mesh("dp=4")))
    half = mc.init_mesh("dp=2", ranks=[0, 1])           # made on every rank; 2 and 3 outside
    attempt("outside", lambda: mc.nn.fully_shard(nn.Linear(2, 2), half))
    return out


four = ranks_fixture(worker, 4)


def test_training_equals_one_process_in_every_mode(four: list[dict[str, Any]]) -> None:
    want_losses, want_params = reference(4)
    for mode, (losses, params) in four[0]["runs"].items():
        assert max(abs(a - b) / b for a, b in zip(losses, want_losses)) < 1e-5, mode
        for name, p in params.items():
            assert torch.allclose(p, want_params[name], rtol=1e-5, atol=1e-6), (mode, name)
    assert all(r["runs"].keys() == four[0]["runs"].keys() for r in four)


def test_parameters_are_dtensor_shards(four: list[dict[str, Any]]) -> None:
    types = four[0]["types"]
    assert set(types) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(t[0] == "DTensor" and t[1] for t in types.values())
    assert all(r["shard0"] for r in four)
    # uneven dim 0 over 4 ranks as torch.chunk: 10 -> 3,3,3,1; 3 -> 1,1,1,0
    assert [r["types"]["0.weight"][3] for r in four] == [(3, 6), (3, 6), (3, 6), (1, 6)]
    assert [r["types"]["4.bias"][3] for r in four] == [(1,), (1,), (1,), (0,)]
    assert four[0]["state_dict"] == ["DTensor"] * 6
    assert len({r["clip"] for r in four}) == 1 and four[0]["clip"] > 0


def test_mixed_precision_gathers_bfloat16_and_keeps_float32(four: list[dict[str, Any]]) -> None:
    mixed = four[0]["mixed"]
    want, _ = reference(3)
    assert max(abs(a - b) / b for a, b in zip(mixed["losses"], want)) < 2e-2
    assert mixed["param_dtypes"] == ["torch.float32"] == mixed["grad_dtypes"]
    bf16, fp32 = mixed["gather_bytes"]
    assert bf16 * 2 == fp32 > 0


def test_a_meta_model_allocates_only_this_rank_s_shards(four: list[dict[str, Any]]) -> None:
    for r in four:
        meta = r["meta"]
        assert meta["local_bytes"] * 4 == meta["total_bytes"]
        assert meta["total_bytes"] > meta["budget"] >= meta["grown"], meta
        assert meta["block_ok"] and meta["full_ok"]


def test_bad_input_is_refused_before_communicating(four: list[dict[str, Any]]) -> None:
    errors = four[0]["errors"]
    assert errors["tied"] == "ran"     # a tie inside one unit is kept (tests/dist/test_ties.py)
    assert errors["axis"].startswith("MeshAxisError: fully_shard(axis='tp'): not an axis of")
    assert "already sharded" in errors["twice"]
    assert errors["root_first"].startswith(
        "ShapeError: fully_shard: parameter weight is sharded by another unit already: a module"
        " around this one was fully_shard'ed first. fix: fully_shard the inner modules first")
    assert errors["mesh"].startswith("MeshMismatchError: fully_shard needs a DeviceMesh or a mesh"
                                     " bound to torch.distributed, got")
    assert [r["errors"]["outside"] for r in four][:2] == ["ran"] * 2
    for rank in (2, 3):
        assert four[rank]["errors"]["outside"].startswith(
            f"MeshMismatchError: fully_shard: rank {rank} is not in Mesh(dp=2) (its ranks are"
            " [0, 1]), so it holds no shard")
    same = [{k: v for k, v in r["errors"].items() if k != "outside"} for r in four]
    assert all(e == same[0] for e in same)


def test_prefetch_issues_the_next_gather_before_a_unit_computes(
        four: list[dict[str, Any]]) -> None:
    # step 1 records the order (no forward prefetch yet); from step 2 on, layer 2's gather
    # is in flight while layer 0 computes; backward prefetches in both steps
    assert four[0]["in_flight"][True] == [("forward", False), ("backward", True),
                                          ("forward", True), ("backward", True)]
    assert four[0]["in_flight"][False] == [("forward", False), ("backward", False)] * 2


def test_each_model_records_its_own_order(four: list[dict[str, Any]]) -> None:
    """The fifth model built in the process still gets one schedule for its 4 units, recorded
    in its first forward (prefetch follows it from the second)."""
    assert four[0]["shared"] == (1, 4, False)


def test_the_schedule_says_what_overlaps_what(four: list[dict[str, Any]]) -> None:
    lines = [re.split(r"\s{2,}", line) for line in four[0]["schedule"].splitlines()]
    assert [(w[0], w[1], w[2]) for w in lines] == [
        ("forward", "all_gather", "0"), ("forward", "all_gather", "2"),
        ("forward", "all_gather", "4"),
        ("backward", "all_gather", "4"), ("backward", "reduce_scatter", "4"),
        ("backward", "all_gather", "2"), ("backward", "reduce_scatter", "2"),
        ("backward", "all_gather", "0"), ("backward", "reduce_scatter", "0")]
    # layer 2: a 7x10 weight (2 rows a rank, padded) + 7 bias (2 a rank): 22 x 4 B x 3 peers
    assert lines[1][3] == "264 B" and lines[1][4].endswith("issued before 0 computes (prefetch)")
    assert lines[4][4].endswith("runs while 2's backward computes")
