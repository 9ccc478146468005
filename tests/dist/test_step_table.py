"""One table of step kinds (`meshcomm.executors.steps.KINDS`), implemented by both executors.

Every (kind, wire) pair of the table runs through the simulator and through the
torch.distributed executor on 4 gloo processes: outputs must be bit-identical, and the
bytes each executor measured from the buffers it handed to its collectives must equal the
plan's bytes (the planner's formulas, `meshcomm.planner.traffic`) rank by rank.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.executors import sim
from meshcomm.executors.steps import KINDS

from conftest import run_scaled

TIMEOUT_S = 240.0       # run_ranks, scaled by MESHCOMM_TEST_TIMEOUT_FACTOR


@dataclass(frozen=True)
class Case:
    kind: str
    wire: str
    mesh: str
    shape: tuple[int, ...]
    src: str
    dst: str
    ranks: tuple[int, ...] | None = None       # the mesh's ranks (default 0..size-1)
    dst_ranks: tuple[int, ...] | None = None   # a destination mesh over these ranks


CASES = (
    Case("local", "", "tp=4", (8, 6), "a b", "(tp a) b"),
    Case("all_gather", "all_gather", "tp=4", (8, 6), "(tp a) b", "a b"),
    Case("all_gather", "all_to_all", "tp=4", (10, 6), "(tp a) b", "a b"),
    Case("reduce_scatter", "reduce_scatter", "tp=4", (8, 6), "a b | sum(tp)", "(tp a) b"),
    # large enough for no tree step (trees.ELEMENT_LIMIT: elements x ranks above 2^22):
    # those beat an uneven reduce_scatter
    Case("reduce_scatter", "all_to_all", "tp=4", (10, 104900), "a b | max(tp)", "(tp a) b"),
    Case("all_reduce", "all_reduce", "tp=4", (5, 3), "a b | sum(tp)", "a b"),
    Case("all_to_all", "all_to_all", "tp=4", (8, 16), "(tp a) b", "a (tp b)"),
    Case("collective_permute", "all_to_all", "dp=2 tp=2", (8, 8, 4), "(dp b) (tp s) h",
         "(tp b) (dp s) h"),
    Case("send_recv", "all_to_all", "tp=4", (10, 6), "(tp a) b", "a (tp b)"),
    Case("send_recv", "send/recv", "tp=2", (6, 4), "(tp a) b", "a (tp b)", ranks=(0, 1),
         dst_ranks=(2, 3)),
)


def _mesh(case: Case) -> mc.Mesh:
    return mc.Mesh(case.mesh, ranks=list(case.ranks) if case.ranks else None)


def _dst_mesh(case: Case) -> mc.Mesh | None:
    return None if case.dst_ranks is None else mc.Mesh(case.mesh, ranks=list(case.dst_ranks))


def _plan(case: Case) -> mc.Plan:
    return mc.plan(_mesh(case), case.shape, case.src, case.dst, dst_mesh=_dst_mesh(case))


def _global(shape: tuple[int, ...]) -> torch.Tensor:
    # Small integers: every reduction is exact in any order.
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) % 7 - 3


def test_every_kind_and_wire_of_the_table_has_a_case() -> None:
    pairs = {(k, w) for k, ws in KINDS.items() for w in ws}
    assert {(c.kind, c.wire) for c in CASES} == pairs


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.kind}-{c.wire or 'local'}")
def test_case_plans_its_kind_with_its_wire(case: Case) -> None:
    steps = [(s.kind, s.wire) for s in _plan(case).steps]
    assert (case.kind, case.wire) in steps, steps


def test_both_executors_have_one_handler_per_kind() -> None:
    # The packages re-export their `execute` functions, so take the modules by name.
    sim_run = importlib.import_module("meshcomm.executors.sim.execute").HANDLERS
    dist_run = importlib.import_module("meshcomm.executors.distributed.handlers").HANDLERS
    assert set(sim_run) == set(KINDS) == set(dist_run)


def _rank(rank: int, world_size: int) -> list[dict[str, Any]]:
    bound_cache: dict[tuple[str, tuple[int, ...] | None], mc.BoundMesh] = {}

    def bound(mesh: mc.Mesh) -> mc.BoundMesh:
        key = (str(mesh), mesh.ranks)
        if key not in bound_cache:
            # The spec-string-and-ranks spelling of init_mesh, checked against the Mesh.
            spec = " ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.shape))
            bound_cache[key] = mc.init_mesh(spec, ranks=list(mesh.ranks))
            assert bound_cache[key].mesh == mesh
        return bound_cache[key]

    out = []
    for case in CASES:
        mesh, dst_mesh = _mesh(case), _dst_mesh(case)
        src, dst = bound(mesh), (bound(dst_mesh) if dst_mesh is not None else None)
        x = _global(case.shape)
        trace = mc.ByteTrace()
        local = mc.distribute(x, src, case.src).local if rank in mesh.ranks else None
        if dst is None:
            y = mc.reshard(local, src, case.src, case.dst, shape=case.shape, trace=trace) \
                if rank in mesh.ranks else None
        else:
            y = mc.reshard(local, src, case.src, case.dst, dst_mesh=dst, shape=case.shape,
                           dtype=torch.float32, trace=trace)
        out.append({"y": y, "calls": [tuple(c) for c in trace.calls]})
    return out


def test_every_kind_runs_alike_on_both_executors_and_measures_the_plans_bytes() -> None:
    per_rank = run_scaled(_rank, 4, timeout_s=TIMEOUT_S)
    for k, case in enumerate(CASES):
        p = _plan(case)
        mesh = _mesh(case)
        locals_ = sim.scatter(_global(case.shape), mesh, case.src)
        res = sim.execute(p, locals_)
        # Simulated outputs and measured bytes, by global rank.
        ranks = p.ranks
        assert res.send_bytes == p.send_bytes and res.recv_bytes == p.recv_bytes, case
        for i, r in enumerate(ranks):
            got = per_rank[r][k]
            sent = sum(c[2] for c in got["calls"])
            received = sum(c[3] for c in got["calls"])
            assert (sent, received) == (p.send_bytes[i], p.recv_bytes[i]), (case, r)
            want = res.outputs[i]
            if want is None:
                assert got["y"] is None, (case, r)
            else:
                assert torch.equal(got["y"], want), (case, r)
        # The distributed executor made one call per collective step, of the step's kind.
        for r in ranks:
            kinds = [c[0] for c in per_rank[r][k]["calls"]]
            assert kinds == [s.kind for s in p.collectives], (case, r)
