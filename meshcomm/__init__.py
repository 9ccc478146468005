"""meshcomm: sharded tensors you can reason about.

>>> import meshcomm as mc
>>> mesh = mc.Mesh("dp=2 tp=4")
>>> [step.kind for step in mc.plan(mesh, (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)").steps]
['all_to_all']
"""
# Layers, bottom up: values and the planner (pure), simulated ranks, the torch.distributed
# runtime, the thin public API, interop and building blocks, printouts.
from .errors import (CollectiveError, CollectiveMismatchError, CollectiveTimeout, InteropError,
                     LayoutSyntaxError, MeshAxisError, MeshcommError, MeshMismatchError,
                     PlanError, RankFailure, RecipeError, ShapeError)
from .mesh import Mesh
from .layout import Layout, as_layout
from .plan import CostModel, Plan, Step, plan, plan_cache_info, set_plan_cache_size
from .recipes import Recipe, logical, recipe
from . import sim
from .dist import BoundMesh, ByteTrace, init_mesh
from .dist.checks import checks
from .dist.collectives import (all_gather, all_reduce, all_to_all, broadcast, collective_permute,
                               recv, reduce_scatter, send, sendrecv)
from .api import Sharded, distribute, reshard, reshard_many
from .interop import bind_device_mesh, from_dtensor, from_placements, to_dtensor, to_placements
from .display import show, show_plan
from . import nn

__all__ = [
    "BoundMesh", "ByteTrace", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeout",
    "CostModel", "InteropError", "Layout", "LayoutSyntaxError", "Mesh", "MeshAxisError",
    "MeshMismatchError", "MeshcommError", "Plan", "PlanError", "RankFailure", "Recipe",
    "RecipeError", "ShapeError", "Sharded", "Step", "all_gather", "all_reduce", "all_to_all",
    "as_layout", "bind_device_mesh", "broadcast", "checks", "collective_permute", "distribute",
    "from_dtensor", "from_placements", "init_mesh", "logical", "nn", "plan", "plan_cache_info",
    "recipe", "recv", "reduce_scatter", "reshard", "reshard_many", "send", "sendrecv",
    "set_plan_cache_size", "show", "show_plan", "sim", "to_dtensor", "to_placements",
]
