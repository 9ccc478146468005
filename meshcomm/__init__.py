"""meshcomm: sharded tensors you can reason about.

>>> import meshcomm as mc
>>> mesh = mc.Mesh("dp=2 tp=4")
>>> [step.kind for step in mc.plan(mesh, (8, 16, 32), "(dp b) s (tp h)", "b (dp s) (tp h)").steps]
['all_to_all']

The public surface (docs/api.md): the values and functions in `__all__`, and five
namespaces: `mc.errors` (every error class), `mc.collectives` (functional collectives on
a BoundMesh), `mc.dtensor` (DTensor and placements), `mc.sim` (simulated ranks) and
`mc.nn` (building blocks). The layers below (`meshcomm.core`, `meshcomm.planner`,
`meshcomm.executors`) are importable for advanced use; docs/architecture.md draws them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# CPU builds of torch without numpy print "Failed to initialize NumPy" when torch loads.
# meshcomm needs no numpy, so the message is noise: silence exactly it (when meshcomm is
# imported before torch; `run_ranks` children get the same filter). docs/runtime.md.
NUMPY_WARNING = "Failed to initialize NumPy"
warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)

# Names load on first use (PEP 562), so `import meshcomm` and `meshcomm --help` do not pay
# for torch.distributed, rich and pydantic until a name that needs them is read.
_EXPORTS = {
    "collectives": "meshcomm.collectives", "dryrun": "meshcomm.dryrun",
    "dtensor": "meshcomm.dtensor",
    "errors": "meshcomm.errors", "nn": "meshcomm.nn", "sim": "meshcomm.sim",
    "Layout": "meshcomm.core.layout", "Mesh": "meshcomm.core.mesh",
    "show": "meshcomm.display", "show_plan": "meshcomm.display",
    "BoundMesh": "meshcomm.runtime", "ByteTrace": "meshcomm.executors.distributed",
    "init_mesh": "meshcomm.runtime",
    "plan": "meshcomm.planner.plan",
    "CostModel": "meshcomm.planner.values", "Plan": "meshcomm.planner.values",
    "Step": "meshcomm.planner.values",
    "Recipe": "meshcomm.recipes", "logical": "meshcomm.recipes", "recipe": "meshcomm.recipes",
    "Sharded": "meshcomm.sharded", "distribute": "meshcomm.sharded",
    "reshard": "meshcomm.sharded", "reshard_many": "meshcomm.sharded",
}
_NAMESPACES = frozenset({"collectives", "dryrun", "dtensor", "errors", "nn", "sim"})
_SUBPACKAGES = frozenset({"core", "planner", "executors", "runtime", "interop", "display",
                          "recipes", "sharded", "testing", "cli"})

if TYPE_CHECKING:
    from . import collectives, dryrun, dtensor, errors, nn, sim
    from .core.layout import Layout
    from .core.mesh import Mesh
    from .display import show, show_plan
    from .executors.distributed import ByteTrace
    from .planner.plan import plan
    from .planner.values import CostModel, Plan, Step
    from .recipes import Recipe, logical, recipe
    from .runtime import BoundMesh, init_mesh
    from .sharded import Sharded, distribute, reshard, reshard_many

__all__ = [
    # values
    "BoundMesh", "ByteTrace", "CostModel", "Layout", "Mesh", "Plan", "Recipe", "Sharded", "Step",
    # functions
    "distribute", "init_mesh", "logical", "plan", "recipe", "reshard", "reshard_many",
    "show", "show_plan",
    # namespaces
    "collectives", "dryrun", "dtensor", "errors", "nn", "sim",
]

# Spellings of meshcomm 0.1, removed in 0.2 (docs/changelog.md): reading one raises an
# AttributeError that names the spelling to use instead. Nothing here works as an alias.
_REMOVED = {
    **{name: f"mc.collectives.{name}"
       for name in ("all_gather", "all_reduce", "all_to_all", "broadcast", "collective_permute",
                    "recv", "reduce_scatter", "send", "sendrecv")},
    **{name: f"mc.dtensor.{name}"
       for name in ("bind_device_mesh", "from_dtensor", "from_placements", "to_dtensor",
                    "to_placements")},
    **{name: f"mc.errors.{name}"
       for name in ("CollectiveError", "CollectiveMismatchError", "CollectiveTimeout",
                    "InteropError", "LayoutSyntaxError", "MeshAxisError", "MeshcommError",
                    "MeshMismatchError", "PlanError", "RankFailure", "RecipeError", "ShapeError")},
    "as_layout": "mc.Layout(...)",
    "checks": "mc.init_mesh(..., check=True) or check=True on a call (MESHCOMM_CHECK=1 sets"
              " the default)",
    "plan_cache_info": "meshcomm.planner.plan_cache_info",
    "set_plan_cache_size": "meshcomm.planner.set_plan_cache_size",
    "dist": "meshcomm.executors.distributed",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":    # the installed distribution's (pyproject.toml's) version
        from importlib.metadata import version

        return version("meshcomm")
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if name in _NAMESPACES else getattr(module, name)
        globals()[name] = value          # later reads skip this function
        return value
    if name in _SUBPACKAGES:     # the layers below, e.g. mc.planner.plan_cache_info()
        return importlib.import_module(f"meshcomm.{name}")
    if name in _REMOVED:
        raise AttributeError(f"mc.{name} was removed in meshcomm 0.2 (docs/changelog.md);"
                             f" use {_REMOVED[name]}")
    raise AttributeError(f"module 'meshcomm' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names only (what tab completion offers): not this module's helpers
    (`importlib`, `warnings`, `Any`, ...), which `globals()` also holds."""
    return sorted({*__all__, *_EXPORTS, "__version__"})
