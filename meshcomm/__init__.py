"""meshcomm: sharded tensors you can reason about."""
from . import sim
from .errors import (LayoutSyntaxError, MeshAxisError, MeshcommError, MeshMismatchError,
                     PlanError, RecipeError, ShapeError)
from .layout import Layout, as_layout
from .mesh import Mesh

__all__ = ["Layout", "LayoutSyntaxError", "Mesh", "MeshAxisError", "MeshMismatchError",
           "MeshcommError", "PlanError", "RecipeError", "ShapeError", "as_layout", "sim"]
