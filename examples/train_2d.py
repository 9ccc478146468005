"""Train a small transformer on 4 CPU processes, 2-D parallel from the `fsdp_tp` recipe, and
check every loss against the same model trained in one process.

    python examples/train_2d.py          # exit 0 when all losses agree to 1e-5 (relative)

The model code names logical dims only ("embed mlp", "batch seq embed"); the recipe and the
mesh decide the rest. Both meshes run in the same 4 processes, one after the other:

- Mesh(dp=2, tp=2): the recipe's `fsdp` axis is absent, so parameters are split over tp only
  and replicated over dp; gradients are all-reduced over dp (DDP x Megatron TP).
- Mesh(fsdp=2, tp=2): parameters are split over fsdp too, gathered for each block's forward
  (one collective per block), gathered again for its backward, and their gradients
  reduce-scattered (FSDP x Megatron TP). The optimizer steps on the local shards.
"""

from __future__ import annotations

import argparse
import sys
import time

import meshcomm as mc  # isort: skip  (first: quiets torch's NumPy warning)
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshcomm.runtime.launch import print_on_rank0, run_ranks

CONFIG = {"layers": 2, "embed": 16, "heads": 2, "mlp": 32, "vocab": 64, "seq": 8, "batch": 4,
          "steps": 20, "lr": 1e-2, "seed": 0}
RECIPE = "fsdp_tp"
MESHES = ("dp=2 tp=2", "fsdp=2 tp=2")


