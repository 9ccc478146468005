"""Parameters stored sharded, gathered for use, gradients reduced back: FSDP from a recipe.

Building-block layer: every collective here is a meshcomm plan, run by `mc.reshard_many` (one
collective per bucket of parameters). A parameter has three layouts, all from a recipe
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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import MeshMismatchError
from ..core.layout import Layout, Shape
from ..core.mesh import AxisName, Mesh
from ..core.names import positional_names
from ..executors.distributed.handlers import step_shape
from ..planner.plan import plan
from ..planner.values import CostModel, Plan
from ..recipes import RecipeLike, logical
from ..runtime.bind import BoundMesh, require_bound
from ..sharded import distribute, reshard, reshard_many
from .comms import Comm, format_comms
from .fsdp.regather import Regather
from .fsdp.schedule import Schedule

BUCKET_BYTES = 25 * 2**20
# the training blocks plan steps of one collective call each (no tree steps): their plans run
# every step, and a tree's rounds share no bucket
ONE_CALL_PER_STEP = CostModel(trees=False)


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

    def gather_plan(self) -> Plan:
        """The forward plan: stored -> use."""
        return plan(self.mesh, self.shape, self.stored, self.use, dtype=self.dtype,
                    cost_model=ONE_CALL_PER_STEP)

    def reduce_plan(self) -> Plan:
        """The backward plan: grad -> stored (then times `grad_scale`)."""
        return plan(self.mesh, self.shape, self.grad, self.stored, dtype=self.dtype,
                    cost_model=ONE_CALL_PER_STEP)

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


# -- the gather and its backward -----------------------------------------------------------
class _Call:
    """One forward's gather of some parameters: what backward reduces, and (for
    `saved_tensors_hooks`) the saved-tensor regather of `mc.nn.fully_shard`, whose gatherer
    this is: no schedule of units, so no prefetch."""

    prefetch = False
    reshard_after_forward = True

    def __init__(self, bound: BoundMesh, specs: Sequence[ParamSpec], params: Sequence[Tensor],
                 bucket_bytes: int) -> None:
        self.bound, self.specs, self.params = bound, tuple(specs), tuple(params)
        self.bucket_bytes = bucket_bytes
        self.schedule: Schedule[Any] = Schedule()
        self.regather = Regather(self)

    def gather_tensors(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Each tensor stored -> use, bucketed; a parameter that needs no collective is a view."""
        moved = [i for i, s in enumerate(self.specs) if s.gather_plan().collectives]
        outs = [t.view_as(t) for t in tensors]
        got = reshard_many([(tensors[i], self.bound, self.specs[i].stored, self.specs[i].use,
                             self.specs[i].shape) for i in moved], bucket_bytes=self.bucket_bytes,
                           cost_model=ONE_CALL_PER_STEP)
        for i, t in zip(moved, got):
            outs[i] = t
        return outs

    def gather(self) -> list[Tensor]:
        """The parameters gathered again (the regather's first use in backward)."""
        return self.gather_tensors([p.detach() for p in self.params])

    def prefetch_gather(self) -> None:
        """Nothing to prefetch: a FullyShard unit knows no next unit."""

    def remember(self, outs: list[Tensor]) -> list[Tensor]:
        """Tell the regather which saved tensors are the gathered parameters (not those that
        needed no collective: they are the stored parameters themselves)."""
        self.regather.remember(outs, [i for i, s in enumerate(self.specs)
                                      if s.gather_plan().collectives])
        return outs

    def reduce(self, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """Each use-layout gradient grad -> stored, bucketed, times its spec's grad_scale."""
        mesh, rank = self.bound.mesh, self.bound.rank
        full = [torch.zeros(s.use.local_shape(mesh, s.shape, rank), dtype=s.dtype,
                            device=p.device) if g is None else g.contiguous()
                for s, p, g in zip(self.specs, self.params, grads)]
        outs = reshard_many([(g, self.bound, s.grad, s.stored, s.shape)
                             for g, s in zip(full, self.specs)], bucket_bytes=self.bucket_bytes,
                            cost_model=ONE_CALL_PER_STEP)
        return [o * s.grad_scale if s.grad_scale != 1 else o for o, s in zip(outs, self.specs)]


class _Gather(torch.autograd.Function):
    """Forward: the parameters stored -> use. Backward: their gradients grad -> stored."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *stored: Tensor) -> tuple[Tensor, ...]:
        ctx.call = call
        return tuple(call.gather_tensors(stored))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        call.regather.release()
        return (None, *call.reduce(grads))


def gather_params(bound: BoundMesh, specs: Sequence[ParamSpec], params: Sequence[Tensor], *,
                  bucket_bytes: int = BUCKET_BYTES) -> list[Tensor]:
    """The parameters in their use layouts (one collective per bucket); differentiable, with
    the gradients reduced to the stored layouts in backward (again one per bucket).

    >>> w_up, w_down = gather_params(bound, [spec_up, spec_down], [p_up, p_down])  # doctest: +SKIP
    """
    call = _Call(bound, specs, params, bucket_bytes)
    return list(_Gather.apply(call, *params))  # type: ignore[no-untyped-call]


# -- modules --------------------------------------------------------------------------------
class ShardedModule(nn.Module):
    """An nn.Module whose parameters are stored sharded under a recipe (base of meshcomm.nn).

    >>> class Scale(ShardedModule):                                    # doctest: +SKIP
    ...     def __init__(self, bound, recipe, w):
    ...         super().__init__(bound, recipe)
    ...         self.add_param("weight", "embed", w)    # stored "(fsdp embed)" under fsdp_tp
    ...     def forward(self, x):
    ...         return x * self.use("weight")           # gathered to "embed"

    `use(name)` is the parameter in its use layout: gathered by an enclosing `FullyShard`
    (bucketed with its other parameters) or, outside one, gathered alone.
    """

    def __init__(self, bound: BoundMesh, recipe: RecipeLike) -> None:
        super().__init__()
        self.bound = require_bound(bound, type(self).__name__)
        self.recipe = recipe
        self.specs: dict[str, ParamSpec] = {}
        self.in_use: dict[str, Tensor] = {}      # filled by FullyShard during its forward

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


def owned(module: nn.Module) -> Iterator[tuple[str, ShardedModule]]:
    """(qualified name, module) of `module` and its descendants, stopping at nested units."""
    def walk(prefix: str, m: nn.Module) -> Iterator[tuple[str, ShardedModule]]:
        if isinstance(m, ShardedModule):
            yield prefix, m
        for child_name, child in m.named_children():
            if not isinstance(child, FullyShard):
                yield from walk(f"{prefix}.{child_name}" if prefix else child_name, child)
    yield from walk("", module)


class FullyShard(nn.Module):
    """`module` run with its parameters gathered together for forward (one collective per
    bucket), their gradients reduced together in backward (FSDP).

    >>> block = mc.nn.FullyShard(Block(bound, "fsdp_tp", ...))      # doctest: +SKIP
    >>> block(x).sum().backward()     # doctest: +SKIP

    `reshard_after_forward`: drop the gathered parameters after forward and gather them
    again (once per unit) when backward first needs one; False keeps them until backward.
    Parameters of nested `FullyShard` units are theirs, not this unit's.
    """

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__()
        self.module = module
        self.reshard_after_forward = reshard_after_forward
        self.bucket_bytes = bucket_bytes
        meshes = {id(m.bound) for _, m in owned(module)}
        if len(meshes) > 1:
            raise MeshMismatchError("FullyShard: the modules of one unit must share one bound"
                                    " mesh; fix: wrap the modules of each mesh separately")

    def entries(self) -> list[tuple[str, ShardedModule, str]]:
        """(qualified parameter name, owning module, attribute) of every parameter of the unit."""
        return [(f"{path}.{attr}" if path else attr, m, attr)
                for path, m in owned(self.module) for attr in m.specs]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        entries = self.entries()
        if not entries:
            return self.module(*args, **kwargs)
        bound = entries[0][1].bound
        call = _Call(bound, [m.specs[a] for _, m, a in entries],
                     [getattr(m, a) for _, m, a in entries], self.bucket_bytes)
        used = call.remember(list(_Gather.apply(call, *call.params)))  # type: ignore[no-untyped-call]
        for (_, m, a), t in zip(entries, used):
            m.in_use[a] = t
        try:
            if self.reshard_after_forward and torch.is_grad_enabled():
                with torch.autograd.graph.saved_tensors_hooks(call.regather.pack,
                                                              call.regather.unpack):
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)
        finally:
            for _, m, a in entries:
                m.in_use.pop(a, None)
            call.regather.forget()

    def comms(self) -> list[Comm]:
        """Every parameter's gather, regather (when resharding after forward) and reduction."""
        return [c for name, m, a in self.entries()
                for c in m.specs[a].comms(name, regather=self.reshard_after_forward)]

    def buckets(self) -> tuple[int, int]:
        """(gather collectives, reduce collectives) per forward and backward, bucketed:
        one per collective shape and step (assuming each bucket fits `bucket_bytes`)."""
        specs = [m.specs[a] for _, m, a in self.entries()]
        return (_bucketed([s.gather_plan() for s in specs]),
                _bucketed([s.reduce_plan() for s in specs]))

    def explain(self, *, full: bool = False) -> str:
        """The unit's parameters, one row each (stored -> use, what forward and backward run),
        and the bucketed collective counts; with `full`, one line per plan and their tables."""
        entries = self.entries()
        if not entries:
            return "FullyShard: no sharded parameters"
        mesh = entries[0][1].bound.mesh
        title = f"FullyShard of {type(self.module).__name__} on {mesh!r}: {len(entries)} parameters"
        gathers, reduces = self.buckets()
        again = (f"{gathers} all_gather to gather them again, " if self.reshard_after_forward
                 else "none to gather (kept from forward), ")
        notes = ((f"bucketed: forward runs {gathers} all_gather for all the parameters; backward"
                  f" runs {again}{reduces} collective(s) for the gradients"),)
        if full:
            return format_comms(title, self.comms(), full=True, notes=notes)
        rows = [("parameter", "shape", "stored -> use", "forward", "backward")]
        for name, m, a in entries:
            spec = m.specs[a]
            gather = spec.gather_plan()
            back = [_kinds(gather)] if self.reshard_after_forward and gather.collectives else []
            scale = "" if spec.grad_scale == 1 else f", then x {spec.grad_scale:g}"
            back.append(_kinds(spec.reduce_plan()) + scale)
            rows.append((name, str(spec.shape), f'"{spec.stored}" -> "{spec.use}"',
                         _kinds(gather), ", ".join(back)))
        return "\n".join([title, *("  " + line for line in _columns(rows)),
                          *("  " + n for n in notes)])


def _kinds(p: Plan) -> str:
    """'all_gather(fsdp)', 'reduce_scatter avg(fsdp)' or '-' (no collective)."""
    return ", ".join(f"{s.kind}{' ' + s.op if s.op else ''}({', '.join(s.axes)})"
                     for s in p.collectives) or "-"


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _bucketed(plans: Sequence[Plan]) -> int:
    shapes = {step_shape(p) for p in plans if p.collectives}
    return sum(sum(1 for s in steps if s[0] != "local") for steps in shapes)
