"""Parameters stored sharded, gathered for use, gradients reduced back: FSDP from a recipe.

Building-block layer: every collective here is a meshcomm plan run by the engine (a
`mc.nn.fully_shard` unit: one collective per bucket of its parameters). A parameter has
three layouts, all from a recipe
(see `param_spec`):

- stored: what its `nn.Parameter` holds and the optimizer steps, e.g. "(fsdp embed) (tp mlp)";
- use: what forward computes with, stored with the batch axes gathered out, "embed (tp mlp)";
- grad: the gradient each rank's backward produces for `use`, partial over the axes whose
  ranks saw other data, "embed (tp mlp) | avg(fsdp)".

Forward runs the plans stored -> use; backward runs grad -> stored (a reduce_scatter where
the forward gathered, an all_reduce where the parameter is replicated) and scales by
`grad_scale`. Training loss convention: each rank's loss is the mean over its own tokens,
and the loss being trained is the mean of those over the ranks that split the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.layout import Layout, Shape
from ..core.mesh import AxisName, Mesh
from ..core.names import positional_names
from ..executors.distributed.autograd import reshard_autograd
from ..planner.plan import plan
from ..planner.values import CostModel, Plan
from ..recipes import RecipeLike, logical
from ..runtime.bind import BoundMesh, require_bound
from ..sharded import distribute, reshard
from .comms import Comm, format_comms

# the training blocks plan steps of one collective call each (no tree steps): their plans run
# every step, and a tree's rounds share no bucket. On bytes (no latency): their calls are
# bucketed, so a latency is paid once per bucket, not once per tensor.
ONE_CALL_PER_STEP = CostModel(trees=False, latency_s=0.0)


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter of global `shape` is stored, used in forward, and reduced in backward.

    >>> s = param_spec(Mesh("fsdp=2 tp=2"), "fsdp_tp", "embed mlp", (16, 32))
    >>> str(s.stored), str(s.use), str(s.grad)
    ('(fsdp embed) (tp mlp)', 'embed (tp mlp)', 'embed (tp mlp) | avg(fsdp)')
    """

    dims: str
    mesh: Mesh
    shape: Shape
    dtype: torch.dtype
    stored: Layout
    use: Layout
    grad: Layout
    grad_scale: float = 1.0
    cost_model: CostModel = ONE_CALL_PER_STEP     # what the plans may use (fully_shard: FSDP's)

    def gather_plan(self, dtype: torch.dtype | None = None) -> Plan:
        """The forward plan: stored -> use (in `dtype`, default the parameter's: mixed
        precision gathers in another)."""
        return plan(self.mesh, self.shape, self.stored, self.use, dtype=dtype or self.dtype,
                    cost_model=self.cost_model)

    def reduce_plan(self, dtype: torch.dtype | None = None) -> Plan:
        """The backward plan: grad -> stored (then times `grad_scale`), in `dtype`."""
        return plan(self.mesh, self.shape, self.grad, self.stored, dtype=dtype or self.dtype,
                    cost_model=self.cost_model)

    def comms(self, name: str, *, regather: bool = False) -> list[Comm]:
        """This parameter's communication: gather, optional regather in backward, reduce."""
        out = [Comm("forward", f"{name} gather", self.gather_plan())]
        if regather and self.gather_plan().collectives:
            out.append(Comm("backward", f"{name} regather", self.gather_plan()))
        scale = "" if self.grad_scale == 1 else f"then x {self.grad_scale:g}"
        out.append(Comm("backward", f"{name} grad", self.reduce_plan(), scale))
        return out


def logical_axes(names: str, recipe: RecipeLike, mesh: Mesh) -> tuple[AxisName, ...]:
    """The mesh axes the rules of logical `names` (space-separated) give on `mesh`.

    >>> logical_axes("batch", "fsdp_tp", Mesh("fsdp=2 tp=2"))
    ('fsdp',)
    """
    if not names.split():
        return ()
    one_dim = Layout.of_names(positional_names(1, mesh.axis_names, names.split()))
    return logical(one_dim.pending("sum", names.split()), recipe, mesh).partial_axes


def param_spec(mesh: Mesh, recipe: RecipeLike, dims: str, shape: Sequence[int],
               dtype: torch.dtype = torch.float32, *, gather: str = "batch",
               partial: str = "batch", loss: str = "batch") -> ParamSpec:
    """The layouts of a parameter with logical `dims` under `recipe` on `mesh`.

    >>> s = param_spec(Mesh("dp=2 tp=2"), "fsdp_tp", "embed mlp", (16, 32))
    >>> str(s.stored), str(s.use), str(s.grad)
    ('embed (tp mlp)', 'embed (tp mlp)', 'embed (tp mlp) | avg(dp)')

    `gather`: logical names whose axes are gathered out of the parameter for use (FSDP);
    "" keeps it as stored (expert weights under expert parallelism). `partial`: logical
    names whose axes split the activations the parameter meets (its gradient is a partial
    sum over them), e.g. "batch norm_seq" in a sequence-parallel region. `loss`: logical
    names whose axes split the loss (see the module doc); the gradient is divided by
    their size, folded into an `avg` when they are exactly the partial axes.
    """
    stored = logical(dims, recipe, mesh)
    use = stored if not gather.split() else logical(
        Layout(dims).pending("sum", gather.split()), recipe, mesh).without_reduction()
    own = set(use.sharded_axes(mesh))
    part = tuple(a for a in logical_axes(partial, recipe, mesh) if a not in own)
    loss_axes = logical_axes(loss, recipe, mesh)
    n = mesh.group_size(loss_axes)
    if part and set(part) == set(loss_axes):
        grad, scale = use.pending("avg", part), 1.0
    elif part:
        grad, scale = use.pending("sum", part), 1.0 / n
    else:
        grad, scale = use, 1.0 / n
    return ParamSpec(dims, mesh, tuple(int(s) for s in shape), dtype, stored, use, grad, scale)


