"""How evenly causal (or windowed) attention's work falls on the ranks of a sequence split:
the query-key pairs each rank's queries see, counted from the layout's positions (never
timed, no communication). A contiguous split of a causal sequence gives the last rank
about 2 - 1/cp times the mean; a striped one about the mean.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.layout import Layout
from ...core.mesh import Mesh


def pairs_per_rank(mesh: Mesh, layout: str | Layout, seq_len: int, *, causal: bool = True,
                   window: int | None = None, seq_dim: int = 0) -> dict[int, int]:
    """Per rank of `mesh`, the (query, key) pairs its queries attend to under `layout`
    (`seq_dim`: the sequence's dim in it; the other dims whole, size 1) for a sequence of
    `seq_len` tokens; the keys are the whole sequence (every strategy sees them all)."""
    lay = Layout.parse(layout)
    shape = tuple(seq_len if d == seq_dim else 1 for d in range(lay.ndim))
    out = {}
    for rank in mesh.ranks:
        positions = lay.indices(mesh, shape, rank)[seq_dim]
        out[rank] = sum(_seen(t, seq_len, causal, window) for t in positions)
    return out


def imbalance(work: Sequence[int] | dict[int, int]) -> float:
    """max / mean of per-rank work (1.0: perfectly even)."""
    values = list(work.values()) if isinstance(work, dict) else list(work)
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def _seen(t: int, n: int, causal: bool, window: int | None) -> int:
    """Keys token `t` of `n` sees."""
    lo = 0 if window is None else max(0, t - window + 1)
    hi = t if causal else (n - 1 if window is None else min(n - 1, t + window - 1))
    return hi - lo + 1
