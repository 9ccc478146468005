"""`mc.sim`: exact in-process simulation of N ranks: shards, collectives and plan execution.

Reduction ops, their identities and chunk sizes are `meshcomm.core.reduce_ops`; the blocks a
`send_recv` copies are the plan's `meshcomm.planner.Transfer`.
"""

from ..local import take
from .collectives import (
                          SendRecvResult,
                          SimResult,
                          all_gather,
                          all_reduce,
                          all_to_all,
                          broadcast,
                          collective_permute,
                          reduce_scatter,
                          send_recv,
)
from .execute import check_locals, execute, execute_cross
from .shards import gather, scatter

__all__ = ["SendRecvResult", "SimResult", "all_gather", "all_reduce", "all_to_all", "broadcast",
           "check_locals", "collective_permute", "execute", "execute_cross", "gather",
           "reduce_scatter", "scatter", "send_recv", "take"]
