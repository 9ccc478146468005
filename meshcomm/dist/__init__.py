"""Run meshcomm over torch.distributed (NCCL on GPUs, gloo on CPU)."""
from .autograd import Reshard, backward_plan, without_reduction
from .bind import BoundMesh, default_backend, init_mesh
from .collectives import (all_gather, all_reduce, all_to_all, broadcast, collective_permute,
                          recv, reduce_scatter, send, sendrecv)
from .execute import ByteTrace, Call, check_local, execute, execute_many, signature
