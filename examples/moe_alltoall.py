"""Route tokens to experts on 4 CPU processes with uneven all_to_all, and check the outputs and
gradients against the same mixture of experts computed in one process.

    python examples/moe_alltoall.py      # exit 0 when everything agrees to 1e-6

Recipe `expert_parallel` on Mesh(ep=4): 8 experts, 2 per rank ("(ep experts) ..."), tokens
split over ep ("(ep batch) seq embed"). A top-1 router picks each token's expert, so every
rank sends a different number of tokens to every other: the counts travel first (an even
all_to_all of int64 counts, the metadata exchange), then the tokens (an uneven all_to_all),
then the experts' outputs come back by the inverse all_to_all.
"""

from __future__ import annotations

import sys

import meshcomm as mc  # isort: skip  (first: quiets torch's NumPy warning)
import torch
import torch.nn.functional as F
from torch import Tensor

from meshcomm.runtime.launch import print_on_rank0, run_ranks

MESH, RECIPE = "ep=4", "expert_parallel"
BATCH, SEQ, EMBED, HIDDEN, EXPERTS = 8, 6, 16, 32, 8
TOL = 1e-6


def init(seed: int = 0) -> dict[str, Tensor]:
    """The global tensors, from the seed: tokens, weights, and the output gradient."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=gen) * std

    return {"x": rand(BATCH, SEQ, EMBED), "router": rand(EMBED, EXPERTS, std=0.5),
            "w_up": rand(EXPERTS, EMBED, HIDDEN, std=EMBED ** -0.5),
            "w_down": rand(EXPERTS, HIDDEN, EMBED, std=HIDDEN ** -0.5),
            "dy": rand(BATCH, SEQ, EMBED)}


def reference(t: dict[str, Tensor], ranks: int) -> dict[str, Tensor]:
    """One process: every token through its top-1 expert; gradients of the mean over ranks of
    each rank's loss (the training convention of meshcomm.nn: each rank's loss is over its own
    tokens, and parameter gradients are averaged over the ranks that split the batch)."""
    p = {k: t[k].clone().requires_grad_() for k in ("x", "router", "w_up", "w_down")}
    flat = p["x"].reshape(-1, EMBED)
    probs = torch.softmax(flat @ p["router"], dim=-1)
    gate, expert = probs.max(dim=-1)
    rows = []
    for i in range(flat.shape[0]):
        e = int(expert[i])
        rows.append(F.gelu(flat[i:i + 1] @ p["w_up"][e]) @ p["w_down"][e])
    y = (torch.cat(rows) * gate.unsqueeze(-1)).reshape(t["x"].shape)
    ((y * t["dy"]).sum() / ranks).backward()
    return {"y": y.detach(), "expert": expert.reshape(BATCH, SEQ),
            **{f"grad {k}": v.grad for k, v in p.items()}}


def worker(rank: int, world: int, t: dict[str, Tensor]) -> dict[str, object]:
    bound = mc.init_mesh(MESH)
    moe = mc.nn.MoE(bound, RECIPE, t["router"], t["w_up"], t["w_down"])
    tokens = mc.logical("batch seq embed", RECIPE, bound.mesh)        # "(ep batch) seq embed"
    x = mc.distribute(t["x"], bound, tokens).local.requires_grad_()
    dy = mc.distribute(t["dy"], bound, tokens).local
    y = moe(x)
    (y * dy).sum().backward()
    # The routing, once more by hand, for the printout (the same calls moe(x) made).
    _, expert = moe.route(x.detach().reshape(-1, EMBED))
    _, routing = mc.nn.dispatch(x.detach().reshape(-1, EMBED), expert, bound,
                                  moe.experts_layout, EXPERTS)
    full = {name: mc.Sharded(getattr(moe, name).grad, bound, moe.specs[name].stored,
                             moe.specs[name].shape).full() for name in ("router", "w_up", "w_down")}
    return {"y": y.detach(), "grad x": x.grad, "sent": routing.send_splits,
            "received": routing.recv_splits, "per expert": routing.recv_counts.sum(0).tolist(),
            **{f"grad {k}": v for k, v in full.items()},
            "explain": moe.explain((BATCH, SEQ, EMBED), routing=routing) if rank == 0 else ""}


def rel_err(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def main() -> int:
    t = init()
    print("running 4 processes (gloo)...", flush=True)
    ranks = run_ranks(worker, 4, t, timeout_s=240)
    ref = reference(t, len(ranks))
    print(f"{BATCH * SEQ} tokens, {EXPERTS} experts on {MESH} (recipe {RECIPE}), top-1 routing")
    print("rank  tokens  sent to r0..r3    received from r0..r3  per local expert")
    for r, out in enumerate(ranks):
        print(f"  r{r}  {sum(out['sent']):>6}  {list(out['sent'])!s:<16}  "
              f"{list(out['received'])!s:<20}  {out['per expert']}")
    print()
    print(ranks[0]["explain"])
    per = BATCH // len(ranks)
    errors = {
        "output": rel_err(torch.cat([o["y"] for o in ranks]), ref["y"]),
        # x's gradient is of this rank's own loss; the reference's is of the mean over ranks.
        "grad x": rel_err(torch.cat([o["grad x"] for o in ranks]) / len(ranks), ref["grad x"]),
        **{k: max(rel_err(o[k], ref[k]) for o in ranks)
           for k in ("grad router", "grad w_up", "grad w_down")},
    }
    assert all(ranks[r]["y"].shape[0] == per for r in range(len(ranks)))
    print()
    for name, err in errors.items():
        print(f"{name:<12} largest difference {err:.1e} of the largest value")
    ok = all(e <= TOL for e in errors.values())
    print(f"{'OK' if ok else 'FAIL'}: outputs and gradients match the single-process reference"
          f" {'within' if ok else 'NOT within'} {TOL:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
