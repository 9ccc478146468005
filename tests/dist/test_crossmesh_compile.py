"""Plans between two meshes under torch.compile (inductor, fullgraph), on 8 gloo processes.

Traced, the transfer step is one all_to_all over the process group of exactly both meshes'
ranks (the world for meshes that cover it; here also a group of ranks 0-5, made before
compiling): a traced batch of point-to-point messages raced under inductor (wrong values on
some ranks in two of three compiles). Each case compiles several times and runs each
compiled function several times; every destination rank's output equals the simulator's bit
for bit (integer-valued data), and a rank outside the destination mesh gets None. Without
such a group, the compiled reshard refuses, naming the ranks and the fix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import meshcomm as mc

from conftest import ints, ranks_fixture

MESHES = {                                            # bound in this order on every rank
    "A": mc.Mesh("dp=2 tp=2"),                        # ranks 0-3
    "B": mc.Mesh("tp=4", ranks=[4, 5, 6, 7]),         # A and B cover the world
    "C": mc.Mesh("x=2 y=2", ranks=[2, 3, 4, 5]),      # A and C: ranks 0-5
    "E": mc.Mesh("q=2", ranks=[6, 7]),                # A and E: ranks 0-3, 6, 7 (no group)
}
CASES = [  # (src mesh, dst mesh, shape, src, dst)
    ("A", "B", (8, 6), "(dp b) s", "(tp b) s"),
    ("B", "A", (8, 8), "b (tp s)", "(dp b) (tp s)"),
    ("A", "C", (8, 6), "(dp b) (tp s)", "(x b) s"),
    ("C", "A", (8, 6), "(x b) s", "(dp b) (tp s)"),
]
COMPILES, CALLS = 3, 3


def _compiled(bound: dict[str, mc.BoundMesh], rank: int, case: int) -> list[bool] | str:
    """Whether each call of each compile equals the simulator on this rank, or the error."""
    import torch._dynamo

    s, d, shape, src, dst = CASES[case] if case < len(CASES) else \
        ("A", "E", (8, 6), "(dp b) s", "(q b) s")
    sb, db = bound[s], bound[d]
    x_global = ints(shape, case)
    x = mc.sim.scatter(x_global, sb.mesh, src)[sb.mesh.position(rank)] if sb.in_mesh else None
    want = (mc.sim.scatter(x_global * 2 + 1, db.mesh, dst)[db.mesh.position(rank)]
            if db.in_mesh else None)

    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return mc.reshard(None if x is None else x * 2 + 1, sb, src, dst, dst_mesh=db,
                          shape=shape, dtype=torch.float32)
    got = []
    try:
        for _ in range(COMPILES):
            torch._dynamo.reset()
            fn = torch.compile(move, backend="inductor", fullgraph=True)
            for _ in range(CALLS):
                y = fn(x)
                got.append(y is None if want is None else y is not None and torch.equal(y, want))
    except Exception as exc:      # noqa: BLE001 - the test reports it
        return _meshcomm_error(exc)
    return got


def _meshcomm_error(exc: BaseException) -> str:
    """The meshcomm error `exc` was raised from (Dynamo wraps what its traced call raises),
    else `exc`, as "Type: message"."""
    err: BaseException | None = exc
    while err is not None and not isinstance(err, mc.errors.MeshcommError):
        err = err.__cause__ or err.__context__
    err = err or exc
    return f"{type(err).__name__}: {err}"


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    bound = {name: mc.init_mesh(mesh) for name, mesh in MESHES.items()}
    dist.new_group([0, 1, 2, 3, 4, 5])     # every rank, before compiling: A and C's group
    return {"cases": [_compiled(bound, rank, i) for i in range(len(CASES))],
            "no_group": _compiled(bound, rank, len(CASES))}


eight = ranks_fixture(eight_ranks, 8, timeout_s=600)


def test_compiled_reshards_between_meshes_equal_the_simulator(eight: list[Any]) -> None:
    """Every call of every compile, on every rank, bit for bit."""
    for rank, r in enumerate(eight):
        for case, got in zip(CASES, r["cases"]):
            assert got == [True] * COMPILES * CALLS, (rank, case, got)


def test_compiled_reshard_without_a_group_of_both_meshes_refuses(eight: list[Any]) -> None:
    """A (ranks 0-3) to E (ranks 6 and 7): no group of ranks 0-3, 6, 7; those ranks raise
    while tracing, before any message, and ranks 4 and 5 (in neither mesh) get None."""
    want = ("no process group of exactly those ranks exists. fix:"
            " torch.distributed.new_group([0, 1, 2, 3, 6, 7]) on every rank before compiling")
    for rank, r in enumerate(eight):
        got = r["no_group"]
        if rank in (4, 5):
            assert got == [True] * COMPILES * CALLS, (rank, got)
        else:
            assert isinstance(got, str) and got.startswith("MeshMismatchError") \
                and want in got, (rank, got)
