"""`fully_shard`: FSDP on unmodified `nn.Module`s, with DTensor parameters.

`fully_shard(module, mesh)` turns the parameters `module` owns (those not owned by a
`fully_shard`ed submodule) into DTensor `nn.Parameter`s sharded along dim 0 over one mesh
axis: stored layout `"(dp d0) d1 ..."`, or `"(tp dp d0) ..."` / `"(dp d0) (tp d1)"` for a
parameter that tensor parallelism (`mc.nn.parallelize`) already split. `torch.optim`,
`clip_grad_norm_`, `state_dict()` and DCP see ordinary DTensors. Around the module's forward:

- before: one all_gather over the axis for all the unit's parameters (a flat buffer, rows
  padded to the largest shard as FSDP2 does), then the gathered tensors stand in for the
  parameters (the unit's `_parameters` entries) while forward runs;
- after: the DTensor parameters are back; with `reshard_after_forward` the gathered
  tensors autograd saved are dropped and gathered again when backward first needs them;
- backward: the unit's gradients are reduce_scattered (averaged over the axis) in one
  collective, issued asynchronously, and written to each parameter's `.grad` (a DTensor
  like the parameter) when backward ends.

Prefetch (on by default): the first iteration records the order units run; after that a
unit's forward issues the next unit's all_gather before computing, and the first use of a
unit's saved parameters in backward issues the gather of the unit backward reaches next.
Collectives are PyTorch functional collectives, waited on at first use, so they overlap
computation. `MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
gathers and computes in bfloat16 and reduces gradients in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from ..core.errors import MeshAxisError, MeshMismatchError, ShapeError
from ..core.layout import Layout
from ..core.reduce_ops import chunk_sizes
from ..executors.distributed import wire
from ..executors.distributed.bind import BoundMesh
from ..executors.local import run_slice, storage_key
from ..executors.steps import Wire
from ..interop.placements import from_placements, to_placements
from ..interop.runtime import (
    bind_device_mesh,
    global_shape,
    is_dtensor,
    placements_of,
    wrap,
)

UNIT_ATTR = "_meshcomm_fsdp_unit"


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of FSDP's communication and compute (None: the parameter's own dtype).

    `param_dtype`: the dtype parameters are gathered and computed in (the shards stay in
    their own dtype for the optimizer). `reduce_dtype`: the dtype gradients are reduced in;
    they are stored in the parameter's dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass
class _Param:
    """One parameter of a unit: where it lives, its layouts and its shard sizes.

    Everything a step needs is a number computed here, once: a step never looks at every
    position of the axis (`rows` is for reports only)."""

    module: nn.Module
    attr: str
    name: str
    param: nn.Parameter            # the DTensor parameter
    shape: tuple[int, ...]         # global shape
    use_shape: tuple[int, ...]     # gathered: the shape forward computes with
    rows: tuple[int, ...]          # dim-0 rows of each position along the axis
    stored: Layout
    use: Layout
    aliases: tuple[tuple[nn.Module, str], ...] = ()   # other places of a tied parameter

    def __post_init__(self) -> None:
        # torch.chunk rows: full chunks of `pad` rows, one shorter, then empty ones; so the
        # gathered rows are the first use_shape[0] of the n padded chunks laid end to end.
        self.pad = max(self.rows, default=0)
        self.inner = math.prod(self.use_shape[1:])
        self.even = all(r == self.pad for r in self.rows)


@dataclass
class _Pending:
    out: Tensor                    # the issued all_gather's result (waited on at use)


@dataclass
class _Saved:
    """A tensor autograd saved that is (a view of) a gathered parameter buffer."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Schedule:
    """Units in the order forward ran them (recorded in the first pass), and the state of
    the backward pass in flight."""

    def __init__(self) -> None:
        self.order: list[_Unit] = []
        self.position: dict[int, int] = {}        # id(unit) -> its index in `order`
        self.recording = True
        self.pending_reduce: list[tuple[_Unit, Tensor, bool]] = []   # (unit, out, replicas done)
        self.callback_queued = False

    def record(self, unit: _Unit) -> None:
        """The first forward records the order; a unit seen again ends the recording."""
        if id(unit) in self.position:
            self.recording = False
        else:
            self.position[id(unit)] = len(self.order)
            self.order.append(unit)

    def next_forward(self, unit: _Unit) -> _Unit | None:
        i = self.position.get(id(unit))
        if self.recording or i is None:
            return None
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def next_backward(self, unit: _Unit) -> _Unit | None:
        i = self.position.get(id(unit))
        return self.order[i - 1] if i else None




