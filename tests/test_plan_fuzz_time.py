"""benchmarks/plan_fuzz_time.py: the random small sample draws valid transitions on meshes
of at most 64 ranks, the same every run, and the side-by-side run plans the same cases
with two checkouts in turn and reports their ratio."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import meshcomm as mc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import plan_fuzz_time as fuzz  # noqa: E402


def test_the_random_small_sample_is_valid_small_and_repeatable() -> None:
    cases = fuzz.random_small(40, seed=3)
    assert cases == fuzz.random_small(40, seed=3)
    assert cases != fuzz.random_small(40, seed=4)
    assert len(set(cases)) == 40
    for spec, shape, src, dst in cases:
        mesh = mc.Mesh(spec)
        assert mesh.size <= 64 and src != dst
        mc.Layout(src).placements(mesh, shape)
        mc.Layout(dst).placements(mesh, shape)
    # partial sources and uneven dims are in the sample
    assert any(mc.Layout(src).reduce_op for _, _, src, _ in cases)
    assert any(any(n % math.prod(mc.Mesh(spec).shape) for n in shape)
               for spec, shape, _, _ in cases)


def test_the_cross_mesh_sample_is_valid_and_repeatable() -> None:
    """`random_cross`: two meshes of at most 32 ranks each, disjoint, overlapping or nested,
    the destination layout valid on the destination mesh; the fixed ones start with issue
    39's two cases."""
    cases = fuzz.random_cross(30, seed=3)
    assert cases == fuzz.random_cross(30, seed=3) != fuzz.random_cross(30, seed=4)
    overlap = set()
    for case in cases:
        src_mesh, dst_mesh = fuzz.meshes(case)
        assert dst_mesh is not None and dst_mesh != src_mesh
        assert src_mesh.size <= 32 and dst_mesh.size <= 32
        mc.Layout(case[2]).placements(src_mesh, case[1])
        mc.Layout(case[3]).placements(dst_mesh, case[1])
        overlap.add(bool(set(src_mesh.ranks) & set(dst_mesh.ranks)))
    assert overlap == {False, True}
    assert fuzz.fixed_cross(2)[:2] == fuzz.CROSS_ISSUE


def test_both_sections_plan_cold_and_report(tmp_path: Path) -> None:
    """A small sample's summary (its max and how many took 100 ms or more: the target of
    issue 39), and this checkout against itself, on one mesh and between two: every case
    planned by both workers in turn, with the same bytes."""
    small = fuzz.small_section(6, seed=5, limit_s=60.0)
    s = small["summary"]
    assert s["cases"] == 6 and s["failed"] == 0
    assert 0 < s["p50_ms"] <= s["max_ms"]
    assert s["over_target"] == sum(r["ms"] >= 100.0 for r in small["rows"])
    first = fuzz.small_lines(small)[0]
    assert "random small" in first and f"max {s['max_ms']:.1f} ms" in first
    assert f"{s['over_target']} at or over 100 ms" in first
    cases = fuzz.fixed_small(2)[:2] + fuzz.fixed_cross(1)[-2:]
    got = fuzz.run_cases({"old": fuzz.ROOT, "new": fuzz.ROOT}, cases, 1, 60.0, tmp_path)
    for old, new in zip(got["old"], got["new"]):
        assert old[0]["ms"] > 0 and new[0]["ms"] > 0
        assert (old[0]["sent"], old[0]["recv"]) == (new[0]["sent"], new[0]["recv"])
