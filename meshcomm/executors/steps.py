"""The step kinds both executors implement, and what a collective call measures.

`KINDS` is the planner's table (`meshcomm.planner.values.WIRES`): every step kind and the
collectives its steps run as. The simulator and the torch.distributed executor each have
one handler per kind (a test checks both tables against `KINDS` and runs every
(kind, wire) pair through both, comparing outputs and byte traces).

`Wire` is what one collective call was handed on one rank: the sizes of its input and
output buffers and, for an all_to_all, the split lists. Its `sent`/`received` follow from
those sizes and the collective's data movement, so an executor's byte trace is a
measurement of what it really did, not a copy of the planner's formulas
(`meshcomm.planner.traffic`), and the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.reduce_ops import chunk_size
from ..planner.values import WIRES

KINDS: dict[str, tuple[str, ...]] = WIRES


@dataclass(frozen=True, slots=True)
class Wire:
    """One collective call on one rank: `kind` over a group of `group` ranks at position
    `pos`, handed an input buffer of `numel_in` elements and giving `numel_out`; for an
    all_to_all, `in_splits`/`out_splits` per position (empty: even splits); for a broadcast,
    the `root` position whose buffer every other member receives.

    Data movement per kind (the standard algorithms, ring for all_reduce):
    - all_gather: the input goes to the g-1 others; the output's other blocks come in.
    - reduce_scatter: every chunk but the own output chunk goes out; g-1 chunks come in.
    - all_reduce: a reduce_scatter then an all_gather of the flat tensor's torch.chunk
      chunks: (n - c) + (g-1) c both ways, c this position's chunk.
    - all_to_all: every split but the own one, both ways.
    - broadcast: the root sends its buffer to each of the g-1 others (as gloo does).
    - p2p: a batch of point-to-point messages (`group` of them); what it sends is its
      input, what it receives its output.

    >>> Wire("all_gather", 4, 0, 6, 24).sent, Wire("all_gather", 4, 0, 6, 24).received
    (18, 18)
    >>> Wire("all_to_all", 2, 1, 5, 3, (2, 3), (1, 2)).sent
    2
    """

    kind: str
    group: int
    pos: int
    numel_in: int
    numel_out: int
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    root: int = 0

    @property
    def sent(self) -> int:
        g, n = self.group, self.numel_in
        if self.kind == "all_gather":
            return (g - 1) * n
        if self.kind == "reduce_scatter":
            return n - self.numel_out
        if self.kind == "all_reduce":
            return self._ring()
        if self.kind == "all_to_all":
            return _others(self.in_splits, n, g, self.pos)
        if self.kind == "broadcast":
            return (g - 1) * n if self.pos == self.root else 0
        if self.kind == "p2p":
            return n
        raise AssertionError(f"unknown collective {self.kind!r}")

    @property
    def received(self) -> int:
        g = self.group
        if self.kind == "all_gather":
            return self.numel_out - self.numel_in
        if self.kind == "reduce_scatter":
            return (g - 1) * self.numel_out
        if self.kind == "all_reduce":
            return self._ring()
        if self.kind == "all_to_all":
            return _others(self.out_splits, self.numel_out, g, self.pos)
        if self.kind == "broadcast":
            return 0 if self.pos == self.root else self.numel_out
        if self.kind == "p2p":
            return self.numel_out
        raise AssertionError(f"unknown collective {self.kind!r}")

    def _ring(self) -> int:
        c = chunk_size(self.numel_in, self.group, self.pos)   # O(1): per call
        return (self.numel_in - c) + (self.group - 1) * c


def _others(splits: Sequence[int], n: int, g: int, pos: int) -> int:
    """Elements of an all_to_all buffer of `n` that belong to other positions."""
    return n - (splits[pos] if splits else n // g)
