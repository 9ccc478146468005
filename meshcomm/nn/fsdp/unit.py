"""A fully_shard unit's communication: one all_gather of all its parameters (copy-in: one
`_foreach_copy_` into one buffer, each shard padded to the largest; copy-out: the gathered
rows), one reduce_scatter of its gradients (copy-in: a pad per short parameter and one
concatenation), and HSDP's all_reduce of the shard over the replicas. Every call goes
through the executor's wire module, and its bytes are those of the `Wire` the call
measured. A step's work here is a few tensor ops per parameter, whatever the world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...executors.distributed import wire
from ...executors.steps import Wire
from ...interop.runtime import like
from ...runtime.bind import BoundMesh
from .param import MixedPrecision, Param
from .regather import Regather
from .schedule import Schedule


@dataclass
class Pending:
    out: Tensor                    # the issued all_gather's result (waited on at use)


class Unit:
    """A fully_shard'ed module's parameters and their communication."""

    def __init__(self, module: nn.Module, bound: BoundMesh, axis: str, params: list[Param],
                 mp: MixedPrecision, reshard_after_forward: bool, prefetch: bool,
                 schedule: Schedule[Unit], replicate: str | None = None) -> None:
        self.module, self.bound, self.axis, self.params = module, bound, axis, params
        self.mp, self.reshard_after_forward, self.prefetch = mp, reshard_after_forward, prefetch
        self.n = bound.mesh.axis_size(axis)
        self.pos = bound.mesh.coords(bound.rank)[axis]
        self.group = wire.Group(bound.group_name(axis), self.n, self.pos)
        self.replicate = replicate       # HSDP: gradients also averaged over this axis
        self.n_rep = bound.mesh.axis_size(replicate) if replicate else 1
        self.rep_group = wire.Group(bound.group_name(replicate), self.n_rep,
                                    bound.mesh.coords(bound.rank)[replicate]) if replicate else None
        self.width = sum(p.pad * p.inner for p in params)   # a position's padded elements
        self.offsets = [0, *itertools.accumulate(p.pad * p.inner for p in params)][:-1]
        self.short = any(p.rows[self.pos] < p.pad for p in params)   # padding to zero
        self.sync = True                 # False: accumulate unsharded gradients, no reduce
        self.unsharded_grads: list[Tensor] | None = None
        self.kept: list[Tensor] | None = None   # gathered, kept to backward (no reshard)
        self.regather = Regather(self)   # the saved-tensor hooks (regather.py)
        self.hooks: Any = None
        self.schedule = schedule         # shared by every unit of one model (see fully_shard)
        self.sent_bytes = 0
        self.received_bytes = 0

    # -- all_gather ------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mp.param_dtype or self.params[0].param.dtype

    def issue_gather(self) -> Pending:
        """Start the unit's all_gather (returns at once; waited on in `finish_gather`)."""
        dtype = self.compute_dtype
        locals_ = [p.param.to_local().detach().reshape(-1) for p in self.params]
        buf = torch.empty(self.width, dtype=dtype, device=locals_[0].device)
        if self.short:               # some shard of this rank is short: zero its padding
            buf.zero_()
        # every shard copied (and cast) into its place in one op, as FSDP2's copy-in
        torch._foreach_copy_([buf[o:o + t.numel()] for o, t in zip(self.offsets, locals_)],
                             locals_)
        out, call = wire.all_gather(buf, self.group, wait=False)
        self._record(call, buf.element_size())
        return Pending(out)

    def _record(self, call: Wire, itemsize: int) -> None:
        """Count one collective call's bytes, as the call measured them (`Wire`)."""
        self.sent_bytes += call.sent * itemsize
        self.received_bytes += call.received * itemsize

    def finish_gather(self, pending: Pending) -> list[Tensor]:
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
        """The gathered parameters: the all_gather issued ahead (prefetched), else one now."""
        pending = self.schedule.take(self)
        return self.finish_gather(pending if isinstance(pending, Pending)
                                  else self.issue_gather())

    def prefetch_gather(self) -> None:
        """Issue the all_gather now (once), for `gather` to finish when the unit runs."""
        if self.params:
            self.schedule.issue_ahead(self, self.issue_gather)

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
        # n chunks of each gradient (torch.chunk rows: a prefix of n padded chunks), laid out
        # position by position: a pad for each short parameter, one concatenation
        columns = []
        for p, g in zip(self.params, grads):
            flat = g.reshape(-1)
            if not p.even:
                flat = F.pad(flat, (0, (self.n * p.pad - p.use_shape[0]) * p.inner))
            columns.append(flat.view(self.n, p.pad * p.inner))
        buf = torch.cat(columns, dim=1).reshape(-1)
        out, call = wire.reduce_scatter(buf, "sum", self.group, wait=False)
        self._record(call, buf.element_size())
        return out

    def issue_replica_reduce(self, out: Tensor) -> Tensor:
        """HSDP: the reduce_scatter's shard summed over the replicate axis (waits for the
        reduce_scatter, returns the all_reduce at once); without HSDP, `out` itself."""
        if self.rep_group is None:
            return out
        flat = wire.waited(out)
        reduced, call = wire.all_reduce(flat, "sum", self.rep_group, wait=False)
        self._record(call, flat.element_size())
        return reduced

    def finish_reduce(self, out: Tensor) -> None:
        """Each parameter's gradient: its rows of the reduced buffer, averaged (one division
        for the unit), as a DTensor like the parameter (views where no cast is needed)."""
        flat = wire.waited(out).div_(self.n * self.n_rep)
        off = 0
        for p in self.params:
            local = flat[off:off + p.rows[self.pos] * p.inner].view(p.local_shape)
            off += p.pad * p.inner
            grad = like(local.to(p.param.dtype), p.param)
            if p.param.grad is None:
                p.param.grad = grad
            else:
                p.param.grad += grad
