"""Run a plan over torch.distributed (NCCL on GPUs, gloo on CPU): one code path for both.

`execute` (a plan on this rank, byte traces), `cross` (plans between meshes), `autograd`
(differentiable reshard), `wire` (every functional-collective call, measured), `groups`
(what an executor needs of a bound mesh). The bound mesh, check mode, the public
collectives and the launcher are the runtime's (`meshcomm.runtime`).
"""

from .autograd import Reshard
from .execute import ByteTrace, Call, check_local, execute, execute_many, signature
from .groups import Groups

__all__ = ["ByteTrace", "Call", "Groups", "Reshard", "check_local", "execute", "execute_many",
           "signature"]
