"""The plan memos: each mesh's plans, keyed on `plan()`'s arguments as given, and their bound.

This module never communicates. A mesh carries its memo (`Mesh._plans`, made on its first
`plan()` call), so that a repeated call is four dict lookups and hashes no mesh;
`PlanMemos` keeps every mesh's memo within one bound together, and dies with nothing: a
memo goes with its mesh.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..core.mesh import Mesh
from .values import CostModel, Plan


class PlanMemo:
    """One mesh's plans. `plain`: dtype (None by default) -> src -> dst -> shape -> plan, for
    calls without a cost model or destination mesh; `options`: (dtype, cost_model, dst_mesh)
    -> src -> dst -> shape -> plan for the others; `count`: the plans in both.

    Keys are the arguments as given (a layout string, a Layout, a tuple shape), so a hit
    normalizes nothing. `plan()` reads the tables inline (`memo.plain[dtype][src][dst]
    [shape]`): a lookup method would double the time of a hit.

    >>> memo = PlanMemo()
    >>> memo.insert("plan", (8, 4), "(dp b) h", "b h", None, None, None)
    >>> memo.plain[None]["(dp b) h"]["b h"][(8, 4)], memo.count
    ('plan', 1)
    """

    __slots__ = ("plain", "options", "count")

    def __init__(self) -> None:
        self.plain: dict[Any, Any] = {}
        self.options: dict[Any, Any] = {}
        self.count = 0

    def _branch(self, dtype: Any, cost_model: CostModel | None, dst_mesh: Mesh | None
                ) -> tuple[dict[Any, Any], Any]:
        if cost_model is None and dst_mesh is None:
            return self.plain, dtype
        return self.options, (dtype, cost_model, dst_mesh)

    def insert(self, found: Plan, shape: Any, src: Any, dst: Any, dtype: Any,
               cost_model: CostModel | None, dst_mesh: Mesh | None) -> None:
        """Remember `found` for these arguments (TypeError if one is unhashable)."""
        table, key = self._branch(dtype, cost_model, dst_mesh)
        table.setdefault(key, {}).setdefault(src, {}).setdefault(dst, {})[shape] = found
        self.count += 1

    def clear(self) -> None:
        self.plain.clear()
        self.options.clear()
        self.count = 0


class PlanMemos:
    """Every mesh's memo together: at most `bound` plans in all (0: none kept), and the
    `plan()` calls since they were last emptied that no memo answered (`misses`).

    >>> memos, mesh = PlanMemos(bound=1), Mesh("dp=2")
    >>> memos.insert(mesh, "plan", (2,), "(dp b)", "b", None, None, None)
    >>> memos.of(mesh).count, memos.fill()
    (1, 1)
    """

    def __init__(self, bound: int = 4096) -> None:
        self.bound = bound
        self.misses = 0
        self._held = 0          # plans inserted since the memos were last emptied
        self._meshes: weakref.WeakValueDictionary[int, Mesh] = weakref.WeakValueDictionary()

    def of(self, mesh: Mesh) -> PlanMemo:
        """`mesh`'s memo, made on first use (the Mesh slot is set once; the memo is not part
        of the mesh's value)."""
        memo = mesh._plans
        if memo is None:
            memo = PlanMemo()
            object.__setattr__(mesh, "_plans", memo)    # Mesh refuses plain assignment
        assert isinstance(memo, PlanMemo), f"Mesh._plans holds {memo!r}, not a PlanMemo"
        return memo

    def insert(self, mesh: Mesh, found: Plan, shape: Any, src: Any, dst: Any, dtype: Any,
               cost_model: CostModel | None, dst_mesh: Mesh | None) -> None:
        """Put `found` in `mesh`'s memo; where the memos hold `bound` plans, they empty first
        (the search's cache still holds the plans)."""
        if not self.bound:
            return
        if self._held >= self.bound:
            self._held = self.fill()              # plans in memos of meshes still alive
            if self._held >= self.bound:
                self.clear(keep_misses=True)
        self.of(mesh).insert(found, shape, src, dst, dtype, cost_model, dst_mesh)
        self._held += 1
        self._meshes[id(mesh)] = mesh

    def fill(self) -> int:
        """The plans in the memos of the meshes still alive."""
        return sum(self.of(mesh).count for mesh in list(self._meshes.values()))

    def clear(self, keep_misses: bool = False) -> None:
        """Empty every mesh's memo (and count `misses` from 0 unless `keep_misses`)."""
        for mesh in list(self._meshes.values()):
            self.of(mesh).clear()
        self._meshes.clear()
        self._held = 0
        if not keep_misses:
            self.misses = 0
