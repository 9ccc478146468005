"""`mc.errors`: every error meshcomm raises (docs/errors.md). All derive from MeshcommError.

Each message says which argument or token is wrong, what was expected and how to fix it,
and is raised before any communication starts.
"""

from .core.errors import (
                          CheckpointError,
                          CollectiveError,
                          CollectiveMismatchError,
                          CollectiveTimeout,
                          InteropError,
                          LaunchError,
                          LayoutSyntaxError,
                          MeshAxisError,
                          MeshcommError,
                          MeshMismatchError,
                          PlanError,
                          RankFailure,
                          RecipeError,
                          ReplicaDriftError,
                          ScheduleError,
                          ShapeError,
                          StyleError,
)

__all__ = ["CheckpointError", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeout",
           "InteropError", "LaunchError", "LayoutSyntaxError", "MeshAxisError", "MeshMismatchError",
           "MeshcommError", "PlanError", "RankFailure", "RecipeError", "ReplicaDriftError",
           "ScheduleError", "ShapeError", "StyleError"]
