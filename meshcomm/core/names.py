"""Generated names: the one place meshcomm makes up a dim name.

This module never communicates. A name meshcomm invents (a dim named by its position, a
sized factor that needs a name, a fix suggested in an error) never equals a mesh axis or a
name it is written beside: a layout reads a name that equals a mesh axis as that axis, so a
collision turns "dim 0, whole" into "dim 0, sharded over d0" silently. An unnamed
DeviceMesh's axes are d0, d1, ...; PyTorch's tests build meshes that way.
A test scans the package for names generated anywhere else.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator

_POSITIONAL_FORMS = ("d{}", "dim{}", "t{}")


def positional_names(ndim: int, axes: Iterable[str] = (),
                     avoid: Collection[str] = ()) -> tuple[str, ...]:
    """Dim names by position, none a mesh axis in `axes` or a name in `avoid`: d0 d1 ...,
    else dim0 dim1 ..., else t0 t1 ..., else d0_ d1_ ... with as many underscores as it takes.

    >>> positional_names(2, ("dp", "tp")), positional_names(2, ("d0", "d1"))
    (('d0', 'd1'), ('dim0', 'dim1'))
    >>> positional_names(2, ("d0", "dim1", "t0"))
    ('d0_', 'd1_')
    """
    taken = set(axes) | set(avoid)
    forms = itertools.chain(_POSITIONAL_FORMS, (f"d{{}}{'_' * k}" for k in itertools.count(1)))
    for form in forms:                     # ends: each form is free once its suffix is long
        names = tuple(form.format(i) for i in range(ndim))
        if taken.isdisjoint(names):
            return names
    raise AssertionError("unreachable: the forms never end")


def fresh_names(stems: Iterable[str], taken: Collection[str]) -> Iterator[str]:
    """Names not in `taken` and never repeated: each stem, then each stem with 1, 2, ...

    >>> names = fresh_names("xyz", {"x", "y1"})
    >>> [next(names) for _ in range(4)]
    ['y', 'z', 'x1', 'z1']
    """
    stems = tuple(stems)
    for k in itertools.count():
        for stem in stems:
            name = f"{stem}{k or ''}"
            if name not in taken:
                yield name


def fresh_name(stem: str, taken: set[str]) -> str:
    """`stem` with the smallest number 1, 2, ... that makes a name not in `taken`, which
    then holds it (a run of fresh names from one stem never repeats).

    >>> taken = {"b", "b1"}
    >>> fresh_name("b", taken), fresh_name("b", taken)
    ('b2', 'b3')
    """
    name = next(n for n in fresh_names([stem], taken) if n != stem)
    taken.add(name)
    return name
