"""`mc.nn.attention` composed with the rest of training, on gloo ranks, float64:

- activation checkpointing (`torch.utils.checkpoint`, non-reentrant) of each strategy: the
  forward runs again in backward, collectives included; output and gradients equal the
  un-checkpointed call bit for bit, and one process's attention;
- torch.compile of each strategy, forward and backward equal to eager: with graph breaks
  (aot_eager) it works today; `fullgraph=True` does not (Dynamo traces the call's
  resolution and the planner: xfail, see COMPILE_XFAIL). The same strategies behind one
  opaque `torch._dynamo.nonstrict_trace` call (what `mc.reshard` does under compile)
  compile fullgraph under aot_eager, and under inductor all but the ring and the hybrid
  (RING_INDUCTOR_XFAIL): the opaque call is the fix `attention` needs;
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

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import meshcomm as mc
from meshcomm.core.mesh import Mesh
from meshcomm.executors.sim import scatter
from meshcomm.nn.attention import STRATEGIES
from meshcomm.runtime.bind import BoundMesh

from conftest import in_fresh_interpreter, ranks_fixture

sys.path.insert(0, str(Path(__file__).parent))
from test_cp_training import Block  # noqa: E402 - the block test_cp_training trains

MESH = "cp=2 cq=2"              # two axes split the sequence: the hybrid needs two
LAYOUT = "b h (cp cq s) d"
DOCS = "b (cp cq s)"
SHAPE, KV_SHAPE = (2, 4, 12, 4), (2, 2, 12, 4)       # GQA, 3 tokens per rank
NAMES = sorted(STRATEGIES)
ONE_AXIS = [n for n in NAMES if n != "hybrid"]      # those that run on one sequence axis
RING_SENDS_TWO_STREAMS = ("ring", "hybrid")
RING_INDUCTOR_XFAIL = pytest.mark.xfail(run=False, reason=(
    "ring and hybrid compiled by inductor on 4 ranks (a 4-rank ring over cp x cq; a 2-rank"
    " ring passes): the ranks' point-to-point batches stop matching and gloo aborts the"
    " process ('op.preamble.length <= op.nbytes. 816 vs 768': a packed K/V + doc-ids block"
    " arrives where a dK/dV buffer is expected; without doc ids too). aot_eager, which keeps"
    " the traced order, passes: inductor (its partitioner or scheduler) orders the ring's"
    " independent sends to one peer (the next K/V block and the travelling dK/dV) by each"
    " rank's own graph, and the graphs differ by their skipped blocks. fix: make the order"
    " a data dependency, or send the two streams on two groups"))
COMPILE_XFAIL = pytest.mark.xfail(strict=True, reason=(
    "mc.nn.attention under torch.compile(fullgraph=True): Dynamo traces attention() into"
    " call.resolve -> Layout.check_local -> Layout.placements, whose"
    " `_resolve(self, mesh, tuple(int(s) for s in shape))` (an lru_cache call with a"
    " generator argument) is Unsupported ('Failed to convert args/kwargs to proxy:"
    " LocalGeneratorObjectVariable'); past it Dynamo would trace the planner. fix (in"
    " meshcomm/nn/attention/__init__.py): under torch.compiler.is_compiling(), hand the"
    " tensors and plain values of the bound mesh and arguments to one function marked"
    " torch._dynamo.nonstrict_trace, as mc.reshard does (test_opaque_* pass with it; document"
    " ids as a tuple: nonstrict_trace refuses None)"))


def _data() -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q, w = (torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(KV_SHAPE, generator=g, dtype=torch.float64) for _ in range(2))
    doc = torch.randint(0, 3, (SHAPE[0], SHAPE[2]), generator=g).sort(dim=1).values
    return q, k, v, w, doc


def _mine(bound: BoundMesh, t: Tensor, layout: str = LAYOUT) -> Tensor:
    return scatter(t, bound.mesh, layout)[bound.mesh.position(bound.rank)]


def _run(fn: Callable[..., Tensor], bound: BoundMesh) -> list[Tensor]:
    """[out, dq, dk, dv] of `fn(q, k, v, doc)` on this rank's shards, loss (out * w).sum()."""
    q, k, v, w, doc = _data()
    xs = [_mine(bound, t).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*xs, _mine(bound, doc, DOCS))
    (out * _mine(bound, w)).sum().backward()
    return [out.detach()] + [x.grad for x in xs]  # type: ignore[misc]


def _reference(bound: BoundMesh) -> list[Tensor]:
    """One process's [out, dq, dk, dv], this rank's parts."""
    q, k, v, w, doc = _data()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mc.nn.attention_reference(*xs, causal=True, document_ids=doc)
    (out * w).sum().backward()
    return [_mine(bound, t.detach()) for t in [out] + [x.grad for x in xs]]  # type: ignore[misc]


def _diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _attend(bound: BoundMesh, strategy: str) -> Callable[..., Tensor]:
    def attend(q: Tensor, k: Tensor, v: Tensor, doc: Tensor) -> Tensor:
        return mc.nn.attention(q, k, v, bound, LAYOUT, causal=True, document_ids=doc,
                               strategy=strategy)
    return attend


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
def _opaque(q: Tensor, k: Tensor, v: Tensor, doc: Tensor, static: tuple[Any, ...]) -> Tensor:
    """`mc.nn.attention` from plain values: the BoundMesh rebuilt as `mc.reshard` rebuilds it
    under compile (meshcomm/sharded/local.py, `_reshard_opaque`)."""
    axes, sizes, ranks, backend, device, rank, names, strategy = static
    bound = BoundMesh(Mesh(dict(zip(axes, sizes)), ranks=list(ranks)), backend,
                      torch.device(device), rank, dict(names))
    return _attend(bound, strategy)(q, k, v, doc)


