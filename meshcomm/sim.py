"""`mc.sim`: exact in-process simulation of N ranks: shards, collectives and plan execution
(docs/api.md § mc.sim). `import meshcomm.sim` and `from meshcomm.sim import scatter` work
as for every public namespace; the code lives in `meshcomm.executors.sim`.
"""

from .executors.sim import (
                            SendRecvResult,
                            SimResult,
                            all_gather,
                            all_reduce,
                            all_to_all,
                            broadcast,
                            check_locals,
                            collective_permute,
                            execute,
                            execute_cross,
                            gather,
                            reduce_scatter,
                            scatter,
                            send_recv,
                            take,
)

__all__ = ["SendRecvResult", "SimResult", "all_gather", "all_reduce", "all_to_all", "broadcast",
           "check_locals", "collective_permute", "execute", "execute_cross", "gather",
           "reduce_scatter", "scatter", "send_recv", "take"]
