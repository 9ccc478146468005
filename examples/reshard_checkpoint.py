"""Save a sharded state on 4 CPU processes, load it onto 2 with other layouts, check it exact.

    python examples/reshard_checkpoint.py              # exit 0 when every tensor is exact
    python examples/reshard_checkpoint.py --keep DIR   # keep the checkpoint in DIR

Saving, Mesh(dp=2, tp=2): each rank writes its shard of every tensor with `torch.save`
(`rank<r>.pt`) and rank 0 writes `meta.json`: the mesh, and per tensor its layout, global
shape and dtype. Nothing is gathered.

Loading, Mesh(tp=2) on 2 other processes (under `meshcomm launch -n 4` or torchrun, on
ranks 0 and 1 of the same 4 processes; ranks 2 and 3 take part in making its groups only): each rank plans, per tensor, the move from the
saved mesh and layout to its own with `mc.plan(saved_mesh, ..., dst_mesh=new_mesh)`. The
saved mesh's ranks are files here, so the new mesh is numbered after them (ranks 4 and 5
for processes 0 and 1): the plan's one send_recv step then says, for each new rank, which
block of which file lands where, every element read exactly once, and reads of replicated
blocks spread over the files that hold them. Each rank opens only the files its transfers
name. The loaded shards are checked bit for bit against `mc.sim` running the same plan,
and against the original state, gathered on the new mesh with `Sharded.full()`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import meshcomm as mc
from meshcomm.executors.local import fill_reindexed
from meshcomm.executors.distributed.launch import launched_rank, run_ranks

SAVED_MESH = "dp=2 tp=2"
LOADED_MESH = "tp=2"
STATE = {   # name: (global shape, layout when saved, layout when loaded)
    "embedding": ((10, 6), "(tp v) e", "v (tp e)"),
    "w_up": ((6, 10), "i (dp tp h)", "(tp i) h"),          # 10 columns over 4 ranks: uneven
    "bias": ((10,), "(tp h)", "h"),
    "norm": ((6,), "e", "(tp e)"),
}


def state() -> dict[str, Tensor]:
    """The global tensors (the same in every process)."""
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, (shape, _, _) in STATE.items()}


def new_mesh(saved: mc.Mesh) -> mc.Mesh:
    """The loading mesh, numbered after the saved mesh's ranks (which are files here)."""
    first = max(saved.ranks) + 1
    return mc.Mesh(LOADED_MESH, ranks=list(range(first, first + mc.Mesh(LOADED_MESH).size)))


# -- saving: 4 processes -----------------------------------------------------------------
def save(rank: int, world: int, folder: str) -> None:
    bound = mc.init_mesh(SAVED_MESH)
    shards = {name: mc.distribute(x, bound, STATE[name][1]).local for name, x in state().items()}
    torch.save(shards, Path(folder) / f"rank{rank}.pt")
    if rank == 0:
        meta = {"mesh": SAVED_MESH, "tensors": {
            name: {"layout": saved, "shape": list(shape), "dtype": "float32"}
            for name, (shape, saved, _) in STATE.items()}}
        (Path(folder) / "meta.json").write_text(json.dumps(meta, indent=1))


# -- loading: 2 processes ----------------------------------------------------------------
def load(rank: int, world: int, folder: str) -> dict[str, Any] | None:
    bound = mc.init_mesh(LOADED_MESH, ranks=range(mc.Mesh(LOADED_MESH).size))
    if not bound.in_mesh:       # launched with more processes than the new mesh has
        return None
    meta = json.loads((Path(folder) / "meta.json").read_text())
    saved = mc.Mesh(meta["mesh"])
    me = new_mesh(saved).ranks[rank]
    files: dict[int, dict[str, Tensor]] = {}
    original = state()
    out: dict[str, Any] = {"read": {}, "exact_vs_sim": True, "equal_to_state": True}
    for name, info in meta["tensors"].items():
        shape, dtype = tuple(info["shape"]), getattr(torch, info["dtype"])
        p = mc.plan(saved, shape, info["layout"], STATE[name][2], dtype=dtype,
                    dst_mesh=new_mesh(saved))
        (step,) = p.steps                      # complete tensors: one send_recv step
        mine = [t for t in step.transfers if t.dst == me]
        local = torch.empty(step.after.local_shape(new_mesh(saved), shape, me), dtype=dtype)
        for src in sorted({t.src for t in mine}):
            if src not in files:
                files[src] = torch.load(Path(folder) / f"rank{src}.pt")
            local = fill_reindexed([t for t in mine if t.src == src], me,
                                       files[src][name], local)
        out["read"][name] = sorted({t.src for t in mine})
        # Check: mc.sim runs the same plan on all saved shards (this rank reads them all).
        shards = [torch.load(Path(folder) / f"rank{r}.pt")[name] for r in saved.ranks]
        want = mc.sim.execute(p, shards).outputs[p.ranks.index(me)]
        out["exact_vs_sim"] &= torch.equal(local, want)
        full = mc.Sharded(local, bound, STATE[name][2], shape).full()   # an all_gather
        out["equal_to_state"] &= torch.equal(full, original[name])
    return out


def shared_folder() -> str:
    """Under a launcher, one folder for every process of the job (named by its run id)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "job")
    return str(Path(tempfile.gettempdir()) / f"meshcomm-checkpoint-{job}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoint to DIR and keep it")
    args = ap.parse_args(argv)
    launched = launched_rank()      # (rank, world size) under a launcher, else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or (shared_folder() if launched else tmp)
        Path(folder).mkdir(parents=True, exist_ok=True)
        print(f"saving on {SAVED_MESH} ({'this job' if launched else '4 new processes'})...",
              flush=True)
        run_ranks(save, 4, folder, timeout_s=300)
        print(f"saved on {mc.Mesh(SAVED_MESH)!r}: {sorted(p.name for p in Path(folder).iterdir())}")
        saved = mc.Mesh(SAVED_MESH)
        shape, src, dst = STATE["w_up"][0], STATE["w_up"][1], STATE["w_up"][2]
        print(f'\nloading "w_up" onto {new_mesh(saved)!r} (files 0-3 play the saved ranks):')
        print(mc.plan(saved, shape, src, dst, dst_mesh=new_mesh(saved)))
        print("loading...", flush=True)
        ranks = [r for r in run_ranks(load, launched[1] if launched else 2, folder,
                                      timeout_s=300) if r is not None]
        if launched and not args.keep and launched[0] == 0:   # every rank has loaded
            shutil.rmtree(folder, ignore_errors=True)
    print()
    for name, (_, src, dst) in STATE.items():
        reads = ", ".join(f"process {k} files {r['read'][name]}" for k, r in enumerate(ranks))
        print(f'{name}: "{src}" -> "{dst}": {reads}')
    checks = [("every loaded shard equals mc.sim running the same plan, bit for bit",
               all(r["exact_vs_sim"] for r in ranks)),
              (f"every tensor gathered on the new mesh equals the saved state: {list(STATE)}",
               all(r["equal_to_state"] for r in ranks))]
    for text, ok in checks:
        print(f"{'OK' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