def _opaque_attend(bound: BoundMesh, strategy: str) -> Callable[..., Tensor]:
    """`_attend` with the call one opaque `nonstrict_trace` function for Dynamo."""
    from meshcomm.sharded.local import _static_args

    traced = torch._dynamo.nonstrict_trace(_opaque)
    static = (*_static_args(bound, LAYOUT, LAYOUT, None, None, None)[:7], strategy)
    return lambda q, k, v, doc: traced(q, k, v, doc, static)


def compiled(bound: BoundMesh) -> dict[str, Any]:
    """{(how, backend, fullgraph, strategy): max |compiled - eager| or the error}."""
    import torch._dynamo

    out: dict[str, Any] = {}
    runs = [("direct", "aot_eager", True), ("direct", "inductor", True),
            ("direct", "aot_eager", False), ("opaque", "aot_eager", True),
            ("opaque", "inductor", True)]
    for how, backend, fullgraph in runs:
        for name in NAMES:
            if backend == "inductor" and how == "opaque" and name in RING_SENDS_TWO_STREAMS:
                continue        # gloo aborts the process (RING_INDUCTOR_XFAIL)
            key = f"{how} {backend} fullgraph={fullgraph} {name}"
            make = _attend if how == "direct" else _opaque_attend
            torch._dynamo.reset()
            try:
                eager = _run(_attend(bound, name), bound)
                got = _run(torch.compile(make(bound, name), backend=backend,
                                         fullgraph=fullgraph), bound)
                out[key] = _diff(got, eager)
            except Exception as exc:      # noqa: BLE001 - the test reports it
                out[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if how == "direct" and fullgraph:
                    continue               # every rank fails alike, before any collective
                out[key] += traceback.format_exc()[-1500:]
    return out


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH)
    return {"checkpoint": checkpointed(bound), "compile": compiled(bound)}


four = ranks_fixture(four_ranks, 4, timeout_s=600)


@pytest.mark.parametrize("strategy", NAMES)
def test_checkpointed_attention_equals_plain_and_one_process(four: list[Any],
                                                            strategy: str) -> None:
    for r in four:
        got = r["checkpoint"][strategy]
        assert got["vs_plain"] == 0.0, got            # the same ops again: bit for bit
        assert got["vs_reference"] <= 1e-10, got


def _compiled(four: list[Any], how: str, backend: str, fullgraph: bool, strategy: str,
              tolerance: float) -> None:
    key = f"{how} {backend} fullgraph={fullgraph} {strategy}"
    for r in four:
        got = r["compile"][key]
        assert not isinstance(got, str), got
        assert got <= tolerance, (key, got)


@COMPILE_XFAIL
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("strategy", NAMES)
def test_fullgraph_compiled_attention_equals_eager(four: list[Any], backend: str,
                                                   strategy: str) -> None:
    _compiled(four, "direct", backend, True, strategy, 0.0 if backend == "aot_eager" else 1e-12)


@pytest.mark.parametrize("strategy", NAMES)
def test_compiled_attention_with_graph_breaks_equals_eager(four: list[Any],
                                                           strategy: str) -> None:
    """aot_eager runs the same ops as eager: bit for bit."""
    _compiled(four, "direct", "aot_eager", False, strategy, 0.0)


@pytest.mark.parametrize("backend,strategy", [
    pytest.param(backend, name, marks=[RING_INDUCTOR_XFAIL] if backend == "inductor" and
                 name in RING_SENDS_TWO_STREAMS else [])
    for backend in ("aot_eager", "inductor") for name in NAMES])
def test_opaque_call_compiles_fullgraph_and_equals_eager(four: list[Any], backend: str,
                                                         strategy: str) -> None:
    """The strategies' bodies (plans, the ring's point-to-point steps and its autograd
    Function, the blocks' autograd Function) trace under AOTAutograd and inductor.
    Inductor fuses and reorders float64 sums: equal to rounding (1e-12 absolute on values
    of order 1); aot_eager runs the same ops: bit for bit."""
    _compiled(four, "opaque", backend, True, strategy,
              0.0 if backend == "aot_eager" else 1e-12)


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
B8, S8, E8 = 4, 10, 16            # 4 rows over rep x dp = 4, 10 tokens over cp = 2


def _batch8() -> Tensor:
    return torch.randn(B8, S8, E8, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def one_process8() -> dict[str, Any]:
    model = Block()
    y = model(_batch8(), lambda q, k, v: mc.nn.attention_reference(q, k, v, causal=True))
    loss = y.pow(2).mean()
    loss.backward()
    return {"loss": loss.item(), **{n: p.grad for n, p in model.named_parameters()}}


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
                x = scatter(_batch8(), bound.mesh, f"({batch} b) (cp s) e")[rank]

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
    want = one_process8()
    for name in ONE_AXIS:
        for r in eight:
            got = r[f"{form} {name}"]
            assert not isinstance(got, str), got
            assert abs(got["loss"] - want["loss"]) <= 1e-12 * abs(want["loss"]), name
            for p in ("wq", "wk", "wv", "wo"):
                torch.testing.assert_close(got[p], want[p], rtol=1e-10, atol=1e-12,
                                           msg=f"{form} {name} {p}")
