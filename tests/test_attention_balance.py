"""Causal attention's work per rank of a sequence split, counted from the layout: contiguous
"(cp s)" loads the last rank about 2 - 1/cp times the mean, striped "(s cp)" within 5 % of
it (issue 36's balance figure); the counts equal a brute-force count of the mask."""

from __future__ import annotations

import pytest
import torch

import meshcomm as mc
from meshcomm.nn.attention.balance import imbalance, pairs_per_rank
from meshcomm.nn.attention.blocks import Mask


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_striped_is_balanced_and_contiguous_is_not(cp: int) -> None:
    mesh, seq = mc.Mesh(f"cp={cp}"), 64 * cp
    contiguous = imbalance(pairs_per_rank(mesh, "(cp s)", seq))
    striped = imbalance(pairs_per_rank(mesh, "(s cp)", seq))
    assert abs(contiguous - (2 - 1 / cp)) < 0.01
    assert striped <= 1.05


@pytest.mark.parametrize("layout,seq,causal,window", [
    ("(cp s)", 13, True, None), ("(s cp)", 16, True, 3), ("(cp s)", 10, False, 4),
    ("(cp s)", 7, False, None)])
def test_counts_equal_the_mask(layout: str, seq: int, causal: bool, window: int | None) -> None:
    mesh = mc.Mesh("cp=4")
    got = pairs_per_rank(mesh, layout, seq, causal=causal, window=window)
    allowed = Mask(causal, window).allowed(torch.arange(seq), torch.arange(seq))
    for rank in mesh.ranks:
        mine = list(mc.Layout(layout).indices(mesh, (seq,), rank)[0])
        assert got[rank] == int(allowed[mine].sum())
