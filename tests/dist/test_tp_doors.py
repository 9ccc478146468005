"""Tensor parallelism's two front doors run one implementation: `parallelize`'s styles
(layouts from the axis given) and the recipe blocks (layouts from a recipe).

- a style's layouts are `Layout`s derived for the axis it is applied with: "mp" says "mp";
- one vocab-parallel embedding reached from both doors, on 2 gloo ranks over an axis named
  "mp" with an uneven vocabulary (11 rows: 6 + 5) and a padding row held by rank 1:
  equal outputs and table gradients (bit for bit), equal to one process, under
  `embedding` (an all_reduce) and `embedding_sp` (a reduce_scatter along the sequence).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ranks_fixture
from torch import nn

import meshcomm as mc
from meshcomm.nn.parallel import STYLES, TP_ATTR

V, E, B, S, PAD = 11, 4, 2, 6, 7          # vocab (uneven over mp=2), embed, batch, seq, pad row


@pytest.mark.parametrize("style, weight, bias", [
    ("colwise", "(mp d0) d1", "(mp d0)"),
    ("colwise_gather_sp", "(mp d0) d1", "(mp d0)"),
    ("rowwise", "d0 (mp d1)", "d0"),
    ("embedding", "(mp d0) d1", "d0"),
    ("sp_input", None, None),
])
def test_a_style_s_layouts_name_the_axis_it_is_applied_with(style: str, weight: str | None,
                                                             bias: str | None) -> None:
    got = STYLES[style].on("mp", mc.Mesh("dp=2 mp=2"))
    assert (got.weight, got.bias) == (weight and mc.Layout(weight), bias and mc.Layout(bias))


def test_a_style_names_weight_dims_apart_from_the_mesh_s_axes() -> None:
    # an unnamed DeviceMesh's axes are d0, d1: the weight's dims are then dim0, dim1
    assert STYLES["rowwise"].on("d1", mc.Mesh("d0=2 d1=2")).weight == mc.Layout("dim0 (d1 dim1)")


def tokens() -> torch.Tensor:
    x = torch.randint(V, (B, S), generator=torch.Generator().manual_seed(3))
    x[:, 0], x[:, 1], x[:, 2] = PAD, 0, V - 1      # the padding row, and rows of both ranks
    return x


def table() -> torch.Tensor:
    return torch.randn(V, E, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def grad_out() -> torch.Tensor:
    return torch.randn(B, S, E, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def both_doors(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("mp=2")
    out: dict[str, Any] = {}
    for style, out_dims in (("embedding", "batch seq embed"),
                            ("embedding_sp", "batch norm_seq embed")):
        rules = {"vocab": "mp", "norm_seq": "mp"}
        block = mc.nn.VocabParallelEmbedding(bound, rules, table(), out_dims=out_dims,
                                             padding_idx=PAD)
        model = nn.Sequential(nn.Embedding(V, E, padding_idx=PAD, dtype=torch.float64))
        with torch.no_grad():
            model[0].weight.copy_(table())
        mc.nn.parallelize(model, bound, {"0": style}, axis="mp")
        dy = mc.distribute(grad_out(), bound, mc.logical(out_dims, rules, bound.mesh)).local
        got = {}
        for door, m, weight in (("block", block, block.weight), ("style", model, model[0].weight)):
            y = m(tokens())
            (y * dy).sum().backward()
            grad = weight.grad
            got[door] = (y.detach(), grad.to_local() if hasattr(grad, "to_local") else grad)
        out[style] = {"got": got, "placements": str(tuple(model[0].weight.placements)),
                      "layout": str(getattr(model[0], TP_ATTR).layouts.weight),
                      "rows": tuple(block.weight.shape)}
    return out


two = ranks_fixture(both_doors, 2)


@pytest.mark.parametrize("style", ["embedding", "embedding_sp"])
def test_one_vocab_parallel_embedding_from_both_doors(two: list[dict[str, Any]],
                                                      style: str) -> None:
    want_table = table().requires_grad_()
    want = torch.nn.functional.embedding(tokens(), want_table, padding_idx=PAD)
    (want * grad_out()).sum().backward()
    assert want_table.grad is not None
    for rank, rep in enumerate(two):
        got = rep[style]
        (y_block, g_block), (y_style, g_style) = got["got"]["block"], got["got"]["style"]
        assert torch.equal(y_block, y_style) and torch.equal(g_block, g_style), rank
        rows = slice(0, 6) if rank == 0 else slice(6, V)      # 11 rows: 6 + 5
        assert torch.equal(g_block, want_table.grad[rows]), rank
        whole = want.detach() if style == "embedding" else want.detach()[:, 3 * rank:3 * rank + 3]
        assert torch.equal(y_block, whole), rank
        assert got["layout"] == "(mp d0) d1" and got["placements"] == "(Shard(dim=0),)"
        assert got["rows"] == (6 - rank, E)
    assert not want_table.grad[PAD].any()                    # the padding row gets no gradient
    assert two[1][style]["got"]["block"][1][PAD - 6].abs().sum() == 0
