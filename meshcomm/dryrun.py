"""A dry run: this process as rank `rank` of a `world_size`-rank job, alone, in seconds.

torch's fake process group stands in for the job (every collective returns at once, sending
nothing), and the script builds its model on the meta device where it can, so nothing is
allocated either. While it runs, a dispatch mode records what rank `rank` would do, step by
step (a step ends at each `optimizer.step()`, or at the end of the run):

- every collective: its kind, its group (size, and the mesh axes when a meshcomm mesh made
  it), and the bytes this rank sends and receives (formulas below);
- the peak of the bytes held by tensors made while the run goes on (live storages,
  counted once per storage however many views share it; a DTensor counts as its local
  tensor; tensors made before the run, e.g. a model built outside it, are not counted);
- the host time of the step.

Bytes per rank come from the executor's formulas (`meshcomm.executors.steps.Wire`, what
`mc.plan`'s sent and received columns count): for a group of g ranks and a tensor of T bytes
in and O out, all_gather sends T to each of the g - 1 others and receives O - T;
reduce_scatter sends T - O and receives (g - 1) O; all_reduce (ring) sends and receives
(T - c) + (g - 1) c, c this rank's torch.chunk chunk (about 2 T (g - 1) / g); all_to_all
sends what its splits send to others and receives what comes from others.

    $ meshcomm dryrun -n 1024 --rank 5 examples/train_llama.py --size 8b --mesh "dp=128 tp=8"

    >>> result, report = mc.dryrun.run(train_step, world_size=1024, rank=5)   # doctest: +SKIP
    >>> print(report)                                                          # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .core.errors import MeshMismatchError
from .core.units import format_bytes
from .executors.distributed.groups import resolve_group
from .executors.local import storage_key
from .executors.steps import Wire
from .runtime.bind import GROUP_DESC

__all__ = ["Collective", "Report", "Step", "active", "run", "start"]


@dataclass(frozen=True)
class Collective:
    """One collective call of the dry-run rank."""

    kind: str                      # all_gather, reduce_scatter, all_reduce, all_to_all, ...
    group: str                     # the mesh axes of its group (or "world", or "g=N")
    size: int                      # ranks in the group
    sent_bytes: int
    received_bytes: int


@dataclass(frozen=True)
class Step:
    """What the dry-run rank did between two optimizer steps."""

    index: int
    collectives: tuple[Collective, ...]
    peak_bytes: int                # the most bytes live tensors held during the step
    host_s: float

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def received_bytes(self) -> int:
        return sum(c.received_bytes for c in self.collectives)


@dataclass(frozen=True)
class Report:
    """Every step of a dry run; `str()` is the printout."""

    world_size: int
    rank: int
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        lines = [f"dry run: rank {self.rank} of {self.world_size} (fake process group)"]
        for s in self.steps:
            lines.append(f"step {s.index}: {len(s.collectives)} collectives, sent"
                         f" {format_bytes(s.sent_bytes)}, received"
                         f" {format_bytes(s.received_bytes)}, peak memory"
                         f" {format_bytes(s.peak_bytes)}, host {s.host_s:.3f} s")
            rows: dict[tuple[str, str, int], list[int]] = {}
            for c in s.collectives:
                row = rows.setdefault((c.kind, c.group, c.size), [0, 0, 0])
                row[0] += 1
                row[1] += c.sent_bytes
                row[2] += c.received_bytes
            for (kind, group, size), (count, sent, received) in rows.items():
                lines.append(f"  {count:4d} x {kind:<15s} {group + f' ({size})':<16s}"
                             f" sent {format_bytes(sent):>10s}  received"
                             f" {format_bytes(received):>10s}")
        return "\n".join(lines)


def active() -> bool:
    """True inside a dry run (the default process group is the fake one)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def start(world_size: int, rank: int) -> None:
    """Open torch's fake process group as rank `rank` of `world_size` (once per process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
        raise MeshMismatchError(f"dry run: rank {rank!r} of world_size {world_size!r}; fix: a"
                                " world size >= 1 and a rank in [0, world_size)")
    if dist.is_initialized():
        if active() and (dist.get_world_size(), dist.get_rank()) == (world_size, rank):
            return
        raise MeshMismatchError("dry run: torch.distributed is initialized already; fix: start"
                                " the dry run before anything opens a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def run(fn: Callable[..., Any], *args: Any, world_size: int, rank: int,
        **kwargs: Any) -> tuple[Any, Report]:
    """`fn(*args, **kwargs)` run as rank `rank` of a `world_size`-rank job: its result and
    the dry-run report (see the module doc)."""
    start(world_size, rank)
    recorder = _Recorder()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *_: recorder.end_step())
    try:
        with recorder:
            result = fn(*args, **kwargs)
    finally:
        handle.remove()
    recorder.end_step(final=True)
    return result, Report(world_size, rank, tuple(recorder.steps))


# -- recording --------------------------------------------------------------------------------
_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
          "broadcast": "broadcast", "all_gather_into_tensor_coalesced": "all_gather",
          "reduce_scatter_tensor_coalesced": "reduce_scatter",
          "all_reduce_coalesced": "all_reduce"}


_PASS_THROUGH = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


@dataclass
class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records collectives and live tensor bytes of everything dispatched under it."""

    steps: list[Step] = field(default_factory=list)
    calls: list[Collective] = field(default_factory=list)
    live: int = 0
    peak: int = 0
    held: dict[int, list[int]] = field(default_factory=dict)   # storage -> [bytes, refs]
    alias: dict[int, int] = field(default_factory=dict)  # meta storage -> the held one it is
    aliases_of: dict[int, list[int]] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _KINDS:
            self.calls.append(_collective(_KINDS[name], args, out))
        elif func.namespace == "_c10d_functional" and name == "batch_p2p_ops":
            self.calls.append(_p2p(args))
        elif func.namespace == "c10d" and name == "alltoall_base_":
            self.calls.append(_all_to_all_base(args))
        # these hand back their input on a device; their meta kernels make a new tensor
        same = (storage_key(args[0]) if func.namespace == "_c10d_functional"
                and name in _PASS_THROUGH and isinstance(args[0], torch.Tensor) else None)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # a wrapper (DTensor) owns no memory: its local tensor, made by its own ops, does
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                self._hold(t, same)
        return out

    def _hold(self, t: torch.Tensor, same: int | None = None) -> None:
        own = storage_key(t)
        if same is not None and self.alias.get(same, same) in self.held:
            target = self.alias.get(same, same)              # t is its input, on a device
            self.alias[own] = target
            self.aliases_of.setdefault(target, []).append(own)
        key = self.alias.get(own, own)
        entry = self.held.get(key)
        if entry is None:
            entry = self.held[key] = [t.untyped_storage().nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.held.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self.held[key]
                for own in self.aliases_of.pop(key, ()):
                    self.alias.pop(own, None)

    def end_step(self, final: bool = False) -> None:
        if final and not self.calls and self.steps:
            return
        now = time.perf_counter()
        self.steps.append(Step(len(self.steps) + 1, tuple(self.calls), self.peak, now - self.t0))
        self.calls, self.peak, self.t0 = [], self.live, time.perf_counter()


def _collective(kind: str, args: Any, out: Any) -> Collective:
    """One call's bytes, by the executor's formulas (`Wire`, as `mc.plan` counts)."""
    x = args[0]
    group_name = args[-1] if isinstance(args[-1], str) else args[-2]
    size, group = _group(group_name)
    ins = list(x) if isinstance(x, (list, tuple)) else [x]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    item = ins[0].element_size()
    numel_in, numel_out = sum(t.numel() for t in ins), sum(t.numel() for t in outs)
    if kind == "broadcast":       # the root sends to every other rank
        return Collective(kind, group, size, numel_in * (size - 1) * item, numel_in * item)
    splits: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    if kind == "all_to_all" and args[1] is not None:
        row = math.prod(x.shape[1:]) if x.dim() > 1 else 1
        splits = (tuple(s * row for s in args[2]), tuple(s * row for s in args[1]))
    call = Wire(kind, size, _position(group_name), numel_in, numel_out, *splits)
    return Collective(kind, group, size, call.sent * item, call.received * item)


def _all_to_all_base(args: Any) -> Collective:
    """An eager all_to_all as meshcomm's wire posts it: the process group's own call
    (output, input, group, split lists in rows, empty for even splits), as the functional
    op makes it."""
    out, x, pg, out_splits, in_splits = args[:5]
    name = dist.ProcessGroup.unbox(pg).group_name
    size, group = _group(name)
    row = math.prod(x.shape[1:]) if x.dim() > 1 else 1
    call = Wire("all_to_all", size, _position(name), x.numel(), out.numel(),
                tuple(s * row for s in in_splits), tuple(s * row for s in out_splits))
    item = x.element_size()
    return Collective("all_to_all", group, size, call.sent * item, call.received * item)


def _p2p(args: Any) -> Collective:
    """One batch of point-to-point messages (a ring's shift, a permute, a transfer between
    meshes): the bytes of its sends and of its receives, as `wire.p2p` counts them."""
    kinds, _, _, tensors, group_name = args[:5]
    size, group = _group(group_name or "")
    sent = sum(t.numel() * t.element_size() for k, t in zip(kinds, tensors) if k == "isend")
    got = sum(t.numel() * t.element_size() for k, t in zip(kinds, tensors) if k == "irecv")
    return Collective("p2p", group, size, sent, got)


def _group(name: str) -> tuple[int, str]:
    """(size, what to call it) of a process group by name: the mesh axes meshcomm made it
    for (its group_desc), "world", or its size."""
    pg = resolve_group(name)
    size = pg.size()
    desc = getattr(pg, "group_desc", "") or ""
    if desc.startswith(GROUP_DESC):
        return size, desc[len(GROUP_DESC):]
    return size, "world" if size == dist.get_world_size() else f"g={size}"


def _position(name: str) -> int:
    return int(resolve_group(name).rank())
