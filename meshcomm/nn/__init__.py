"""Building blocks for parallel models: plain torch.nn.Modules whose communication is meshcomm
plans chosen by a layout recipe (`import meshcomm as mc; mc.nn.ColumnParallelLinear`).

Every block has `explain(shape)`: the plans it runs in forward and backward, one line each.
See docs/tutorial.md.
"""
from ..core.errors import CheckpointError
from .attention import attention, attention_costs, attention_explain, attention_reference
from .attention.hf import register_hf_attention
from .checkpoint import CheckpointRead, load_checkpoint, save_checkpoint
from .comms import Comm, format_comms
from .experts import MoE, Routing, combine, dispatch
from .fsdp import (
    MixedPrecision,
    fsdp_schedule,
    fully_shard,
    init_shards,
    set_requires_gradient_sync,
)
from .hf_plan import tp_plan_of
from .losses import vocab_parallel_cross_entropy, vocab_range
from .parallel import STYLES, FusedRows, parallelize, tp_style
from .params import (
    ParamSpec,
    ShardedModule,
    gather_params,
    logical_axes,
    param_spec,
    planning_mesh,
)
from .pipeline import Pipeline, Stage, Tie, stage_meshes
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPEntry,
    VocabParallelEmbedding,
)

__all__ = ["CheckpointError", "CheckpointRead", "ColumnParallelLinear", "Comm",
           "FusedRows", "MixedPrecision", "MoE", "ParamSpec", "Pipeline", "Stage", "Tie",
           "Routing", "RowParallelLinear", "STYLES", "ShardedModule", "TPEntry",
           "VocabParallelEmbedding", "attention", "attention_costs", "attention_explain",
           "attention_reference",
           "combine", "dispatch", "format_comms",
           "fsdp_schedule", "fully_shard", "gather_params", "init_shards", "load_checkpoint",
           "logical_axes", "parallelize", "param_spec", "planning_mesh", "register_hf_attention",
           "save_checkpoint",
           "set_requires_gradient_sync", "stage_meshes", "tp_plan_of", "tp_style",
           "vocab_parallel_cross_entropy", "vocab_range"]


# Removed in meshcomm 0.3 (docs/changelog.md): reading one raises an AttributeError that names
# what to use instead. Nothing here works as an alias.
_REMOVED = {
    "FullyShard": "mc.nn.fully_shard(module, bound) (it takes recipe modules too: for block in"
                  " model.blocks: fully_shard(block, bound); then fully_shard(model, bound))",
}


def __getattr__(name: str) -> object:
    if name in _REMOVED:
        raise AttributeError(f"mc.nn.{name} was removed in meshcomm 0.3 (docs/changelog.md);"
                             f" use {_REMOVED[name]}")
    raise AttributeError(f"module 'meshcomm.nn' has no attribute {name!r}")
