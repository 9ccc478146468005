"""Megatron tensor-parallel blocks whose layouts come from a recipe, and the vocab-parallel
lookup that `parallelize`'s embedding styles share.

Weights are stored (in, out), named by logical dims ("embed mlp"); the recipe decides which
axes split them, so one model's code runs under `tp`, `fsdp_tp` or `sequence_parallel`.
Activations are local tensors in the layouts of their logical dims. Every activation move
is an `Entry` or `Exit` (moves.py), the same ones `parallelize` (parallel.py) runs with
layouts from the axis it is given:

- `TPEntry`: the entry of a tensor-parallel region. Forward: input layout -> use layout
  (nothing, or an all_gather along the sequence under sequence parallelism); backward:
  the gradient, a partial sum over the region's axes, reduced back (all_reduce, or
  reduce_scatter along the sequence). Megatron's `f` and its sequence-parallel gather.
- `ColumnParallelLinear`: weight split along its output dim; no forward communication.
- `RowParallelLinear`: weight split along its input dim; its output `| sum(tp)` is resolved
  by the plan to the output layout: an all_reduce, or a reduce_scatter into
  sequence-parallel activations ("batch norm_seq embed" under `sequence_parallel`).
- `VocabParallelEmbedding`: table split over vocab, masked lookup (`VocabRows`), the
  pending sum resolved the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.layout import Layout, Shape
from ..core.mesh import Mesh
from ..recipes import RecipeLike
from ..runtime.bind import BoundMesh
from .comms import Comm
from .moves import Entry, Exit
from .params import ShardedModule


class VocabRows:
    """The rows of a vocab-split table (dim 0 under `layout`) that `rank` holds, and the
    masked lookup: a token held here reads its local row, any other reads zeros; the sum
    over the ranks that split the vocab (an `Exit`'s plan) makes every token's row.

    >>> rows = VocabRows(Layout("(tp v) e"), Mesh("tp=2"), (5, 4), rank=1)
    >>> rows.index(torch.tensor([0, 3, 4]))
    (tensor([0, 0, 1]), tensor([False,  True,  True]))
    >>> rows.local_row(4), rows.local_row(0)
    (1, None)
    """

    def __init__(self, layout: Layout, mesh: Mesh, shape: Shape, rank: int) -> None:
        held = layout.indices(mesh, shape, rank)[0]
        table = torch.full((shape[0],), -1, dtype=torch.long)
        table[torch.tensor(held, dtype=torch.long)] = torch.arange(len(held))
        # this rank's local row of each global row (-1: not held), per device it is used on
        self.local_of = {table.device: table}

    def local_row(self, row: int | None) -> int | None:
        """This rank's local index of global `row` (e.g. a `padding_idx`), or None."""
        if row is None:
            return None
        local = int(self.local_of[torch.device("cpu")][row])
        return local if local >= 0 else None

    def index(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(local row of each token, 0 where not held; whether this rank holds it)."""
        table = self.local_of.get(tokens.device)
        if table is None:
            table = self.local_of[tokens.device] = self.local_of[torch.device("cpu")].to(
                tokens.device)
        index = table[tokens]
        held = index >= 0
        return index.clamp(min=0), held

    @staticmethod
    def masked(rows: Tensor, held: Tensor) -> Tensor:
        """The looked-up `rows`, zeros for the tokens this rank does not hold."""
        return rows * held.unsqueeze(-1).to(rows.dtype)


class TPEntry(ShardedModule):
    """The entry of a tensor-parallel region: forward `x_dims` -> `use_dims`, backward the
    gradient `use_dims | sum(reduce)` -> `x_dims`.

    >>> enter = TPEntry(bound, "tp", reduce="heads")   # doctest: +SKIP

    Under `tp`: forward nothing, backward an all_reduce over tp (Megatron's `f`). With
    `x_dims="batch norm_seq embed"` under `sequence_parallel`: forward an all_gather of the
    sequence over tp, backward a reduce_scatter. Use one entry for layers sharing an input
    (q, k and v) and build them with `enter=False`.
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, *, x_dims: str = "batch seq embed",
                 use_dims: str = "batch seq embed", reduce: str = "mlp") -> None:
        super().__init__(bound, recipe)
        self.moves = Entry(self.layout(x_dims), self.layout(use_dims),
                           self.layout(Layout(use_dims).pending("sum", reduce.split())))

    def forward(self, x: Tensor) -> Tensor:
        return self.moves(x, self.bound)

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        return [] if shape is None else self.moves.comms(self.bound.mesh, shape)


class ColumnParallelLinear(ShardedModule):
    """`x @ weight + bias` with `weight` (in, out) split along out (Megatron column parallel).

    >>> up = ColumnParallelLinear(bound, "tp", w_up, b_up)   # doctest: +SKIP

    Input: logical `x_dims` (default "<lead> <in>"); output "<lead> <out>", split like the
    weight's out dim, or whole with `gather_output` (an all_gather; backward keeps this
    rank's slice). `weight` and `bias` are the global tensors, the same on every rank.
    `enter=False` skips the `TPEntry` (the caller entered the region once for several layers).
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, weight: Tensor,
                 bias: Tensor | None = None, *, dims: str = "embed mlp", lead: str = "batch seq",
                 x_dims: str | None = None, enter: bool = True,
                 gather_output: bool = False) -> None:
        super().__init__(bound, recipe)
        in_name, out_name = dims.split()
        self.add_param("weight", dims, weight, partial=lead)
        if bias is not None:
            self.add_param("bias", out_name, bias, partial=lead)
        use_dims = f"{lead} {in_name}"
        self.entry = (TPEntry(bound, recipe, x_dims=x_dims or use_dims, use_dims=use_dims,
                              reduce=out_name) if enter else None)
        split = self.layout(f"{lead} {out_name}")
        self.gather = Exit(split, split.with_dim(-1, out_name)) if gather_output else None

    def forward(self, x: Tensor) -> Tensor:
        if self.entry is not None:
            x = self.entry(x)
        y = torch.matmul(x, self.use("weight"))
        if "bias" in self.specs:
            y = y + self.use("bias")
        return y if self.gather is None else self.gather(y, self.bound)

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        if self.entry is not None:
            out += self.entry.comms(shape)
        if self.gather is not None:
            w = self.specs["weight"]
            out += self.gather.comms(self.bound.mesh, (*tuple(shape)[:-1], w.shape[1]), w.dtype)
        return out


class RowParallelLinear(ShardedModule):
    """`x @ weight + bias` with `weight` (in, out) split along in (Megatron row parallel).

    >>> down = RowParallelLinear(bound, "tp", w_down, b_down)   # doctest: +SKIP

    Input: "<lead> <in>", split like the weight's in dim (a column-parallel output). The
    local product is "<lead> <out> | sum(<in>)"; a plan resolves it to `out_dims` (default
    "<lead> <out>": an all_reduce; "batch norm_seq embed" under `sequence_parallel`: a
    reduce_scatter along the sequence). The bias is added once, after the reduction.
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, weight: Tensor,
                 bias: Tensor | None = None, *, dims: str = "mlp embed", lead: str = "batch seq",
                 out_dims: str | None = None) -> None:
        super().__init__(bound, recipe)
        in_name, out_name = dims.split()
        out_dims = out_dims or f"{lead} {out_name}"
        out_lead = " ".join(Layout(out_dims).dim_names()[:-1])    # the bias meets these
        self.add_param("weight", dims, weight, partial=lead)
        if bias is not None:
            self.add_param("bias", out_name, bias, partial=out_lead)
        self.sum = Exit(self.layout(Layout.of_names([*lead.split(), out_name]).pending(
            "sum", [in_name])), self.layout(out_dims))

    def forward(self, x: Tensor) -> Tensor:
        bias = self.use("bias") if "bias" in self.specs else None
        return self.sum(torch.matmul(x, self.use("weight")), self.bound, bias=bias)

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        w = self.specs["weight"]
        return out + self.sum.comms(self.bound.mesh, (*tuple(shape)[:-1], w.shape[1]), w.dtype)


class VocabParallelEmbedding(ShardedModule):
    """`weight[tokens]` with the table (vocab, embed) split over vocab: each rank looks up the
    tokens it holds (zeros elsewhere) and a plan resolves the pending sum.

    >>> emb = VocabParallelEmbedding(bound, "tp", table)   # doctest: +SKIP

    Tokens: local, in the layout of `lead` ("(dp batch) seq"). Output: `out_dims` (default
    "<lead> <embed>": an all_reduce of "<lead> <embed> | sum(<vocab>)"). `padding_idx`, a
    global row as in `nn.Embedding`, gets no gradient (only on the rank that holds it).
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, weight: Tensor, *,
                 dims: str = "vocab embed", lead: str = "batch seq",
                 out_dims: str | None = None, padding_idx: int | None = None) -> None:
        super().__init__(bound, recipe)
        vocab, embed = dims.split()
        spec = self.add_param("weight", dims, weight, partial=lead)
        self.rows = VocabRows(spec.use, bound.mesh, spec.shape, bound.rank)
        self.padding_idx = padding_idx
        self.local_padding = self.rows.local_row(
            None if padding_idx is None else range(spec.shape[0])[padding_idx])
        self.sum = Exit(self.layout(Layout.of_names([*lead.split(), embed]).pending(
            "sum", [vocab])), self.layout(out_dims or f"{lead} {embed}"))

    def forward(self, tokens: Tensor) -> Tensor:
        index, held = self.rows.index(tokens)
        rows = F.embedding(index, self.use("weight"), padding_idx=self.local_padding)
        return self.sum(VocabRows.masked(rows, held), self.bound)

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        w = self.specs["weight"]
        return out + self.sum.comms(self.bound.mesh, (*tuple(shape), w.shape[1]), w.dtype)
