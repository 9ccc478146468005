"""Cold planning time on small meshes: a random sample's slowest plan, and a side-by-side run
against another checkout of meshcomm (the last release).

Run: `python benchmarks/plan_fuzz_time.py [--random-small N] [--seed S] [--against PATH]
[--fixed N] [--fixed-cross N] [--reps R] [--limit-s S] [--json PATH]`.

`--random-small N` (default 2,000; 0: none): N valid transitions drawn with `random_small`
on meshes of at most 64 ranks (1 to 4 axes named from `SMALL_AXES`, sizes 1 to 8; 1 to 4
dims of small, often uneven sizes; random layouts with every pending op, a tenth of them
with a sized local factor); one cold plan each (every meshcomm cache emptied first, as in
`plan_scale.cold_ms`), under `--limit-s`. Printed: p50, p90, max, how many took 100 ms or
more, and the slowest cases; the target of issue 39 is max < 100 ms.

`--against PATH` (a checkout of meshcomm, e.g. a `git worktree` of the last release): the
`--fixed N` transitions (the first N of `random_small`'s draw with seed 39, plus the small
fixed cases of `plan_scale.suite()`) are planned cold by two worker processes, one
importing meshcomm from PATH and one from this checkout, in turn (old, new, old, new, ...
for `--reps` rounds), each with one torch thread and every cache emptied before each call.
Printed: per side the sum and median of the per-case medians, and the ratio new / old
(sum and median of per-case ratios), with the machine's load before and after. A case
one side cannot plan (an error, a timeout) is left out of the ratios and counted. Then
the same for the fixed cases between two meshes (`--fixed-cross N`, default 100: issue
39's two and the first N of `random_cross`'s draw with seed 39), apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SMALL_AXES = ("dp", "tp", "cp", "sp", "pp", "ep")
SMALL_SIZES = (1, 2, 2, 2, 3, 4, 4, 5, 8)
DIM_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 24, 64, 96, 128)
OPS = ("sum", "avg", "max", "min")
TARGET_MAX_MS = 100.0     # issue 39: no plan over 100 ms on meshes of <= 64 ranks
CROSS_SIZES = (1, 2, 2, 2, 3, 4, 4)
# mesh spec, shape, src, dst; between two meshes also the destination mesh, as
# "spec@first" (its ranks first, first + 1, ...; the source mesh's start at 0)
Case = tuple[str, tuple[int, ...], str, str] | tuple[str, tuple[int, ...], str, str, str]
# issue 39's cases between two meshes
CROSS_ISSUE: list[Case] = [
    ("sp=4", (4, 8, 12), "a b c | sum(sp)", "a (cp b) (c dp ep)", "cp=4 ep=3 dp=4@0"),
    ("tp=2 sp=1", (4,), "a | sum(sp)", "(tp a)", "tp=2@0"),
]


def meshes(case: Case) -> tuple[Any, Any]:
    """The source mesh of `case`, and its destination mesh (None on one mesh)."""
    import meshcomm as mc

    if len(case) == 4:
        return mc.Mesh(case[0]), None
    spec, first = case[4].rsplit("@", 1)
    axes = dict(mc.Mesh(spec).axes)
    return mc.Mesh(case[0]), mc.Mesh(axes, ranks=range(int(first), int(first) + math.prod(
        axes.values())))


def random_small(count: int, seed: int, most: int = 64) -> list[Case]:
    """`count` valid transitions (mesh spec, shape, src, dst) on meshes of at most `most`
    ranks, drawn from `random.Random(seed)` with `meshcomm.testing.random_layout`: 1 to 4
    axes (`SMALL_AXES`, sizes from `SMALL_SIZES`), 1 to 4 dims (sizes from `DIM_SIZES`), a
    source with any pending op or none and a destination with the same op or none."""
    import meshcomm as mc
    from meshcomm.testing import random_layout

    rng = random.Random(seed)
    out: list[Case] = []
    while len(out) < count:
        names = rng.sample(SMALL_AXES, rng.randint(1, 4))
        sizes = [rng.choice(SMALL_SIZES) for _ in names]
        if math.prod(sizes) > most:
            continue
        spec = " ".join(f"{a}={n}" for a, n in zip(names, sizes))
        mesh = mc.Mesh(spec)
        ndim = rng.randint(1, 4)
        shape = tuple(rng.choice(DIM_SIZES) for _ in range(ndim))
        if math.prod(shape) > 1 << 20:
            continue
        src = random_layout(rng, mesh, ndim, OPS, name_inside=0.3, sized=0.1)
        op = mc.Layout(src).reduce_op
        dst = random_layout(rng, mesh, ndim, (op,) if op else OPS, name_inside=0.3, sized=0.1)
        if dst == src:
            continue
        try:
            mc.Layout(src).placements(mesh, shape)
            mc.Layout(dst).placements(mesh, shape)
        except mc.errors.MeshcommError:
            continue
        out.append((spec, shape, src, dst))
    return out


def random_cross(count: int, seed: int, most: int = 32) -> list[Case]:
    """`count` valid transitions between two meshes of at most `most` ranks each (1 to 3
    axes from `SMALL_AXES`, sizes from `CROSS_SIZES`; the destination's first rank drawn so
    that the meshes are disjoint, overlap or nest), 1 to 3 dims (sizes from `DIM_SIZES`), a
    source with any pending op or none and a destination with the same op or none, drawn
    from `random.Random(seed)` with `meshcomm.testing.random_layout`."""
    import meshcomm as mc
    from meshcomm.testing import random_layout

    rng = random.Random(seed)
    out: list[Case] = []

    def spec() -> str:
        names = rng.sample(SMALL_AXES, rng.randint(1, 3))
        return " ".join(f"{a}={rng.choice(CROSS_SIZES)}" for a in names)

    while len(out) < count:
        a, b = spec(), spec()
        src_mesh, size_b = mc.Mesh(a), mc.Mesh(b).size
        if src_mesh.size > most or size_b > most:
            continue
        case_b = f"{b}@{rng.randint(0, src_mesh.size)}"
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(DIM_SIZES) for _ in range(ndim))
        if math.prod(shape) > 1 << 20:
            continue
        _, dst_mesh = meshes((a, shape, "", "", case_b))
        if dst_mesh == src_mesh:
            continue
        src = random_layout(rng, src_mesh, ndim, OPS, name_inside=0.3, sized=0.1)
        op = mc.Layout(src).reduce_op
        dst = random_layout(rng, dst_mesh, ndim, (op,) if op else OPS, name_inside=0.3,
                            sized=0.1)
        try:
            mc.Layout(src).placements(src_mesh, shape)
            mc.Layout(dst).placements(dst_mesh, shape)
        except mc.errors.MeshcommError:
            continue
        out.append((a, shape, src, dst, case_b))
    return out


def plan_case(case: Case) -> Any:
    """`mc.plan` of `case` (between its two meshes where it has two)."""
    import meshcomm as mc

    src_mesh, dst_mesh = meshes(case)
    if dst_mesh is None:
        return mc.plan(src_mesh, case[1], case[2], case[3])
    return mc.plan(src_mesh, case[1], case[2], case[3], dst_mesh=dst_mesh)


def fixed_cross(count: int) -> list[Case]:
    """The fixed cases between two meshes: issue 39's, then the first `count` of
    `random_cross(count, seed=39)`."""
    return CROSS_ISSUE + random_cross(count, seed=39)


def fixed_small(count: int) -> list[Case]:
    """The fixed small cases: `plan_scale.suite()`'s on <= 64 ranks, then the first `count`
    of `random_small(count, seed=39)`."""
    sys.path.insert(0, str(HERE))
    import plan_scale

    import meshcomm as mc

    suite = [(c.mesh, tuple(c.shape), c.src, c.dst) for c in plan_scale.suite()
             if mc.Mesh(c.mesh).size <= 64]
    return suite + random_small(count, seed=39)


def load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "n/a"


def clear_caches() -> None:
    """Every cache of the meshcomm imported (functools caches and the plan memo, where the
    checkout has one: an old release may not), so that the next plan is cold."""
    clear_memos = getattr(sys.modules.get("meshcomm.planner.plan"), "clear_memos", None)
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("meshcomm") or module is None:
            continue
        for value in list(vars(module).values()):
            fn = getattr(value, "cache_clear", None)
            if isinstance(value, type) or not callable(fn) or id(value) in seen:
                continue
            seen.add(id(value))
            fn()
    if clear_memos is not None:
        clear_memos()


# -- the worker: plans cases cold, one per line read, in its own process ------------------
def worker_cases(root: str, cases_path: str) -> list[Case]:
    """A worker's start: meshcomm imported from the checkout at `root` (checked), one torch
    thread, and the cases written to `cases_path`."""
    sys.path.insert(0, root)
    import torch

    import meshcomm as mc
    assert Path(mc.__file__).resolve().is_relative_to(Path(root).resolve()), mc.__file__
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    return [tuple(c[:1]) + (tuple(c[1]),) + tuple(c[2:])
            for c in json.loads(Path(cases_path).read_text())]


def worker(root: str, cases_path: str, limit_s: float) -> None:
    """Reads a case index per line from stdin and answers, per line, its cold plan time in
    ms (or a reason) and its busiest rank's sent and received bytes, as JSON."""
    import gc

    cases = worker_cases(root, cases_path)
    from plan_scale import PlanTimeout, time_limit

    for line in sys.stdin:
        case = cases[int(line)]
        clear_caches()
        gc.collect()
        out: dict[str, Any]
        try:
            with time_limit(limit_s):
                t0 = time.perf_counter()
                p = plan_case(case)
                ms = (time.perf_counter() - t0) * 1e3
            out = {"ms": ms, "sent": max(p.send_bytes, default=0),
                   "recv": max(p.recv_bytes, default=0), "steps": len(p.steps)}
        except PlanTimeout:
            out = {"ms": f"timeout (> {limit_s:g} s)"}
        except Exception as exc:   # reported, not raised: the other side may plan it
            out = {"ms": f"n/a: {type(exc).__name__}: {str(exc)[:120]}"}
        print(json.dumps(out), flush=True)