# -- the model in one process: plain torch -------------------------------------------------
def init_params(cfg: dict[str, int], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every parameter of the model, as global tensors, from the seed (the same everywhere)."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    e, m, v = cfg["embed"], cfg["mlp"], cfg["vocab"]

    def rand(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)

    p = {"embedding": rand(v, e, std=1.0), "norm": 1 + rand(e, std=0.1),
         "head": rand(e, v, std=e ** -0.5)}
    for i in range(cfg["layers"]):
        p |= {f"{i}.norm1": 1 + rand(e, std=0.1), f"{i}.norm2": 1 + rand(e, std=0.1),
              f"{i}.wq": rand(e, e, std=e ** -0.5), f"{i}.wk": rand(e, e, std=e ** -0.5),
              f"{i}.wv": rand(e, e, std=e ** -0.5), f"{i}.wo": rand(e, e, std=e ** -0.5),
              f"{i}.w_up": rand(e, m, std=e ** -0.5), f"{i}.b_up": rand(m, std=0.1),
              f"{i}.w_down": rand(m, e, std=m ** -0.5), f"{i}.b_down": rand(e, std=0.1)}
    return p


def batches(cfg: dict[str, int]) -> Tensor:
    """(steps, batch, seq + 1) tokens: counting sequences a, a+d, a+2d, ... mod vocab."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (cfg["steps"], cfg["batch"], 1)
    start = torch.randint(cfg["vocab"], shape, generator=gen)
    stride = torch.randint(1, 4, shape, generator=gen)
    return (start + stride * torch.arange(cfg["seq"] + 1)) % cfg["vocab"]


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def attention(q: Tensor, k: Tensor, v: Tensor, head_dim: int) -> Tensor:
    """Causal attention over the heads that q, k, v hold (all of them, or this rank's)."""
    b, s, width = q.shape
    q, k, v = (t.reshape(b, s, width // head_dim, head_dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, width)


def reference_loss(p: dict[str, Tensor], tokens: Tensor, cfg: dict[str, int]) -> Tensor:
    x = p["embedding"][tokens[:, :-1]]
    for i in range(cfg["layers"]):
        h = rms_norm(x, p[f"{i}.norm1"])
        x = x + attention(h @ p[f"{i}.wq"], h @ p[f"{i}.wk"], h @ p[f"{i}.wv"],
                          cfg["embed"] // cfg["heads"]) @ p[f"{i}.wo"]
        h = rms_norm(x, p[f"{i}.norm2"])
        x = x + F.gelu(h @ p[f"{i}.w_up"] + p[f"{i}.b_up"]) @ p[f"{i}.w_down"] + p[f"{i}.b_down"]
    logits = rms_norm(x, p["norm"]) @ p["head"]
    return F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))


def train_reference(cfg: dict[str, int], dtype: torch.dtype) -> list[float]:
    params = {k: v.requires_grad_() for k, v in init_params(cfg, dtype).items()}
    opt = torch.optim.AdamW(params.values(), lr=cfg["lr"])
    losses = []
    for tokens in batches(cfg):
        loss = reference_loss(params, tokens, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- the same model, parallel: meshcomm.nn blocks --------------------------------------------
class RMSNorm(mc.nn.ShardedModule):
    """rms_norm with its weight stored under the recipe ("(fsdp embed)" under fsdp_tp)."""

    def __init__(self, bound: mc.BoundMesh, recipe: str, weight: Tensor) -> None:
        super().__init__(bound, recipe)
        self.add_param("weight", "embed", weight, partial="batch seq")

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.use("weight"))


class Block(nn.Module):
    def __init__(self, bound: mc.BoundMesh, recipe: str, p: dict[str, Tensor], i: int,
                 head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm1 = RMSNorm(bound, recipe, p[f"{i}.norm1"])
        self.enter = mc.nn.TPEntry(bound, recipe, reduce="heads")   # once for q, k and v
        self.wq, self.wk, self.wv = (
            mc.nn.ColumnParallelLinear(bound, recipe, p[f"{i}.{n}"], dims="embed heads",
                                       enter=False) for n in ("wq", "wk", "wv"))
        self.wo = mc.nn.RowParallelLinear(bound, recipe, p[f"{i}.wo"], dims="heads embed")
        self.norm2 = RMSNorm(bound, recipe, p[f"{i}.norm2"])
        self.up = mc.nn.ColumnParallelLinear(bound, recipe, p[f"{i}.w_up"], p[f"{i}.b_up"])
        self.down = mc.nn.RowParallelLinear(bound, recipe, p[f"{i}.w_down"], p[f"{i}.b_down"])

    def forward(self, x: Tensor) -> Tensor:
        h = self.enter(self.norm1(x))
        x = x + self.wo(attention(self.wq(h), self.wk(h), self.wv(h), self.head_dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, bound: mc.BoundMesh, recipe: str, p: dict[str, Tensor],
                 cfg: dict[str, int]) -> None:
        super().__init__()
        self.embedding = mc.nn.VocabParallelEmbedding(bound, recipe, p["embedding"])
        self.blocks = nn.ModuleList(
            Block(bound, recipe, p, i, cfg["embed"] // cfg["heads"]) for i in range(cfg["layers"]))
        self.norm = RMSNorm(bound, recipe, p["norm"])
        self.head = mc.nn.ColumnParallelLinear(bound, recipe, p["head"], dims="embed vocab",
                                               gather_output=True)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))       # logits "(dp fsdp batch) seq vocab"


def build(bound: mc.BoundMesh, cfg: dict[str, int], dtype: torch.dtype) -> nn.Module:
    """The parallel model: one fully_shard unit per block, then one for the rest (the root).
    Its recipe modules keep their parameters as the recipe stores them; each unit gathers
    them for forward (one collective per bucket) and reduces their gradients in backward."""
    model = Transformer(bound, RECIPE, init_params(cfg, dtype), cfg)
    for block in model.blocks:
        mc.nn.fully_shard(block, bound)
    return mc.nn.fully_shard(model, bound)


def train_parallel(bound: mc.BoundMesh, cfg: dict[str, int], dtype: torch.dtype) -> list[float]:
    model = build(bound, cfg, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])     # local shards
    tokens_layout = mc.logical("batch seq", RECIPE, bound.mesh)
    batch_axes = mc.nn.logical_axes("batch", RECIPE, bound.mesh)
    losses = []
    for tokens in batches(cfg):
        local = mc.distribute(tokens, bound, tokens_layout).local
        logits = model(local[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), local[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(mc.collectives.all_reduce(loss.detach(), bound, batch_axes, op="avg").item())
    return losses


def worker(rank: int, world: int, cfg: dict[str, int],
           dtype: torch.dtype) -> dict[str, list[float]]:
    out = {}
    for mesh in MESHES:
        start = time.perf_counter()
        out[mesh] = train_parallel(mc.init_mesh(mesh), cfg, dtype)
        if rank == 0:     # progress as it goes (the table comes at the end)
            print(f"  [rank 0] {mesh}: {cfg['steps']} steps in {time.perf_counter() - start:.1f} s,"
                  f" last loss {out[mesh][-1]:.4f}", flush=True)
    return out


# -- side by side ----------------------------------------------------------------------------
def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative loss difference")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = ap.parse_args(argv)
    cfg = {**CONFIG, "steps": args.steps}
    dtype = getattr(torch, args.dtype)
    print(f"model: {cfg['layers']} layers, embed {cfg['embed']}, {cfg['heads']} heads, mlp"
          f" {cfg['mlp']}, vocab {cfg['vocab']}; batch {cfg['batch']} x seq {cfg['seq']};"
          f" AdamW lr {cfg['lr']}; {args.dtype}; recipe {RECIPE}")
    ref = train_reference(cfg, dtype)
    print(f"  1 process: {len(ref)} steps, last loss {ref[-1]:.4f}; now {', '.join(MESHES)} on 4"
          " processes...", flush=True)
    ranks = run_ranks(worker, 4, cfg, dtype, timeout_s=300)
    if any(r != ranks[0] for r in ranks):
        print("FAIL: ranks report different losses")
        return 1
    got = ranks[0]
    head = "".join(f"  {m:>14}  rel diff" for m in MESHES)
    print(f"step  {'1 process':>14}{head}")
    worst = 0.0
    for step, want in enumerate(ref):
        cells = ""
        for mesh in MESHES:
            d = rel(got[mesh][step], want)
            worst = max(worst, d)
            cells += f"  {got[mesh][step]:>14.7f}  {d:8.1e}"
        print(f"{step + 1:>4}  {want:>14.7f}{cells}")
    ok = worst <= args.tol
    print(f"{'OK' if ok else 'FAIL'}: largest relative difference {worst:.1e}"
          f" ({'within' if ok else 'above'} {args.tol:g}) over {len(ref)} steps")
    return 0 if ok else 1


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
