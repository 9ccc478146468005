"""What runs when, for one model: the order its units run in (recorded by the first forward),
what is issued ahead of use (a unit's all_gather prefetched before it runs), the units whose
forward is running, and the reduce_scatters of the backward pass in flight. One schedule is
shared by every unit of one model; prefetch reads it (the next unit forward, the one before
in backward).

Named states: a schedule is `"recording"` until the first forward has seen every unit (a unit
seen again ends it), then `"ready"`. A forward that raises leaves nothing behind: `abandon()`
(called by the unit's post-forward hook, which runs on the way out of a failing forward too)
waits for and drops every prefetched buffer, and a recording cut short starts over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Literal, TypeVar

from ...executors.distributed import Handle

U = TypeVar("U")
T = TypeVar("T")
State = Literal["recording", "ready"]


class Schedule(Generic[U]):
    """Units in the order forward ran them, what was issued ahead of their use, and the
    state of the backward pass in flight."""

    def __init__(self) -> None:
        self.order: list[U] = []
        self.position: dict[int, int] = {}        # id(unit) -> its index in `order`
        self.state: State = "recording"
        self.ahead: dict[int, object] = {}        # id(unit) -> what was issued for it
        self.pending_reduce: list[tuple[U, Handle]] = []   # (unit, its issued reduction)
        self.callback_queued = False

    @property
    def recording(self) -> bool:
        return self.state == "recording"

    def record(self, unit: U) -> None:
        """The first forward records the order; a unit seen again ends the recording."""
        if id(unit) in self.position:
            self.state = "ready"
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

    # -- issued ahead of use -------------------------------------------------------------------
    def issue_ahead(self, unit: U, issue: Callable[[], T]) -> None:
        """Issue `unit`'s work now (`issue()`), unless it is issued already; `take` gets it."""
        if id(unit) not in self.ahead:
            self.ahead[id(unit)] = issue()

    def take(self, unit: U) -> object | None:
        """What was issued ahead for `unit`, now its own (None: nothing was)."""
        return self.ahead.pop(id(unit), None)

    def drop_ahead(self, wait: Callable[[object], None]) -> None:
        """Wait for (`wait(issued)`) and drop everything issued ahead that no unit used: a
        prefetch no forward used would be stale the next step."""
        ahead, self.ahead = self.ahead, {}
        for issued in ahead.values():
            wait(issued)

    def abandon(self, wait: Callable[[object], None]) -> None:
        """A forward raised: drop what was issued ahead, and record the order again if the
        recording was cut short (the next forward starts from a clean schedule)."""
        self.drop_ahead(wait)
        if self.recording:
            self.order, self.position = [], {}
