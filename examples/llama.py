"""A small Llama-style decoder in plain PyTorch (no meshcomm): the model that
`benchmarks/train_vs_fsdp2.py` trains with FSDP2, FSDP2 + tensor parallel, and meshcomm.

    python examples/llama.py         # trains a tiny config for a few steps, prints losses

What it has: RMSNorm, rotary position embeddings (a precomputed cos/sin table kept as
non-persistent buffers), grouped-query attention (`n_kv_heads` < `n_heads`, each key/value
head serving `n_heads // n_kv_heads` query heads) through
`F.scaled_dot_product_attention(is_causal=True)`, a SwiGLU feed-forward, pre-norm residual
blocks, and an untied output projection. Parameter names follow the usual Llama layout
(`layers.0.attention.wq.weight`, `layers.0.feed_forward.w1.weight`, `tok_embeddings.weight`,
`output.weight`, ...), so sharding plans written for that layout apply as they are.

Written to be sharded from the outside:

- Every module has `reset_parameters(generator)`, and `Transformer.init_weights(seed)` runs
  them all in a fixed order from one generator: a model built under
  `torch.device("meta")`, then `to_empty(device="cpu")` and `init_weights(seed)`, holds
  exactly the weights of `Transformer(args)` built directly with `args.seed == seed`.
- Attention takes its head counts from the projections' outputs at run time, not from
  `ModelArgs`: when `wq`, `wk`, `wv` hold only some heads' rows and `wo` the matching
  columns (tensor parallel, heads split over ranks), the module runs unchanged on the
  heads it has, and its output is that subset's share of the full output (the shares of
  all subsets sum to it).
- `forward` reads parameters only through the submodules' own calls (`self.wq(x)`, ...)
  and keeps no reference to any parameter, so a wrapper may swap parameters for other
  tensors (gathered or sharded ones) around or during a forward.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4            # grouped-query attention: n_heads / n_kv_heads q per kv head
    vocab_size: int = 4096
    multiple_of: int = 64          # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    init_std: float = 0.02
    seed: int = 0                  # the weights of a directly built Transformer

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads"
                             f" {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """2/3 of 4 * dim (SwiGLU keeps the parameter count of a 4x MLP), times the optional
        multiplier, rounded up to `multiple_of`."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# -- building blocks ------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        del generator   # deterministic: ones
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles, each (max_seq_len, head_dim // 2): position p
    turns the pair (i, i + head_dim/2) by p * theta^(-2i / head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (batch, seq, heads, head_dim) by the table rows of its positions: the first
    and second half of head_dim are the two coordinates of each rotated pair."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


def _linear_init(layer: nn.Linear, std: float, generator: torch.Generator | None) -> None:
    nn.init.trunc_normal_(layer.weight, std=std, a=-3 * std, b=3 * std, generator=generator)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary embeddings.

    The head counts come from the projections' outputs (`q.shape[-1] // head_dim`), so a
    module whose wq/wk/wv hold a subset of the heads' rows (and wo the matching input
    columns) attends over that subset: only `head_dim` is fixed by the arguments. That is
    read from the outputs, not from `wq.weight.shape`, because under some wrappers (DTensor
    tensor parallelism) the weight reports its global shape while the output is local.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_layers = args.n_layers
        self.init_std = args.init_std
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        # context parallelism: the attention of (b, h, s, d) q, k, v, e.g. mc.nn.attention
        # over a split sequence (examples/train_llama.py --mesh with a cp axis); None: SDPA
        self.attend: Any = None
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for layer in (self.wq, self.wk, self.wv):
            _linear_init(layer, self.init_std, generator)
        # residual output projections: scaled down with depth
        _linear_init(self.wo, self.init_std / math.sqrt(2 * self.n_layers), generator)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)      # (b, s, local q heads, head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)      # (b, s, local kv heads, head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        n_heads, n_kv_heads = q.shape[2], k.shape[2]
        if n_heads % n_kv_heads:
            raise ValueError(f"attention got {n_heads} query heads and {n_kv_heads} key/value"
                             " heads: the query heads must be a multiple (split wq and wk/wv"
                             " over the same number of ranks)")
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.attend is not None:      # takes grouped heads as they are (GQA)
            out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.wo(out.transpose(1, 2).reshape(b, s, n_heads * self.head_dim))
        rep = n_heads // n_kv_heads
        if rep > 1:   # kv head j serves q heads j*rep .. j*rep + rep - 1
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.n_layers = args.n_layers
        self.init_std = args.init_std
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        _linear_init(self.w1, self.init_std, generator)
        _linear_init(self.w3, self.init_std, generator)
        _linear_init(self.w2, self.init_std / math.sqrt(2 * self.n_layers), generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for module in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            module.reset_parameters(generator)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) int64 -> logits (batch, seq, vocab_size) float32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # derived from the arguments, never trained or saved: to_empty() leaves them
        # uninitialized, and init_weights() computes them again
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2),
                             persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2),
                             persistent=False)
        if self.output.weight.device.type != "meta":
            self.init_weights(args.seed)

    def init_buffers(self) -> None:
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, seed: int | None = None,
                     generator: torch.Generator | None = None) -> None:
        """Every parameter and buffer, deterministically: from `generator`, else from a
        fresh CPU generator seeded with `seed` (default `args.seed`). Modules draw in a
        fixed order (embeddings, blocks in order, norm, output), whatever device the
        parameters are on."""
        if generator is None:
            generator = torch.Generator().manual_seed(self.args.seed if seed is None else seed)
        self.init_buffers()
        with torch.no_grad():
            nn.init.normal_(self.tok_embeddings.weight, std=1.0, generator=generator)
        for layer in self.layers:
            layer.reset_parameters(generator)
        self.norm.reset_parameters(generator)
        _linear_init(self.output, self.args.dim ** -0.5, generator)

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits of `tokens` (batch, seq); `positions` (seq,): the tokens' positions in their
        sequence (default 0..seq-1; under context parallelism, this rank's share)."""
        seq = tokens.shape[1]
        if positions is None and seq > self.args.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than max_seq_len"
                             f" {self.args.max_seq_len}")
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every position: logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def counting_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> Tensor:
    """(steps, batch, seq + 1) tokens: random counting sequences a, a+d, a+2d, ... mod vocab
    (random start a, stride d in 1..3), fresh each step: random data with something to learn.
    Drawn step by step, so the first k steps are the same whatever `steps` is."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        out.append((start + stride * torch.arange(seq + 1)) % vocab)
    return torch.stack(out) if out else torch.empty(0, batch, seq + 1, dtype=torch.long)


# -- a tiny run in one process ----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                     max_seq_len=max(64, a.seq), seed=a.seed)
    torch.manual_seed(a.seed)
    # built on the meta device, then materialized: the same weights as Transformer(args)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Transformer: dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads"
          f" ({args.n_kv_heads} kv), ffn {args.ffn_hidden_dim}, vocab {args.vocab_size}:"
          f" {n_params:,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    data = counting_batches(a.steps, a.batch, a.seq, args.vocab_size, a.seed + 1)
    start = time.perf_counter()
    losses = []
    for step in range(a.steps):
        tokens = data[step]
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}")
    print(f"{a.steps} steps in {time.perf_counter() - start:.2f} s; loss {losses[0]:.4f} ->"
          f" {losses[-1]:.4f}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
