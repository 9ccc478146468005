"""examples/llama.py, the plain-PyTorch Llama-style model the FSDP2 benchmark trains: shapes,
grouped-query attention against a loop written out by hand, meta-device construction,
training, and attention/SwiGLU on a subset of the heads (as tensor parallelism runs them)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load() -> ModuleType:
    name = "meshcomm_example_llama"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / "llama.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module        # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


llama = _load()


def small(**overrides: object) -> object:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                max_seq_len=32, seed=0)
    return llama.ModelArgs(**(base | overrides))


def tokens(batch: int, seq: int, vocab: int, seed: int = 1) -> Tensor:
    return torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_default_args_and_shapes() -> None:
    args = llama.ModelArgs()
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size) == (
        256, 8, 8, 4, 4096)
    assert args.head_dim == 32 and args.ffn_hidden_dim == 704     # 682 rounded up to 64s
    model = llama.Transformer(small())
    x = tokens(3, 10, 64)
    logits = model(x)
    assert logits.shape == (3, 10, 64) and logits.dtype == torch.float32
    names = dict(model.named_parameters())
    a = small()
    assert names["layers.0.attention.wq.weight"].shape == (32, 32)
    assert names["layers.0.attention.wk.weight"].shape == (2 * a.head_dim, 32)   # 2 kv heads
    assert names["layers.0.attention.wv.weight"].shape == (2 * a.head_dim, 32)
    assert names["layers.0.attention.wo.weight"].shape == (32, 32)
    assert names["layers.1.feed_forward.w1.weight"].shape == (a.ffn_hidden_dim, 32)
    assert names["layers.1.feed_forward.w2.weight"].shape == (32, a.ffn_hidden_dim)
    assert {"tok_embeddings.weight", "norm.weight", "output.weight",
            "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight"} <= set(names)
    assert all(p.grad is None for p in model.parameters())
    # the rotary tables are buffers, not saved
    assert not any("rope" in k for k in model.state_dict())
    loss = llama.loss_fn(logits, tokens(3, 10, 64, seed=2))
    assert loss.shape == () and math.isfinite(loss.item())


@pytest.mark.parametrize("bad", [dict(n_heads=5), dict(n_kv_heads=3), dict(dim=24, n_heads=8)])
def test_bad_args_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        small(**bad)


def manual_attention(attn: object, x: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
                     n_kv_heads: int) -> Tensor:
    """Causal GQA written as loops: query head h reads key/value head h // (n_heads /
    n_kv_heads); softmax over explicit masked scores."""
    b, s, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, n_heads, hd)
    k = (x @ attn.wk.weight.T).view(b, s, n_kv_heads, hd)
    v = (x @ attn.wv.weight.T).view(b, s, n_kv_heads, hd)
    q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for h in range(n_heads):
        j = h // (n_heads // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, j].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, j])
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_a_hand_written_loop(n_kv_heads: int) -> None:
    args = small(n_kv_heads=n_kv_heads)
    model = llama.Transformer(args).double()
    attn = model.layers[0].attention
    x = torch.randn(2, 9, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    got = attn(x, cos, sin)
    want = manual_attention(attn, x, cos, sin, args.n_heads, n_kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gqa_equals_full_attention_with_repeated_kv_weights() -> None:
    """n_kv_heads=2 of 4 heads is the same function as 4 kv heads whose wk/wv rows repeat
    each kv head for the two query heads it serves."""
    gqa = llama.Transformer(small(n_kv_heads=2)).double().layers[0].attention
    mha = llama.Attention(small(n_kv_heads=4)).double()
    hd = gqa.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for src, dst in ((gqa.wk, mha.wk), (gqa.wv, mha.wv)):
            dst.weight.copy_(src.weight.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(-1, 32))
    cos, sin = llama.rope_tables(hd, 16, 10000.0)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    torch.testing.assert_close(gqa(x, cos.double(), sin.double()),
                               mha(x, cos.double(), sin.double()), rtol=1e-10, atol=1e-12)


def test_rope_is_relative() -> None:
    """Rotated q.k depends on the positions' difference only; position 0 is not rotated."""
    cos, sin = llama.rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def at(x: Tensor, p: int) -> Tensor:
        return llama.apply_rope(x, cos[p:p + 1].double(), sin[p:p + 1].double())

    torch.testing.assert_close(at(q, 0), q)
    d1 = (at(q, 5) * at(k, 2)).sum()
    d2 = (at(q, 12) * at(k, 9)).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-6, atol=1e-6)


