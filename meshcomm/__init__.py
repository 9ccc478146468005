"""meshcomm: sharded tensors you can reason about.

>>> import meshcomm as mc
>>> mesh = mc.Mesh("dp=2 tp=4")
>>> [step.kind for step in mc.plan(mesh, (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)").steps]
['all_to_all']
"""
from . import sim
from .display import show, show_plan
from .dist.collectives import (all_gather, all_reduce, all_to_all, broadcast, collective_permute,
                               recv, reduce_scatter, send, sendrecv)
from .errors import (LayoutSyntaxError, MeshAxisError, MeshcommError, MeshMismatchError,
                     PlanError, RecipeError, ShapeError)
from .layout import Layout, as_layout
from .mesh import Mesh
from .plan import CostModel, Plan, Step, plan

__all__ = ["CostModel", "Layout", "LayoutSyntaxError", "Mesh", "MeshAxisError",
           "MeshMismatchError", "MeshcommError", "Plan", "PlanError", "RecipeError", "ShapeError",
           "Step", "as_layout", "plan", "show", "show_plan", "sim"]
__all__ += ["all_gather", "all_reduce", "all_to_all", "broadcast", "collective_permute", "recv",
            "reduce_scatter", "send", "sendrecv"]
from .api import Sharded, distribute, reshard, reshard_many
from .dist import BoundMesh, ByteTrace, init_mesh

__all__ += ["BoundMesh", "ByteTrace", "Sharded", "distribute", "init_mesh", "reshard",
            "reshard_many"]
from .recipes import Recipe, logical, recipe

__all__ += ["Recipe", "logical", "recipe"]
from .errors import InteropError
from .interop import bind_device_mesh, from_dtensor, from_placements, to_dtensor, to_placements

__all__ += ["InteropError", "bind_device_mesh", "from_dtensor", "from_placements", "to_dtensor",
            "to_placements"]
from . import nn  # noqa: E402  (blocks built on everything above)

__all__ += ["nn"]
from .dist.checks import checks
from .errors import CollectiveError, CollectiveMismatchError, CollectiveTimeout, RankFailure
from .plan import plan_cache_info, set_plan_cache_size

__all__ += ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeout", "RankFailure",
            "checks", "plan_cache_info", "set_plan_cache_size"]
