"""The saved-tensor regather of one unit: after forward, what autograd saved of the gathered
parameters is kept as (which parameter, size, stride, offset) only, and gathered again when
backward first needs it (then the next unit's gather is prefetched). Tensors are matched by
their storage (`storage_key`: meta tensors all have data_ptr 0)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from ...executors.local import storage_key
from .schedule import Schedule


class Gatherer(Protocol):
    """What the regather needs of a unit (unit.py's `Unit`)."""

    prefetch: bool
    schedule: Schedule[Any]

    @property
    def reshards(self) -> bool: ...

    def gather(self) -> list[Tensor]: ...

    def prefetch_gather(self) -> None: ...


@dataclass
class Saved:
    """A tensor autograd saved that is (a view of) a gathered parameter buffer."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Regather:
    """`pack` / `unpack` for `torch.autograd.graph.saved_tensors_hooks` around a unit's
    forward, and the parameters gathered again for its backward."""

    def __init__(self, unit: Gatherer) -> None:
        self.unit = unit
        self.storages: dict[int, int] = {}        # storage_key -> index of the parameter
        self.gathered: list[Tensor] | None = None  # gathered again for backward

    def forget(self) -> None:
        """Forward is over: no new saved tensor is one of the parameters."""
        self.storages = {}

    def release(self) -> None:
        """Backward of the unit is over: drop the parameters gathered again."""
        self.gathered = None

    def remember(self, tensors: Sequence[Tensor], which: Sequence[int] | None = None) -> None:
        """The tensors forward uses as the unit's parameters (views of the gathered ones);
        with `which`, only those positions (the others are not gathered tensors)."""
        self.storages = {}
        for i in range(len(tensors)) if which is None else which:
            self.storages.setdefault(storage_key(tensors[i]), i)

    def pack(self, t: Tensor) -> Any:
        key = self.storages.get(storage_key(t)) if t.numel() else None
        if key is None:
            return t
        return Saved(key, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def parameters(self) -> list[Tensor]:
        """The unit's parameters gathered again for backward (the first call gathers them
        and prefetches the gather of the unit backward reaches next)."""
        if self.gathered is None:
            unit = self.unit
            self.gathered = unit.gather()
            after = unit.schedule.next_backward(unit)
            if unit.prefetch and after is not None and after.reshards:
                after.prefetch_gather()
        return self.gathered

    def unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, Saved):
            return saved      # type: ignore[no-any-return]
        base = self.parameters()[saved.key]
        return base.as_strided(saved.size, saved.stride, saved.offset)

