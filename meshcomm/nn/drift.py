"""Check mode's watch on replicated parameters: no silent drift under tensor parallelism.

A parameter that `parallelize` leaves replicated over its axis (a plain tensor, or a
DTensor with `Replicate` on that axis) has one copy on every rank of the axis; the copies
stay equal only if their gradients are equal. Inside a split region they need not be: a
per-head norm between a colwise and a rowwise layer (Qwen3's `q_norm`, `k_norm`) sees only
this rank's heads, so each rank's gradient is its own part of the sum, and nothing raises
while the copies drift apart step by step. The fix is a style that sums those gradients
over the axis; this module finds the parameters that lack it.

In check mode (`init_mesh(..., check=True)` / `MESHCOMM_CHECK=1`) `parallelize` calls
`watch`: after every backward pass through the parallelized module (after fully_shard has
reduced its gradients, where it is also used) each rank digests the gradient of every such
parameter it holds, and the ranks of the axis compare the digests
(`runtime.checks.compare_values`: one 32-byte all_reduce per backward when they agree). At
the first pass where a gradient differs every rank of the axis raises `ReplicaDriftError`,
naming the parameter, the pass and the ranks, with the fix. Without check mode nothing is
installed: no hook, no communication. Under `torch.compile` nothing is checked.

The digest is exact and does not depend on reduction order: the gradient's bits as
integers (after -0.0 becomes 0.0 and every NaN one NaN, so equal values digest alike),
summed plainly and weighted by position, modulo 2**64. Any difference in one element
changes it; two changes cancel only with a chance of about 2**-64.

Bit for bit is the default. Nondeterministic kernels can make equal gradients differ in
their last bits, so `parallelize(..., drift_rtol=..., drift_atol=...)` may allow a
difference: the parameters whose digests differ are then compared by value
(`Watch.spread_beyond`), and only those further apart than the tolerance raise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ..core.errors import ReplicaDriftError
from ..core.mesh import AxisName
from ..interop.runtime import device_mesh_of, is_dtensor, local_of, placements_of
from ..runtime.bind import BoundMesh
from ..runtime.checks import Disagreement, compare_values, ranks_text
from ..runtime.collectives import all_reduce
from .params import ShardedModule

WATCH_ATTR = "_meshcomm_drift"   # the attribute a watched module holds its Watch in
COMPARED = 3       # digest columns compared: has a gradient, sum of its bits, weighted sum
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = -0x61C8864680B583EB      # 0x9E3779B97F4A7C15 (odd) as an int64: position weights
SHOWN = 4                        # differing parameters named in the message
TOLERANCE = "(drift_rtol, drift_atol)"   # the row of the tolerance in the compared table


def digest(grad: Tensor | None) -> Tensor:
    """(4,) int64: 1 if there is a gradient, the sum of its bits, their sum weighted by
    position (both modulo 2**64), and the bits of its float64 sum (shown, never compared).

    >>> bool((digest(torch.tensor([0.0, 1.0])) == digest(torch.tensor([-0.0, 1.0]))).all())
    True
    """
    if grad is None:
        return torch.zeros(4, dtype=torch.int64)
    x = (local_of(grad) if is_dtensor(grad) else grad).detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():      # -0.0 + 0 is 0.0; every NaN is the same NaN
        x = (x + 0).masked_fill(x.isnan(), float("nan"))
    elif x.dtype == torch.bool:
        x = x.to(torch.int8)
    bits = x.contiguous().view(_INTS[x.element_size()]).flatten().to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) * _MIX
    total = x.sum(dtype=torch.float64).reshape(1).view(torch.int64)
    one = torch.ones(1, dtype=torch.int64, device=bits.device)
    return torch.cat([one, bits.sum().reshape(1), (bits * weights).sum().reshape(1), total])


def replicated(module: nn.Module, bound: BoundMesh, axis: AxisName
               ) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter of `module` that trains and is replicated over
    `axis`: a plain tensor (but not a `ShardedModule`'s parameter whose stored layout splits
    it over `axis`: its local shard), or a DTensor on `bound`'s mesh with `Replicate` on
    `axis` (a fully_shard'ed one is sharded over its own axis only)."""
    split = {id(getattr(m, attr)) for m in module.modules() if isinstance(m, ShardedModule)
             for attr, spec in m.specs.items()
             if axis in spec.stored.sharded_axes(spec.mesh) and hasattr(m, attr)}
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in split:     # a ShardedModule's shard over `axis`
            continue
        if is_dtensor(p):
            names = device_mesh_of(p).mesh_dim_names or ()
            if axis not in names or not placements_of(p)[names.index(axis)].is_replicate():
                continue
        out.append((name, p))
    return out


