"""Expert parallelism: top-1 routed tokens dispatched to their experts' ranks and combined back.

Building-block layer. The experts are split over the axes of the recipe's `experts` rule (`ep`).
Tokens per expert vary, so the all_to_all is uneven and its receive sizes are data:

1. metadata exchange: an even `mc.collectives.all_to_all` of the token counts per expert (int64), so
   each rank learns how many tokens every rank sends it, for each of its experts;
2. dispatch: `mc.collectives.all_to_all` of the tokens with `input_splits` (tokens per destination)
   and `output_splits` (from step 1);
3. each rank runs its experts on the tokens it received;
4. combine: the inverse all_to_all (splits swapped), then the tokens back in their order.

Backward of each token all_to_all is the inverse all_to_all of the gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.errors import ShapeError
from ..core.layout import Layout
from ..core.mesh import AxisName
from ..core.units import format_bytes
from ..recipes import RecipeLike
from ..runtime.bind import BoundMesh
from ..runtime.collectives import all_to_all
from .comms import Comm, format_comms
from .params import ShardedModule


@dataclass(frozen=True, eq=False)
class Routing:
    """How `dispatch` moved this rank's tokens; `combine` undoes it.

    `send_splits[p]` tokens went to group position p and `recv_splits[p]` came from it;
    `recv_counts[p, k]` of those are for this rank's local expert k; `local_expert` is the
    local expert of each received row; `order` sorted this rank's tokens by destination.
    """

    axes: tuple[AxisName, ...]
    order: Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_counts: Tensor
    local_expert: Tensor


@functools.lru_cache(maxsize=64)
def expert_owners(bound: BoundMesh, experts: Layout, n_experts: int,
                  device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """(group position, local index) of each expert under layout `experts` ("(ep experts)"),
    on `device`. Walks the group once per (mesh, layout, experts, device), never per step.
    The tensors are shared: read only."""
    axes = experts.sharded_axes(bound.mesh)
    position = torch.full((n_experts,), -1, dtype=torch.long)
    local = torch.full((n_experts,), -1, dtype=torch.long)
    for p, rank in enumerate(bound.group_ranks(axes)):
        held = torch.tensor(experts.indices(bound.mesh, (n_experts,), rank)[0], dtype=torch.long)
        position[held], local[held] = p, torch.arange(len(held))
    return position.to(device), local.to(device)


def dispatch(x: Tensor, expert: Tensor, bound: BoundMesh, experts: Layout,
             n_experts: int) -> tuple[Tensor, Routing]:
    """The tokens this rank's experts get from every rank, and the routing to send them back.

    >>> got, routing = dispatch(tokens, expert_of_token, bound,  # doctest: +SKIP
    ...                         Layout("(ep experts)"), 8)

    `x` is (tokens, features), `expert` the chosen expert of each token (top-1). Received
    rows come grouped by source position, then by local expert. Every rank calls it.
    """
    axes = experts.sharded_axes(bound.mesh)
    g = len(bound.group_ranks(axes))
    if n_experts % g:
        raise ShapeError(f"dispatch: {n_experts} experts do not split evenly over"
                         f" {', '.join(axes)} ({g} ranks); fix: use a multiple of {g} experts")
    per = n_experts // g
    position, local = expert_owners(bound, experts, n_experts, x.device)
    key = position[expert] * per + local[expert]
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=g * per)
    recv_counts = all_to_all(counts, bound, axes).view(g, per)      # the metadata exchange
    send_splits = tuple(counts.view(g, per).sum(1).tolist())
    recv_splits = tuple(recv_counts.sum(1).tolist())
    got = all_to_all(x[order], bound, axes, input_splits=send_splits, output_splits=recv_splits)
    local_expert = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(g),
                                           recv_counts.reshape(-1))
    return got, Routing(axes, order, send_splits, recv_splits, recv_counts, local_expert)


def combine(y: Tensor, routing: Routing, bound: BoundMesh) -> Tensor:
    """The expert outputs `y` (rows as `dispatch` returned them) back on the tokens' ranks, in
    the tokens' original order (the inverse all_to_all)."""
    back = all_to_all(y, bound, routing.axes, input_splits=routing.recv_splits,
                      output_splits=routing.send_splits)
    return back.index_select(0, torch.argsort(routing.order))


