"""Every error meshcomm raises, and helpers that write their messages.

All errors derive from `MeshcommError`; the input errors also derive from
`ValueError`, so `except ValueError` keeps working in user code. Messages say
what is wrong, where (the user's text, quoted verbatim, with a caret when there
is a position), what was expected, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MeshcommError(Exception):
    """Base class of every error raised by meshcomm."""


class LayoutSyntaxError(MeshcommError, ValueError):
    """A layout pattern that does not parse."""


class MeshAxisError(MeshcommError, ValueError):
    """An unknown, duplicated or misused mesh axis."""


class ShapeError(MeshcommError, ValueError):
    """A shape, size or local tensor that does not fit a layout or mesh."""


class MeshMismatchError(MeshcommError, ValueError):
    """Two meshes that should be the same are not."""


class RecipeError(MeshcommError, ValueError):
    """A layout recipe file that is not valid."""


class PlanError(MeshcommError, ValueError):
    """A layout change that cannot be planned (e.g. mixing two reductions on one axis)."""


class StyleError(MeshcommError, ValueError):
    """A tensor-parallel plan (`mc.nn.parallelize`) that names an unknown style, a pattern
    that matches no module, or a style on a module it does not fit."""


class ScheduleError(MeshcommError, ValueError):
    """A pipeline schedule that cannot run: an action that does not parse, a stage on two
    ranks, a microbatch computed twice or never, an order that deadlocks, or stages and
    hand-offs that do not fit each other."""


class LaunchError(MeshcommError, ValueError):
    """A launch that cannot start: a script that does not exist, no processes."""


class InteropError(MeshcommError, ValueError):
    """A layout, placement or mesh with no exact counterpart in torch DTensor (or back)."""


class CheckpointError(MeshcommError, KeyError):
    """A checkpoint that cannot fill the given state dict (missing keys, other shapes, not a
    meshcomm checkpoint)."""

    def __str__(self) -> str:       # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RankFailure(MeshcommError, RuntimeError):
    """A rank of a multi-process run raised, crashed or did not finish in time."""


class CollectiveError(MeshcommError, RuntimeError):
    """A collective that failed on this rank: a member of its group died or broke off."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective that did not complete within the process-group timeout (a member of its
    group died, hangs, or never called it)."""


class CollectiveMismatchError(CollectiveError):
    """Check mode: the ranks of a group asked for different operations (docs/errors.md)."""


class ReplicaDriftError(MeshcommError, RuntimeError):
    """Check mode: the copies of a replicated parameter got different gradients on the ranks
    that hold them, so an optimizer step would make them drift apart (docs/errors.md)."""


# Users meet these as `mc.errors.<Name>` (the module `meshcomm.errors`): tracebacks and
# pickles name that public home rather than this module.
for _cls in (MeshcommError, LayoutSyntaxError, MeshAxisError, ShapeError, MeshMismatchError,
             RecipeError, PlanError, InteropError, RankFailure, CollectiveError,
             CollectiveTimeout, CollectiveMismatchError, StyleError, LaunchError, CheckpointError,
             ReplicaDriftError):
    _cls.__module__ = "meshcomm.errors"


def caret(text: str, start: int, end: int | None = None, note: str = "") -> str:
    """The text on one line and a caret line under `text[start:end]`, indented by 4."""
    end = start + 1 if end is None or end <= start else end
    marks = " " * start + "^" * (end - start)
    return f"    {text}\n    {marks}" + (f" {note}" if note else "")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' fix: did you mean "x"?' for the closest choice, or '' when none is close. Two
    swapped letters count as one typo ("pd" is "dp", not "tp").

    >>> did_you_mean("pd", ["dp", "tp"]), did_you_mean("tpp", ["dp", "tp"])
    ('did you mean "dp"?', 'did you mean "tp"?')
    """
    options = list(choices)
    swapped = [c for c in options if len(c) == len(word) and c != word and _one_swap(word, c)]
    if swapped:
        return f'did you mean "{swapped[0]}"?'
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f'did you mean "{close[0]}"?' if close else ""


def _one_swap(a: str, b: str) -> bool:
    """True if `b` is `a` with two neighbouring letters swapped."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return (len(diff) == 2 and diff[1] == diff[0] + 1
            and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
