"""Exact in-process simulation of N ranks: shards, collectives and plan execution."""
from .collectives import (REDUCE_OPS, SendRecvResult, SimResult, Transfer, all_gather,
                          all_reduce, all_to_all, broadcast, chunk_sizes, collective_permute,
                          op_reduce, reduce_scatter, send_recv)
from .execute import check_locals, execute
from .shards import gather, scatter, take

__all__ = ["REDUCE_OPS", "SendRecvResult", "SimResult", "Transfer", "all_gather", "all_reduce",
           "all_to_all", "broadcast", "check_locals", "chunk_sizes", "collective_permute",
           "execute", "gather", "op_reduce", "reduce_scatter", "scatter", "send_recv", "take"]
