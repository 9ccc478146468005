"""Check mode (`init_mesh(check=True)`, `check=True`, MESHCOMM_CHECK=1): the ranks of a group agree on each call first.

On 4 gloo processes (dp=2 tp=2): calls that agree run as without checks; calls that differ
(layouts, dtype, item count, shape, op) raise the same CollectiveMismatchError on every rank
of the group, naming which ranks differ and how, and leave the groups usable; a rank that
never makes the call times out the others' check with a CollectiveTimeout. The message
format and the fingerprint encoding are tested in this process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import meshcomm as mc
from meshcomm.runtime.bind import check_default
from meshcomm.runtime.checks import (FINGERPRINT_BYTES, TEXT_BYTES, checking, decode, encode,
                                     mismatch_message, ranks_text, reshard_fields)

from conftest import outcome, run_scaled, scaled, set_group_timeout

MESH = "dp=2 tp=2"
HANG_TIMEOUT_S = 2.0          # the hanging group's (tp [0, 1]) check timeout: short, never scaled
HEALTHY_TIMEOUT_S = 90.0      # init_mesh(timeout_s=scaled(...)): every other group's
RUN_TIMEOUT_S = 120.0         # run_ranks(timeout_s=scaled(...)): the whole test
SLACK_S = 5.0                 # scaled: how late past the timeout the error may come
FIX = ("  fix: every rank of the group must make the same calls in the same order; look for a"
       " branch on the rank, or on data that differs between ranks, before this call")


# -- in this process ---------------------------------------------------------------------------
def fake(check: bool) -> mc.BoundMesh:
    return mc.BoundMesh(mc.Mesh(MESH), "gloo", torch.device("cpu"), 0, {}, check)


def test_check_mode_is_the_call_s_choice_else_the_mesh_s() -> None:
    on, off = fake(True), fake(False)
    assert checking(on, None) and not checking(off, None)
    assert checking(off, True) and not checking(on, False)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("yes", True), ("", False),
                                       ("0", False), ("false", False), ("off", False)])
def test_the_environment_variable_is_the_meshes_default(monkeypatch: pytest.MonkeyPatch,
                                                        value: str, on: bool) -> None:
    monkeypatch.setenv("MESHCOMM_CHECK", value)
    assert check_default(None) is on
    assert check_default(not on) is (not on)     # an explicit choice wins
    assert checking(None, None) is on            # groups that are not a BoundMesh


def test_ranks_text() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 1]) == "ranks 0, 1"
    assert ranks_text([0, 2, 5, 6, 7]) == "ranks 0, 2, 5-7"


def rows_for(*fields_per_rank: tuple[tuple[str, str], ...]) -> list[list[int]]:
    return [encode(f, "", torch.device("cpu")).row[0].tolist() for f in fields_per_rank]


def reshard_of(src: str, dtype: torch.dtype = torch.float32) -> tuple[tuple[str, str], ...]:
    return reshard_fields(mc.plan(mc.Mesh(MESH), (8, 6), src, "b h", dtype=dtype))[0]


def test_a_fingerprint_is_256_bytes_and_its_text_reads_back() -> None:
    fields = reshard_of("(dp b) h")
    row, probe = encode(fields, "detail", torch.device("cpu"))
    assert row.shape == (1, FINGERPRINT_BYTES) and row.dtype == torch.uint8
    assert decode(row[0].tolist())[1] == fields
    assert probe.dtype == torch.int64 and torch.equal(probe[:2], -probe[2:])
    assert bool((probe[:2] >= 0).all())
    # the hash covers the detail (the plan's steps) that the text leaves out
    other = encode(fields, "other detail", torch.device("cpu"))
    assert not torch.equal(row, other.row) and not torch.equal(probe, other.probe)


def test_a_long_call_is_cut_at_a_field_boundary_but_hashed_whole() -> None:
    long = (("call", "reshard"), ("src", '"' + "b" * 300 + '"'), ("dst", '"b"'))
    digest, shown = decode(encode(long, "", torch.device("cpu")).row[0].tolist())
    assert shown == (("call", "reshard"),)
    assert TEXT_BYTES == 240


def test_mismatch_message_names_the_ranks_and_the_difference() -> None:
    a, b = reshard_of("(dp b) h"), reshard_of("(tp b) h")
    message = mismatch_message("reshard on Mesh(dp=2, tp=2)", [0, 1, 2, 3], rows_for(a, a, a, b))
    assert message == (
        'reshard on Mesh(dp=2, tp=2): rank 3 asked for reshard src="(tp b) h",'
        ' plan=all_gather(tp) but ranks 0-2 asked for reshard src="(dp b) h",'
        " plan=all_gather(dp)\n"
        '  ranks 0-2: reshard src="(dp b) h" dst="b h" shape=(8, 6) dtype=float32'
        " mesh=Mesh(dp=2, tp=2) plan=all_gather(dp)\n"
        '  rank 3:    reshard src="(tp b) h" dst="b h" shape=(8, 6) dtype=float32'
        " mesh=Mesh(dp=2, tp=2) plan=all_gather(tp)\n" + FIX)


def test_a_shape_only_mismatch_names_shape() -> None:
    """7 rows over dp=2 without shape=: rank 0 (4 rows) infers 8, rank 1 (3 rows) infers 6."""
    mesh = mc.Mesh("dp=2")
    eight, six = (reshard_fields(mc.plan(mesh, (n, 6), "(dp b) h", "b h"))[0] for n in (8, 6))
    message = mismatch_message("reshard on Mesh(dp=2)", [0, 1], rows_for(eight, six))
    assert message.splitlines()[-1] == (
        "  fix: the ranks disagree on the global shape only: pass shape=(...), the global"
        " shape, on every rank (without it each rank infers the shape from its own shard, and"
        " uneven shards infer different ones)")


def test_mismatch_message_with_three_classes_and_another_operation() -> None:
    a, b = reshard_of("(dp b) h"), reshard_of("(dp b) h", torch.float64)
    c = (("call", "all_gather"), ("group", 'over "tp" of Mesh(dp=2, tp=2)'))
    first = mismatch_message("reshard on Mesh(dp=2, tp=2)", [0, 1, 2, 3], rows_for(a, b, a, c))
    assert first.splitlines()[:2] == [
        "reshard on Mesh(dp=2, tp=2): rank 1 asked for reshard dtype=float64 but ranks 0, 2"
        " asked for reshard dtype=float32",
        "reshard on Mesh(dp=2, tp=2): rank 3 asked for all_gather but ranks 0, 2 asked for"
        " reshard"]


def test_a_difference_past_the_text_is_still_reported() -> None:
    a = reshard_of("(dp b) h")
    rows = [encode(a, d, torch.device("cpu")).row[0].tolist() for d in ("x", "x", "y", "x")]
    message = mismatch_message("reshard on Mesh(dp=2, tp=2)", [0, 1, 2, 3], rows)
    assert message.splitlines()[0] == (
        "reshard on Mesh(dp=2, tp=2): rank 2 asked for a different reshard than ranks 0, 1, 3"
        " (it differs past the part of the call that is shown, e.g. in the plan's steps)")


# -- on 4 processes ----------------------------------------------------------------------------
def expected(mesh: mc.Mesh, src: str, dst: str, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    data = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    locs = mc.sim.scatter(data, mesh, src)
    return mc.sim.execute(mc.plan(mesh, shape, src, dst), locs).outputs[mesh.position(rank)]


def local(mesh: mc.Mesh, src: str, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    data = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    return mc.sim.scatter(data, mesh, src)[mesh.position(rank)]


def mismatch_worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh(MESH, timeout_s=scaled(HEALTHY_TIMEOUT_S), check=True)
    mesh, out = bound.mesh, {}

    def attempt(name: str, call: Any) -> None:
        out[name] = outcome(call)

    x = local(mesh, "(dp b) h", (8, 6), rank)
    y = mc.reshard(x, bound, "(dp b) h", "b h")
    out["agreed"] = bool(torch.equal(y, expected(mesh, "(dp b) h", "b h", (8, 6), rank)))
    src = "(tp b) h" if rank == 3 else "(dp b) h"
    attempt("src", lambda: mc.reshard(x, bound, src, "b h"))
    # a mesh without check mode, checked for one call
    plain = mc.init_mesh(MESH, timeout_s=scaled(HEALTHY_TIMEOUT_S), check=False)
    attempt("src_call", lambda: mc.reshard(x, plain, src, "b h", check=True))
    attempt("dtype", lambda: mc.reshard(x.double() if rank == 0 else x, bound, "(dp b) h",
                                        "b h"))
    items = [(x, bound, "(dp b) h", "b h", (8, 6))] * (1 if rank == 2 else 2)
    attempt("many", lambda: mc.reshard_many(items))
    attempt("all_gather", lambda: mc.collectives.all_gather(torch.ones(2, 3 if rank == 0 else 2),
                                                bound, "tp") + 0)
    attempt("all_reduce", lambda: mc.collectives.all_reduce(torch.ones(3), bound, ("dp", "tp"),
                                                op="max" if rank == 3 else "sum") + 0)
    # a rank whose own checks fail before communicating: every rank raises, at once
    bad = x[:, :5] if rank == 1 else x                    # (4, 5) where (4, 6) is due
    attempt("local_inferred", lambda: mc.reshard(x[0] if rank == 1 else x, bound, "(dp b) h",
                                                 "b h"))              # 1 dim where 2 are due
    attempt("local_given", lambda: mc.reshard(bad, bound, "(dp b) h", "b h", shape=(8, 6)))
    attempt("local_many", lambda: mc.reshard_many([(bad, bound, "(dp b) h", "b h", (8, 6))]))
    # the groups are still usable, and agreeing collectives run
    total = mc.collectives.all_reduce(torch.ones(3), bound, ("dp", "tp")) + 0
    out["after"] = total.tolist()
    return out


def test_mismatches_raise_on_every_rank_naming_the_ranks_and_the_difference() -> None:
    results = run_scaled(mismatch_worker, 4, timeout_s=RUN_TIMEOUT_S)
    assert all(r["agreed"] for r in results)
    assert all(r["after"] == [4.0, 4.0, 4.0] for r in results)
    for key in ("src", "dtype", "many", "all_reduce"):
        assert len({r[key] for r in results}) == 1, [r[key] for r in results]
    head = {key: results[0][key].splitlines()[0] for key in results[0]
            if isinstance(results[0][key], str)}
    assert head["src"] == (
        'CollectiveMismatchError: reshard on Mesh(dp=2, tp=2): rank 3 asked for reshard'
        ' src="(tp b) h", plan=all_gather(tp) but ranks 0-2 asked for reshard src="(dp b) h",'
        " plan=all_gather(dp)")
    assert head["dtype"] == (
        "CollectiveMismatchError: reshard on Mesh(dp=2, tp=2): rank 0 asked for reshard"
        " dtype=float64 but ranks 1-3 asked for reshard dtype=float32")
    assert head["many"] == (
        "CollectiveMismatchError: reshard_many on Mesh(dp=2, tp=2): rank 2 asked for"
        " reshard_many items=1 but ranks 0, 1, 3 asked for reshard_many items=2")
    assert head["all_reduce"] == (
        'CollectiveMismatchError: all_reduce over (\'dp\', \'tp\') of Mesh(dp=2, tp=2): rank 3'
        " asked for all_reduce op=max but ranks 0-2 asked for all_reduce op=sum")
    assert results[0]["all_gather"] == results[1]["all_gather"]
    assert results[0]["all_gather"].splitlines()[0] == (
        'CollectiveMismatchError: all_gather over "tp" of Mesh(dp=2, tp=2): rank 1 asked for'
        " all_gather shape=(2, 2) but rank 0 asked for all_gather shape=(2, 3)")
    assert results[2]["all_gather"] == results[3]["all_gather"] == "ran"
    assert results[0]["src"].endswith(FIX)
    for key in ("local_inferred", "local_given", "local_many"):
        got = [r[key].splitlines()[0] for r in results]
        assert got[1].startswith("ShapeError: ") and "rank 1" in got[1], got
        for other in (0, 2, 3):       # the others do not wait for rank 1: they raise too
            assert got[other].startswith("CollectiveMismatchError: "), got
            assert ": rank 1 raised ShapeError: " in got[other], got
            assert got[other].endswith("raise with it instead of waiting for it"), got
    assert [r["src_call"] for r in results] == [r["src"] for r in results]


def skip_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    bound = mc.init_mesh(MESH, timeout_s=scaled(HEALTHY_TIMEOUT_S), check=True)
    if bound.group_ranks("tp") == (0, 1):     # the group that hangs: a short timeout
        set_group_timeout(bound, "tp", HANG_TIMEOUT_S)
    flag = Path(out_dir, "rank0.json")
    torch.distributed.barrier()         # start together: ranks 2 and 3 never wait on a slow peer
    start = time.monotonic()
    if rank == 1:   # skips the all_gather: waits until rank 0 has given up on it
        while not flag.exists() and time.monotonic() - start < scaled(RUN_TIMEOUT_S):
            time.sleep(0.05)
        return {"skipped": True, "pid": os.getpid()}
    try:
        mc.collectives.all_gather(torch.ones(2), bound, "tp")
        result: dict[str, Any] = {"ran": True}
    except mc.errors.MeshcommError as err:
        result = {"error": type(err).__name__, "message": str(err),
                  "seconds": time.monotonic() - start}
    flag.parent.joinpath(f"rank{rank}.json").write_text(json.dumps(result))
    return {**result, "pid": os.getpid()}


def test_a_rank_that_skips_a_checked_collective_times_out_the_check(tmp_path: Path) -> None:
    results = run_scaled(skip_worker, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S)
    pids = [r.pop("pid") for r in results]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    for pid in pids:            # every rank's process is reaped and gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert results[1] == {"skipped": True}
    assert results[2] == results[3] == {"ran": True}
    peer = results[0]
    assert peer["error"] == "CollectiveTimeout", peer
    # The hanging group's short timeout fired: not before it, and long before the healthy one.
    assert HANG_TIMEOUT_S - 0.5 < peer["seconds"] < HANG_TIMEOUT_S + scaled(SLACK_S), peer
    assert peer["message"].startswith(
        'all_gather over "tp" of Mesh(dp=2, tp=2): check mode could not compare the call across'
        " the group (ranks 0, 1): a rank of the group died, hangs, or never made this call. cause:"
        " RuntimeError: "), peer["message"]