def _put_chunks(target: Tensor, rows: Tensor, pad: int) -> None:
    """Write `rows` (torch.chunk'ed into `target.shape[0]` chunks of at most `pad` rows) into
    `target` (chunks x pad x inner), the padding zeroed: at most four ops, whatever the
    number of chunks (full chunks, the short one, then the padding)."""
    n, total = target.shape[0], rows.shape[0]
    full, rest = divmod(total, pad)
    if full:
        target[:full].copy_(rows[:full * pad].view(full, pad, -1))
    if full < n:
        target[full, :rest].copy_(rows[full * pad:])
        target[full, rest:].zero_()
        target[full + 1:].zero_()


class _Unit:
    """A fully_shard'ed module's parameters and their communication."""

    def __init__(self, module: nn.Module, bound: BoundMesh, axis: str, params: list[_Param],
                 mp: MixedPrecision, reshard_after_forward: bool, prefetch: bool,
                 replicate: str | None = None) -> None:
        self.module, self.bound, self.axis, self.params = module, bound, axis, params
        self.mp, self.reshard_after_forward, self.prefetch = mp, reshard_after_forward, prefetch
        self.group = bound.group_name(axis)
        self.n = bound.mesh.axis_size(axis)
        self.pos = bound.mesh.coords(bound.rank)[axis]
        self.replicate = replicate       # HSDP: gradients also averaged over this axis
        self.rep_group = bound.group_name(replicate) if replicate else None
        self.n_rep = bound.mesh.axis_size(replicate) if replicate else 1
        self.rep_pos = bound.mesh.coords(bound.rank)[replicate] if replicate else 0
        self.width = sum(p.pad * p.inner for p in params)   # a position's padded elements
        self.sync = True                 # False: accumulate unsharded gradients, no reduce
        self.unsharded_grads: list[Tensor] | None = None
        self.pending: _Pending | None = None
        self.regathered: list[Tensor] | None = None
        self.storages: dict[int, int] = {}       # storage_key -> key (see _buffers)
        self.hooks: Any = None
        self.schedule = _Schedule()      # shared by every unit of one model (see fully_shard)
        self.sent_bytes = 0
        self.received_bytes = 0

    # -- all_gather ------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mp.param_dtype or self.params[0].param.dtype

    def issue_gather(self) -> _Pending:
        """Start the unit's all_gather (returns at once; waited on in `finish_gather`)."""
        dtype = self.compute_dtype
        first = self.params[0].param.to_local()
        buf = torch.empty(self.width, dtype=dtype, device=first.device)
        off = 0
        for p in self.params:      # each shard copied in, its padding rows zeroed: 2 ops
            local = p.param.to_local().detach().reshape(-1)
            buf[off:off + local.numel()].copy_(local)
            if local.numel() < p.pad * p.inner:
                buf[off + local.numel():off + p.pad * p.inner].zero_()
            off += p.pad * p.inner
        self._record(Wire("all_gather", self.n, self.pos, buf.numel(), buf.numel() * self.n),
                     buf.element_size())
        return _Pending(wire.call(funcol.all_gather_single, buf, 0, self.group, wait=False))

    def _record(self, call: Wire, itemsize: int) -> None:
        """Count one collective call's bytes by the executor's formulas (`Wire`)."""
        self.sent_bytes += call.sent * itemsize
        self.received_bytes += call.received * itemsize

    def finish_gather(self, pending: _Pending) -> list[Tensor]:
        """The gathered parameters (views of the gathered buffer where shards are even)."""
        flat = wire.waited(pending.out).view(self.n, -1)
        out, off = [], 0
        for p in self.params:
            width = p.pad * p.inner
            block = flat[:, off:off + width].reshape(self.n * p.pad, p.inner)
            off += width
            full = block if p.even else block[:p.use_shape[0]]    # drop the padding rows
            out.append(full.view(p.use_shape))
        return out

    def gather(self) -> list[Tensor]:
        pending, self.pending = self.pending, None
        return self.finish_gather(pending or self.issue_gather())

    def prefetch_gather(self) -> None:
        if self.pending is None and self.params:
            self.pending = self.issue_gather()

    # -- saved tensors: drop the gathered parameters after forward, gather them again ---
    def _remember(self, tensors: Sequence[Tensor]) -> None:
        self.storages = {}
        for i, t in enumerate(tensors):
            self.storages.setdefault(storage_key(t), i)

    def pack(self, t: Tensor) -> Any:
        key = self.storages.get(storage_key(t)) if t.numel() else None
        if key is None:
            return t
        return _Saved(key, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved      # type: ignore[no-any-return]
        if self.regathered is None:
            self.regathered = self.gather()
            after = self.schedule.next_backward(self)
            if self.prefetch and after is not None and after.reshard_after_forward:
                after.prefetch_gather()
        base = self.regathered[saved.key]
        return base.as_strided(saved.size, saved.stride, saved.offset)

    # -- reduce_scatter -----------------------------------------------------------------
    def accumulate(self, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """`grads` plus the unsharded gradients kept by backward passes without sync."""
        dtype = self.mp.reduce_dtype or self.params[0].param.dtype
        out = [torch.zeros(p.use_shape, dtype=dtype, device=p.param.device) if g is None
               else g.to(dtype) for p, g in zip(self.params, grads)]
        if self.unsharded_grads is not None:
            out = [a + b for a, b in zip(out, self.unsharded_grads)]
        self.unsharded_grads = None
        return out

    def issue_reduce(self, grads: Sequence[Tensor]) -> Tensor:
        """Start the reduce_scatter of `grads` (from `accumulate`: in the reduce dtype)."""
        n = self.n
        rows_out = torch.empty((n, self.width), dtype=grads[0].dtype, device=grads[0].device)
        off = 0
        for p, g in zip(self.params, grads):   # each gradient written into its column block
            if p.pad:
                _put_chunks(rows_out[:, off:off + p.pad * p.inner].view(n, p.pad, p.inner),
                            g.reshape(p.use_shape[0], p.inner), p.pad)
            off += p.pad * p.inner
        buf = rows_out.reshape(-1)
        self._record(Wire("reduce_scatter", self.n, self.pos, buf.numel(),
                          buf.numel() // self.n), buf.element_size())
        return wire.call(funcol.reduce_scatter_single, buf, "sum", 0, self.group, wait=False)

    def issue_replica_reduce(self, out: Tensor) -> Tensor:
        """HSDP: the reduce_scatter's shard summed over the replicate axis (waits for the
        reduce_scatter, returns the all_reduce at once); without HSDP, `out` itself."""
        if self.rep_group is None:
            return out
        flat = wire.waited(out)
        self._record(Wire("all_reduce", self.n_rep, self.rep_pos, flat.numel(), flat.numel()),
                     flat.element_size())
        return wire.call(funcol.all_reduce, flat, "sum", self.rep_group, wait=False)

    def finish_reduce(self, out: Tensor) -> None:
        flat = wire.waited(out)
        off = 0
        for p in self.params:
            width = p.pad * p.inner
            rows = p.rows[self.pos]
            local = flat[off:off + rows * p.inner].view(p.param.to_local().shape)
            off += width
            local = local.to(p.param.dtype) / (self.n * self.n_rep)
            grad = wrap(local, p.param.device_mesh, p.param.placements, p.shape)
            if p.param.grad is None:
                p.param.grad = grad
            else:
                p.param.grad += grad


def _finish_backward(schedule: _Schedule) -> None:
    pending, schedule.pending_reduce = schedule.pending_reduce, []
    schedule.callback_queued = False
    outs = [out if done else unit.issue_replica_reduce(out) for unit, out, done in pending]
    for (unit, _, _), out in zip(pending, outs):
        unit.finish_reduce(out)
    for unit in schedule.order:     # a prefetch no forward used would be stale next step
        unit.regathered = None
        if unit.pending is not None:
            wire.waited(unit.pending.out)
            unit.pending = None


class _Gathered(torch.autograd.Function):
    """Forward: the unit's gathered parameters (already gathered: they are passed through).
    Backward: the unit's gradients reduce_scattered, written to `.grad` when backward ends."""

    @staticmethod
    def forward(ctx: Any, unit: _Unit, gathered: list[Tensor], *params: Tensor
                ) -> tuple[Tensor, ...]:
        ctx.unit = unit
        return tuple(t.view_as(t) for t in gathered)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        unit: _Unit = ctx.unit
        unit.regathered = None     # every use of the saved parameters is behind us
        schedule = unit.schedule
        if not schedule.callback_queued:
            schedule.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: _finish_backward(schedule))
        grads_now = unit.accumulate(grads)
        if not unit.sync:          # gradient accumulation: keep them unsharded, send nothing
            unit.unsharded_grads = grads_now
            return (None, None) + (None,) * len(unit.params)
        if schedule.pending_reduce and not schedule.pending_reduce[-1][2]:
            # HSDP: the previous unit's reduce_scatter had this unit's backward to finish;
            # its all_reduce over the replicas now runs while the rest of backward computes
            before, out, _ = schedule.pending_reduce[-1]
            schedule.pending_reduce[-1] = (before, before.issue_replica_reduce(out), True)
        schedule.pending_reduce.append((unit, unit.issue_reduce(grads_now),
                                        unit.rep_group is None))
        return (None, None) + (None,) * len(unit.params)


# -- hooks ------------------------------------------------------------------------------------
def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
    unit: _Unit = getattr(module, UNIT_ATTR)
    schedule = unit.schedule
    if schedule.recording:
        schedule.record(unit)
    gathered = unit.gather() if unit.params else []
    after = schedule.next_forward(unit)
    if unit.prefetch and after is not None:
        after.prefetch_gather()
    params = [p.param for p in unit.params]
    if params and torch.is_grad_enabled() and any(p.requires_grad for p in params):
        used = list(_Gathered.apply(unit, gathered, *params))  # type: ignore[no-untyped-call]
    else:
        used = gathered
    unit._remember(used)
    for p, t in zip(unit.params, used):
        p.module._parameters[p.attr] = t      # type: ignore[assignment]
        for m, a in p.aliases:                # a tied parameter: one gathered tensor
            m._parameters[a] = t              # type: ignore[assignment]
    if unit.reshard_after_forward and torch.is_grad_enabled():
        unit.hooks = torch.autograd.graph.saved_tensors_hooks(unit.pack, unit.unpack)
        unit.hooks.__enter__()
    dtype = unit.mp.param_dtype
    if dtype is None:
        return None
    # as FSDP2: floating-point inputs of the unit computed in param_dtype
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _post_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    unit: _Unit = getattr(module, UNIT_ATTR)
    if unit.hooks is not None:
        unit.hooks.__exit__(None, None, None)
        unit.hooks = None
    for p in unit.params:
        p.module._parameters[p.attr] = p.param
        for m, a in p.aliases:
            m._parameters[a] = p.param
    unit.storages = {}
    return output


# -- fully_shard ---------------------------------------------------------------------------
def fully_shard(module: nn.Module, mesh: Any, *, axis: str | None = None,
                reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecision | None = None, prefetch: bool = True,
                replicate: str | None = None) -> nn.Module:
    """Shard the parameters `module` owns over mesh axis `axis` and gather them around its
    forward (FSDP); returns `module` (changed in place), as FSDP2's `fully_shard`.

    >>> for block in model.layers:                                  # doctest: +SKIP
    ...     mc.nn.fully_shard(block, bound)
    >>> mc.nn.fully_shard(model, bound)                             # doctest: +SKIP

    `mesh`: a BoundMesh (`mc.init_mesh`) or a torch DeviceMesh. `axis`: the mesh axis to
    shard over (default: the mesh's only axis, else "dp" or "fsdp"). Apply it to inner
    modules first (each becomes one unit: one all_gather and one reduce_scatter), then to
    the root, which takes the parameters no unit took. `reshard_after_forward` (default:
    True, False for a module that holds other units) frees the gathered parameters after
    forward and gathers them again in backward. `mp_policy`: `MixedPrecision`. `prefetch`:
    issue the next unit's all_gather before computing this one (forward and backward).
    `replicate`: HSDP, a second mesh axis over which the shards are replicated and the
    gradients averaged too (one all_reduce of the shard per unit after its reduce_scatter).
    Parameters on the meta device stay on it (shard-sized): `model.to_empty(device=...)`
    then `mc.nn.init_shards(model, fn)` fills them.
    """
    bound = _bound(mesh)
    axis = _axis(bound, axis)
    if replicate is not None and (replicate not in bound.mesh.axis_names or replicate == axis):
        raise MeshAxisError(f"fully_shard(replicate={replicate!r}): not an axis of"
                            f" {bound.mesh!r} other than axis={axis!r}; fix: one of"
                            f" {[a for a in bound.mesh.axis_names if a != axis]}")
    if not bound.in_mesh:
        raise MeshMismatchError(
            f"fully_shard: rank {bound.rank} is not in {bound.mesh!r} (its ranks are"
            f" {list(bound.mesh.ranks)}), so it holds no shard and cannot run the model;"
            " fix: build and shard the model on the mesh's ranks only (if bound.in_mesh: ...)")
    if hasattr(module, UNIT_ATTR):
        raise MeshMismatchError(f"fully_shard: {type(module).__name__} is already sharded;"
                                " fix: call fully_shard once per module")
    has_units = any(hasattr(m, UNIT_ATTR) for m in module.modules() if m is not module)
    if reshard_after_forward is None:
        reshard_after_forward = not has_units
    owned, tied = _owned_params(module)
    params = [_shard_param(bound, axis, m, attr, name, p, replicate, tied.get(id(p), ()),
                           module) for m, attr, name, p in owned]
    unit = _Unit(module, bound, axis, params, mp_policy or MixedPrecision(),
                 reshard_after_forward, prefetch, replicate)
    setattr(module, UNIT_ATTR, unit)
    if has_units:   # the units below and this one: one model, one recorded order
        shared = _Schedule()
        for m in module.modules():
            if hasattr(m, UNIT_ATTR):
                getattr(m, UNIT_ATTR).schedule = shared
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward, with_kwargs=True)
    return module


def _bound(mesh: Any) -> BoundMesh:
    if isinstance(mesh, BoundMesh):
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return bind_device_mesh(mesh)
    raise MeshMismatchError(f"fully_shard needs a BoundMesh (mc.init_mesh) or a DeviceMesh,"
                            f" got {type(mesh).__name__}")


def _axis(bound: BoundMesh, axis: str | None) -> str:
    names = bound.mesh.axis_names
    if axis is None:
        found = names if len(names) == 1 else [a for a in ("dp", "fsdp") if a in names]
        if len(found) != 1:
            raise MeshAxisError(f"fully_shard: which axis of {bound.mesh!r} shards the"
                                f" parameters? fix: pass axis= one of {list(names)}")
        axis = found[0]
    if axis not in names:
        raise MeshAxisError(f"fully_shard(axis={axis!r}): not an axis of {bound.mesh!r};"
                            f" fix: one of {list(names)}")
    return axis


Tied = dict[int, tuple[tuple[nn.Module, str], ...]]


def _owned_params(module: nn.Module) -> tuple[list[tuple[nn.Module, str, str, nn.Parameter]],
                                              Tied]:
    """(module, attribute, qualified name, parameter) of every parameter `module` owns, not
    those under a submodule that is a unit already; and, per parameter, the other
    (module, attribute) places that hold the same tensor (tied weights: one unit shards it
    once and puts it in every place). A tensor tied to one another unit manages is refused,
    as FSDP2 refuses it."""
    out, seen, tied = [], {}, {}
    units: dict[int, str] = {}          # id(module of a unit below) -> its qualified name

    def elsewhere(p: Any) -> str | None:
        """Where another unit holds `p` (a tensor it replaced by its shard), or None."""
        holder = getattr(p, "_meshcomm_sharded_as", None)
        if holder is None:
            return None
        owner, name = holder
        return f"{units[owner]}.{name}" if owner in units else f"{name} of another unit"

    def walk(prefix: str, m: nn.Module) -> None:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            name = f"{prefix}{attr}"
            taken = seen.get(id(p)) or elsewhere(p)
            if taken is not None and (taken.endswith("(unit)") or id(p) not in seen):
                raise ShapeError(
                    f"fully_shard: parameter {name} is the same tensor as {taken}, which"
                    " another fully_shard unit manages already (tied weights across units);"
                    " fix: put every module that holds it in one unit (fully_shard their"
                    " common parent, not each of them)")
            if is_dtensor(p) and getattr(p, "_meshcomm_fsdp", False):
                raise ShapeError(f"fully_shard: parameter {name} is sharded by another unit"
                                 " already (tied weights?); fix: put every module that holds"
                                 " it in one unit")
            if taken is not None:            # tied inside this unit: sharded once
                tied[id(p)] = (*tied.get(id(p), ()), (m, attr))
                continue
            seen[id(p)] = name
            out.append((m, attr, name, p))
        for child_name, child in m._modules.items():
            if child is not None and not hasattr(child, UNIT_ATTR):
                walk(f"{prefix}{child_name}.", child)
            elif child is not None:
                units[id(child)] = f"{prefix}{child_name}"
                for q in child.parameters():
                    seen.setdefault(id(q), f"{prefix}{child_name}.(unit)")

    walk("", module)
    return out, tied


def _names(ndim: int) -> list[str]:
    return [f"d{i}" for i in range(ndim)]


def _shard_param(bound: BoundMesh, axis: str, module: nn.Module, attr: str, name: str,
                 p: nn.Parameter, replicate: str | None = None,
                 aliases: tuple[tuple[nn.Module, str], ...] = (),
                 unit_module: nn.Module | None = None) -> _Param:
    """`p` as a DTensor parameter sharded along dim 0 over `axis` (on top of the tensor
    parallel split a DTensor `p` already has)."""
    mesh = bound.mesh
    if p.dim() == 0:
        raise ShapeError(f"fully_shard: parameter {name} is a scalar; FSDP shards dim 0."
                         " fix: make it shape (1,) or keep it outside the unit")
    names = _names(p.dim())
    if is_dtensor(p):
        if bound.mesh != type(mesh).from_device_mesh(p.device_mesh):
            raise MeshMismatchError(f"fully_shard: parameter {name} is a DTensor on"
                                    f" {type(mesh).from_device_mesh(p.device_mesh)!r}, not on"
                                    f" {mesh!r}; fix: parallelize on the same mesh")
        shape = global_shape(p)
        use = from_placements(mesh, shape, placements_of(p), names=" ".join(names))
        for taken in (axis, replicate):
            if taken is not None and (taken in use.sharded_axes(mesh) or use.partial_axes):
                raise ShapeError(f"fully_shard: parameter {name} is already split over"
                                 f' {taken!r} ("{use}"); fix: shard it over another axis')
        full = p.to_local()
    else:
        shape, use, full = tuple(p.shape), Layout(" ".join(names)), p.detach()
    use_shape = tuple(full.shape)
    first = use.dims[0].factors
    stored = Layout(" ".join(
        ["(" + " ".join([f.name for f in first[:-1]] + [axis, first[-1].name]) + ")"]
        + [str(d) for d in use.dims[1:]]))
    n = mesh.axis_size(axis)
    rows = chunk_sizes(use_shape[0], n)
    mine = stored.local_shape(mesh, shape, bound.rank) if bound.in_mesh else None
    me = mesh.coords(bound.rank)[axis]
    if mine is None or mine[0] != rows[me] or tuple(mine[1:]) != use_shape[1:]:
        raise ShapeError(
            f"fully_shard: parameter {name} of shape {shape} (\"{use}\") cannot be split"
            f" evenly enough over {axis!r}: its shards would not be consecutive rows."
            f" fix: make dim 0 ({shape[0]}) divisible by the sizes of the axes that split it")
    start = sum(rows[:me])
    if full.is_meta:
        local = torch.empty((rows[me], *use_shape[1:]), dtype=full.dtype, device="meta")
    else:
        local = full[start:start + rows[me]].detach().clone()
    dm = p.device_mesh if is_dtensor(p) else bound.device_mesh
    dt = wrap(local, dm, to_placements(mesh, shape, stored), shape)
    param = nn.Parameter(dt, requires_grad=p.requires_grad)
    param._meshcomm_fsdp = True      # type: ignore[attr-defined]
    # the tensor replaced here: a later unit that meets it (a tie across units) refuses it
    p._meshcomm_sharded_as = (id(unit_module), name)   # type: ignore[attr-defined]
    module._parameters[attr] = param
    for m, a in aliases:             # tied: every place holds the one sharded parameter
        m._parameters[a] = param
    return _Param(module, attr, name, param, shape, use_shape, rows, stored, use, aliases)


# -- what runs when ---------------------------------------------------------------------------
def fsdp_schedule(module: nn.Module) -> str:
    """The FSDP schedule of `module`'s units, one line per collective, in the order they are
    issued, and what each overlaps (the order is the one the first forward recorded)::

        forward   all_gather      layers.1   96.0 KiB  issued before layers.0 computes
        backward  reduce_scatter  layers.1   96.0 KiB  runs while layers.0's backward computes
    """
    from ..planner.explain import format_bytes

    units = {id(getattr(m, UNIT_ATTR)): name or "(root)" for name, m in module.named_modules()
             if hasattr(m, UNIT_ATTR)}
    root = getattr(module, UNIT_ATTR, None)
    recorded = root.schedule.order if root is not None and not root.schedule.recording else []
    order = [u for u in recorded if id(u) in units] or [
        getattr(m, UNIT_ATTR) for _, m in module.named_modules() if hasattr(m, UNIT_ATTR)]
    order = [u for u in order if u.params]
    if not order:
        return "no fully_shard units with parameters"
    rows = []

    def size(u: _Unit, dtype: torch.dtype) -> str:
        per_rank = sum(p.pad * p.inner for p in u.params) * dtype.itemsize
        return format_bytes(per_rank * (u.n - 1))

    for i, u in enumerate(order):
        name = units[id(u)]
        prev = units[id(order[i - 1])] if i else None
        shared = bool(i) and order[i - 1].schedule is u.schedule   # one model: prefetched
        when = (f"issued before {prev} computes (prefetch)" if u.prefetch and prev and shared
                else "issued when it starts, waited on at once")
        rows.append(("forward", "all_gather", name, size(u, u.compute_dtype), when))
    for i in range(len(order) - 1, -1, -1):
        u, name = order[i], units[id(order[i])]
        nxt = units[id(order[i + 1])] if i + 1 < len(order) else None
        if u.reshard_after_forward:
            when = (f"issued while {nxt}'s backward computes (prefetch)" if u.prefetch and nxt
                    and order[i + 1].reshard_after_forward
                    and order[i + 1].schedule is u.schedule else "issued when its backward starts")
            rows.append(("backward", "all_gather", name, size(u, u.compute_dtype), when))
        before = units[id(order[i - 1])] if i else None
        dtype = u.mp.reduce_dtype or u.params[0].param.dtype
        rows.append(("backward", "reduce_scatter", name, size(u, dtype),
                     f"runs while {before}'s backward computes" if before
                     else "waited on when backward ends"))
        if u.replicate:
            shard = sum(p.pad * p.inner for p in u.params) * dtype.itemsize
            rows.append(("backward", f"all_reduce({u.replicate})", name,
                         format_bytes(2 * shard * (u.n_rep - 1) // u.n_rep),
                         f"issued with {before}'s reduce_scatter, runs while backward goes on"
                         if before else "issued when backward ends"))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
                     for r in rows)


def set_requires_gradient_sync(module: nn.Module, requires: bool) -> nn.Module:
    """Turn gradient reduction of every fully_shard unit in `module` off or back on (as
    FSDP2's `set_requires_gradient_sync`): gradient accumulation over micro-batches.

    With `requires=False`, backward sends nothing: each unit adds its unsharded gradients to
    a buffer it keeps (the unit's full parameter size, per rank). The next backward with
    `requires=True` adds the buffer to its gradients and reduce_scatters the sum once, so
    `.grad` gets the average over ranks of the sum over micro-batches. Returns `module`.
    """
    units = [getattr(m, UNIT_ATTR) for m in module.modules() if hasattr(m, UNIT_ATTR)]
    if not units:
        raise MeshMismatchError(f"set_requires_gradient_sync: {type(module).__name__} has no"
                                " fully_shard units; fix: call mc.nn.fully_shard first")
    for unit in units:
        unit.sync = bool(requires)
    return module


# -- meta-device models: fill each rank's shards -----------------------------------------------
def init_shards(module: nn.Module, fn: Callable[[str, tuple[int, ...], tuple[slice, ...]], Tensor]
                ) -> nn.Module:
    """Fill every DTensor parameter's local shard with `fn(name, global_shape, index)`, where
    `index` is this rank's block of the global tensor as one slice per dim: the function
    computes only this rank's values (a model built on the meta device never exists whole).

    >>> mc.nn.init_shards(model, lambda name, shape, index: torch.zeros(shape)[index])  # doctest: +SKIP

    Call it after `model.to_empty(device=...)`. Plain (unsharded) parameters get
    `fn(name, shape, full index)`. Returns `module`.
    """
    for name, p in module.named_parameters():
        if is_dtensor(p):
            mesh = type(_bound_mesh_of(p)).from_device_mesh(p.device_mesh)
            layout = from_placements(mesh, global_shape(p), placements_of(p))
            index = _block(layout, mesh, global_shape(p), _rank())
            local = p.to_local()
        else:
            index, local = tuple(slice(0, n) for n in p.shape), p
        values = fn(name, tuple(global_shape(p) if is_dtensor(p) else p.shape), index)
        if tuple(values.shape) != tuple(local.shape):
            raise ShapeError(f"init_shards: fn gave shape {tuple(values.shape)} for {name},"
                             f" whose block {index} has shape {tuple(local.shape)}; fix: return"
                             " the values of exactly that block")
        with torch.no_grad():
            local.copy_(values)
    return module


def _bound_mesh_of(p: Any) -> Any:
    from ..core.mesh import Mesh

    return Mesh.from_device_mesh(p.device_mesh)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _block(layout: Layout, mesh: Any, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """This rank's block of `layout` as slices (the layout's indices must be one run per dim)."""
    out = []
    for dim, ix in enumerate(layout.indices(mesh, shape, rank)):
        s = run_slice(ix)
        if s is None:
            raise ShapeError(f"init_shards: dim {dim} of \"{layout}\" gives rank {rank} rows"
                             " that are not one run; fn gets slices only for blocks")
        out.append(s)
    return tuple(out)
