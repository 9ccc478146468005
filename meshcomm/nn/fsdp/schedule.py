"""The order a model's units run in: recorded by the first forward, shared by every unit
of one model, read by prefetch (the next unit forward, the one before in backward); and the
reduce_scatters of the backward pass in flight."""

from __future__ import annotations

from typing import Generic, TypeVar

from torch import Tensor

U = TypeVar("U")


class Schedule(Generic[U]):
    """Units in the order forward ran them (recorded in the first pass), and the state of
    the backward pass in flight."""

    def __init__(self) -> None:
        self.order: list[U] = []
        self.position: dict[int, int] = {}        # id(unit) -> its index in `order`
        self.recording = True
        self.pending_reduce: list[tuple[U, Tensor, bool]] = []   # (unit, out, replicas done)
        self.callback_queued = False

    def record(self, unit: U) -> None:
        """The first forward records the order; a unit seen again ends the recording."""
        if id(unit) in self.position:
            self.recording = False
        else:
            self.position[id(unit)] = len(self.order)
            self.order.append(unit)

    def next_forward(self, unit: U) -> U | None:
        i = self.position.get(id(unit))
        if self.recording or i is None:
            return None
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def next_backward(self, unit: U) -> U | None:
        i = self.position.get(id(unit))
        return self.order[i - 1] if i else None
