"""Modelled time of one attention call, forward and backward, per strategy: the link time of
what it sends (a `CostModel`: latency + bytes / bandwidth per collective, each collective
under its wire's figures where the model names them: `CostModel(wires=...)`) combined with
the time of the attention blocks it computes (FLOPs over a `flops` rate). A collective over
g ranks pays a latency per step of its ring algorithm (g - 1; an all_reduce 2 (g - 1)), a
point-to-point batch ("p2p", the ring's shifts) one. This module never
communicates; every figure is the same on every rank of the sequence's group (the slowest
member sets each phase), so every rank picks the same strategy.

FLOPs: a block of `sq` queries by `sk` keys costs `4 sq sk d` per head forward (scores,
probabilities x values) and `10 sq sk d` backward (scores recomputed, dV, dP, dQ, dK), 14
in all. A block no query sees by position is skipped, as the strategies skip it; a computed
block counts every pair (it runs dense under its mask): `allgather` and `ulysses` attend
`blocks.KEY_CHUNK` keys at a time, the ring one rank's block at a time. A causal triangle
counts the pairs the fused kernel computes (`causal_pairs`): on CPU its query tiles each
run whole tiles of `CPU_KEY_TILE` keys up to the diagonal, so a triangle of 512 keys or
fewer costs its whole square, one of 1,024 three quarters; elsewhere its lower half.

Overlap, as the strategies run:
- `ring`: each step posts the next block's exchange, then computes: a step takes the larger
  of its slowest member's block and its messages (K/V forward; K/V and the travelling
  dK/dV backward); plus one exposed latency per pass and the last dK/dV hop home.
- `allgather`: the gathers of K and V finish before the blocks start and the
  reduce_scatters of dK, dV start after their backward, so nothing overlaps: comm +
  compute. (K's and V's plans run back to back; the model adds their times.)
- `ulysses`: its all_to_alls sit between the blocks' phases: comm + compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...planner.values import CostModel, Plan
from .blocks import KEY_CHUNK, Mask, key_blocks

FORWARD_FLOPS, BACKWARD_FLOPS = 4, 10     # per query-key pair, head and head-dim element
DEFAULT_FLOPS = 100e12                    # FLOP/s of one rank's attention (an accelerator's)
DEFAULT_COST_MODEL = CostModel(latency_s=10e-6, bandwidth=50e9)   # one link of a node
CPU_KEY_TILE = 512      # keys per tile of torch's fused CPU attention (its kv split size)


def cpu_query_tile(n: int) -> int:
    """Queries per tile of torch's fused CPU attention over `n` queries (its q split size)."""
    return 256 if n >= 768 else 64 if n >= 192 else 32