def test_meta_construction_then_init_equals_direct_construction() -> None:
    args = small(seed=7)
    direct = llama.Transformer(args)
    with torch.device("meta"):
        lazy = llama.Transformer(args)
    assert all(p.is_meta for p in lazy.parameters()) and lazy.rope_cos.is_meta
    lazy.to_empty(device="cpu")
    lazy.init_weights(7)
    got, want = dict(lazy.named_parameters()), dict(direct.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(lazy.rope_cos, direct.rope_cos)
    assert torch.equal(lazy.rope_sin, direct.rope_sin)
    x = tokens(2, 12, 64)
    assert torch.equal(lazy(x), direct(x))
    # init_weights() with no seed uses args.seed; another seed gives other weights
    lazy.init_weights()
    assert torch.equal(lazy.output.weight, direct.output.weight)
    other = llama.Transformer(small(seed=8))
    assert not torch.equal(other.layers[0].attention.wq.weight,
                           direct.layers[0].attention.wq.weight)
    # norms start at one, residual projections smaller than the others
    assert torch.equal(direct.norm.weight, torch.ones(32))
    wq, wo = direct.layers[0].attention.wq.weight, direct.layers[0].attention.wo.weight
    assert wo.std() < wq.std()


def test_training_lowers_the_loss() -> None:
    torch.manual_seed(0)
    model = llama.Transformer(small())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = llama.counting_batches(1, 8, 16, 64, seed=3)[0]
    losses = []
    for _ in range(15):
        loss = llama.loss_fn(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def head_slice(attn: object, args: object, q_heads: range) -> object:
    """An Attention holding only query heads `q_heads` (and their kv heads): wq/wk/wv rows
    and wo columns, as a tensor-parallel rank holds them."""
    hd, rep = args.head_dim, args.n_heads // args.n_kv_heads
    kv_heads = range(q_heads.start // rep, q_heads.stop // rep)
    part = llama.Attention(args).double()
    qs = slice(q_heads.start * hd, q_heads.stop * hd)
    kvs = slice(kv_heads.start * hd, kv_heads.stop * hd)
    with torch.no_grad():
        part.wq.weight = torch.nn.Parameter(attn.wq.weight[qs].clone())
        part.wk.weight = torch.nn.Parameter(attn.wk.weight[kvs].clone())
        part.wv.weight = torch.nn.Parameter(attn.wv.weight[kvs].clone())
        part.wo.weight = torch.nn.Parameter(attn.wo.weight[:, qs].clone())
    return part


def test_attention_on_half_the_heads_is_half_the_sum() -> None:
    """Heads split 2 + 2 over two "ranks": each half runs unmodified on its smaller weights,
    and the two outputs sum to the full attention's output (the row-parallel wo's sum)."""
    args = small(n_heads=4, n_kv_heads=2)
    full = llama.Transformer(args).double().layers[1].attention
    halves = [head_slice(full, args, range(0, 2)), head_slice(full, args, range(2, 4))]
    assert halves[0].wq.weight.shape == (16, 32) and halves[0].wk.weight.shape == (8, 32)
    assert halves[0].wo.weight.shape == (32, 16)
    cos, sin = (t[:10].double() for t in llama.rope_tables(args.head_dim, 32, args.rope_theta))
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    parts = [h(x, cos, sin) for h in halves]
    torch.testing.assert_close(parts[0] + parts[1], full(x, cos, sin), rtol=1e-10, atol=1e-12)
    # a kv head shared by more query heads than a rank holds would be split: refused
    odd = head_slice(full, args, range(0, 2))
    odd.wq.weight = torch.nn.Parameter(full.wq.weight[:8].clone())      # 1 q head, 1 kv head: fine
    odd.wo.weight = torch.nn.Parameter(full.wo.weight[:, :8].clone())
    assert odd(x, cos, sin).shape == (3, 10, 32)
    odd.wk.weight = torch.nn.Parameter(full.wk.weight.clone())          # 1 q head, 2 kv heads
    odd.wv.weight = torch.nn.Parameter(full.wv.weight.clone())
    with pytest.raises(ValueError, match="multiple"):
        odd(x, cos, sin)


def test_swiglu_on_half_the_hidden_units_is_half_the_sum() -> None:
    args = small()
    full = llama.Transformer(args).double().layers[0].feed_forward
    h = args.ffn_hidden_dim // 2
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    total = torch.zeros(2, 5, 32, dtype=torch.float64)
    for rows in (slice(0, h), slice(h, None)):
        part = llama.FeedForward(args).double()
        part.w1.weight = torch.nn.Parameter(full.w1.weight[rows].clone())
        part.w3.weight = torch.nn.Parameter(full.w3.weight[rows].clone())
        part.w2.weight = torch.nn.Parameter(full.w2.weight[:, rows].clone())
        total += part(x)
    torch.testing.assert_close(total, full(x), rtol=1e-10, atol=1e-12)


def test_whole_model_runs_with_half_the_heads_and_hidden_units() -> None:
    """Every block's projections cut to half (what one of 2 tensor-parallel ranks holds):
    the unmodified forward runs and its backward reaches every parameter."""
    args = small()
    model = llama.Transformer(args)
    hd = args.head_dim
    with torch.no_grad():
        for layer in model.layers:
            a, f = layer.attention, layer.feed_forward
            a.wq.weight = torch.nn.Parameter(a.wq.weight[:2 * hd].clone())
            a.wk.weight = torch.nn.Parameter(a.wk.weight[:hd].clone())
            a.wv.weight = torch.nn.Parameter(a.wv.weight[:hd].clone())
            a.wo.weight = torch.nn.Parameter(a.wo.weight[:, :2 * hd].clone())
            half = args.ffn_hidden_dim // 2
            f.w1.weight = torch.nn.Parameter(f.w1.weight[:half].clone())
            f.w3.weight = torch.nn.Parameter(f.w3.weight[:half].clone())
            f.w2.weight = torch.nn.Parameter(f.w2.weight[:, :half].clone())
    x = tokens(2, 8, 64)
    logits = model(x)
    assert logits.shape == (2, 8, 64)
    llama.loss_fn(logits, tokens(2, 8, 64, seed=5)).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_parameters_can_be_swapped_for_other_tensors() -> None:
    """forward keeps no parameter references: functional_call with other tensors computes
    the model that holds those tensors."""
    a, b = llama.Transformer(small(seed=1)), llama.Transformer(small(seed=2))
    x = tokens(2, 8, 64)
    swapped = torch.func.functional_call(a, dict(b.named_parameters()), (x,))
    torch.testing.assert_close(swapped, b(x), rtol=0, atol=0)
    torch.testing.assert_close(a(x), llama.Transformer(small(seed=1))(x), rtol=0, atol=0)


def test_sdpa_path_matches_reference_for_the_whole_model_in_double() -> None:
    """The full model (float64) against the same blocks written with manual_attention."""
    args = small()
    model = llama.Transformer(args).double()
    x = tokens(2, 11, 64)
    cos, sin = model.rope_cos[:11], model.rope_sin[:11]
    h = model.tok_embeddings(x)
    for layer in model.layers:
        a = layer.attention_norm(h)
        h = h + manual_attention(layer.attention, a, cos, sin, args.n_heads, args.n_kv_heads)
        f = layer.ffn_norm(h)
        ff = layer.feed_forward
        h = h + (F.silu(f @ ff.w1.weight.T) * (f @ ff.w3.weight.T)) @ ff.w2.weight.T
    want = model.norm(h) @ model.output.weight.T
    torch.testing.assert_close(model(x), want.float(), rtol=1e-6, atol=1e-6)


def test_the_example_runs() -> None:
    assert llama.main(["--steps", "5"]) == 0


def test_counting_batches_are_prefix_stable_and_learnable() -> None:
    five = llama.counting_batches(5, 4, 8, 64, seed=3)
    assert five.shape == (5, 4, 9)
    assert torch.equal(llama.counting_batches(2, 4, 8, 64, seed=3), five[:2])
    step = (five[:, :, 1:] - five[:, :, :-1]) % 64
    assert torch.equal(step, step[:, :, :1].expand_as(step))      # one stride per row
    assert set(step.unique().tolist()) <= {1, 2, 3}
