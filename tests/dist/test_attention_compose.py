"""`mc.nn.attention` composed with the rest of training, on gloo ranks, float64:

- activation checkpointing (`torch.utils.checkpoint`, non-reentrant) of each strategy: the
  forward runs again in backward, collectives included; output and gradients equal the
  un-checkpointed call bit for bit, and one process's attention;
- torch.compile of each strategy, forward and backward equal to eager: `attention` under
  compile is one opaque `torch._dynamo.nonstrict_trace` call (as `mc.reshard` is), so
  `fullgraph=True` compiles every strategy under aot_eager (bit for bit) and inductor (to
  rounding; the ring's shifts are traced as all_to_alls over its group, `post_shift`);
- the same under the fake process group (rank 0 of 4): each strategy compiled before any
  eager call planned its shapes, and recompiled for a second batch size (a dynamic batch
  dim); on gloo, the ring recompiled so equals eager and one process;
- meta tensors under the fake process group (rank 3 of 8): each strategy's output and
  gradients are meta tensors of the right shapes (a host sync on a meta tensor raises);
- HSDP and CP on separate axes (8 ranks, "rep=2 dp=2 cp=2"): parameters sharded over dp
  and replicated over rep and cp (`fully_shard(axis="dp", replicate=("rep", "cp"))`), and
  two forms on a second view of the same ranks whose one axis is two of the first's:
  sharded over dp x cp and replicated over rep (torchtitan's "dp_shard_cp"), or sharded
  over dp and replicated over one flattened rep x cp axis. A causal attention block trains
  as one process in each.
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import meshcomm as mc
from meshcomm.executors.sim import scatter
from meshcomm.nn.attention import STRATEGIES
from meshcomm.runtime.bind import BoundMesh

from conftest import in_fresh_interpreter, ranks_fixture

sys.path.insert(0, str(Path(__file__).parent))
from test_cp_training import Block, _batch, one_process  # noqa: E402 - its block and data

MESH = "cp=2 cq=2"              # two axes split the sequence: the hybrid needs two
LAYOUT = "b h (cp cq s) d"
DOCS = "b (cp cq s)"
SHAPE, KV_SHAPE = (2, 4, 12, 4), (2, 2, 12, 4)       # GQA, 3 tokens per rank
NAMES = sorted(STRATEGIES)
ONE_AXIS = [n for n in NAMES if n != "hybrid"]      # those that run on one sequence axis


def _data(batch: int = SHAPE[0]) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q, w = (torch.randn((batch, *SHAPE[1:]), generator=g, dtype=torch.float64)
            for _ in range(2))
    k, v = (torch.randn((batch, *KV_SHAPE[1:]), generator=g, dtype=torch.float64)
            for _ in range(2))
    doc = torch.randint(0, 3, (batch, SHAPE[2]), generator=g).sort(dim=1).values
    return q, k, v, w, doc


def _mine(bound: BoundMesh, t: Tensor, layout: str = LAYOUT) -> Tensor:
    return scatter(t, bound.mesh, layout)[bound.mesh.position(bound.rank)]


def _run(fn: Callable[..., Tensor], bound: BoundMesh, batch: int = SHAPE[0]) -> list[Tensor]:
    """[out, dq, dk, dv] of `fn(q, k, v, doc)` on this rank's shards, loss (out * w).sum()."""
    q, k, v, w, doc = _data(batch)
    xs = [_mine(bound, t).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*xs, _mine(bound, doc, DOCS))
    (out * _mine(bound, w)).sum().backward()
    return [out.detach()] + [x.grad for x in xs]  # type: ignore[misc]


def _reference(bound: BoundMesh, batch: int = SHAPE[0]) -> list[Tensor]:
    """One process's [out, dq, dk, dv], this rank's parts."""
    q, k, v, w, doc = _data(batch)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mc.nn.attention_reference(*xs, causal=True, document_ids=doc)
    (out * w).sum().backward()
    return [_mine(bound, t.detach()) for t in [out] + [x.grad for x in xs]]  # type: ignore[misc]


def _diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _attend(bound: BoundMesh, strategy: str, **more: Any) -> Callable[..., Tensor]:
    def attend(q: Tensor, k: Tensor, v: Tensor, doc: Tensor) -> Tensor:
        return mc.nn.attention(q, k, v, bound, LAYOUT, causal=True, document_ids=doc,
                               strategy=strategy, **more)
    return attend


