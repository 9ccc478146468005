"""Print how a recipe lays out a model: every parameter's layouts, the activations', one
picture, one plan, one module's `explain()` and the plans a `mc.nn.fully_shard` unit of one
block runs. One process, no communication.

    python examples/debug_layouts.py                          # fsdp_tp on Mesh(fsdp=2, tp=2)
    python examples/debug_layouts.py --mesh "dp=2 tp=2"       # the same recipe, no fsdp axis
    python examples/debug_layouts.py --recipe tp --mesh "tp=4"

The model is the transformer of train_2d.py, built on `mc.nn.planning_mesh(mesh, rank)`: a
mesh with no process groups, enough to place every parameter and plan every collective.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch import nn
from train_2d import CONFIG, Transformer, init_params

import meshcomm as mc
from meshcomm.runtime.launch import print_on_rank0

ACTIVATIONS = (          # (what, logical dims, global shape from CONFIG)
    ("tokens", "batch seq", ("batch", "seq")),
    ("residual x", "batch seq embed", ("batch", "seq", "embed")),
    ("q, k, v", "batch seq heads", ("batch", "seq", "embed")),
    ("mlp hidden", "batch seq mlp", ("batch", "seq", "mlp")),
    ("row-parallel out", "batch seq embed | sum(mlp)", ("batch", "seq", "embed")),
    ("logits (local)", "batch seq vocab", ("batch", "seq", "vocab")),
)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def param_rows(model: nn.Module, mesh: mc.Mesh, rank: int) -> list[tuple[str, ...]]:
    rows = [("parameter", "logical", "shape", "stored", f"rank {rank}", "use", "grad (pending)")]
    for path, module in model.named_modules():
        if isinstance(module, mc.nn.ShardedModule):
            for name, s in module.specs.items():
                rows.append((f"{path}.{name}", s.dims, str(s.shape), str(s.stored),
                             str(s.stored.local_shape(mesh, s.shape, rank)), str(s.use),
                             str(s.grad)))
    return rows


def unit_comms(block: nn.Module) -> list[mc.nn.Comm]:
    """What a fully_shard unit of `block` runs for each recipe parameter it holds: its
    ParamSpec's gather (stored -> use) in forward, again in backward (the unit reshards
    after forward), and its reduction (grad -> stored, times grad_scale) in backward."""
    return [c for path, module in block.named_modules()
            if isinstance(module, mc.nn.ShardedModule)
            for name, spec in module.specs.items()
            for c in spec.comms(f"{path}.{name}", regather=True)]


def activation_rows(recipe: str, mesh: mc.Mesh, rank: int) -> list[tuple[str, ...]]:
    rows = [("activation", "logical", "shape", "layout", f"rank {rank}")]
    for what, dims, names in ACTIVATIONS:
        shape = tuple(CONFIG[n] for n in names)
        layout = mc.logical(dims, recipe, mesh)
        rows.append((what, dims, str(shape), str(layout),
                     str(layout.local_shape(mesh, shape, rank))))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="fsdp_tp")
    ap.add_argument("--mesh", default="fsdp=2 tp=2")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(argv)
    bound = mc.nn.planning_mesh(args.mesh, args.rank)
    mesh, recipe = bound.mesh, mc.recipe(args.recipe)
    cfg, params = CONFIG, init_params(CONFIG)
    model = Transformer(bound, args.recipe, params, cfg)

    print(f'recipe "{recipe.name}" on {mesh!r}, as rank {args.rank} sees it')
    print("rules: " + "; ".join(f"{n} -> {', '.join(a) or '(whole)'}" for n, a in recipe.rules)
          + f"  (axes not in {mesh!r} are dropped)")
    print("\n== parameters: stored (the optimizer's shard), use (forward), grad (backward) ==")
    print(table(param_rows(model, mesh, args.rank)))
    print("\n== activations ==")
    print(table(activation_rows(args.recipe, mesh, args.rank)))

    up = model.blocks[0].up
    assert isinstance(up, mc.nn.ColumnParallelLinear), type(up)
    w = up.specs["weight"]
    print(f"\n== picture: blocks.0.up.weight {w.shape} stored as \"{w.stored}\" ==")
    mc.show(mesh, w.shape, w.stored, width=100)
    print("== plan: gather it for forward ==")
    print(w.gather_plan().explain())
    x_shape = (cfg["batch"], cfg["seq"], cfg["embed"])
    print(f"\n== explain: blocks.0.up for an input of shape {x_shape} ==")
    print(up.explain(x_shape))
    print("\n== fully_shard(blocks.0): the plans its unit runs, per parameter ==")
    comms = unit_comms(model.blocks[0])
    print(mc.nn.format_comms(
        f"blocks.0 on {mesh!r}, recipe {recipe.name}: {len(comms)} plans", comms,
        notes=("the unit runs each phase's plans bucketed, one collective per bucket;"
               " mc.nn.fsdp_schedule(model) prints those calls on a bound mesh",)))
    return 0


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
