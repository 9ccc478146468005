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
