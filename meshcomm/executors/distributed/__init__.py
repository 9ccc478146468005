"""Run plans over torch.distributed (NCCL on GPUs, gloo on CPU): one code path for both.

`execute` (the engine: `prepare` plans once, `issue` them now, `wait` later; `execute`,
`execute_many`, `execute_cross` issue and wait at once), `handlers` (one per step kind, byte
traces), `autograd` (differentiable reshard, on one mesh and between two), `wire` (every
functional-collective call, measured), `groups` (what an executor needs of a bound mesh).
The bound mesh, check mode, the public collectives and the launcher are the runtime's
(`meshcomm.runtime`).
"""

from .autograd import Reshard
from .execute import Handle, Prepared, execute, execute_cross, execute_many, prepare
from .groups import Groups
from .handlers import ByteTrace, Call, check_local, signature

__all__ = ["ByteTrace", "Call", "Groups", "Handle", "Prepared", "Reshard", "check_local",
           "execute", "execute_cross", "execute_many", "prepare", "signature"]
