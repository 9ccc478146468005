"""Train the unmodified Llama-style model of examples/llama.py with meshcomm FSDP x tensor
parallelism on 4 CPU processes, and check every step's loss against one process.

    python examples/train_llama.py                          # starts its 4 processes itself
    torchrun --nproc-per-node 4 examples/train_llama.py     # or as PyTorch users launch
    meshcomm launch -n 4 examples/train_llama.py

Mesh dp=2 x tp=2. `mc.nn.parallelize` splits attention heads, the SwiGLU hidden units and
the vocabulary over tp (the output layer stays vocabulary-split: the loss is
`mc.nn.vocab_parallel_cross_entropy`, which never gathers the logits); `mc.nn.fully_shard`
then shards every block's parameters over dp (one all_gather and one reduce_scatter per
block, prefetched). Each dp rank trains on half of the batch; the gradients are averaged
over dp, so the losses equal one process training on the whole batch.

A dry run shows one rank of a production-sized job, alone, in a minute or two: the model
with Llama-3-8B's shapes built on the meta device, on dp=128 x tp=8, each collective of a
training step with its bytes, the rank's peak tensor memory and host time:

    meshcomm dryrun -n 1024 --rank 5 examples/train_llama.py --size 8b --mesh "dp=128 tp=8"

With a cp axis the sequence is split too (context parallelism, docs/context.md), e.g.
Llama-3-8B at 131,072 tokens:

    meshcomm dryrun -n 1024 --rank 5 examples/train_llama.py --size 8b \
        --mesh "dp=8 cp=16 tp=8" --seq 131072 --cp-strategy allgather

With `--pp N` the layers are split into pipeline stages on a pp axis before the mesh's axes
(`mc.nn.Pipeline`, `--schedule`, `--microbatches`), and the rank also prints the hand-offs'
bytes and the whole pipeline's simulated step from a cost model, e.g. Llama-3-70B's shapes:

    meshcomm dryrun -n 1024 --rank 5 examples/train_llama.py --size 70b \
        --mesh "dp=16 tp=8" --pp 8 --schedule 1f1b --microbatches 16
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import meshcomm as mc  # isort: skip  (first: quiets torch's NumPy warning)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import ModelArgs, Transformer, counting_batches, loss_fn

from meshcomm.nn.pipeline import StageCosts
from meshcomm.runtime.launch import print_on_rank0, run_ranks

MESH = "dp=2 tp=2"
PLAN = {   # module-name patterns -> tensor-parallel style (docs/fsdp.md)
    "tok_embeddings": "embedding",
    "layers.*.attention.w[qkv]": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w[13]": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "colwise",
}
SP_PLAN = {   # --sequence-parallel: activations between blocks split over the sequence
    "tok_embeddings": "embedding_sp",
    "layers.*.attention_norm": "sp_params", "layers.*.ffn_norm": "sp_params", "norm": "sp_params",
    "layers.*.attention": "sp_input", "layers.*.feed_forward": "sp_input",
    "layers.*.attention.w[qkv]": "colwise_sp", "layers.*.attention.wo": "rowwise_sp",
    "layers.*.feed_forward.w[13]": "colwise_sp", "layers.*.feed_forward.w2": "rowwise_sp",
    "output": "colwise_gather_sp",
}


def model_args(vocab: int) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                     max_seq_len=64, seed=0)


# Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads / 8 kv heads, SwiGLU 14336, vocab
# 128256), for dry runs: built on the meta device, it never exists in memory.
LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=8192,
                      rope_theta=500000.0)


# Llama-3-70B's shapes (hidden 8192, 80 layers, 64 heads / 8 kv heads, SwiGLU 28672, vocab
# 128256): on the meta device only, like LLAMA3_8B.
LLAMA3_70B = ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=8192,
                       rope_theta=500000.0)
SIZES = {"tiny": None, "8b": LLAMA3_8B, "70b": LLAMA3_70B}

SPLITS = {"contiguous": "(cp s)", "zigzag": "zigzag(cp s)", "striped": "(s cp)"}


def dry_run(args: argparse.Namespace) -> int:
    """Under `meshcomm dryrun`: this rank's training steps on meta tensors, nothing checked
    against other ranks (there are none); the dry run prints what the rank did.

    A mesh with a `cp` axis splits the sequence too (context parallelism): each rank holds
    `"(dp b) (cp s)"` of the tokens (`--cp-split zigzag`: `"zigzag(cp s)"`), with their
    positions (the rotary embedding reads them), the attention runs `mc.nn.attention` over
    `"(dp b) (tp h) (cp s) d"` (`--cp-strategy`), and the parameters are replicated over cp
    (`fully_shard(..., replicate="cp")`: the cp ranks average their gradients, as HSDP's
    replicas). `--pp N`: `pipeline_dry_run`."""
    if args.pp > 1:
        return pipeline_dry_run(args)
    bound = mc.init_mesh(args.mesh)
    margs = SIZES[args.size] or model_args(251)
    seq = args.seq or (32 if args.size == "tiny" else 8192)
    cp = "cp" in bound.mesh.axis_names
    if seq > margs.max_seq_len:
        margs = dataclasses.replace(margs, max_seq_len=seq)
    with torch.device("meta"):
        model = Transformer(margs)
    mc.nn.parallelize(model, bound, SP_PLAN if args.sequence_parallel else PLAN, axis="tp")
    replicate = "cp" if cp else None
    for block in model.layers:
        mc.nn.fully_shard(block, bound, axis="dp", replicate=replicate)
    mc.nn.fully_shard(model, bound, axis="dp", replicate=replicate)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    tokens = torch.zeros(args.batch, seq + 1, dtype=torch.long, device="meta")
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], None
    if cp:
        split = SPLITS[args.cp_split]      # the sequence's split: tokens, labels, positions
        heads = "(tp h)" if "tp" in bound.mesh.axis_names else "h"
        for block in model.layers:
            block.attention.attend = functools.partial(
                mc.nn.attention, bound=bound, layout=f"(dp b) {heads} {split} d", causal=True,
                strategy=args.cp_strategy)
        # each dp rank's batch, held whole, into the split: a local select (the same plan
        # for the tokens, the labels and the positions; from a loader's "(cp s)" split it
        # would be one exchange within the cp group)
        inputs, labels = (mc.reshard(t, bound, "b s", f"b {split}") for t in (inputs, labels))
        positions = mc.reshard(torch.arange(seq, device="meta"), bound, "s", split)
    for _ in range(args.steps):
        logits = model(inputs, positions)
        if args.sequence_parallel:
            loss = loss_fn(logits, labels)
        else:
            loss = mc.nn.vocab_parallel_cross_entropy(logits, labels, bound, "tp",
                                                      vocab_size=margs.vocab_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return 0


class PipelineStage(torch.nn.Module):
    """Layers `first`..`last - 1` of `model` as one pipeline stage: the token embedding before
    them on stage 0, the final norm and the output layer after them on the last stage.
    Takes tokens (stage 0) or the hidden states (batch, seq, dim); gives the hidden states,
    or the logits on the last stage."""

    def __init__(self, model: Transformer, first: int, last: int, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if is_first else None
        self.layers = torch.nn.ModuleList(model.layers[first:last])
        self.norm, self.output = (model.norm, model.output) if is_last else (None, None)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.output is not None and self.norm is not None:
            return self.output(self.norm(h)).float()
        return h


def pipeline_dry_run(args: argparse.Namespace) -> int:
    """`--pp N`: the layers split into stages on a pp axis before the mesh's axes (stage i on
    `mesh.slice("pp", i)`, each tensor-parallel over tp and fully sharded over dp), run by
    `mc.nn.Pipeline` with `--schedule` over `--microbatches`; then the simulated step of the
    whole pipeline from a cost model (`stage_costs`), drawn rank by rank."""
    from meshcomm import display
    from meshcomm.core.units import format_bytes
    from meshcomm.nn.pipeline import Pipeline, Stage, simulate, stage_meshes
    from meshcomm.pipeline_display import format_seconds

    mesh = mc.Mesh(f"pp={args.pp} {args.mesh}")
    if set(mesh.axis_names) != {"pp", "dp", "tp"} or args.sequence_parallel:
        print(f"--pp runs on a mesh of dp and tp axes (got {args.mesh!r}) without"
              " --sequence-parallel", file=sys.stderr)
        return 2
    margs = SIZES[args.size] or model_args(251)
    seq = args.seq or (32 if args.size == "tiny" else 8192)
    v = 2 if args.schedule in ("interleaved_1f1b", "zero_bubble_v") else 1
    n = args.pp * v
    if margs.n_layers < n:
        print(f"--pp {args.pp} with {args.schedule}: {n} stages, but the model has"
              f" {margs.n_layers} layers; fix: fewer stages or a larger --size", file=sys.stderr)
        return 2
    bounds = [mc.init_mesh(m) for m in stage_meshes(mesh, "pp")]
    rank_of = ((lambda s: min(s, n - 1 - s)) if args.schedule == "zero_bubble_v"
               else (lambda s: s % args.pp))
    cut = layer_cut(margs, seq, mesh.axis_size("tp"), n)      # stage s: layers cut[s]..
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(margs, max_seq_len=max(seq, margs.max_seq_len)))
    stages = []
    for s in range(n):
        bound, module = bounds[rank_of(s)], None
        if bound.in_mesh:
            module = PipelineStage(model, cut[s], cut[s + 1], s == 0, s == n - 1)
            names = {name for name, _ in module.named_modules()}
            mc.nn.parallelize(module, bound, {k: v for k, v in PLAN.items()
                                              if "*" in k or k in names}, axis="tp")
            for block in module.layers:
                mc.nn.fully_shard(block, bound, axis="dp")
            mc.nn.fully_shard(module, bound, axis="dp")
        stages.append(Stage(bound, "(dp b) s" if s == 0 else "(dp b) s h",
                            "(dp b) s (tp v)" if s == n - 1 else "(dp b) s h", module,
                            averaged=("dp",)))
    last = bounds[rank_of(n - 1)]
    dp = mesh.axis_size("dp")
    pipe = Pipeline(stages, args.schedule, microbatches=args.microbatches,
                    shapes=(dp * args.batch, seq, margs.dim),
                    loss_fn=lambda y, t: mc.nn.vocab_parallel_cross_entropy(
                        y, t, last, "tp", vocab_size=margs.vocab_size))
    mine = [stages[s].module for s in pipe.mine]
    opt = torch.optim.AdamW([q for m in mine if m is not None for q in m.parameters()],
                            lr=3e-4, foreach=False)
    tokens = torch.zeros(args.batch * args.microbatches, seq + 1, dtype=torch.long,
                         device="meta")
    for _ in range(args.steps):
        pipe.step(tokens[:, :-1] if 0 in pipe.mine else None,
                  tokens[:, 1:] if n - 1 in pipe.mine else None)
        opt.step()
        opt.zero_grad()
    where = ", ".join(f"stage {s} (layers {cut[s]}-{cut[s + 1] - 1})" for s in pipe.mine)
    print(f"pipeline: {margs.n_layers} layers in {n} stages on {mesh!r},"
          f" {pipe.schedule.name}, {args.microbatches} microbatches of {args.batch} x {seq}"
          f" tokens per dp rank; rank {pipe.rank} is pipeline rank {pipe.me}: {where}")
    for b, (fwd, bwd) in enumerate(zip(pipe.forward_plans, pipe.backward_plans)):
        if pipe.rank in fwd.ranks and rank_of(b) != rank_of(b + 1):
            at, back = fwd.ranks.index(pipe.rank), bwd.ranks.index(pipe.rank)
            print(f"  hand-off stage {b} -> {b + 1} per microbatch, this rank: activations"
                  f" sent {format_bytes(fwd.send_bytes[at])}, received"
                  f" {format_bytes(fwd.recv_bytes[at])}; gradients sent"
                  f" {format_bytes(bwd.send_bytes[back])}, received"
                  f" {format_bytes(bwd.recv_bytes[back])}")
    costs = stage_costs(margs, cut, seq * args.batch, mesh.axis_size("tp"), pipe, args)
    print(f"simulated step (cost model: {args.flops:.3g} FLOP/s a rank, hand-offs at"
          f" {args.link_bandwidth:.3g} B/s; activations float32, no recomputation); per"
          f" microbatch: stage 0 forward {format_seconds(costs.forward[0])}, backward"
          f" {format_seconds(costs.backward[0])}, holds {format_bytes(costs.activation_bytes[0])};"
          f" stage {n - 1} (with the output layer) forward {format_seconds(costs.forward[-1])},"
          f" holds {format_bytes(costs.activation_bytes[-1])}; a hand-off"
          f" {format_seconds(max(costs.send_forward, default=0.0))}")
    display.show_timeline(simulate(pipe.schedule, costs), width=args.width)
    return 0


def layer_flops(margs: ModelArgs, seq: int, tp: int) -> tuple[float, float]:
    """Forward FLOPs per token a rank of one layer (2 x the weights it holds, plus causal
    attention, 2 x seq x dim / tp), and of the output layer."""
    h, kv, f = margs.dim, margs.n_kv_heads * margs.head_dim, margs.ffn_hidden_dim
    return (2 * (2 * h * h + 2 * h * kv + 3 * h * f) / tp + 2 * seq * h / tp,
            2 * h * margs.vocab_size / tp)


def layer_cut(margs: ModelArgs, seq: int, tp: int, n: int) -> list[int]:
    """Where each of `n` stages starts, by `mc.nn.pipeline.balance` of the layers' FLOPs with
    the output layer's counted in the last layer (the embedding lookup costs no FLOPs), and
    the end: the last stage takes fewer layers."""
    from meshcomm.nn.pipeline import balance

    layer, output = layer_flops(margs, seq, tp)
    weights = [layer] * margs.n_layers
    weights[-1] += output
    return list(balance(weights, n)) + [margs.n_layers]


def stage_costs(margs: ModelArgs, cut: list[int], tokens: int, tp: int,
                pipe: mc.nn.Pipeline, args: argparse.Namespace) -> StageCosts:
    """Seconds and activation bytes per stage and microbatch of `tokens` tokens a rank, from
    the model's shapes: forward FLOPs 2 x the weights a rank holds per token (plus causal
    attention, 2 x seq x dim / tp a token a layer), backward twice that, half of it the
    weight gradient (W); the activations a layer keeps for backward (norm inputs and
    outputs, q k v, attention output, the SwiGLU's four hidden tensors), float32; a hand-off
    its plan's largest per-rank bytes over `--link-bandwidth`."""
    h, kv, f, vocab = margs.dim, margs.n_kv_heads * margs.head_dim, margs.ffn_hidden_dim, \
        margs.vocab_size
    per_layer, output = layer_flops(margs, tokens // args.batch, tp)
    layer_bytes = 4 * (4 * h + (2 * h + 2 * kv + 4 * f) / tp)
    n = len(cut) - 1
    fwd, act = [], []
    for s in range(n):
        layers = cut[s + 1] - cut[s]
        flops = layers * per_layer + (output if s == n - 1 else 0)
        held = layers * layer_bytes + (4 * 2 * vocab / tp if s == n - 1 else 0)
        fwd.append(tokens * flops / args.flops)
        act.append(int(tokens * held))
    hop = tuple(max(p.send_bytes) / args.link_bandwidth for p in pipe.forward_plans)
    return StageCosts(tuple(fwd), tuple(2 * t for t in fwd), tuple(fwd), hop, hop,
                            tuple(act))


def reference(cfg: dict[str, int]) -> list[float]:
    """One process, the whole batch."""
    model = Transformer(model_args(cfg["vocab"]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in counting_batches(cfg["steps"], cfg["batch"], cfg["seq"], cfg["vocab"]):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, cfg: dict[str, int]) -> list[float]:
    bound = mc.init_mesh(MESH)
    model = Transformer(model_args(cfg["vocab"]))        # the same weights on every rank
    sp = bool(cfg["sequence_parallel"])
    mc.nn.parallelize(model, bound, SP_PLAN if sp else PLAN, axis="tp")
    for block in model.layers:
        mc.nn.fully_shard(block, bound, axis="dp")
    mc.nn.fully_shard(model, bound, axis="dp")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp, n = bound.coords["dp"], bound.mesh.axis_size("dp")
    rows = cfg["batch"] // n
    losses = []
    start = time.perf_counter()
    for step, tokens in enumerate(counting_batches(cfg["steps"], cfg["batch"], cfg["seq"],
                                                   cfg["vocab"]), 1):
        mine = tokens[dp * rows:(dp + 1) * rows]
        logits = model(mine[:, :-1])        # (rows, seq, vocab / tp); whole vocab with sp
        loss = (loss_fn(logits, mine[:, 1:]) if sp else
                mc.nn.vocab_parallel_cross_entropy(logits, mine[:, 1:], bound, "tp",
                                                   vocab_size=cfg["vocab"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = mc.collectives.all_reduce(loss.detach(), bound, "dp", op="avg")
        losses.append(float(mean))
        if rank == 0 and (step % 5 == 0 or step == cfg["steps"]):   # progress as it goes
            print(f"  [rank 0] step {step}/{cfg['steps']}: loss {losses[-1]:.4f}"
                  f" ({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        print(mc.nn.fsdp_schedule(model), flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative loss difference")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="split activations between blocks over the sequence too")
    ap.add_argument("--size", choices=tuple(SIZES), default="tiny",
                    help="dry runs only: tiny (the tested model), Llama-3-8B's or -70B's"
                    " shapes")
    ap.add_argument("--mesh", default=MESH, help="dry runs only: the mesh (dp and tp axes,"
                    " and cp to split the sequence)")
    ap.add_argument("--cp-strategy", default="auto", help="dry runs with a cp axis: the"
                    " attention strategy (allgather, ulysses or auto)")
    ap.add_argument("--cp-split", choices=sorted(SPLITS), default="contiguous",
                    help="dry runs with a cp axis: how the sequence is split (zigzag and"
                    " striped balance causal attention)")
    ap.add_argument("--batch", type=int, default=1, help="dry runs only: sequences per rank")
    ap.add_argument("--seq", type=int, default=0, help="dry runs only: sequence length"
                    " (default 8192 for 8b, 32 for tiny)")
    ap.add_argument("--pp", type=int, default=1, help="dry runs only: pipeline stages on a"
                    " pp axis before --mesh's axes (docs/pipeline.md)")
    ap.add_argument("--schedule", default="1f1b", help="with --pp: gpipe, 1f1b,"
                    " interleaved_1f1b, zero_bubble or zero_bubble_v (interleaved_1f1b and"
                    " zero_bubble_v: 2 stages per pipeline rank)")
    ap.add_argument("--microbatches", type=int, default=8,
                    help="with --pp: microbatches per step, each --batch sequences a rank")
    ap.add_argument("--flops", type=float, default=4e14, help="with --pp: FLOP/s a rank in"
                    " the simulated step (default 4e14: an H100 at about 40%% of its bf16 peak)")
    ap.add_argument("--link-bandwidth", type=float, default=25e9, help="with --pp: bytes per"
                    " second of a hand-off between stages in the simulated step (default 25e9)")
    ap.add_argument("--width", type=int, default=None, help="with --pp: columns of the"
                    " simulated step's picture (default: the terminal's)")
    args = ap.parse_args(argv)
    if mc.dryrun.active():      # meshcomm dryrun -n N --rank R examples/train_llama.py ...
        return dry_run(args)
    cfg = {"steps": args.steps, "batch": 8, "seq": 32, "vocab": 251,   # 251: uneven over tp=2
           "sequence_parallel": int(args.sequence_parallel)}
    print(f"Llama-style model (dim 64, 2 layers, GQA 4/2 heads, vocab {cfg['vocab']}) on {MESH}"
          f"{' with sequence parallelism' if args.sequence_parallel else ''},"
          f" {cfg['steps']} steps, batch {cfg['batch']} x seq {cfg['seq']}", flush=True)
    want = reference(cfg)
    got = run_ranks(worker, 4, cfg, timeout_s=300)
    if any(g != got[0] for g in got):
        print("FAIL: ranks report different losses")
        return 1
    worst = 0.0
    print(f"{'step':>4}  {'1 process':>10}  {MESH:>10}  rel diff")
    for step, (w, g) in enumerate(zip(want, got[0]), 1):
        diff = abs(g - w) / abs(w)
        worst = max(worst, diff)
        print(f"{step:>4}  {w:>10.6f}  {g:>10.6f}  {diff:8.1e}")
    ok = worst <= args.tol
    print(f"{'OK' if ok else 'FAIL'}: largest relative difference {worst:.1e}"
          f" ({'within' if ok else 'above'} {args.tol:g}) over {len(want)} steps")
    return 0 if ok else 1


if __name__ == "__main__":
    print_on_rank0()  # launched: the report prints once (MESHCOMM_PRINT_ALL=1: all)
    sys.exit(main())
