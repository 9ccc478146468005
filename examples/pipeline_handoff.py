"""Two pipeline stages with different tensor-parallel degrees on 4 + 4 CPU processes, handing
activations forward and gradients back with `mc.reshard(..., dst_mesh=...)`, checked against
the same model trained in one process.

    python examples/pipeline_handoff.py          # exit 0 when every check passes

- stage 0, ranks 0-3, Mesh(dp=2, tp=2): h = tanh(x @ w0), batch split over dp, w0 split by
  columns over tp, so h is "(dp b) (tp h)";
- stage 1, ranks 4-7, Mesh(tp=4): y = h @ w1 with w1 split by rows over tp=4, so it takes h
  as "b (tp h)" (the whole batch, a quarter of the hidden units each) and all-reduces y.

The forward hand-off is one plan from "(dp b) (tp h)" on stage 0 to "b (tp h)" on stage 1
(point-to-point sends between the two meshes); the backward hand-off is the reverse plan.
Every rank of the world calls both: the senders pass their tensor, the receivers pass None
with the global shape and dtype. Each hand-off is checked bit for bit against `mc.sim`,
and the losses and weights against one process.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import meshcomm as mc  # isort: skip  (first: quiets torch's NumPy warning)
import torch
from torch import Tensor

from meshcomm.runtime.launch import print_on_rank0, run_ranks

CONFIG = {"batch": 8, "inputs": 6, "hidden": 8, "outputs": 4, "steps": 3, "seed": 0}
LR = 0.1
STAGE0 = mc.Mesh("dp=2 tp=2")                          # ranks 0-3
STAGE1 = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
H_SENT, H_RECEIVED = "(dp b) (tp h)", "b (tp h)"       # h on stage 0, on stage 1


def data(cfg: dict[str, int]) -> dict[str, Tensor]:
    """Weights, inputs and targets from the seed (the same in every process)."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    b, i, h, o = cfg["batch"], cfg["inputs"], cfg["hidden"], cfg["outputs"]
    return {"w0": torch.randn(i, h, generator=gen) / i ** 0.5,
            "w1": torch.randn(h, o, generator=gen) / h ** 0.5,
            "x": torch.randn(cfg["steps"], b, i, generator=gen),
            "target": torch.randn(cfg["steps"], b, o, generator=gen)}


def plans(cfg: dict[str, int]) -> tuple[mc.Plan, mc.Plan]:
    """The forward hand-off (stage 0 -> stage 1) and the backward one (stage 1 -> stage 0)."""
    shape = (cfg["batch"], cfg["hidden"])
    return (mc.plan(STAGE0, shape, H_SENT, H_RECEIVED, dst_mesh=STAGE1),
            mc.plan(STAGE1, shape, H_RECEIVED, H_SENT, dst_mesh=STAGE0))


