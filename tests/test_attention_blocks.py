"""The block math of `mc.nn.attention` in one process: `chunked` (keys block by block,
flash-style: skipped blocks, log-sum-exp merges, probabilities recomputed in backward)
equals one-block attention (`reference`) in output and in the gradients of q, k and v,
for every mask, GQA, blocks of 1 to more than the keys, and queries at other positions
than the keys."""

from __future__ import annotations

import itertools

import pytest
import torch

from meshcomm.nn.attention.blocks import Mask, block, chunked, reference

MASKS = [Mask(), Mask(causal=True), Mask(causal=True, window=3), Mask(window=2)]


@pytest.mark.parametrize("mask,chunk,heads,docs", list(itertools.product(
    MASKS, [1, 3, 5, 64], [(4, 4), (4, 2), (6, 1)], [False, True])))
def test_chunked_equals_one_block(mask: Mask, chunk: int, heads: tuple[int, int],
                                  docs: bool) -> None:
    g = torch.Generator().manual_seed(chunk)
    b, s, d = 2, 11, 8
    q = torch.randn(b, heads[0], s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, heads[1], s, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, heads[1], s, d, generator=g, dtype=torch.float64, requires_grad=True)
    doc = torch.randint(0, 3, (b, s), generator=g).sort(dim=1).values if docs else None
    want = reference(q, k, v, mask, doc=doc)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    got = chunked(q, k, v, mask, d ** -0.5, range(s), range(s), doc, doc, chunk=chunk)
    got_grads = torch.autograd.grad(got, (q, k, v), dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, w in zip(got_grads, want_grads):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


def test_queries_at_other_positions_and_skipped_blocks() -> None:
    """Queries 4..6 of a causal sequence over keys 0..10 in blocks of 2: blocks of keys
    7..10 are skipped, the result is the masked one-block attention."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64)
    mask = Mask(causal=True)
    assert mask.skips(range(4, 7), range(8, 10)) and not mask.skips(range(4, 7), range(6, 8))
    got = chunked(q, k, v, mask, 0.5, range(4, 7), range(11), chunk=2)
    want, _ = block(q, k, v, mask.allowed(torch.arange(4, 7), torch.arange(11)), 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention written out with torch.softmax (no meshcomm code): rows that see nothing
    are 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("causal_block", [False, True])
def test_the_fused_kernel_block_equals_softmax_attention_and_its_gradients(
        causal_block: bool) -> None:
    """`block` on CPU runs torch's fused kernel: output equal to the written-out softmax,
    lse -inf where a query sees nothing, and gradients (through `chunked`, whose backward
    runs the fused backward kernel) equal autograd's of the written-out form."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=g)
    pos = torch.arange(9)
    allowed = pos[None, :] <= pos[:, None] if causal_block else (pos[None, :] % 3 == 1) \
        & (pos[:, None] > 0)
    out, lse = block(q, k, v, None if causal_block else allowed, 0.3, causal_block)
    torch.testing.assert_close(out, _softmax_attention(q, k, v, allowed, 0.3), rtol=1e-12,
                               atol=1e-12)
    if not causal_block:
        assert torch.isinf(lse[..., 0]).all() and not torch.isinf(lse[..., 1:]).any()
    mask = Mask(causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (chunked(*leaves, mask, 0.3, tuple(range(9)), tuple(range(9)), chunk=4) ** 2).sum() \
        .backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (_softmax_attention(*ref, pos[None, :] <= pos[:, None], 0.3) ** 2).sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_blocks_cut_at_the_queries_run_and_join_what_is_seen_whole() -> None:
    """A rank's queries 8..11 over keys 0..15 (causal), chunks of 3: keys 0..7 are seen
    whole (one block, no mask), 8..11 are the causal triangle (no mask), 12..15 skipped;
    with a window the blocks near the edge need masks."""
    from meshcomm.nn.attention.blocks import _blocks
    got = [(c0, c1, a is None, causal) for c0, c1, a, causal in
           _blocks(Mask(causal=True), tuple(range(8, 12)), tuple(range(16)), None, None, 3,
                   torch.device("cpu"))]
    assert got == [(0, 8, True, False), (8, 12, True, True)]
    plain = [(c0, c1) for c0, c1, _, _ in     # the plain math (CUDA, meta): chunks of 3 only
             _blocks(Mask(causal=True), tuple(range(8, 12)), tuple(range(16)), None, None, 3,
                     torch.device("cpu"), fused=False)]
    assert plain == [(0, 3), (3, 6), (6, 9), (9, 12)]
    windowed = [(c0, c1, a is None) for c0, c1, a, _ in
                _blocks(Mask(causal=True, window=4), tuple(range(8, 12)), tuple(range(16)),
                        None, None, 3, torch.device("cpu"))]
    assert windowed == [(3, 6, False), (6, 8, False), (8, 12, False)]
    docs = torch.zeros(1, 4, dtype=torch.long)
    masked = [a is None for _, _, a, _ in _blocks(Mask(causal=True), tuple(range(8, 12)),
                                                  tuple(range(16)), docs,
                                                  torch.zeros(1, 16, dtype=torch.long), 3,
                                                  torch.device("cpu"))]
    assert masked and not any(masked)            # document ids always take the mask
