"""Layer 2, the planner (pure, no I/O): plan values, states, moves, bounds, the search.

`plan()` (in `planner.plan`) is the entry point; its caches are bounded and inspectable.
"""

from .plan import DEFAULT_PLAN_CACHE_SIZE, plan, plan_cache_info, set_plan_cache_size
from .transfers import receiver_blocks
from .values import CostModel, Plan, Step, Transfer

__all__ = ["DEFAULT_PLAN_CACHE_SIZE", "CostModel", "Plan", "Step", "Transfer", "plan",
           "plan_cache_info", "receiver_blocks", "set_plan_cache_size"]
