"""`mc.collectives`: functional collectives addressed by mesh axis, over torch.distributed.

Each returns a new tensor at once and is waited on at first use (PyTorch's functional
collectives), checks what it can locally before communicating, and equals
`mc.sim`'s collective of the same name bit for bit (docs/collectives.md).
"""

from .runtime.collectives import (
                                                all_gather,
                                                all_reduce,
                                                all_to_all,
                                                broadcast,
                                                collective_permute,
                                                recv,
                                                reduce_scatter,
                                                send,
                                                sendrecv,
)

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "collective_permute", "recv",
           "reduce_scatter", "send", "sendrecv"]