# Every other argument of `attention` given (a Layout, a CostModel, floats, shapes), with
# `auto`: what the compiled call hands its opaque function as plain values.
EVERY_ARGUMENT = {"kv_layout": mc.Layout(LAYOUT), "window": 5, "scale": 0.4, "shape": SHAPE,
                  "kv_shape": KV_SHAPE, "memory_budget": 1 << 30, "flops": 1e12,
                  "cost_model": mc.CostModel(latency_s=5e-6, bandwidth={"cp": 10e9})}


def checkpointed(bound: BoundMesh) -> dict[str, dict[str, float]]:
    from torch.utils.checkpoint import checkpoint

    want = _reference(bound)
    out = {}
    for name in NAMES:
        attend = _attend(bound, name)
        plain = _run(attend, bound)
        again = _run(lambda *a: checkpoint(attend, *a, use_reentrant=False), bound)
        out[name] = {"vs_plain": _diff(again, plain), "vs_reference": _diff(again, want)}
    return out


# -- torch.compile -------------------------------------------------------------------------
def compiled(bound: BoundMesh) -> dict[str, Any]:
    """{(backend, fullgraph, strategy): max |compiled - eager| or the error}."""
    import torch._dynamo

    out: dict[str, Any] = {}
    runs = [("aot_eager", True, n, {}) for n in NAMES] + \
        [("inductor", True, n, {}) for n in NAMES] + \
        [("aot_eager", False, n, {}) for n in NAMES] + \
        [("aot_eager", True, "auto", EVERY_ARGUMENT)]
    for backend, fullgraph, name, more in runs:
        key = f"{backend} fullgraph={fullgraph} {name}"
        torch._dynamo.reset()
        try:
            eager = _run(_attend(bound, name, **more), bound)
            got = _run(torch.compile(_attend(bound, name, **more), backend=backend,
                                     fullgraph=fullgraph), bound)
            out[key] = _diff(got, eager)
        except Exception as exc:      # noqa: BLE001 - the test reports it
            out[key] = f"{type(exc).__name__}: {str(exc)[:300]}" + traceback.format_exc()[-1500:]
    return out


