"""Megatron tensor-parallel blocks whose every collective is a meshcomm plan from a recipe.

Executor layer. Weights are stored (in, out), named by logical dims ("embed mlp"); the
recipe decides which axes split them, so one model's code runs under `tp`, `fsdp_tp` or
`sequence_parallel`. Activations are local tensors in the layouts of their logical dims:

- `TPEntry`: the entry of a tensor-parallel region. Forward: input layout -> use layout
  (nothing, or an all_gather along the sequence under sequence parallelism); backward:
  the gradient, a partial sum over the region's axes, reduced back (all_reduce, or
  reduce_scatter along the sequence). Megatron's `f` and its sequence-parallel gather.
- `ColumnParallelLinear`: weight split along its output dim; no forward communication.
- `RowParallelLinear`: weight split along its input dim; its output `| sum(tp)` is resolved
  by the plan to the output layout: an all_reduce, or a reduce_scatter into
  sequence-parallel activations ("batch norm_seq embed" under `sequence_parallel`).
- `VocabParallelEmbedding`: table split over vocab, masked lookup, the pending sum resolved
  the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.layout import Layout
from ..planner.plan import backward_plan, plan
from ..recipes import RecipeLike
from ..runtime.bind import BoundMesh
from ..sharded import reshard
from .comms import Comm
from .moves import move
from .params import ONE_CALL_PER_STEP, ShardedModule


def _whole_last(layout: Layout, name: str) -> Layout:
    """`layout` with its last dim whole (named `name`), e.g. for gathered logits."""
    return layout.with_dim(-1, name)


def _lead(dims: str) -> str:
    return " ".join(dims.split()[:-1])


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
        self.x_layout = self.layout(x_dims)
        self.use_layout = self.layout(use_dims)
        self.grad_layout = self.layout(Layout(use_dims).pending("sum", reduce.split()))

    def forward(self, x: Tensor) -> Tensor:
        return move(x, self.bound, (self.x_layout, self.use_layout),
                    (self.grad_layout, self.x_layout))

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        if shape is None:
            return []
        mesh, shape = self.bound.mesh, tuple(shape)
        return [Comm("forward", "input", plan(mesh, shape, self.x_layout, self.use_layout)),
                Comm("backward", "input grad", plan(mesh, shape, self.grad_layout, self.x_layout))]


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
        self.out_layout = self.layout(f"{lead} {out_name}")
        self.gathered_layout = _whole_last(self.out_layout, out_name) if gather_output else None

    def forward(self, x: Tensor) -> Tensor:
        if self.entry is not None:
            x = self.entry(x)
        y = torch.matmul(x, self.use("weight"))
        if "bias" in self.specs:
            y = y + self.use("bias")
        if self.gathered_layout is not None:
            y = reshard(y, self.bound, self.out_layout, self.gathered_layout,
                        cost_model=ONE_CALL_PER_STEP)
        return y

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        if self.entry is not None:
            out += self.entry.comms(shape)
        if self.gathered_layout is not None:
            w = self.specs["weight"]
            out_shape = (*tuple(shape)[:-1], w.shape[1])
            fwd = plan(self.bound.mesh, out_shape, self.out_layout, self.gathered_layout,
                       dtype=w.dtype, cost_model=ONE_CALL_PER_STEP)
            out += [Comm("forward", "output", fwd),
                    Comm("backward", "output grad", backward_plan(fwd, w.dtype))]
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
        self.add_param("weight", dims, weight, partial=lead)
        if bias is not None:
            self.add_param("bias", out_name, bias, partial=_lead(out_dims))
        self.partial_layout = self.layout(Layout.of_names([*lead.split(), out_name]).pending(
            "sum", [in_name]))
        self.out_layout = self.layout(out_dims)

    def forward(self, x: Tensor) -> Tensor:
        y = reshard(torch.matmul(x, self.use("weight")), self.bound, self.partial_layout,
                    self.out_layout, cost_model=ONE_CALL_PER_STEP)
        return y + self.use("bias") if "bias" in self.specs else y

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        w = self.specs["weight"]
        fwd = plan(self.bound.mesh, (*tuple(shape)[:-1], w.shape[1]), self.partial_layout,
                   self.out_layout, dtype=w.dtype, cost_model=ONE_CALL_PER_STEP)
        return out + [Comm("forward", "output", fwd),
                      Comm("backward", "output grad", backward_plan(fwd, w.dtype))]


class VocabParallelEmbedding(ShardedModule):
    """`weight[tokens]` with the table (vocab, embed) split over vocab: each rank looks up the
    tokens it holds (zeros elsewhere) and a plan resolves the pending sum.

    >>> emb = VocabParallelEmbedding(bound, "tp", table)   # doctest: +SKIP

    Tokens: local, in the layout of `lead` ("(dp batch) seq"). Output: `out_dims` (default
    "<lead> <embed>": an all_reduce of "<lead> <embed> | sum(<vocab>)").
    """

    local_of: Tensor

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, weight: Tensor, *,
                 dims: str = "vocab embed", lead: str = "batch seq",
                 out_dims: str | None = None) -> None:
        super().__init__(bound, recipe)
        vocab, embed = dims.split()
        spec = self.add_param("weight", dims, weight, partial=lead)
        device = weight.device
        held = torch.tensor(spec.use.indices(bound.mesh, spec.shape, bound.rank)[0],
                            dtype=torch.long, device=device)
        local_of = torch.full((spec.shape[0],), -1, dtype=torch.long, device=device)
        local_of[held] = torch.arange(len(held), device=device)
        self.register_buffer("local_of", local_of, persistent=False)
        self.partial_layout = self.layout(Layout.of_names([*lead.split(), embed]).pending(
            "sum", [vocab]))
        self.out_layout = self.layout(out_dims or f"{lead} {embed}")

    def forward(self, tokens: Tensor) -> Tensor:
        index = self.local_of[tokens]
        held = (index >= 0).unsqueeze(-1)
        w = self.use("weight")
        y = F.embedding(index.clamp(min=0), w) * held.to(w.dtype)
        return reshard(y, self.bound, self.partial_layout, self.out_layout,
                       cost_model=ONE_CALL_PER_STEP)

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        out = self.param_comms()
        if shape is None:
            return out
        w = self.specs["weight"]
        fwd = plan(self.bound.mesh, (*tuple(shape), w.shape[1]), self.partial_layout,
                   self.out_layout, dtype=w.dtype, cost_model=ONE_CALL_PER_STEP)
        return out + [Comm("forward", "output", fwd),
                      Comm("backward", "output grad", backward_plan(fwd, w.dtype))]

