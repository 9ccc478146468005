"""Save a sharded state on 4 CPU processes, load it onto 2 with other layouts, check it exact.

    python examples/reshard_checkpoint.py              # exit 0 when every tensor is exact
    python examples/reshard_checkpoint.py --keep DIR   # keep the checkpoint in DIR

Saving, Mesh(dp=2, tp=2), with `mc.nn.save_checkpoint`: each rank writes the shards it holds
(`rank<r>.pt`), each distinct shard once (a replica is written by the rank at coordinate 0 of
the axes it is replicated over), and rank 0 writes `meshcomm.json`: per tensor the mesh of
its writers, its layout, global shape and dtype. Nothing is gathered.

Loading, Mesh(tp=2) on 2 other processes (under `meshcomm launch -n 4` or torchrun, on
ranks 0 and 1 of the same 4 processes; ranks 2 and 3 take part in making its groups only),
with `mc.nn.load_checkpoint`. The move from the saved mesh and layout to the new one is
`mc.plan(saved_mesh, ..., dst_mesh=new_mesh)` (printed below), the saved mesh's ranks being
files here, so the new mesh is numbered after them (ranks 4 and 5 for processes 0 and 1):
its one send_recv step says, for each new rank, which block of which file lands where,
every element read exactly once; each loading rank computes its own blocks of that step. Each rank opens only the files its transfers name,
and nothing is communicated. The loaded tensors are checked against the original state,
gathered on the new mesh with `Sharded.full()`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import meshcomm as mc  # isort: skip  (first: quiets torch's NumPy warning)
import torch
from torch import Tensor

from meshcomm.runtime.launch import launched_rank, print_on_rank0, run_ranks

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


# -- saving: 4 processes -----------------------------------------------------------------
def save(rank: int, world: int, folder: str) -> None:
    bound = mc.init_mesh(SAVED_MESH)
    mc.nn.save_checkpoint({name: mc.distribute(x, bound, STATE[name][1])
                           for name, x in state().items()}, folder)


# -- loading: 2 processes ----------------------------------------------------------------
def load(rank: int, world: int, folder: str) -> dict[str, Any] | None:
    bound = mc.init_mesh(LOADED_MESH, ranks=range(mc.Mesh(LOADED_MESH).size))
    if not bound.in_mesh:       # launched with more processes than the new mesh has
        return None
    original = state()
    out: dict[str, Any] = {"read": {}, "exact": True, "equal_to_state": True}
    for name, (shape, _, layout) in STATE.items():
        target = mc.Sharded(torch.empty(mc.Layout(layout).local_shape(bound.mesh, shape, rank)),
                            bound, layout, shape)
        read = mc.nn.load_checkpoint({name: target}, folder)   # one tensor, to see its files
        out["read"][name] = list(read.files)
        out["exact"] &= read.bytes == target.local.nbytes
        full = target.full()                                   # an all_gather
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
        shape, src, dst = STATE["w_up"]
        print(f'\nloading "w_up" onto {mc.Mesh(LOADED_MESH, ranks=[4, 5])!r} (files 0-3 play'
              " the saved ranks):")
        print(mc.plan(mc.Mesh(SAVED_MESH), shape, src, dst,
                      dst_mesh=mc.Mesh(LOADED_MESH, ranks=[4, 5])))
        print("loading...", flush=True)
        ranks = [r for r in run_ranks(load, launched[1] if launched else 2, folder,
                                      timeout_s=300) if r is not None]
        if launched and not args.keep and launched[0] == 0:   # every rank has loaded
            shutil.rmtree(folder, ignore_errors=True)
    print()
    for name, (_, src, dst) in STATE.items():
        reads = ", ".join(f"process {k} files {r['read'][name]}" for k, r in enumerate(ranks))
        print(f'{name}: "{src}" -> "{dst}": {reads}')
    checks = [("every rank read each element of its shards once, and nothing more",
               all(r["exact"] for r in ranks)),
              (f"every tensor gathered on the new mesh equals the saved state: {list(STATE)}",
               all(r["equal_to_state"] for r in ranks))]
    for text, ok in checks:
        print(f"{'OK' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
