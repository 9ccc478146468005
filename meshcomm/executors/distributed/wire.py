"""The one place that hands tensors to PyTorch's functional collectives.

Complex tensors travel as real pairs (a view, no copy); `wait=True` waits at once (the
executor's local rearranges need the data anyway), `wait=False` returns the async tensor
that is waited on at first use (`mc.collectives`). Traced calls are already waited on.

The functional collectives by the names of torch 2.12 and later, on any torch from 2.6:
`all_gather_single` and `reduce_scatter_single` (before: `all_gather_tensor`,
`reduce_scatter_tensor`, the same calls) and `batch_p2p` (before torch's
`batch_p2p_ops_inplace`: `batch_isend_irecv`, waited on, which torch.compile cannot trace).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def all_gather_single(x: Tensor, dim: int, group: str) -> Tensor:
    """funcol's all_gather of `x` along `dim` (looked up per call, as tests wrap funcol)."""
    fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return fn(x, dim, group)


def reduce_scatter_single(x: Tensor, op: str, dim: int, group: str) -> Tensor:
    """funcol's reduce_scatter of `x` along `dim` with `op` (looked up per call)."""
    fn = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return fn(x, op, dim, group)


def batch_p2p(kinds: Sequence[str], peers: Sequence[int], tensors: list[Tensor],
              name: str) -> list[Tensor]:
    """Sends ("isend") and receives ("irecv", filling the tensor given) with group-rank
    `peers` over group `name`, posted together; per op, an empty token for a send and the
    filled tensor for a receive."""
    if hasattr(funcol, "batch_p2p_ops_inplace"):
        return list(funcol.batch_p2p_ops_inplace(list(kinds), list(peers), [0] * len(kinds),
                                                 tensors, name))
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(name)
    ops = [(t, dist.get_global_rank(group, peer)) for peer, t in zip(peers, tensors)]
    for work in post_p2p([o for o, k in zip(ops, kinds) if k == "isend"],
                         [o for o, k in zip(ops, kinds) if k == "irecv"], group):
        work.wait()
    # as the functional op: a send gives back an empty token, a receive its filled tensor
    return [t if kind == "irecv" else t.new_empty(0) for kind, t in zip(kinds, tensors)]


def post_p2p(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
             group: Any = None) -> list[Any]:
    """Post sends and receives (tensor, global peer rank) together in one batch; the works
    to wait on. Complex tensors travel as real pairs."""
    ops = ([dist.P2POp(dist.isend, as_real(t), peer, group) for t, peer in sends]
           + [dist.P2POp(dist.irecv, as_real(t), peer, group) for t, peer in recvs])
    return list(dist.batch_isend_irecv(ops)) if ops else []


def as_real(x: Tensor) -> Tensor:
    """`x` as the backend sends it: complex tensors as real pairs (a view, no copy)."""
    return torch.view_as_real(x) if x.is_complex() else x


def waited(t: Tensor) -> Tensor:
    """`t`, waited on if it is an eager functional-collective result."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def call(fn: Callable[..., Tensor], x: Tensor, *args: object, wait: bool = True) -> Tensor:
    """`fn(x, *args)` with complex `x` sent as real pairs and given back complex."""
    y = fn(as_real(x), *args)
    if wait:
        y = waited(y)
    return torch.view_as_complex(y) if x.is_complex() else y


def all_to_all(rows: Tensor, name: str, out_splits: Sequence[int] | None = None,
               in_splits: Sequence[int] | None = None, *, wait: bool = True) -> Tensor:
    """all_to_all_single along dim 0 (splits in rows of dim 0, process-group order)."""
    y = call(funcol.all_to_all_single, rows.contiguous(),
             None if out_splits is None else list(out_splits),
             None if in_splits is None else list(in_splits), name, wait=wait)
    if out_splits is not None and torch.compiler.is_compiling():
        # traced, uneven splits give the output an unknown length; it is their sum, and
        # saying so lets the compiler slice it without guarding on data
        torch._check(y.shape[0] == sum(out_splits))
    return y