class Worker:
    """A worker process (`script --worker *args`, one torch thread, `env` added) that answers
    one JSON line per case index written to it: the planning benchmarks' workers."""

    def __init__(self, script: str, args: list[str], env: dict[str, str] | None = None
                 ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script, "--worker", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def plan(self, index: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.args} exited (code {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_cases(roots: dict[str, Path], cases: list[Case], reps: int, limit_s: float,
              tmp: Path) -> dict[str, list[list[dict[str, Any]]]]:
    """Each case planned cold `reps` times by a worker per root, the workers in turn."""
    cases_path = tmp / f"plan_fuzz_cases_{os.getpid()}.json"
    cases_path.write_text(json.dumps(cases))
    workers = {name: Worker(__file__, [str(root), str(cases_path), str(limit_s)])
               for name, root in roots.items()}
    out: dict[str, list[list[dict[str, Any]]]] = {name: [[] for _ in cases] for name in roots}
    try:
        for i in range(len(cases)):
            for _ in range(reps):
                for name, w in workers.items():
                    out[name][i].append(w.plan(i))
    finally:
        for w in workers.values():
            w.close()
    return out


def _median_ms(runs: list[dict[str, Any]]) -> float | str:
    times = [r["ms"] for r in runs if not isinstance(r["ms"], str)]
    if len(times) < len(runs):
        return next(r["ms"] for r in runs if isinstance(r["ms"], str))
    return statistics.median(times)


def small_section(count: int, seed: int, limit_s: float) -> dict[str, Any]:
    """The random sample on <= 64 ranks, one cold plan each by this checkout."""
    cases = random_small(count, seed)
    got = run_cases({"new": ROOT}, cases, 1, limit_s, Path(os.environ.get("TMPDIR", "/tmp")))
    rows = [{"case": list(c), **r[0]} for c, r in zip(cases, got["new"])]
    times = sorted(r["ms"] for r in rows if not isinstance(r["ms"], str))
    failed = [r for r in rows if isinstance(r["ms"], str)]
    slowest = sorted((r for r in rows if not isinstance(r["ms"], str)),
                     key=lambda r: -r["ms"])[:5]
    summary = {"cases": len(rows), "failed": len(failed),
               "p50_ms": times[len(times) // 2] if times else None,
               "p90_ms": times[int(0.9 * (len(times) - 1))] if times else None,
               "max_ms": times[-1] if times else None,
               "over_target": sum(t >= TARGET_MAX_MS for t in times),
               "target_max_ms": TARGET_MAX_MS,
               "target_met": bool(times) and not failed and times[-1] < TARGET_MAX_MS}
    return {"rows": rows, "summary": summary, "slowest": slowest, "failed_rows": failed}


def against_section(old: Path, cases: list[Case], reps: int, limit_s: float
                    ) -> dict[str, Any]:
    """`cases` planned by `old` and by this checkout, in turn."""
    before = load()
    got = run_cases({"old": old, "new": ROOT}, cases, reps, limit_s,
                    Path(os.environ.get("TMPDIR", "/tmp")))
    after = load()
    rows = []
    for c, o, n in zip(cases, got["old"], got["new"]):
        rows.append({"case": list(c), "old_ms": _median_ms(o), "new_ms": _median_ms(n),
                     "old_recv": o[0].get("recv"), "new_recv": n[0].get("recv"),
                     "old_sent": o[0].get("sent"), "new_sent": n[0].get("sent")})
    both = [r for r in rows if not isinstance(r["old_ms"], str)
            and not isinstance(r["new_ms"], str)]
    old_sum = sum(r["old_ms"] for r in both)
    new_sum = sum(r["new_ms"] for r in both)
    summary = {
        "old": str(old), "cases": len(rows), "compared": len(both), "reps": reps,
        "old_failed": sum(isinstance(r["old_ms"], str) for r in rows),
        "new_failed": sum(isinstance(r["new_ms"], str) for r in rows),
        "old_sum_ms": old_sum, "new_sum_ms": new_sum,
        "ratio_of_sums": new_sum / old_sum if old_sum else None,
        "old_p50_ms": statistics.median(r["old_ms"] for r in both) if both else None,
        "new_p50_ms": statistics.median(r["new_ms"] for r in both) if both else None,
        "median_ratio": statistics.median(r["new_ms"] / r["old_ms"] for r in both)
        if both else None,
        "old_max_ms": max((r["old_ms"] for r in both), default=None),
        "new_max_ms": max((r["new_ms"] for r in both), default=None),
        "recv_more": sum(r["new_recv"] > r["old_recv"] for r in both),
        "recv_less": sum(r["new_recv"] < r["old_recv"] for r in both),
        "load_before": before, "load_after": after,
    }
    return {"rows": rows, "summary": summary}


def small_lines(section: dict[str, Any]) -> list[str]:
    s = section["summary"]
    lines = [f"random small (<= 64 ranks, {s['cases']} transitions, {s['failed']} failed):"
             f" cold p50 {s['p50_ms']:.2f} / p90 {s['p90_ms']:.2f} / max {s['max_ms']:.1f} ms;"
             f" {s['over_target']} at or over {s['target_max_ms']:g} ms; target max <"
             f" {s['target_max_ms']:g} ms: {'met' if s['target_met'] else 'NOT met'}"]
    for r in section["slowest"]:
        spec, shape, src, dst = r["case"]
        lines.append(f"  {r['ms']:8.1f} ms  Mesh({spec!r}) {tuple(shape)} {src!r} -> {dst!r}")
    for r in section["failed_rows"][:5]:
        lines.append(f"  failed: {r['ms']}  {r['case']}")
    return lines


def against_lines(section: dict[str, Any], name: str) -> list[str]:
    s = section["summary"]
    return [
        f"against {s['old']}: {s['compared']} of {s['cases']} {name}, {s['reps']}"
        f" cold plans each side in turn (failed: old {s['old_failed']}, new {s['new_failed']})",
        f"  old: sum {s['old_sum_ms']:.0f} ms, p50 {s['old_p50_ms']:.2f} ms, max"
        f" {s['old_max_ms']:.1f} ms; new: sum {s['new_sum_ms']:.0f} ms, p50"
        f" {s['new_p50_ms']:.2f} ms, max {s['new_max_ms']:.1f} ms",
        f"  new / old: sum {s['ratio_of_sums']:.2f}x, median per case"
        f" {s['median_ratio']:.2f}x; busiest receive more in {s['recv_more']}, less in"
        f" {s['recv_less']}; load {s['load_before']} -> {s['load_after']}",
    ]


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return 0
    sys.path.insert(0, str(ROOT))     # this checkout's meshcomm draws the cases
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--random-small", type=int, default=2000, metavar="N",
                        help="random transitions on <= 64 ranks (default 2,000; 0: none)")
    parser.add_argument("--seed", type=int, default=64, help="seed of the random sample")
    parser.add_argument("--against", type=Path, default=None, metavar="PATH",
                        help="a checkout of meshcomm to compare cold times with")
    parser.add_argument("--fixed", type=int, default=300, metavar="N",
                        help="random cases (seed 39) among the fixed small ones (default 300)")
    parser.add_argument("--fixed-cross", type=int, default=100, metavar="N",
                        help="random cases (seed 39) among the fixed ones between two meshes"
                             " (default 100; 0: none)")
    parser.add_argument("--reps", type=int, default=3, help="cold plans a case a side")
    parser.add_argument("--limit-s", type=float, default=30.0, help="limit per cold plan")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    if args.random_small:
        report["random_small"] = small_section(args.random_small, args.seed, args.limit_s)
        print("\n".join(small_lines(report["random_small"])), flush=True)
    if args.against is not None:
        report["against"] = against_section(args.against, fixed_small(args.fixed), args.reps,
                                            args.limit_s)
        print("\n".join(against_lines(report["against"], "fixed small cases")), flush=True)
        if args.fixed_cross:
            report["against_cross"] = against_section(
                args.against, fixed_cross(args.fixed_cross), args.reps, args.limit_s)
            print("\n".join(against_lines(report["against_cross"],
                                           "fixed cases between two meshes")), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
