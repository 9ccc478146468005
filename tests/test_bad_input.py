"""Every kind of bad input, and the error it gets: one exact message per case, the same text
as docs/errors.md (checked), raised before any communication.

The bound meshes here are bound to process groups that exist nowhere (`fake_bound`), so any
attempt to communicate would fail with another error: getting the expected one shows the
input was rejected first. Cases that need real processes (a mesh larger than the world, a
rank outside the mesh, faults) are in tests/dist/test_faults.py; the pattern parser's fuzz
is tests/test_notation.py::test_fuzz_any_text_parses_or_raises_a_meshcomm_error.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.runtime.bind import BoundMesh
from meshcomm.core.errors import (LayoutSyntaxError, MeshAxisError, MeshcommError,
                                  MeshMismatchError, PlanError, ShapeError)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def fake_bound(spec: str = "dp=2 tp=2", rank: int = 1, ranks: list[int] | None = None
               ) -> BoundMesh:
    """A BoundMesh whose group names exist nowhere: any communication would fail."""
    mesh = mc.Mesh(spec) if ranks is None else mc.Mesh(spec, ranks=ranks)
    names = {s: "fake-" + "-".join(s) for k in range(1, len(mesh.axis_names) + 1)
             for s in itertools.combinations(mesh.axis_names, k)}
    return BoundMesh(mesh, "gloo", torch.device("cpu"), rank, names)


M = mc.Mesh("dp=2 tp=2")
B = fake_bound()
X = torch.zeros(4, 3)            # rank 1's shard of (8, 6) under "(dp b) (tp h)"
S = mc.Sharded(X, B, "(dp b) (tp h)", (8, 6))

# (category, case, call, error, exact message)
CASES: list[tuple[str, str, Callable[[], Any], type, str]] = [
    # -- pattern
    ("pattern", "malformed", lambda: mc.Layout("(dp b s (tp h)"), LayoutSyntaxError,
     'cannot parse layout "(dp b s (tp h)"\n'
     '    (dp b s (tp h)\n'
     '            ^ a group cannot open inside another group\n'
     '  fix: close the first group, e.g. "(dp b) s (tp h)"'),
    ("pattern", "unclosed", lambda: mc.plan(M, (8, 6), "(dp b", "b"), LayoutSyntaxError,
     'cannot parse layout "(dp b"\n'
     '    (dp b\n'
     '    ^^^^^ this group is never closed\n'
     "  fix: add ')' at the end of the group"),
    ("pattern", "two reductions", lambda: mc.Layout("b | sum(tp) max(dp)"), LayoutSyntaxError,
     'cannot parse layout "b | sum(tp) max(dp)"\n'
     '    b | sum(tp) max(dp)\n'
     "      ^^^^^^^^^^^^^^^^^ one layout can hold one pending reduction, got ['sum',"
     " 'max']\n"
     '  fix: resolve one reduction first (e.g. reshard to a layout without it)'),
    ("pattern", "not a string", lambda: mc.plan(M, (8,), 3, "b"), ShapeError,
     'src must be a layout string or Layout, got int'),
    # -- axes
    ("axes", "unknown axis", lambda: mc.plan(M, (8, 6), "(dq b) h", "b h"), MeshAxisError,
     'layout "(dq b) h" on Mesh(dp=2, tp=2): "dq" is not a mesh axis\n'
     '    (dq b) h\n'
     '     ^^ a group is one dim name plus mesh axes (dp, tp) or sized factors (x=2)\n'
     '  fix: did you mean "dp"?'),
    ("axes", "unknown axis in reduction", lambda: mc.reshard(X, B, "(dp b) (tp h)", "b h | sum(cp)"), MeshAxisError,
     'layout "b h | sum(cp)" on Mesh(dp=2, tp=2): "cp" is not a mesh axis\n'
     '    b h | sum(cp)\n'
     '              ^^ a pending reduction is over mesh axes (dp, tp)\n'
     '  fix: did you mean "tp"?'),
    ("axes", "axis shards two dims", lambda: mc.plan(M, (8, 6), "(dp b) (dp h)", "b h"), LayoutSyntaxError,
     'cannot parse layout "(dp b) (dp h)"\n'
     '    (dp b) (dp h)\n'
     '            ^^ "dp" appears twice; every name is used once\n'
     '  fix: a mesh axis shards one dim or is pending; rename the dim'),
    ("axes", "axis sharded and partial", lambda: mc.Layout("(tp h) s | sum(tp)"), LayoutSyntaxError,
     'cannot parse layout "(tp h) s | sum(tp)"\n'
     '    (tp h) s | sum(tp)\n'
     '                   ^^ "tp" appears twice; every name is used once\n'
     '  fix: a mesh axis shards one dim or is pending; rename the dim'),
    ("axes", "dim name twice", lambda: mc.Layout("b s b"), LayoutSyntaxError,
     'cannot parse layout "b s b"\n'
     '    b s b\n'
     '        ^ "b" appears twice; every name is used once\n'
     '  fix: a mesh axis shards one dim or is pending; rename the dim'),
    ("axes", "collective unknown axis", lambda: mc.collectives.all_gather(X, B, "tq"), MeshAxisError,
     'all_gather: "tq" is not an axis of Mesh(dp=2, tp=2); axes are dp, tp\n'
     '  fix: did you mean "tp"?'),
    ("axes", "collective axis twice", lambda: mc.collectives.all_gather(X, B, ("tp", "tp")), MeshAxisError,
     "all_gather: axes ['tp', 'tp'] name an axis twice; fix: name each once"),
    # -- mesh
    ("mesh", "mesh text", lambda: mc.Mesh("dp=2 tp4"), MeshAxisError,
     'cannot parse mesh "dp=2 tp4"\n'
     '    dp=2 tp4\n'
     '         ^^^ expected NAME=SIZE, e.g. dp=2\n'
     '  fix: write the axes as "dp=2 tp=4"'),
    ("mesh", "mesh axis twice", lambda: mc.Mesh("dp=2 dp=4"), MeshAxisError,
     'mesh axis "dp" appears 2 times in [\'dp\', \'dp\']; fix: give each axis a distinct name'),
    ("mesh", "mesh axis size 0", lambda: mc.Mesh("dp=0"), MeshAxisError,
     'mesh axis "dp" has size 0; sizes are positive integers'),
    ("mesh", "mesh ranks repeat", lambda: mc.Mesh("dp=2", ranks=[0, 0]), ShapeError,
     'ranks= must hold distinct non-negative ranks, got [0, 0]'),
    # -- dims
    ("dims", "layout vs shape", lambda: mc.plan(M, (8, 6, 2), "(dp b) h", "b h"), ShapeError,
     'layout "(dp b) h" has 2 dims but the shape (8, 6, 2) has 3. fix: name one dim per'
     ' tensor dim, e.g. "a b c"'),
    ("dims", "dst vs shape", lambda: mc.reshard(X, B, "(dp b) (tp h)", "b"), ShapeError,
     'layout "b" has 1 dims but the shape (8, 6) has 2. fix: name one dim per tensor dim,'
     ' e.g. "a b"'),
    ("dims", "local tensor vs layout", lambda: mc.reshard(torch.zeros(4, 3, 1), B, "(dp b) (tp h)", "b h"), ShapeError,
     'local tensor on rank 1 has 3 dims but layout "(dp b) (tp h)" has 2; fix: pass a'
     ' tensor with one dim per layout dim'),
    # -- sizes
    ("sizes", "cyclic does not divide", lambda: mc.plan(M, (7, 6), "(b dp) h", "b h"), ShapeError,
     'layout "(b dp) h" does not fit dim 0 of size 7: (b dp) needs a multiple of 2; only'
     ' "(axes... name)" groups allow uneven shards. fix: use "(dp b)", or pad dim 0 to 8'),
    ("sizes", "sized factor does not divide", lambda: mc.plan(M, (7, 6), "(x=2 dp b) h", "b h"), ShapeError,
     'layout "(x=2 dp b) h" does not fit dim 0 of size 7: (x=2 dp b) needs a multiple of'
     ' 4; only "(axes... name)" groups allow uneven shards. fix: use "(dp b)", or pad dim'
     ' 0 to 8'),
    ("sizes", "factors without a name", lambda: mc.plan(M, (16,), "(dp tp)", "b"), ShapeError,
     'layout "(dp tp)" does not fit dim 0 of size 16: its factors (dp tp) multiply to 4.'
     ' fix: give the dim a name that takes the rest, e.g. "(dp tp x)"'),
    ("sizes", "sized factor vs mesh", lambda: mc.plan(M, (8,), "(tp=4 h)", "h"), ShapeError,
     'layout "(tp=4 h)": "tp=4" in dim 0 gives mesh axis tp size 4, but Mesh(dp=2, tp=2)'
     ' has tp=2. fix: write tp alone'),
    ("sizes", "negative size", lambda: mc.plan(M, (-1,), "(dp b)", "b"), ShapeError,
     'layout "(dp b)": shape (-1,) has a negative size; sizes are >= 0'),
    ("sizes", "uneven shards need shape", lambda: mc.reshard(torch.zeros(0, 3), B, "(dp b) (tp h)", "b h"), ShapeError,
     'cannot infer the global shape of layout "(dp b) (tp h)" on Mesh(dp=2, tp=2): rank 1'
     ' holds 0 elements of dim 0, so its shards are uneven. fix: pass shape=(...) (the'
     ' global shape) on every rank'),
    # -- local
    ("local", "local shape", lambda: mc.reshard(torch.zeros(4, 6), B, "(dp b) (tp h)", "b h", shape=(8, 6)), ShapeError,
     'local tensor on rank 1 has shape (4, 6), but layout "(dp b) (tp h)" of global shape'
     ' (8, 6) on Mesh(dp=2, tp=2) gives it shape (4, 3). fix: pass the shard this rank'
     ' holds, or the right global shape/layout'),
    ("local", "Sharded.local shape", lambda: mc.Sharded(torch.zeros(3, 3), B, "(dp b) (tp h)", (8, 6)), ShapeError,
     'Sharded.local on rank 1 has shape (3, 3), but layout "(dp b) (tp h)" of global'
     ' shape (8, 6) on Mesh(dp=2, tp=2) gives it shape (4, 3). fix: pass the shard this'
     ' rank holds, or the right global shape/layout'),
    ("local", "local dtype", lambda: mc.reshard(X, B, "(dp b) (tp h)", "b h", dtype=torch.float64), ShapeError,
     'local tensor of rank 1 has dtype torch.float32 but the plan was made for'
     ' torch.float64; fix: mc.plan(..., dtype=torch.float32) (reshard:'
     ' dtype=torch.float32 or none), or pass x.to(torch.float64)'),
    ("local", "not a tensor", lambda: mc.reshard([1.0], B, "(dp b) (tp h)", "b h"), ShapeError,
     'reshard needs a local torch.Tensor, got list'),
    ("local", "a Sharded as x", lambda: mc.reshard(S, B, "(dp b) (tp h)", "b h"), ShapeError,
     'reshard needs a local torch.Tensor, got Sharded; fix: s.reshard(dst) for a Sharded s'),
    # -- meshes
    ("meshes", "plan for another mesh", lambda: mc.executors.distributed.execute(mc.plan(mc.Mesh("dp=4"), (8, 6), "(dp b) h", "b h"), X, B), MeshMismatchError,
     'plan was made for Mesh(dp=4) but is run on Mesh(dp=2, tp=2). fix: plan with the'
     ' bound mesh, mc.plan(bound.mesh, ...)'),
    ("meshes", "plan for another rank order", lambda: mc.executors.distributed.execute(mc.plan(M, (8, 6), "(dp b) (tp h)", "b h"), X, fake_bound(ranks=[3, 2, 1, 0])), MeshMismatchError,
     'plan was made for Mesh(dp=2, tp=2) but is run on Mesh(dp=2, tp=2, ranks=[3, 2, 1,'
     ' 0]). fix: plan with the bound mesh, mc.plan(bound.mesh, ...)'),
    ("meshes", "plan between meshes", lambda: mc.executors.distributed.execute(mc.plan(M, (8, 6), "(dp b) (tp h)", "(dp b) h", dst_mesh=mc.Mesh("dp=4")), X, B), MeshMismatchError,
     'plan goes from Mesh(dp=2, tp=2) to dst_mesh=Mesh(dp=4), so it runs on the ranks of'
     ' both meshes; fix: mc.reshard(x, mesh, src, dst, dst_mesh=bound_dst), which runs it'
     ' with meshcomm.executors.distributed.execute_cross'),
    ("meshes", "shard of another mesh", lambda: mc.reshard(X, fake_bound("dp=4"), "(dp b) h", "b h", shape=(8, 6)), ShapeError,
     'local tensor on rank 1 has shape (4, 3), but layout "(dp b) h" of global shape (8,'
     ' 6) on Mesh(dp=4) gives it shape (2, 6). fix: pass the shard this rank holds, or'
     ' the right global shape/layout'),
    ("meshes", "unbound mesh", lambda: mc.reshard(X, M, "(dp b) (tp h)", "b h"), MeshMismatchError,
     'reshard needs a mesh bound to torch.distributed, got the Mesh Mesh(dp=2, tp=2);'
     " fix: bound = mc.init_mesh('dp=2 tp=2') on every rank, then pass bound"),
    ("meshes", "Sharded on an unbound mesh", lambda: mc.Sharded(X, M, "(dp b) (tp h)", (8, 6)), MeshMismatchError,
     "Sharded needs a mesh bound to torch.distributed, got the Mesh Mesh(dp=2, tp=2); fix:"
     " bound = mc.init_mesh('dp=2 tp=2') on every rank, then pass bound"),
    ("meshes", "distribute on an unbound mesh", lambda: mc.distribute(torch.zeros(8, 6), M, "(dp b) (tp h)"), MeshMismatchError,
     "distribute needs a mesh bound to torch.distributed, got the Mesh Mesh(dp=2, tp=2); fix:"
     " bound = mc.init_mesh('dp=2 tp=2') on every rank, then pass bound"),
    ("meshes", "dst_mesh unbound", lambda: mc.reshard(X, B, "(dp b) (tp h)", "b h", dst_mesh=mc.Mesh("dp=4")), MeshMismatchError,
     'reshard(..., dst_mesh=...) needs dst_mesh bound to torch.distributed, got the Mesh'
     " Mesh(dp=4); fix: bound = mc.init_mesh('dp=4') on every rank, then pass bound"),
    # -- rank
    ("rank", "rank outside the mesh: reshard", lambda: mc.reshard(X, fake_bound(rank=5), "(dp b) (tp h)", "b h"), MeshMismatchError,
     'reshard: rank 5 is not in Mesh(dp=2, tp=2) (its ranks are [0, 1, 2, 3]), so it'
     " holds no shard of a tensor on it. fix: call reshard on the mesh's ranks only (if"
     ' mesh.in_mesh: ...)'),
    ("rank", "rank outside the mesh: execute", lambda: mc.executors.distributed.execute(mc.plan(M, (8, 6), "(dp b) (tp h)", "b h"), X, fake_bound(rank=5)), MeshMismatchError,
     'rank 5 is not in Mesh(dp=2, tp=2); only its ranks [0, 1, 2, 3] run its plans. fix:'
     ' execute it on those ranks only (if bound.in_mesh: ...)'),
    ("rank", "rank outside the mesh: collective", lambda: mc.collectives.all_gather(X, fake_bound(rank=5), "tp"), MeshMismatchError,
     'all_gather: rank 5 is not in Mesh(dp=2, tp=2); only its ranks [0, 1, 2, 3] run its'
     ' collectives'),
    # -- other
    ("other", "two reductions on one axis", lambda: mc.plan(M, (8,), "b | sum(tp)", "b | max(tp)"), PlanError,
     'src "b | sum(tp)" has a pending sum over tp but dst "b | max(tp)" asks for a'
     ' pending max there; one axis cannot mix two reductions. fix: resolve the sum first'
     ' (reshard to a layout without | sum(tp)), then mark the new one'),
    ("other", "dtype not a dtype", lambda: mc.plan(M, (8,), "(dp b)", "b", dtype="float32"), PlanError,
     "dtype must be a torch.dtype, got 'float32'"),
    ("other", "mesh not a Mesh", lambda: mc.plan("dp=2", (8,), "(dp b)", "b"), PlanError,
     'mesh must be a meshcomm Mesh, got str; fix: mc.Mesh("dp=2 tp=4")'),
    ("other", "cost model values", lambda: mc.CostModel(bandwidth=0), PlanError,
     "CostModel needs bandwidth > 0 and latency >= 0, got CostModel(latency_s=(('*',"
     " 1e-05),), bandwidth=(('*', 0.0),), backend='nccl', native=('local', 'all_gather',"
     " 'reduce_scatter', 'all_reduce', 'all_to_all', 'collective_permute', 'send_recv'),"
     " trees=True, wires=())"),
    ("other", "reshard_many item", lambda: mc.reshard_many([(X, B)]), ShapeError,
     'reshard_many: items[0] is neither (Sharded, dst) nor (x_local, mesh, src, dst,'
     ' shape)'),
    ("other", "reshard without dst", lambda: mc.reshard(X, B, "(dp b) (tp h)"), ShapeError,
     'mc.reshard(x_local, mesh, src, dst): give both layouts, src and dst'),
    ("other", "plan cache size", lambda: mc.planner.set_plan_cache_size(-1), PlanError,
     'plan cache size must be an int >= 0, got -1; fix: e.g. set_plan_cache_size(4096)'),
]


@pytest.mark.parametrize("call, error, message", [c[2:] for c in CASES],
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_gets_its_error(call: Callable[[], Any], error: type, message: str) -> None:
    with pytest.raises(error, match="^" + re.escape(message) + "$") as info:
        call()
    assert isinstance(info.value, MeshcommError) and isinstance(info.value, ValueError)


def test_every_message_is_in_the_docs_table() -> None:
    text = DOCS.read_text()
    missing = [f"{c[0]}/{c[1]}" for c in CASES if c[4] not in text]
    assert not missing, f"docs/errors.md lacks the messages of {missing}"


def test_categories_cover_the_issue() -> None:
    assert {c[0] for c in CASES} == {"pattern", "axes", "mesh", "dims", "sizes", "local",
                                     "meshes", "rank", "other"}


# -- the planner's input validation, fuzzed: a Plan or a meshcomm error, never another ------
TOKENS = st.sampled_from(["dp", "tp", "cp", "b", "h", "s", "x=2", "tp=2", "(", ")", "|",
                          "sum(", "max(", "avg(", ",", " ", "dp b", "(tp h)", "(b dp)", "=",
                          "1", "é", "\n"])
LAYOUTS = st.lists(TOKENS, max_size=10).map("".join) | st.text(max_size=20)
SHAPES = st.lists(st.integers(-1, 9), max_size=3).map(tuple)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=LAYOUTS, dst=LAYOUTS, shape=SHAPES, mesh=st.sampled_from(["dp=2 tp=2", "tp=4"]))
def test_fuzz_plan_gives_a_plan_or_a_meshcomm_error(src: str, dst: str,
                                                    shape: tuple[int, ...], mesh: str) -> None:
    try:
        p = mc.plan(mc.Mesh(mesh), shape, src, dst)
    except MeshcommError as err:
        assert isinstance(err, ValueError), err
        return
    assert (p.src, p.dst, p.shape) == (mc.Layout(src), mc.Layout(dst), shape)


# -- plan()'s own argument checks ------------------------------------------------------------
@pytest.mark.parametrize("shape", [("a",), None, 8, (4.5,), (True,)],
                         ids=["str", "None", "int", "float", "bool"])
def test_a_shape_that_is_not_ints(shape: Any) -> None:
    with pytest.raises(mc.errors.PlanError, match="shape must"):
        mc.plan(M, shape, "(dp b)", "b")


def test_a_cost_model_that_is_not_one() -> None:
    with pytest.raises(mc.errors.PlanError, match="cost_model must be a meshcomm CostModel"):
        mc.plan(M, (8,), "(dp b)", "b", cost_model="fast")  # type: ignore[arg-type]


# -- one guard for "this needs a bound mesh" ----------------------------------------------------
UNBOUND_CALLS = {
    "reshard": lambda: mc.reshard(X, M, "(dp b) (tp h)", "b h"),
    "Sharded": lambda: mc.Sharded(X, M, "(dp b) (tp h)", (8, 6)),
    "distribute": lambda: mc.distribute(torch.zeros(8, 6), M, "(dp b) (tp h)"),
    "parallelize": lambda: mc.nn.parallelize(torch.nn.Linear(4, 4), M, {"": "colwise"}),
    "fully_shard": lambda: mc.nn.fully_shard(torch.nn.Linear(4, 4), M),
    "vocab_parallel_cross_entropy": lambda: mc.nn.vocab_parallel_cross_entropy(
        torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), M, "tp"),
    "ColumnParallelLinear": lambda: mc.nn.ColumnParallelLinear(M, "tp", torch.zeros(4, 4)),
    "execute": lambda: mc.executors.distributed.execute(
        mc.plan(M, (8, 6), "(dp b) (tp h)", "b h"), X, M),
}


@pytest.mark.parametrize("who", sorted(UNBOUND_CALLS))
def test_every_call_that_needs_a_bound_mesh_says_so_the_same_way(who: str) -> None:
    with pytest.raises(MeshMismatchError) as info:
        UNBOUND_CALLS[who]()
    assert str(info.value).startswith(f"{who} needs ")
    assert str(info.value).endswith(" bound to torch.distributed, got the Mesh Mesh(dp=2, tp=2);"
                                    " fix: bound = mc.init_mesh('dp=2 tp=2') on every rank,"
                                    " then pass bound")
