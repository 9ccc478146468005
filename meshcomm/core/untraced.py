"""Running planner code (which counts with small real tensors) while torch.compile traces.

Pure torch, no communication. Under a dispatch mode (the compiler's fake tensors), the
tensors the planner makes would become fake, data-dependent ones; `untraced` runs a
function outside every active mode instead, so its results are real values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

T = TypeVar("T")


def tracing() -> bool:
    """True while a dispatch mode is active (e.g. the compiler's fake tensors)."""
    return _get_current_dispatch_mode() is not None


def untraced(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` outside any active dispatch mode (a plain call when none is).

    >>> untraced(max, 2, 3)
    3
    """
    if not tracing():
        return fn(*args, **kwargs)
    with _disable_current_modes():
        return fn(*args, **kwargs)
