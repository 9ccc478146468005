"""Pipeline parallelism (docs/pipeline.md): stages on their own meshes and layouts, hand-offs
as planned reshards both ways, the standard schedules, and a simulator.

`Pipeline` and `Stage` run a step; the schedules and the simulator are pure values from
`meshcomm.planner.pipeline`, re-exported here.
"""

from ...planner.pipeline import (
    SCHEDULES,
    Action,
    Event,
    Schedule,
    StageCosts,
    Timeline,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    timeline,
    zero_bubble,
    zero_bubble_v,
)
from ...planner.pipeline.balance import balance, stage_sums
from .checkpoint import StageParam, load_state_dict, state_dict
from .grads import Tie
from .runner import Pipeline
from .stage import Stage, stage_meshes

__all__ = ["SCHEDULES", "Action", "Event", "Pipeline", "Schedule", "Stage", "StageCosts",
           "StageParam", "Tie", "Timeline", "balance", "build", "gpipe", "interleaved_1f1b",
           "load_state_dict", "one_f_one_b", "simulate", "stage_meshes", "stage_sums",
           "state_dict", "timeline", "zero_bubble", "zero_bubble_v"]
