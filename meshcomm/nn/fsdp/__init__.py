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

from .api import fully_shard, init_shards, set_requires_gradient_sync
from .param import UNIT_ATTR, MixedPrecision
from .report import fsdp_schedule

__all__ = ["UNIT_ATTR", "MixedPrecision", "fsdp_schedule", "fully_shard", "init_shards",
           "set_requires_gradient_sync"]