def recompiled(bound: BoundMesh) -> dict[str, Any]:
    """The ring compiled fullgraph, called for batch sizes 2, 3 and 4: Dynamo recompiles
    for 3 with a dynamic batch dim (the call's plan then guards on it, so 4 compiles
    again). Per backend: per batch, max |compiled - eager| and max |compiled - one
    process|; or the error."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        try:
            fn = torch.compile(_attend(bound, "ring"), backend=backend, fullgraph=True)
            diffs = []
            for batch in DYNAMIC_BATCHES:
                got = _run(fn, bound, batch)
                diffs.append((_diff(got, _run(_attend(bound, "ring"), bound, batch)),
                              _diff(got, _reference(bound, batch))))
            out[backend] = {"diffs": diffs, "graphs": counters["stats"]["unique_graphs"]}
        except Exception as exc:      # noqa: BLE001 - the test reports it
            out[backend] = (f"{type(exc).__name__}: {str(exc)[:300]}"
                            + traceback.format_exc()[-1500:])
    return out


DYNAMIC_BATCHES = (2, 3, 4)


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH)
    return {"checkpoint": checkpointed(bound), "compile": compiled(bound),
            "recompile": recompiled(bound)}


four = ranks_fixture(four_ranks, 4, timeout_s=600)


@pytest.mark.parametrize("strategy", NAMES)
def test_checkpointed_attention_equals_plain_and_one_process(four: list[Any],
                                                            strategy: str) -> None:
    for r in four:
        got = r["checkpoint"][strategy]
        assert got["vs_plain"] == 0.0, got            # the same ops again: bit for bit
        assert got["vs_reference"] <= 1e-10, got


def _compiled(four: list[Any], backend: str, fullgraph: bool, strategy: str,
              tolerance: float) -> None:
    key = f"{backend} fullgraph={fullgraph} {strategy}"
    for r in four:
        got = r["compile"][key]
        assert not isinstance(got, str), got
        assert got <= tolerance, (key, got)


@pytest.mark.parametrize("backend,strategy", [
    (backend, name) for backend in ("aot_eager", "inductor") for name in NAMES])
def test_fullgraph_compiled_attention_equals_eager(four: list[Any], backend: str,
                                                   strategy: str) -> None:
    """The strategies' bodies (plans, the ring's point-to-point steps and its autograd
    Function, the blocks' autograd Function) trace under AOTAutograd and inductor behind
    one opaque call. Inductor fuses and reorders float64 sums: equal to rounding (1e-12
    absolute on values of order 1); aot_eager runs the same ops: bit for bit."""
    _compiled(four, backend, True, strategy, 0.0 if backend == "aot_eager" else 1e-12)


def test_fullgraph_compiled_attention_takes_every_argument(four: list[Any]) -> None:
    """`auto` with a cost model, a budget, a window, a scale, a Layout and global shapes:
    the plain values rebuild the same call (bit for bit under aot_eager)."""
    _compiled(four, "aot_eager", True, "auto", 0.0)


@pytest.mark.parametrize("strategy", NAMES)
def test_compiled_attention_with_graph_breaks_equals_eager(four: list[Any],
                                                           strategy: str) -> None:
    """aot_eager runs the same ops as eager: bit for bit."""
    _compiled(four, "aot_eager", False, strategy, 0.0)


def _fake_call(bound: BoundMesh, name: str, batch: int, compiled: bool) -> None:
    """Forward and backward of `name` on random inputs of `batch` rows, compiled fullgraph
    (aot_eager) or eager."""
    q = torch.randn(batch, 4, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, 2, 3, 4, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    fn = _attend(bound, name)
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    fn(q, k, v, torch.zeros(batch, 3, dtype=torch.long)).sum().backward()


def fake_compile_worker() -> dict[str, dict[str, str]]:
    """Runs in a fresh interpreter (fake process group, rank 0 of 4 on MESH), per strategy:
    "cold": compiled before anything planned its shapes (a batch of its own); "dynamic":
    compiled again for a second batch size (Dynamo's automatic dynamic shapes), each shape
    planned eagerly first. "ok" or the error."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    bound = mc.init_mesh(MESH, backend="fake")
    out: dict[str, dict[str, str]] = {"cold": {}, "dynamic": {}}
    for i, name in enumerate([*NAMES, "auto"]):
        for how, batches in (("cold", [1 + i]), ("dynamic", [10 + 2 * i, 11 + 2 * i])):
            torch._dynamo.reset()
            try:
                for batch in batches:
                    if how == "dynamic":
                        _fake_call(bound, name, batch, compiled=False)
                    _fake_call(bound, name, batch, compiled=True)
                out[how][name] = "ok"
            except Exception as exc:      # noqa: BLE001 - the test reports it
                out[how][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


@functools.cache
def _fake_compiled() -> dict[str, dict[str, str]]:
    return in_fresh_interpreter(  # type: ignore[no-any-return]
        "dist.test_attention_compose", "fake_compile_worker")


@pytest.mark.parametrize("strategy", [*NAMES, "auto"])
def test_fullgraph_compiles_before_any_eager_call(strategy: str) -> None:
    """The strategies plan outside the trace (`plan_untraced`): compiling first works."""
    assert _fake_compiled()["cold"][strategy] == "ok"


@pytest.mark.parametrize("strategy", [*NAMES, "auto"])
def test_fullgraph_recompiles_for_another_batch_size(strategy: str) -> None:
    """A second batch size recompiles with a dynamic batch dim: the ring makes its receive
    shapes ints for `post_shift` (a guard the call's plan makes already)."""
    assert _fake_compiled()["dynamic"][strategy] == "ok"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recompiled_ring_equals_eager_and_one_process(four: list[Any], backend: str) -> None:
    """On gloo ranks, the ring compiled for batch 2 and recompiled (dynamic) for 3 and
    4: each batch's output and gradients equal eager's (bit for bit under aot_eager, to
    rounding under inductor) and one process's attention."""
    for r in four:
        got = r["recompile"][backend]
        assert not isinstance(got, str), got
        assert got["graphs"] >= 2, got            # a recompile for another batch size
        for vs_eager, vs_reference in got["diffs"]:
            assert vs_eager <= (0.0 if backend == "aot_eager" else 1e-12), got
            assert vs_reference <= 1e-10, got


# -- meta tensors under the fake process group -----------------------------------------------
def meta_worker() -> dict[str, Any]:
    """Runs in a fresh interpreter (the fake process group is process-wide): rank 3 of 8 on
    "dp=2 cp=2 cq=2", 13 tokens (uneven, torch.chunk blocks: 4, 4, 4, 1), GQA, causal with
    a window and document ids, each strategy forward and backward on meta tensors."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    bound = mc.init_mesh("dp=2 cp=2 cq=2", backend="fake")
    shape, kv_shape = (4, 4, 13, 8), (4, 2, 13, 8)
    layout, docs = "(dp b) h (cp cq s) d", "(dp b) (cp cq s)"
    lay = mc.Layout(layout)
    out: dict[str, Any] = {}
    for name in NAMES:
        q = torch.empty(lay.local_shape(bound.mesh, shape, 3), dtype=torch.float64,
                        device="meta", requires_grad=True)
        k, v = (torch.empty(lay.local_shape(bound.mesh, kv_shape, 3), dtype=torch.float64,
                            device="meta", requires_grad=True) for _ in range(2))
        doc = torch.zeros(mc.Layout(docs).local_shape(bound.mesh, (4, 13), 3),
                          dtype=torch.long, device="meta")
        try:
            y = mc.nn.attention(q, k, v, bound, layout, causal=True, window=5,
                                document_ids=doc, strategy=name, shape=shape,
                                kv_shape=kv_shape)
            y.sum().backward()
            out[name] = {"out": [y.device.type, list(y.shape)],
                         "grads": [[t.grad.device.type, list(t.grad.shape)]  # type: ignore[union-attr]
                                   for t in (q, k, v)],
                         "want": [list(q.shape), list(k.shape), list(v.shape)]}
        except Exception as exc:          # noqa: BLE001 - the test reports it
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return out


def test_every_strategy_runs_on_meta_tensors() -> None:
    got = in_fresh_interpreter("dist.test_attention_compose", "meta_worker")
    for name in NAMES:
        r = got[name]
        assert not isinstance(r, str), r
        q_shape = r["want"][0]
        assert r["out"] == ["meta", q_shape], r
        assert r["grads"] == [["meta", s] for s in r["want"]], r
        # rank 3 (dp 0, cp 1, cq 1): rows 0-1; 13 tokens are 7, 6 over cp, 6 are 3, 3 over cq
        assert q_shape == [2, 4, 3, 8]


# -- HSDP and CP on separate axes (8 ranks) ----------------------------------------------------
ROWS8 = 4                         # 4 rows over rep x dp = 4, 10 tokens over cp = 2


# (name, attention mesh, batch axes, fsdp view mesh, fully_shard kwargs)
HSDP_FORMS = [
    ("shard dp x cp, replicate rep", "rep=2 dp=2 cp=2", "rep dp", "rep=2 dc=4",
     {"axis": "dc", "replicate": "rep"}),
    ("shard dp, replicate rep x cp", "dp=2 rep=2 cp=2", "dp rep", "dp=2 rc=4",
     {"axis": "dp", "replicate": "rc"}),
    ("replicate=(rep, cp)", "rep=2 dp=2 cp=2", "rep dp", None,
     {"axis": "dp", "replicate": ("rep", "cp")}),
]


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    meshes: dict[str, BoundMesh] = {}
    for form, mesh, batch, view, kwargs in HSDP_FORMS:
        for spec in (mesh, view):
            if spec is not None and spec not in meshes:
                meshes[spec] = mc.init_mesh(spec)
        bound = meshes[mesh]
        shard_on = meshes[view] if view else bound
        layout = f"({batch} b) h (cp s) d"
        for name in ONE_AXIS:
            try:
                model = Block()
                mc.nn.fully_shard(model, shard_on, **kwargs)
                x = scatter(_batch(ROWS8), bound.mesh, f"({batch} b) (cp s) e")[rank]

                def attend(q: Tensor, k: Tensor, v: Tensor, name: str = name) -> Tensor:
                    return mc.nn.attention(q, k, v, bound, layout, causal=True, strategy=name)
                loss = model(x, attend).pow(2).mean()     # as many tokens on every rank
                loss.backward()
                whole = mc.reshard(loss.detach().reshape(1), bound,
                                   f"a | avg({', '.join(bound.mesh.axis_names)})", "a")
                out[f"{form} {name}"] = {"loss": whole.item(), **{
                    n: p.grad.full_tensor() for n, p in model.named_parameters()}}
            except Exception as exc:      # noqa: BLE001 - every rank raises alike, before
                out[f"{form} {name}"] = f"{type(exc).__name__}: {exc}"   # communicating
    return out


eight = ranks_fixture(eight_ranks, 8)


@pytest.mark.parametrize("form", [f[0] for f in HSDP_FORMS])
def test_hsdp_and_cp_on_separate_axes_train_as_one_process(eight: list[Any],
                                                          form: str) -> None:
    want = one_process(ROWS8)
    for name in ONE_AXIS:
        for r in eight:
            got = r[f"{form} {name}"]
            assert not isinstance(got, str), got
            assert abs(got["loss"] - want["loss"]) <= 1e-12 * abs(want["loss"]), name
            for p in ("wq", "wk", "wv", "wo"):
                torch.testing.assert_close(got[p], want[p], rtol=1e-10, atol=1e-12,
                                           msg=f"{form} {name} {p}")
