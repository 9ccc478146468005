"""Helpers for tests and benchmarks: random layouts drawn alike on every rank.

Processes are started by `meshcomm.runtime.launch.run_ranks`.
"""

from __future__ import annotations

from typing import Any


def random_layout(rng: Any, mesh: Any, ndim: int, ops: tuple[str, ...],
                  names: str = "ijkl", *, name_inside: float = 0.5, sized: float = 0.0,
                  sized_names: str = "xyzw") -> str:
    """A random layout text for tests and benchmarks: each axis of `mesh` shards a dim (either
    side of its name), is pending with one of `ops`, or stays replicated. `rng` is a
    `random.Random` (or one drawn by hypothesis, `st.randoms()`), so every rank that seeds it
    alike draws the same layouts.

    `name_inside` is the chance that a dim's name stands at a random place among its axes
    ("(dp i tp)", "(i dp)") rather than after them; 0 draws blocks only, "(axes... i)".
    `sized` is the chance that a dim also gets a sized local factor ("(x=2 dp i)", named from
    `sized_names`) at a random place; at 0 (the default) no draw is spent on it.

    >>> import random
    >>> from meshcomm import Mesh
    >>> random_layout(random.Random(0), Mesh("dp=2 tp=2"), 2, ("sum",))
    'i (dp j)'
    """
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
        at = rng.randint(0, len(group)) if rng.random() < name_inside else len(group)
        factors = group[:at] + [names[i]] + group[at:]
        if sized and rng.random() < sized:
            factors.insert(rng.randint(0, len(factors)), f"{sized_names[i]}=2")
        parts.append(f"({' '.join(factors)})" if len(factors) > 1 else factors[0])
    text = " ".join(parts)
    return text + (f" | {rng.choice(ops)}({', '.join(sorted(partial))})" if partial else "")