class Watch:
    """The check on one parallelized module: after each backward pass through it, its
    replicated parameters' gradients are compared over `axis`."""

    def __init__(self, module: nn.Module, bound: BoundMesh, axis: AxisName,
                 fixes: Sequence[str], rtol: float = 0.0, atol: float = 0.0) -> None:
        self.module, self.bound, self.axis, self.fixes = module, bound, axis, tuple(fixes)
        self.rtol, self.atol = rtol, atol     # both 0: bit for bit
        self.passes = 0          # backward passes checked
        self.queued = -1         # the backward pass (autograd graph task) queued for, if any

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward with gradients: the first gradient that reaches any of its outputs
        queues the check for the end of that backward pass."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        outputs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, self._backward, mode="any")

    def _backward(self, _: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task == self.queued:  # several forwards into one backward: one check
            return
        self.queued = task       # (a pass that failed before its end leaves no trace)
        # Queued from the queue: it runs after every end-of-backward callback queued during
        # the pass (fully_shard's, which writes the reduced gradients to `.grad`).
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self.check))

    def check(self) -> None:
        """Compare the gradients now; raise ReplicaDriftError on every rank of the axis
        where they differ."""
        self.queued = -1
        self.passes += 1
        params = replicated(self.module, self.bound, self.axis)
        if not params:
            return
        # the tolerance is compared too: ranks that decide differently whether to compare
        # values would post different collectives (a hang)
        tolerance = torch.tensor([self.rtol, self.atol], dtype=torch.float64)
        table = torch.stack([digest(p.grad).to(self.bound.device) for _, p in params]
                            + [digest(tolerance).to(self.bound.device)])
        names = [name for name, _ in params]
        what = f"gradients of replicated parameters over {self.axis}"
        found = compare_values(self.bound, self.axis, names + [TOLERANCE], table, COMPARED,
                               what)
        if found is not None and len(params) in found.items:
            raise ReplicaDriftError(
                f"check mode: parallelize's drift_rtol={self.rtol} and drift_atol={self.atol}"
                f" on rank {self.bound.rank} are not those of every rank holding copies over"
                f" {self.axis} ({ranks_text(self.bound.group_ranks(self.axis))}); fix: pass"
                " the same tolerance to parallelize on every rank")
        table = table[:-1]
        if found is not None and (self.rtol or self.atol):
            beyond = [i for i, far in zip(found.items, self.spread_beyond(
                [params[i][1] for i in found.items])) if far]
            found = None if not beyond else compare_values(
                self.bound, self.axis, [names[i] for i in beyond], table[beyond], COMPARED,
                what)
            if found is not None:
                found = found._replace(items=tuple(beyond[i] for i in found.items))
        if found is not None:
            raise ReplicaDriftError(self.message(names, found))

    def spread_beyond(self, params: Sequence[nn.Parameter]) -> list[bool]:
        """For each of `params` (parameters whose gradients' digests differ over the axis),
        whether the ranks' gradients differ by more than the tolerance
        somewhere: |max - min| > atol + rtol * max(|max|, |min|) over the ranks, element by
        element, or a gradient on some ranks only, or a NaN on some ranks only. One
        all_reduce(max) over the axis of (x, -x), x every gradient in float64 with its
        NaNs and whether it is there, so every rank gets the same answer."""
        parts = []
        for p in params:
            g = p.grad      # none here: zeros of the parameter's size, so every rank's match
            x = (local_of(p) if is_dtensor(p) else p).detach() if g is None else (
                local_of(g) if is_dtensor(g) else g).detach()
            x = torch.view_as_real(x) if x.is_complex() else x
            x = (x if g is not None else torch.zeros_like(x)).to(
                device=self.bound.device, dtype=torch.float64).flatten()
            nan = x.isnan()
            flags = torch.tensor([float(g is not None)], dtype=torch.float64, device=x.device)
            parts.append(torch.cat([flags, x.masked_fill(nan, 0.0), nan.to(torch.float64)]))
        sizes = [len(x) for x in parts]
        flat = torch.cat(parts)
        both = all_reduce(torch.cat([flat, -flat]), self.bound, self.axis, op="max",
                          check=False)
        out = []
        for hi, lo in zip(torch.split(both[:len(flat)], sizes),
                          torch.split(-both[len(flat):], sizes)):
            allowed = self.atol + self.rtol * torch.maximum(hi.abs(), lo.abs())
            n = (len(hi) - 1) // 2     # presence, values, NaN flags: exact but values
            exact = torch.cat([hi[:1] - lo[:1], hi[1 + n:] - lo[1 + n:]])
            # an infinity on some ranks only is never within a tolerance (inf - x > inf is
            # False, and 0 * inf is NaN)
            far = ((hi - lo) > allowed) | ((hi != lo) & ~(hi.isfinite() & lo.isfinite()))
            out.append(bool(exact.any()) or bool(far[1:1 + n].any()))
        return out

    def message(self, names: Sequence[str], found: Disagreement) -> str:
        name = names[found.items[0]]
        group = self.bound.group_ranks(self.axis)
        others = [names[i] for i in found.items[1:SHOWN]]
        more = len(found.items) - 1 - len(others)
        also = (f"; {len(found.items) - 1} more differ: " + ", ".join(others)
                + (f" and {more} more" if more else "")) if others else ""
        owner = name.rpartition(".")[0]
        pattern = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", owner)
        styles = " or ".join(f'"{s}"' for s in self.fixes)
        if owner:
            where = f"give {owner} a style that does ({styles}) in the parallelize plan, e.g."
            where += f' {{"{pattern}": "{self.fixes[0]}"}}' if self.fixes else ""
        else:     # a plan names submodules only
            where = (f"move it into a submodule and give that a style that does ({styles})"
                     " in the parallelize plan")
        return (f"check mode: at step {self.passes} (backward pass {self.passes} through"
                f" {type(self.module).__name__} since parallelize), the gradient of {name},"
                f" which is replicated over {self.axis}, differs between the ranks that hold"
                f" its copies ({ranks_text(group)}): {found.describe(_show)}{also}. The optimizer"
                " would make the copies drift apart.\n"
                f"  fix: sum its gradient over {self.axis}: {where}. A parameter used on"
                f" activations split over {self.axis} (a per-head norm between colwise and"
                " rowwise layers, a norm on sequence-split activations) gets only this"
                " rank's part of its gradient")


def _show(row: tuple[int, ...]) -> str:
    if not row[0]:
        return "no gradient"
    total = torch.tensor([row[3]], dtype=torch.int64).view(torch.float64).item()
    return f"gradient sum {total:.9g}"


def watch(module: nn.Module, bound: BoundMesh, axis: AxisName, fixes: Sequence[str],
          rtol: float = 0.0, atol: float = 0.0) -> None:
    """Check mode: compare the gradients of `module`'s parameters replicated over `axis`
    across that axis after every backward pass through it (once per module, however many
    times it is parallelized). `fixes`: the styles that sum a module's gradients over the
    axis, named in the error. `rtol`, `atol`: how far copies may differ (`spread_beyond`);
    both 0, the default: bit for bit."""
    if hasattr(module, WATCH_ATTR) or bound.mesh.axis_size(axis) == 1:   # 1: no copies
        return
    w = Watch(module, bound, axis, fixes, rtol, atol)
    setattr(module, WATCH_ATTR, w)
    module.register_forward_hook(w.after_forward)
