"""The CUDA paths on a real GPU: skipped where torch sees none (CI machines have none).

Run on a GPU machine with `python -m pytest tests/test_cuda.py -rA`. What runs:

- every plan kind in the simulator on CUDA tensors (float32 and bfloat16), each checked
  exactly against the global tensor, the results left on the GPU;
- one process acting as rank 3 of a 1,024-rank job (torch's fake process group) with CUDA
  tensors: every plan kind through `mc.reshard`, a `fully_shard` + bf16 mixed-precision step,
  a `parallelize` + `vocab_parallel_cross_entropy` step, each repeated under
  `torch.cuda.set_sync_debug_mode("error")`, which raises at any host sync (`.item()`,
  `.tolist()`, a blocking copy between host and GPU): a step must launch its work and return;
  then rank 3 of a 64-rank job runs reduction trees (`send_recv` steps of action "tree",
  planned only on meshes of up to 256 ranks) the same way;
- a one-GPU NCCL job (world size 1): collectives over the NCCL group, `fully_shard` training
  equal to the same model in one process (float32, then bf16 mixed precision within bf16's
  rounding), `parallelize`, and a checkpoint saved and loaded on the GPU.

Several ranks on one GPU are not tested: NCCL refuses two ranks on one device, and four gloo
processes with CUDA tensors ended in SIGSEGV inside torch 2.11 on an H200 (the multi-rank
paths are the CPU tests' gloo runs, the same code with another backend name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import in_fresh_interpreter, run_scaled
from test_meta_device import CASES, MESH

import meshcomm as mc

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (on a GPU machine: python -m pytest tests/test_cuda.py)")


def exact(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Whole numbers below 128: every dtype holds them, and sums of a few stay exact."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, device=device) % 127).reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "src", "dst"), CASES)
def test_every_plan_kind_in_the_simulator_on_cuda(shape: tuple[int, ...], src: str, dst: str,
                                                   dtype: torch.dtype) -> None:
    mesh = mc.Mesh(MESH)
    x = exact(shape, dtype, "cuda")
    p = mc.plan(mesh, shape, src, dst, dtype=dtype)
    out = mc.sim.execute(p, mc.sim.scatter(x, mesh, src)).outputs
    assert all(o.device.type == "cuda" and o.dtype == dtype for o in out)
    assert torch.equal(mc.sim.gather(list(out), mesh, dst, shape), x)


# -- one process as rank 3 of 1,024 (fake process group), CUDA tensors ------------------------
SCALE_MESH = "dp=128 tp=8"
SCALE_CASES = [((2048, 64), "(dp a) (tp b)", "a b"),
               ((2048, 64), "(dp a) (tp b)", "(tp a) (dp b)"),
               ((2048, 64), "a b | sum(tp)", "(tp a) b"),
               ((2048, 64), "a b | sum(tp)", "a b"),
               ((2048, 64), "(dp a) (tp b)", "(dp tp a) b"),
               ((2048, 64), "(dp tp a) b", "(tp dp a) b"),
               ((2047, 64), "(dp tp a) b", "(tp dp a) b"),
               ((2048, 64), "a b", "(dp a) b | sum(tp)"),
               ((2048, 64), "(dp a) b | max(tp)", "a (dp b)")]


# Trees on rank 3 of 64: in some rounds of the first three it sends nothing but receives
# (`wire.all_to_all` then sends itself one row: torch's fake process group fills a receive
# from the rank's own input and cannot take an empty one); the last sends every round.
TREE_MESH = "dp=8 tp=8"
TREE_CASES = [((5, 3), "(tp a) b | max(dp)", "(dp a) b"),
              ((6,), "a | sum(dp)", "(dp tp a)"),
              ((4, 4), "(dp a) b | avg(tp)", "(tp a) b"),
              ((24, 5), "(dp a) b | sum(tp)", "(tp a) (dp b)")]


def no_sync(where: str, step: Any, problems: list[str]) -> None:
    """Run `step` once to warm caches, then again with host syncs raising (on CUDA)."""
    cuda = torch.cuda.is_available()
    try:
        step()
    except Exception as err:  # noqa: BLE001 - reported as data
        problems.append(f"{where}: {type(err).__name__}: {err}"[:600])
        return
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except Exception as err:  # noqa: BLE001
        problems.append(f"{where} (steady state): {type(err).__name__}: {err}"[:600])
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()


def _reshards(bound: Any, cases: list[tuple[tuple[int, ...], str, str]], device: str,
              problems: list[str], cost_model: mc.CostModel | None = None) -> None:
    """Each case through `mc.reshard` as rank 3 (`no_sync`), and its output's device and
    local shape checked."""
    for shape, src, dst in cases:
        x = torch.randn(mc.Layout(src).local_shape(bound.mesh, shape, 3), device=device)
        want = mc.Layout(dst).local_shape(bound.mesh, shape, 3)
        out: list[torch.Tensor] = []
        no_sync(f'reshard {shape} "{src}" -> "{dst}"',
                lambda x=x, shape=shape, src=src, dst=dst: out.append(
                    mc.reshard(x, bound, src, dst, shape=shape, cost_model=cost_model)),
                problems)
        if out and (out[-1].device.type != device or tuple(out[-1].shape) != want):
            problems.append(f"{src} -> {dst}: {out[-1].device} {tuple(out[-1].shape)}")


def fake_rank_worker(device: str = "cuda") -> dict[str, Any]:
    """Runs in a fresh interpreter (the fake process group is process-wide)."""
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=1024)
    bound = mc.init_mesh(SCALE_MESH, backend="fake")
    problems: list[str] = []
    if bound.device.type != device:
        problems.append(f"init_mesh on the fake backend computes on {bound.device}")
    _reshards(bound, SCALE_CASES, device, problems)

    dp = mc.init_mesh("dp=1024", backend="fake")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU())
                            for _ in range(4)]).to(device)
    policy = mc.nn.MixedPrecision(torch.bfloat16, torch.float32)
    for block in model:
        mc.nn.fully_shard(block, dp, mp_policy=policy)
    mc.nn.fully_shard(model, dp, mp_policy=policy)
    batch = torch.randn(16, 256, device=device)

    def fsdp_step() -> None:
        model(batch).float().sum().backward()
        for p in model.parameters():
            if p.grad is None or p.grad.device.type != device:
                problems.append(f"fully_shard: a gradient on {None if p.grad is None else p.grad.device}")
            p.grad = None
    no_sync("fully_shard + bf16 step", fsdp_step, problems)

    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512)).to(device)
    mc.nn.parallelize(mlp, bound, {"2": "colwise"}, axis="tp")
    tokens = torch.randn(4, 64, device=device)
    target = torch.randint(0, 512, (4,), device=device)

    def tp_step() -> None:
        logits = mlp(tokens)
        local = logits.to_local() if hasattr(logits, "to_local") else logits
        mc.nn.vocab_parallel_cross_entropy(local, target, bound, "tp",
                                           vocab_size=512).backward()
    no_sync("parallelize + vocab_parallel_cross_entropy step", tp_step, problems)
    dist.destroy_process_group()

    # reduction trees run only on meshes of up to 256 ranks: rank 3 of 64
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=64)
    small = mc.init_mesh(TREE_MESH, backend="fake")
    bytes_only = mc.CostModel(latency_s=0.0)   # the default's latency takes one collective
    for shape, src, dst in TREE_CASES:
        if [s.action for s in mc.plan(small.mesh, shape, src, dst,
                                      cost_model=bytes_only).steps] != ["tree"]:
            problems.append(f"{src} -> {dst} on {TREE_MESH} is no longer one tree step")
    _reshards(small, TREE_CASES, device, problems, bytes_only)
    dist.destroy_process_group()
    return {"problems": problems}


def test_a_rank_of_1024_runs_every_block_on_cuda_without_a_host_sync() -> None:
    problems = in_fresh_interpreter("test_cuda", "fake_rank_worker")["problems"]
    assert not problems, "\n".join(problems)


# -- a one-GPU NCCL job ------------------------------------------------------------------------
def nccl_worker(rank: int, world: int, folder: str, device: str = "cuda") -> dict[str, Any]:
    """Each section's result, or "error: ..." where it raised (reported as data)."""
    from torch import nn

    if device == "cuda":
        torch.cuda.set_device(0)
    bound = mc.init_mesh("dp=1", check=True)
    out: dict[str, Any] = {"backend": bound.backend, "device": str(bound.device)}

    def section(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except Exception as err:  # noqa: BLE001
            import traceback
            out[name] = f"error: {type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"

    x = torch.arange(6.0, device=device, dtype=torch.bfloat16).reshape(2, 3)
    section("all_reduce", lambda: mc.collectives.all_reduce(x, bound, "dp").float().tolist())
    section("all_gather",
            lambda: mc.collectives.all_gather(x, bound, "dp", dim=1).float().tolist())
    section("reshard_device", lambda: str(mc.reshard(x, bound, "(dp a) b", "a (dp b)").device))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)

    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(device)

    def train(m: nn.Module, steps: int = 4) -> list[float]:
        opt = torch.optim.AdamW(m.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            loss = m(data).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def sharded(**kwargs: Any) -> nn.Module:
        m = make()
        mc.nn.fully_shard(m, bound, **kwargs)
        return m

    section("reference", lambda: train(make()))
    section("fully_shard", lambda: train(sharded()))
    mixed = sharded(mp_policy=mc.nn.MixedPrecision(torch.bfloat16, torch.float32))
    section("fully_shard_bf16", lambda: train(mixed))
    section("param_devices", lambda: sorted({str(p.device) for p in mixed.parameters()}))

    def tensor_parallel() -> list[float]:
        m = make()
        mc.nn.parallelize(m, bound, {"0": "colwise", "2": "rowwise"}, axis="dp")
        return train(m)
    section("parallelize", tensor_parallel)

    def checkpoint() -> bool:
        m = sharded()
        train(m, 1)
        state = dict(m.state_dict())
        mc.nn.save_checkpoint(state, folder)
        target = sharded().state_dict()
        mc.nn.load_checkpoint(target, folder)
        whole = [(t.full_tensor() if hasattr(t, "full_tensor") else t) for t in
                 (*state.values(), *target.values())]
        n = len(state)
        return all(torch.equal(a, b) and a.device.type == device
                   for a, b in zip(whole[:n], whole[n:]))
    section("checkpoint_equal", checkpoint)
    return out


def test_a_one_gpu_nccl_job_trains_like_one_process(tmp_path: Path) -> None:
    [got] = run_scaled(nccl_worker, 1, str(tmp_path / "ckpt"), timeout_s=240, backend="nccl")
    errors = [f"{k}: {v}" for k, v in got.items() if isinstance(v, str) and v.startswith("error")]
    assert not errors, "\n".join(errors)
    assert got["backend"] == "nccl" and got["device"].startswith("cuda")
    assert got["all_reduce"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert got["all_gather"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert got["reshard_device"].startswith("cuda")
    ref = torch.tensor(got["reference"])
    torch.testing.assert_close(torch.tensor(got["fully_shard"]), ref)
    torch.testing.assert_close(torch.tensor(got["parallelize"]), ref)
    torch.testing.assert_close(torch.tensor(got["fully_shard_bf16"]), ref, rtol=3e-2, atol=3e-2)
    assert got["param_devices"] == ["cuda:0"]
    assert got["checkpoint_equal"]
