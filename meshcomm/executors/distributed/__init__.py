"""Run meshcomm over torch.distributed (NCCL on GPUs, gloo on CPU): one code path for both.

`bind` (init_mesh, BoundMesh), `execute` (plans on this rank, byte traces), `autograd`
(differentiable reshard), `cross` (plans between meshes), `checks` (check mode),
`collectives` (`mc.collectives`), `launch` (run a function on N local processes).
"""

from .autograd import Reshard
from .bind import BoundMesh, default_backend, init_mesh
from .execute import ByteTrace, Call, check_local, execute, execute_many, signature

__all__ = ["BoundMesh", "ByteTrace", "Call", "Reshard", "check_local", "default_backend",
           "execute", "execute_many", "init_mesh", "signature"]