def causal_pairs(n: int, key_tile: int = 1) -> int:
    """Query-key pairs a fused kernel computes for the causal triangle of `n` positions:
    each tile of queries runs every tile of `key_tile` keys up to its last query's
    diagonal, whole. `key_tile` 1: the lower half exactly (a kernel that skips by element).

    >>> causal_pairs(4), causal_pairs(512, CPU_KEY_TILE), causal_pairs(1024, CPU_KEY_TILE)
    (10, 262144, 786432)
    """
    if key_tile <= 1:
        return n * (n + 1) // 2
    rows = cpu_query_tile(n)
    return sum(min(rows, n - m) * min(n, -(-min(m + rows, n) // key_tile) * key_tile)
               for m in range(0, n, rows))


def pairs(mask: Mask, qpos: Sequence[int], kpos: Sequence[int], chunk: int,
          key_tile: int = 1) -> int:
    """Query-key pairs computed when `qpos` attend to `kpos` (`blocks.key_blocks`, as the
    fused kernel runs them): a block no query sees is skipped, a causal triangle counts
    `causal_pairs` (`key_tile`: the kernel's), every other block each of its pairs (masked
    pairs run too)."""
    out = 0
    for c0, c1, found in key_blocks(mask, qpos, kpos, max(1, chunk)):
        n = c1 - c0
        out += causal_pairs(n, key_tile) if found == "causal" else len(qpos) * n
    return out


def key_tile(device: torch.device) -> int:
    """The key tile of the fused kernel the blocks run on `device` (`causal_pairs`): the
    CPU kernel's `CPU_KEY_TILE`, else 1 (an accelerator's flash kernel skips by element)."""
    return CPU_KEY_TILE if device.type == "cpu" else 1


def span(pos: Sequence[int]) -> tuple[int, ...]:
    """(first, last) of positions as `Mask.skips` reads them (it reads the least and the
    greatest only), () when empty: a range's in O(1)."""
    if not pos:
        return ()
    if isinstance(pos, range) and pos.step > 0:
        return pos[0], pos[-1]
    return min(pos), max(pos)


def plan_time(p: Plan, cost_model: CostModel) -> float:
    """Seconds of one run of `p` under `cost_model`: each collective pays its busiest rank's
    bytes over the bandwidth and a latency per hop of its algorithm (`hops`), both its
    wire's (`CostModel(wires=...)`) where the model names that wire."""
    total = 0.0
    for s in p.collectives:
        wire = s.wire or s.kind
        busiest = max(max(s.send_bytes), max(s.recv_bytes))
        extra = hops(wire, p.mesh.group_size(s.axes)) + s.rounds - 2
        total += (cost_model.time(s.axes, busiest, wire)
                  + extra * cost_model.time(s.axes, 0, wire))
    return total


def hops(collective: str, group: int) -> int:
    """The latencies one collective over `group` ranks pays in sequence: a ring all_gather,
    reduce_scatter or all_to_all runs g - 1 steps, an all_reduce 2 (g - 1); a
    point-to-point batch (the ring's shifts, a send_recv) one."""
    if collective in ("p2p", "send_recv", "collective_permute"):
        return 1
    return max(1, (2 if collective == "all_reduce" else 1) * (group - 1))


def seconds(flops_per_unit: float, units: int, rate: float) -> float:
    """Seconds of `units` pair x batch x heads x head-dim elements at `flops_per_unit` each."""
    return flops_per_unit * units / rate


def serial(comm_s: float, compute_s: float) -> tuple[float, float, float]:
    """(time, comm, compute) of a strategy whose communication does not overlap its math."""
    return comm_s + compute_s, comm_s, compute_s


def ring_time(step_work: Sequence[int], kv_s: float, dkv_s: float, latency_s: float,
              rate: float) -> tuple[float, float, float]:
    """(time, comm, compute) of the ring: `step_work[t]` is the most pairs x batch x heads x
    head dim any member computes at step t; `kv_s` one K/V hop, `dkv_s` one dK/dV hop.
    Forward: step t < size - 1 overlaps the next block's hop; backward: step t overlaps the
    next K/V block and the dK/dV buffer posted at step t - 1, one message (one latency,
    `latency_s`, which `kv_s` and `dkv_s` each include); the last buffer's hop home is
    exposed, and each pass exposes one latency."""
    size = len(step_work)
    fwd = [seconds(FORWARD_FLOPS, n, rate) for n in step_work]
    bwd = [seconds(BACKWARD_FLOPS, n, rate) for n in step_work]
    if size <= 1:
        return sum(fwd) + sum(bwd), 0.0, sum(fwd) + sum(bwd)
    kv = [kv_s if t < size - 1 else 0.0 for t in range(size)]
    # backward, one message a step: the next K/V block and the dK/dV buffer pay one latency
    back = [kv[t] + (dkv_s - (latency_s if kv[t] else 0.0) if t > 0 else 0.0)
            for t in range(size)]
    time = (sum(max(c, m) for c, m in zip(fwd, kv)) + sum(max(c, m) for c, m in zip(bwd, back))
            + dkv_s + 2 * latency_s)
    return time, sum(kv) + sum(back) + dkv_s, sum(fwd) + sum(bwd)


def chunked_seconds(mask: Mask, qpos: Sequence[int], kpos: Sequence[int], per_pair: int,
                    rate: float, tile: int = 1) -> float:
    """Seconds of forward and backward of `blocks.chunked` over these positions (`tile`:
    the kernel's key tile, `key_tile`)."""
    return seconds((FORWARD_FLOPS + BACKWARD_FLOPS) * per_pair,
                   pairs(mask, qpos, kpos, KEY_CHUNK, tile), rate)


def per_pair(local_shape: Sequence[int], order: Sequence[int], head_dim: int) -> int:
    """Batch x heads x head dim of a rank's local query shape (`order`: b h s d dims)."""
    b, h = order[0], order[1]
    return (local_shape[b] if b >= 0 else 1) * local_shape[h] * head_dim


def check_rate(flops: float) -> None:
    if not (flops > 0 and math.isfinite(flops)):
        raise ValueError(f"attention(flops={flops!r}): expected a positive FLOP/s rate, e.g."
                         " flops=100e12")
