"""What runs when: the autograd node that hands a unit's gradients to its reduce_scatter,
the end-of-backward callback, and the forward hooks that put the gathered parameters in
place and take them out again (the order units run in is schedule.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ...executors.distributed import Handle
from .param import UNIT_ATTR
from .schedule import Schedule
from .unit import Unit


def finish_backward(schedule: Schedule[Unit]) -> None:
    pending, schedule.pending_reduce = schedule.pending_reduce, []
    schedule.callback_queued = False
    for _, handle in pending:          # HSDP: every all_reduce issued before any is waited
        handle.advance(handle.steps_left)
    for unit, handle in pending:
        unit.finish_reduce(handle)
    for unit in schedule.order:
        put_back(unit)
        unit.kept = None
        unit.regather.release()
    schedule.drop_ahead(_wait)    # a prefetch no forward used would be stale next step


def _wait(issued: object) -> None:
    if isinstance(issued, Handle):
        issued.wait()


class Gathered(torch.autograd.Function):
    """Forward: the unit's gathered parameters (already gathered: they are passed through).
    Backward: the unit's gradients reduce_scattered, written to `.grad` when backward ends."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, gathered: list[Tensor], *params: Tensor
                ) -> tuple[Tensor, ...]:
        ctx.unit = unit
        return tuple(t.view_as(t) for t in gathered)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        unit: Unit = ctx.unit
        put_back(unit)             # a recompute's gathered parameters: out of the modules
        unit.regather.release()    # every use of the saved parameters is behind us
        schedule = unit.schedule
        if not schedule.callback_queued:
            schedule.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: finish_backward(schedule))
        grads_now = unit.accumulate(grads)
        if not unit.sync:          # gradient accumulation: keep them unsharded, send nothing
            unit.unsharded_grads = grads_now
            return (None, None) + (None,) * len(unit.params)
        if schedule.pending_reduce:
            # HSDP: the previous unit's reduce_scatter had this unit's backward to finish;
            # its all_reduce over the replicas now runs while the rest of backward computes
            before = schedule.pending_reduce[-1][1]
            before.advance(before.steps_left)
        schedule.pending_reduce.append((unit, unit.issue_reduce(grads_now)))
        return (None, None) + (None,) * len(unit.params)


def pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
    unit: Unit = getattr(module, UNIT_ATTR)
    schedule = unit.schedule
    if schedule.recording:
        schedule.record(unit)
    gathered = unit.gather() if unit.params else []
    after = schedule.next_forward(unit)
    if unit.prefetch and after is not None:
        after.prefetch_gather()
    params = [p.param for p in unit.params]
    if params and torch.is_grad_enabled() and any(p.requires_grad for p in params):
        used = list(Gathered.apply(unit, gathered, *params))  # type: ignore[no-untyped-call]
    else:
        used = gathered
    unit.regather.remember(used, unit.moved)
    unit.kept = None if unit.reshards else used
    place(unit, used)
    if unit.reshards and torch.is_grad_enabled():
        unit.hooks = torch.autograd.graph.saved_tensors_hooks(unit.regather.pack,
                                                               unit.regather.unpack)
        unit.hooks.__enter__()
    dtype = unit.mp.param_dtype
    if dtype is None:
        return None
    # as FSDP2: floating-point inputs of the unit computed in param_dtype
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def place(unit: Unit, tensors: Sequence[Tensor]) -> None:
    """`tensors` where forward reads the unit's parameters (`Param.place`)."""
    for p, t in zip(unit.params, tensors):
        p.place(t)


def put_back(unit: Unit) -> None:
    """The stored parameters back in the modules' places."""
    for p in unit.params:
        p.put_back()


def pre_backward(unit: Unit) -> None:
    """The unit's backward begins: until it ends (`Gathered.backward`), its modules hold
    the gathered parameters, so that a recompute of activation checkpointing that calls
    `forward` itself, without the module's hooks (Hugging Face's gradient checkpointing),
    computes with whole parameters. They are leaves: the recompute only remakes saved
    values, and the gradients flow through the graph of the first forward."""
    if unit.held is not None:
        values = unit.held
    elif unit.reshards:
        values = unit.regather.parameters()
    elif unit.kept is not None:
        values = unit.kept
    else:
        return
    place(unit, [t.detach().requires_grad_(p.param.requires_grad)
                 for p, t in zip(unit.params, values)])


def post_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    """After the unit's forward, also on the way out of one that raised (the hook is
    registered with always_call): the saved-tensor hooks left, the parameters put back;
    after a failure, nothing the unit or the schedule holds survives it."""
    unit: Unit = getattr(module, UNIT_ATTR)
    if unit.hooks is not None:
        unit.hooks.__exit__(None, None, None)
        unit.hooks = None
    put_back(unit)
    unit.regather.forget()
    if sys.exc_info()[0] is not None:      # forward raised: called from its except block
        unit.kept = None
        unit.regather.release()
        unit.schedule.abandon(_wait)
        return None
    if unit.params and torch.is_grad_enabled():
        outputs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        if outputs:    # as FSDP2's pre-backward hook: the first gradient of any output
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda _: pre_backward(unit), mode="any")
    return output