class MoE(ShardedModule):
    """A top-1 mixture of expert MLPs, experts split over the recipe's `experts` axes.

    >>> moe = MoE(bound, "expert_parallel", router, w_up, w_down)   # doctest: +SKIP
    >>> y = moe(x)                          # doctest: +SKIP

    `router` (embed, experts) is replicated; `w_up` (experts, embed, expert_mlp) and
    `w_down` (experts, expert_mlp, embed) are stored "(ep experts) ..." and never gathered.
    Each token's output is its expert's `gelu(x @ w_up) @ w_down`, times its router
    probability.
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike, router: Tensor, w_up: Tensor,
                 w_down: Tensor, *, lead: str = "batch seq") -> None:
        super().__init__(bound, recipe)
        self.add_param("router", "embed gate", router, partial=lead)
        self.add_param("w_up", "experts embed expert_mlp", w_up, gather="", partial=lead)
        self.add_param("w_down", "experts expert_mlp embed", w_down, gather="", partial=lead)
        self.n_experts = router.shape[1]
        self.experts_layout = self.layout("experts")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(router probability of the chosen expert, chosen expert) per row of `x`."""
        probs = torch.softmax(torch.matmul(x, self.use("router")), dim=-1)
        gate, expert = probs.max(dim=-1)
        return gate, expert

    def run_experts(self, got: Tensor, local_expert: Tensor) -> Tensor:
        """This rank's experts on the rows they received, in the rows' order."""
        w_up, w_down = self.use("w_up"), self.use("w_down")
        by_expert = torch.argsort(local_expert, stable=True)
        sizes = torch.bincount(local_expert, minlength=w_up.shape[0]).tolist()
        parts = torch.split(got.index_select(0, by_expert), sizes)
        outs = [torch.matmul(F.gelu(torch.matmul(part, w_up[k])), w_down[k])
                for k, part in enumerate(parts)]
        return torch.cat(outs).index_select(0, torch.argsort(by_expert))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gate, expert = self.route(flat)
        got, routing = dispatch(flat, expert, self.bound, self.experts_layout, self.n_experts)
        y = combine(self.run_experts(got, routing.local_expert), routing, self.bound)
        return (y * gate.unsqueeze(-1)).reshape(x.shape)

    def comms(self, shape: Sequence[int] | None = None,
              routing: Routing | None = None) -> list[Comm]:
        """Parameter plans plus the routing collectives (with this rank's splits, if given)."""
        axes = ", ".join(self.experts_layout.sharded_axes(self.bound.mesh))
        g = len(self.bound.group_ranks(self.experts_layout.sharded_axes(self.bound.mesh)))
        row = self.specs["router"].shape[0] * self.specs["router"].dtype.itemsize
        send = "rows per destination" if routing is None else list(routing.send_splits)
        recv = "from the counts" if routing is None else list(routing.recv_splits)
        return self.param_comms() + [
            Comm("forward", "counts", note=f"all_to_all({axes}) even, int64 ({self.n_experts},)"
                 f" -> ({self.n_experts},): tokens per expert, the metadata exchange"),
            Comm("forward", "dispatch", note=f"all_to_all({axes}) uneven over {g} ranks,"
                 f" input_splits={send}, output_splits={recv}, {format_bytes(row)} per token"),
            Comm("forward", "combine", note=f"all_to_all({axes}) uneven, the splits swapped"),
            Comm("backward", "combine grad", note=f"all_to_all({axes}) uneven, inverse of combine"),
            Comm("backward", "dispatch grad",
                 note=f"all_to_all({axes}) uneven, inverse of dispatch"),
        ]

    def explain(self, shape: Sequence[int] | None = None, *, full: bool = False,
                routing: Routing | None = None) -> str:
        """The parameter plans and the routing collectives (this rank's splits with `routing`)."""
        return format_comms(self._title(), self.comms(shape, routing), full=full)
