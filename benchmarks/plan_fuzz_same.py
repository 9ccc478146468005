"""The same plans from two checkouts of meshcomm: every random case of
`plan_fuzz_time.py` planned by each, and the plans compared whole.

Run: `python benchmarks/plan_fuzz_same.py --against PATH [--random-small N]
[--random-cross N] [--seed S] [--hash-seeds OLD NEW] [--json PATH]`. With `--against .`
and two different hash seeds it checks that plans do not depend on string hashing
(every process of a job gets its own seed unless PYTHONHASHSEED is set, so a plan that
did would differ between ranks).

The cases: `plan_fuzz_time.random_small(N, seed)` (default 2,000 on meshes of at most 64
ranks, seed 64: the timing sample) and `plan_fuzz_time.random_cross(N, seed)` (default
500, between two meshes). A worker process per checkout plans each case cold (every cache
emptied: a warm cache may hand back an equal layout written another way, e.g. with an axis of
size 1; one torch thread; string hashing seeded alike, as sets of axis names may pick which
of two equal layouts is written) and answers a digest of the whole plan: per step its kind, axes,
layouts, action, op, dim, pairs, wire, rounds, local rearranges, per-rank sent and received
bytes, peak and modelled time, and every rank's transfers (a tree's schedule, a
send_recv's blocks); per plan its per-rank totals, lower bound, peak and cost. Printed:
how many plans differ, and per differing case what differs (steps, bytes, bound, cost).
Exit status 1 where any differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def digest(plan: Any) -> dict[str, Any]:
    """The plan's figures (what a reader compares) and a hash of everything it holds."""
    steps = []
    for step in plan.steps:
        ranks = plan.ranks if step.kind != "local" else ()
        moved = [repr(step.rank_transfers(r)) for r in ranks
                 if step.kind == "send_recv" or step.blocks_of is not None]
        steps.append(repr((step.kind, step.axes, str(step.before), str(step.after),
                           step.action, step.op, step.dim, step.pairs, step.wire,
                           step.rounds, step.merge_rounds, repr(step.pre), repr(step.post),
                           step.send_bytes, step.recv_bytes, step.peak_bytes,
                           round(step.time_s, 15), moved)))
    whole = repr((steps, plan.send_bytes, plan.recv_bytes, plan.lower_bound_bytes,
                  plan.peak_bytes, round(plan.cost, 15)))
    return {"hash": hashlib.sha256(whole.encode()).hexdigest(),
            "steps": [str(s) for s in plan.steps],
            "sent": max(plan.send_bytes, default=0), "recv": max(plan.recv_bytes, default=0),
            "bound": max(plan.lower_bound_bytes, default=0), "cost": plan.cost,
            "step_hashes": [hashlib.sha256(s.encode()).hexdigest()[:12] for s in steps]}


def worker(root: str, cases_path: str) -> None:
    """Reads a case index per line and answers its plan's `digest` (or the error), as JSON."""
    sys.path.insert(0, str(HERE))
    from plan_fuzz_time import clear_caches, plan_case, worker_cases

    cases = worker_cases(root, cases_path)
    for line in sys.stdin:
        clear_caches()      # warm caches may hand back an equal layout written otherwise
        try:
            out = digest(plan_case(cases[int(line)]))
        except Exception as exc:   # reported: the other side may plan it
            out = {"hash": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(json.dumps(out), flush=True)


def compare(old: Path, new: Path, cases: list[Any], tmp: Path,
            hash_seeds: tuple[int, int] = (0, 0)) -> list[dict[str, Any]]:
    """Each case planned by a worker on `old` and one on `new` (string hashing seeded with
    `hash_seeds`, one each): the cases whose plans differ, with both digests."""
    path = tmp / f"plan_fuzz_same_{os.getpid()}.json"
    path.write_text(json.dumps(cases))
    from plan_fuzz_time import Worker

    workers = [Worker(__file__, [str(root), str(path)], {"PYTHONHASHSEED": str(seed)})
               for root, seed in zip((old, new), hash_seeds)]
    differ = []
    try:
        for i, case in enumerate(cases):
            got = [w.plan(i) for w in workers]
            if got[0]["hash"] != got[1]["hash"]:
                differ.append({"case": list(case), "old": got[0], "new": got[1]})
    finally:
        for w in workers:
            w.close()
        path.unlink(missing_ok=True)
    return differ


def lines(name: str, cases: int, differ: list[dict[str, Any]]) -> list[str]:
    out = [f"{name}: {len(differ)} of {cases} plans differ"]
    for d in differ[:20]:
        o, n = d["old"], d["new"]
        what = [k for k in ("steps", "sent", "recv", "bound", "cost", "step_hashes")
                if o.get(k) != n.get(k)]
        out.append(f"  {d['case']}: {', '.join(what) or 'error'}")
        for k in what:
            out.append(f"    {k}: {o.get(k)} -> {n.get(k)}")
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    sys.path[:0] = [str(ROOT), str(HERE)]     # this checkout draws the cases
    import plan_fuzz_time as fuzz

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, metavar="PATH",
                        help="a checkout of meshcomm to compare plans with")
    parser.add_argument("--new", type=Path, default=ROOT, metavar="PATH",
                        help="the checkout compared (default: this one)")
    parser.add_argument("--random-small", type=int, default=2000, metavar="N")
    parser.add_argument("--random-cross", type=int, default=500, metavar="N")
    parser.add_argument("--seed", type=int, default=64, help="seed of both samples")
    parser.add_argument("--hash-seeds", type=int, nargs=2, default=(0, 0), metavar=("OLD", "NEW"),
                        help="PYTHONHASHSEED of each side (default 0 0); with --against naming"
                             " this checkout and two seeds, it checks that a plan does not"
                             " depend on string hashing, which differs between ranks")
    parser.add_argument("--json", type=Path, default=None, help="write the differences here")
    args = parser.parse_args(argv)
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    report = {}
    for name, cases in (("random small", fuzz.random_small(args.random_small, args.seed)),
                        ("random cross", fuzz.random_cross(args.random_cross, args.seed))):
        if not cases:
            continue
        differ = compare(args.against, args.new, cases, tmp, tuple(args.hash_seeds))
        report[name] = {"cases": len(cases), "differ": differ}
        print("\n".join(lines(name, len(cases), differ)), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return int(any(r["differ"] for r in report.values()))


if __name__ == "__main__":
    sys.exit(main())
