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
    zero_bubble,
    zero_bubble_v,
)
from .grads import Tie
from .runner import Pipeline
from .stage import Stage, stage_meshes

__all__ = ["SCHEDULES", "Action", "Event", "Pipeline", "Schedule", "Stage", "StageCosts", "Tie",
           "Timeline", "build", "gpipe", "interleaved_1f1b", "one_f_one_b", "simulate",
           "stage_meshes", "zero_bubble", "zero_bubble_v"]
