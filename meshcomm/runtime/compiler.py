"""torch.compile support that costs nothing until torch.compile is used.

Marking a function for Dynamo (`torch._dynamo.nonstrict_trace`) imports `torch._dynamo`,
which takes over a second: more than the rest of `import meshcomm`. Dynamo only reads the
mark when it traces, and by then it has been imported, so meshcomm marks its functions the
moment `torch._dynamo` finishes loading (or at once, when it is already loaded):

    _traced = fn                                   # the plain function until then
    def _mark():
        global _traced
        _traced = torch._dynamo.nonstrict_trace(fn)
    when_dynamo_loads(_mark)

The callers read the module global at call time, which is when Dynamo reads it too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

DYNAMO = "torch._dynamo"

_pending: list[Callable[[], None]] = []
_lock = threading.Lock()


def dynamo_loaded() -> bool:
    """Whether `torch._dynamo` has finished importing in this process."""
    module = sys.modules.get(DYNAMO)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def when_dynamo_loads(callback: Callable[[], None]) -> None:
    """Run `callback` once `torch._dynamo` is imported: now if it is, else right after
    its import finishes (whoever imports it: `torch.compile`, a test, the user)."""
    with _lock:
        if not dynamo_loaded():
            _pending.append(callback)
            if not any(isinstance(f, _DynamoFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _DynamoFinder())
            return
    callback()


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Finds `torch._dynamo` as the other finders do, and runs the pending callbacks
    after its module body has run. Removes itself on first use."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_body = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_body(module)
            with _lock:
                callbacks = list(_pending)
                _pending.clear()
            for callback in callbacks:
                callback()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
