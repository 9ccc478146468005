"""Building blocks for parallel models: plain torch.nn.Modules whose communication is meshcomm
plans chosen by a layout recipe (`import meshcomm as mc; mc.nn.ColumnParallelLinear`).

Every block has `explain(shape)`: the plans it runs in forward and backward, one line each.
See docs/tutorial.md.
"""
from ..core.errors import CheckpointError
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
from .losses import vocab_parallel_cross_entropy, vocab_range
from .parallel import STYLES, parallelize, tp_style
from .params import (
                     FullyShard,
                     ParamSpec,
                     ShardedModule,
                     gather_params,
                     logical_axes,
                     param_spec,
                     planning_mesh,
)
from .tensor_parallel import (
                     ColumnParallelLinear,
                     RowParallelLinear,
                     TPEntry,
                     VocabParallelEmbedding,
)

__all__ = ["CheckpointError", "CheckpointRead", "ColumnParallelLinear", "Comm", "FullyShard",
           "MixedPrecision", "MoE", "ParamSpec",
           "Routing", "RowParallelLinear", "STYLES", "ShardedModule", "TPEntry",
           "VocabParallelEmbedding", "combine", "dispatch", "format_comms",
           "fsdp_schedule", "fully_shard", "gather_params", "init_shards", "load_checkpoint",
           "logical_axes", "parallelize", "param_spec", "planning_mesh", "save_checkpoint",
           "set_requires_gradient_sync", "tp_style",
           "vocab_parallel_cross_entropy", "vocab_range"]
