"""Helpers for tests and benchmarks: random layouts drawn alike on every rank.

Processes are started by `meshcomm.executors.distributed.launch.run_ranks`.
"""

from __future__ import annotations

from typing import Any


def random_layout(rng: Any, mesh: Any, ndim: int, ops: tuple[str, ...],
                  names: str = "ijkl") -> str:
    """A random layout text for tests and benchmarks: each axis of `mesh` shards a dim (either
    side of its name), is pending with one of `ops`, or stays replicated. `rng` is a
    `random.Random`, so every rank that seeds it alike draws the same layouts."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial = []
    axes = list(mesh.axis_names)
    rng.shuffle(axes)
    for axis in axes:
        where = rng.choice(["rep", "partial"] + [f"d{i}" for i in range(ndim)])
        if where == "partial":
            partial.append(axis)
        elif where != "rep":
            dims[int(where[1:])].append(axis)
    parts = []
    for i, group in enumerate(dims):
        at = rng.randint(0, len(group)) if rng.random() < 0.5 else len(group)
        factors = group[:at] + [names[i]] + group[at:]
        parts.append(f"({' '.join(factors)})" if group else names[i])
    text = " ".join(parts)
    return text + (f" | {rng.choice(ops)}({', '.join(sorted(partial))})" if partial else "")
