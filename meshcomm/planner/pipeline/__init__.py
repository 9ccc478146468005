"""Pipeline schedules as pure values: actions in PyTorch's notation, the standard schedules,
and a simulator that times, sizes and checks them (no process groups; see docs/pipeline.md)."""

from .actions import Action, Schedule
from .schedules import (
                        SCHEDULES,
                        build,
                        gpipe,
                        interleaved_1f1b,
                        one_f_one_b,
                        zero_bubble,
                        zero_bubble_v,
)
from .simulate import Event, StageCosts, Timeline, simulate, timeline

__all__ = ["SCHEDULES", "Action", "Event", "Schedule", "StageCosts", "Timeline", "build",
           "gpipe", "interleaved_1f1b", "one_f_one_b", "simulate", "timeline",
           "zero_bubble", "zero_bubble_v"]