def planning_mesh(mesh: Mesh | str, rank: int = 0) -> BoundMesh:
    """A BoundMesh with no process groups, for building blocks in one process to print their
    layouts and plans (`explain`) as `rank` would; running a collective on it raises.

    >>> bound = planning_mesh("fsdp=2 tp=2")
    >>> param_spec(bound.mesh, "fsdp_tp", "embed", (16,)).stored
    Layout('(fsdp embed)')
    """
    mesh = Mesh(mesh) if isinstance(mesh, str) else mesh
    return BoundMesh(mesh, "gloo", torch.device("cpu"), rank, {})


# -- a recipe module's parameters outside a fully_shard unit ----------------------------------
def gather_params(bound: BoundMesh, specs: Sequence[ParamSpec], params: Sequence[Tensor]
                  ) -> list[Tensor]:
    """The parameters in their use layouts, differentiable: each runs its spec's gather plan,
    and backward runs its reduce plan and grad_scale (the engine's one autograd function,
    `Reshard`, given the spec's plans). A `fully_shard` unit buckets them instead.

    >>> w_up, w_down = gather_params(bound, [spec_up, spec_down], [p_up, p_down])  # doctest: +SKIP
    """
    return [reshard_autograd(p, bound, s.gather_plan(), reverse=_reduce_plan_of(s),
                             scale=s.grad_scale)
            for s, p in zip(specs, params)]


def _reduce_plan_of(spec: ParamSpec) -> Any:
    def reverse(_: Plan, dtype: torch.dtype) -> Plan:
        return spec.reduce_plan(dtype)
    return reverse


# -- modules --------------------------------------------------------------------------------
class ShardedModule(nn.Module):
    """An nn.Module whose parameters are stored sharded under a recipe (base of meshcomm.nn).

    >>> class Scale(ShardedModule):                                    # doctest: +SKIP
    ...     def __init__(self, bound, recipe, w):
    ...         super().__init__(bound, recipe)
    ...         self.add_param("weight", "embed", w)    # stored "(fsdp embed)" under fsdp_tp
    ...     def forward(self, x):
    ...         return x * self.use("weight")           # gathered to "embed"

    `use(name)` is the parameter in its use layout: gathered by the `mc.nn.fully_shard` unit
    that holds it (bucketed with the unit's other parameters) or, outside one, alone.
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike) -> None:
        super().__init__()
        self.bound = require_bound(bound, type(self).__name__)
        self.recipe = recipe
        self.specs: dict[str, ParamSpec] = {}
        self.in_use: dict[str, Tensor] = {}      # filled by a fully_shard unit during forward

    def layout(self, dims: str | Layout) -> Layout:
        """`mc.logical(dims, self.recipe, mesh)` on this module's mesh."""
        return logical(dims, self.recipe, self.bound.mesh)

    def add_param(self, name: str, dims: str, value: Tensor, **spec_options: str) -> ParamSpec:
        """Register parameter `name`: this rank's shard of the global `value` (the same on
        every rank) under the stored layout of logical `dims`. Options go to `param_spec`."""
        spec = param_spec(self.bound.mesh, self.recipe, dims, value.shape, value.dtype,
                          **spec_options)
        local = distribute(value.detach(), self.bound, spec.stored).local
        self.register_parameter(name, nn.Parameter(local.clone()))
        self.specs[name] = spec
        return spec

    def use(self, name: str) -> Tensor:
        """Parameter `name` in its use layout (differentiable; see the class doc)."""
        if name in self.in_use:
            return self.in_use[name]
        return gather_params(self.bound, [self.specs[name]], [getattr(self, name)])[0]

    def full_param(self, name: str) -> Tensor:
        """The whole parameter `name` on every rank (a collective: call it on every rank)."""
        spec = self.specs[name]
        return reshard(getattr(self, name).detach(), self.bound, spec.stored,
                       _replicated(spec), shape=spec.shape)

    def param_comms(self) -> list[Comm]:
        """Every parameter's gather and gradient reduction."""
        return [c for name, spec in self.specs.items() for c in spec.comms(name)]

    def comms(self, shape: Sequence[int] | None = None) -> list[Comm]:
        """What this module communicates for an input of global `shape` (activations need it)."""
        return self.param_comms()

    def explain(self, shape: Sequence[int] | None = None, *, full: bool = False) -> str:
        """The plans this module runs, one line each (with `full`, each plan's table too)."""
        notes = () if shape is not None or not self._has_activations() else (
            "(activations: pass the input's global shape, explain(shape=...))",)
        return format_comms(self._title(), self.comms(shape), full=full, notes=notes)

    def _has_activations(self) -> bool:
        return type(self).comms is not ShardedModule.comms

    def _title(self) -> str:
        return f"{type(self).__name__} on {self.bound.mesh!r}, recipe {_recipe_name(self.recipe)}"


def _replicated(spec: ParamSpec) -> Layout:
    return Layout.of_names(spec.stored.dim_names(spec.mesh))


def _recipe_name(recipe: RecipeLike) -> str:
    name = getattr(recipe, "name", None)
    if name is not None:
        return str(name)
    return "(rules)" if isinstance(recipe, Mapping) else str(recipe)