# -- one process: plain torch ------------------------------------------------------------
def reference(cfg: dict[str, int]) -> dict[str, Any]:
    d = data(cfg)
    w0, w1 = d["w0"].clone().requires_grad_(), d["w1"].clone().requires_grad_()
    losses = []
    for x, target in zip(d["x"], d["target"]):
        loss = ((torch.tanh(x @ w0) @ w1 - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for w in (w0, w1):
                w -= LR * w.grad
                w.grad = None
        losses.append(loss.item())
    return {"losses": losses, "w0": w0.detach(), "w1": w1.detach()}


# -- 8 processes: stage 0 on ranks 0-3, stage 1 on ranks 4-7 -----------------------------
def worker(rank: int, world: int, cfg: dict[str, int]) -> dict[str, Any]:
    s0, s1 = mc.init_mesh(STAGE0), mc.init_mesh(STAGE1)    # every rank binds both meshes
    d = data(cfg)
    shape, dtype = (cfg["batch"], cfg["hidden"]), torch.float32
    w = (mc.distribute(d["w0"], s0, "i (tp h)") if s0.in_mesh
         else mc.distribute(d["w1"], s1, "(tp h) o")).local.clone().requires_grad_()
    out: dict[str, Any] = {"stage": 0 if s0.in_mesh else 1, "sent": [], "got": [], "losses": []}
    for x, target in zip(d["x"], d["target"]):
        if s0.in_mesh:                                                  # stage 0 forward
            h = torch.tanh(mc.distribute(x, s0, "(dp b) i").local @ w)
            mc.reshard(h.detach(), s0, H_SENT, H_RECEIVED, dst_mesh=s1)  # returns None here
            grad_h = mc.reshard(None, s1, H_RECEIVED, H_SENT, dst_mesh=s0, shape=shape,
                                dtype=dtype)
            h.backward(grad_h)                                          # stage 0 backward
            grad = mc.reshard(w.grad, s0, "i (tp h) | sum(dp)", "i (tp h)")
            out["sent"].append(h.detach())
            out["got"].append(grad_h)
        else:
            h = mc.reshard(None, s0, H_SENT, H_RECEIVED, dst_mesh=s1, shape=shape, dtype=dtype)
            h.requires_grad_()                                          # stage 1 forward
            y = mc.reshard(h @ w, s1, "b o | sum(tp)", "b o")          # all_reduce over tp
            loss = ((y - target) ** 2).mean()
            loss.backward()                                             # stage 1 backward
            mc.reshard(h.grad, s1, H_RECEIVED, H_SENT, dst_mesh=s0)     # returns None here
            grad = w.grad
            out["sent"].append(h.grad)
            out["got"].append(h.detach())
            out["losses"].append(loss.item())
        with torch.no_grad():
            w -= LR * grad
            w.grad = None
    out["w"] = w.detach()
    return out


# -- checks ---------------------------------------------------------------------------------
def handoffs_exact(ranks: list[dict[str, Any]], cfg: dict[str, int]) -> bool:
    """Each hand-off, every step: what the receivers got equals mc.sim on what was sent."""
    forward, backward = plans(cfg)
    for step in range(cfg["steps"]):
        for p, senders, receivers in ((forward, ranks[:4], ranks[4:]),
                                      (backward, ranks[4:], ranks[:4])):
            want = mc.sim.execute(p, [r["sent"][step] for r in senders]).outputs
            assert p.dst_mesh is not None
            for rank, r in zip(p.dst_mesh.ranks, receivers):
                if not torch.equal(want[p.ranks.index(rank)], r["got"][step]):
                    return False
    return True


def close(a: Tensor | float, b: Tensor | float) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-5, atol=1e-6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    cfg = {**CONFIG, "steps": ap.parse_args(argv).steps}
    forward, backward = plans(cfg)
    print("forward hand-off, activations:")
    print(forward)
    print("\nbackward hand-off, gradients:")
    print(backward)
    print("running 8 processes (gloo)...", flush=True)
    ranks = run_ranks(worker, 8, cfg, timeout_s=300)
    ref = reference(cfg)
    w0 = mc.sim.gather([r["w"] for r in ranks[:4]], STAGE0, "i (tp h)", ref["w0"].shape)
    w1 = mc.sim.gather([r["w"] for r in ranks[4:]], STAGE1, "(tp h) o", ref["w1"].shape)
    checks = [
        ("hand-offs equal mc.sim bit for bit, both directions, every step",
         handoffs_exact(ranks, cfg)),
        ("stage 1 ranks agree on every loss", all(r["losses"] == ranks[4]["losses"]
                                                  for r in ranks[4:])),
        (f"losses equal one process: {[round(v, 6) for v in ref['losses']]}",
         close(ranks[4]["losses"], ref["losses"])),
        ("weights of both stages equal one process after the last step",
         close(w0, ref["w0"]) and close(w1, ref["w1"])),
    ]
    print()
    for text, ok in checks:
        print(f"{'OK' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
