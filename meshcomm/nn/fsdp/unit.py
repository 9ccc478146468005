"""A fully_shard unit's communication: two prepared sets of plans of the engine
(`meshcomm.executors.distributed.prepare`), made once at wrap time from each parameter's
`ParamSpec`: stored -> use (forward's gather) and grad -> stored (backward's reduction),
each one bucket of padded rows as FSDP2 runs them (one all_gather; one reduce_scatter, then
HSDP's all_reduce of the shard over the replicas), a plan of another shape in a bucket of
its own. A step issues them and waits on them later; the bytes are those the engine's calls
measure. A step's work here is a few tensor ops per parameter, whatever the world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...executors.distributed import Handle, prepare
from ...runtime.bind import BoundMesh
from .param import MixedPrecision, Param
from .regather import Regather
from .schedule import Schedule


class Unit:
    """A fully_shard'ed module's parameters and their communication."""

    def __init__(self, module: nn.Module, bound: BoundMesh, axis: str, params: list[Param],
                 mp: MixedPrecision, reshard_after_forward: bool, prefetch: bool,
                 schedule: Schedule[Unit], replicate: tuple[str, ...] = ()) -> None:
        self.module, self.bound, self.axis, self.params = module, bound, axis, params
        self.mp, self.reshard_after_forward, self.prefetch = mp, reshard_after_forward, prefetch
        self.replicate = replicate       # HSDP: gradients also averaged over these axes
        self.sync = True                 # False: accumulate unsharded gradients, no reduce
        self.unsharded_grads: list[Tensor] | None = None
        self.kept: list[Tensor] | None = None   # gathered, kept to backward (no reshard)
        self.holding = False             # `hold()`: one gather serves every use until release
        self.held: list[Tensor] | None = None   # the gathered parameters while holding
        self.regather = Regather(self)   # the saved-tensor hooks (regather.py)
        self.hooks: Any = None
        self.schedule = schedule         # shared by every unit of one model (see fully_shard)
        self.sent_bytes = 0              # measured by the engine's calls (`add`)
        self.received_bytes = 0
        gathers = [p.spec.gather_plan(self.compute_dtype) for p in params]
        self.gathers = prepare(gathers, bound, pad_rows=True)
        self.reduces = prepare([p.spec.reduce_plan(self.reduce_dtype) for p in params], bound,
                               pad_rows=True)
        self.moved = [i for i, g in enumerate(gathers) if g.collectives]   # really gathered
        self.scales = [p.spec.grad_scale for p in params]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mp.param_dtype or (self.params[0].param.dtype if self.params
                                       else torch.float32)

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mp.reduce_dtype or (self.params[0].param.dtype if self.params
                                        else torch.float32)

    def add(self, kind: str, axes: tuple[str, ...], send_bytes: int, recv_bytes: int) -> None:
        """One collective call of the unit, as the engine measured it (its byte trace)."""
        self.sent_bytes += send_bytes
        self.received_bytes += recv_bytes

    # -- gather ------------------------------------------------------------------------
    def issue_gather(self) -> Handle:
        """Start the unit's gather (returns at once; waited on in `finish_gather`)."""
        return self.gathers.issue([p.local() for p in self.params],
                                  trace=self)  # type: ignore[arg-type]

    def finish_gather(self, issued: Handle) -> list[Tensor]:
        """The gathered parameters (views of the gathered buffer where shards are even)."""
        return issued.wait()  # type: ignore[return-value]

    def gather(self) -> list[Tensor]:
        """The gathered parameters: the gather issued ahead (prefetched), else one now;
        while holding, the ones held (gathered at the first use after `hold()`)."""
        if self.held is not None:
            return self.held
        pending = self.schedule.take(self)
        gathered = self.finish_gather(pending if isinstance(pending, Handle)
                                      else self.issue_gather())
        if self.holding:
            self.held = gathered
        return gathered

    def prefetch_gather(self) -> None:
        """Issue the gather now (once), for `gather` to finish when the unit runs (nothing
        while the unit holds its gathered parameters)."""
        if self.params and self.held is None:
            self.schedule.issue_ahead(self, self.issue_gather)

    def hold(self) -> None:
        """From now on the unit gathers once and keeps what it gathered: every later forward
        uses it, backward uses the tensors autograd saved (no gather again), until
        `release()`. A pipeline stage with `gather="step"` holds its units for one step."""
        self.holding = True

    def release(self) -> None:
        """Stop holding and free the held gathered parameters (the next use gathers)."""
        self.holding, self.held, self.kept = False, None, None
        self.regather.release()

    @property
    def reshards(self) -> bool:
        """Whether forward frees the gathered parameters for backward to gather again:
        `reshard_after_forward`, unless the unit holds them."""
        return self.reshard_after_forward and not self.holding

    # -- reduce ------------------------------------------------------------------------
    def accumulate(self, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """`grads` plus the unsharded gradients kept by backward passes without sync."""
        dtype = self.reduce_dtype
        out = [torch.zeros(p.use_shape, dtype=dtype, device=p.param.device) if g is None
               else g.to(dtype) for p, g in zip(self.params, grads)]
        if self.unsharded_grads is not None:
            out = [a + b for a, b in zip(out, self.unsharded_grads)]
        self.unsharded_grads = None
        return out

    def issue_reduce(self, grads: Sequence[Tensor]) -> Handle:
        """Start the first step of the reduction of `grads` (from `accumulate`): the
        reduce_scatter; HSDP's all_reduce waits for `Handle.advance()` (or the end)."""
        return self.reduces.issue(list(grads), trace=self, steps=1)  # type: ignore[arg-type]

    def finish_reduce(self, handle: Handle) -> None:
        """Each parameter's gradient, reduced (an avg divided once for the unit), times its
        grad_scale, added to its `.grad` (as a DTensor like the parameter)."""
        for p, g, scale in zip(self.params, handle.wait(), self.scales):
            assert g is not None, f"{p.name}: no reduced gradient on this rank"
            p.set_grad(g if scale == 1 else g * scale)
