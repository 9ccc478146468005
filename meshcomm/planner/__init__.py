"""Layer 2, the planner (pure, no I/O): plan values, states, moves, bounds, the search.

`plan()` (in `planner.plan`) is the entry point; its caches are bounded and inspectable.
"""

from .plan import (
    DEFAULT_PLAN_CACHE_SIZE,
    backward_plan,
    plan,
    plan_cache_info,
    plan_untraced,
    set_plan_cache_size,
)
from .rank_transfers import receiver_blocks
from .values import CostModel, Plan, Step, Transfer, grad_scale

__all__ = ["DEFAULT_PLAN_CACHE_SIZE", "CostModel", "Plan", "Step", "Transfer", "backward_plan",
           "grad_scale", "plan", "plan_cache_info", "plan_untraced", "receiver_blocks",
           "set_plan_cache_size"]
