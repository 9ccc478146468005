"""Parse and print layout patterns such as "(dp b) s (tp h) | sum(cp)".

This module never communicates and knows nothing of meshes: it turns text into
dims and factors and back. Every pattern that parses prints back in one
canonical form, and parsing that form gives the same value.

Grammar (whitespace separates tokens)::

    layout  := dim* ["|" reduce+]
    dim     := factor | "(" factor+ ")" | "zigzag(" NAME+ ")"
    factor  := NAME | NAME "=" INT          (a sized factor, e.g. x=2)
    reduce  := OP "(" NAME ("," NAME)* ")"   OP in sum, avg, max, min

"zigzag(cp s)" is the head-tail (zigzag) split of a dim over mesh axes: each rank's
contiguous block of "(cp s)" is its two halves, the first at the head of the dim in rank
order, the second at its tail in reverse rank order (rank r of cp holds chunks r and
2cp-1-r of 2cp). Its factors are mesh axes and one dim name, the name last.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .errors import LayoutSyntaxError, caret
from .reduce_ops import REDUCE_OPS

ZIGZAG = "zigzag"     # "zigzag(cp s)": the head-tail split (a dim of that name: no "(" after)

# The token is optional so that trailing whitespace (newlines too, which "." skips) matches.
_TOKEN_RE = re.compile(r"\s*(?:([A-Za-z_][A-Za-z0-9_]*)(\s*=\s*(-?[0-9]+))?|(.))?")


@dataclass(frozen=True, slots=True)
class Factor:
    """One factor of a dim: a mesh axis or local name (size from the mesh/shape) or `x=2`."""

    name: str
    size: int | None = None

    def __str__(self) -> str:
        return self.name if self.size is None else f"{self.name}={self.size}"


@dataclass(frozen=True, slots=True)
class Dim:
    """A tensor dim as factors, major to minor; one factor is a plain dim. `zigzag`: the
    head-tail split of the group (see the module doc)."""

    factors: tuple[Factor, ...]
    zigzag: bool = False

    def __str__(self) -> str:
        if self.zigzag:
            return "zigzag(" + " ".join(str(f) for f in self.factors) + ")"
        if len(self.factors) == 1:
            return str(self.factors[0])
        return "(" + " ".join(str(f) for f in self.factors) + ")"


@dataclass(frozen=True, slots=True)
class Pattern:
    """A parsed layout pattern: dims and the pending reduction (op, axes)."""

    dims: tuple[Dim, ...]
    reduce_op: str | None
    reduce_axes: tuple[str, ...]

    def __str__(self) -> str:
        text = " ".join(str(d) for d in self.dims)
        if self.reduce_op:
            tail = f"| {self.reduce_op}({', '.join(self.reduce_axes)})"
            text = f"{text} {tail}" if text else tail
        return text


def _fail(text: str, start: int, end: int, why: str, fix: str = "") -> LayoutSyntaxError:
    msg = f'cannot parse layout "{text}"\n' + caret(text, start, end, why)
    return LayoutSyntaxError(msg + (f"\n  fix: {fix}" if fix else ""))


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Pattern:
    """Parse a layout pattern into a canonical `Pattern` (cached).

    >>> str(parse("( dp  b ) s|sum(tp)"))
    '(dp b) s | sum(tp)'
    """
    if not isinstance(text, str):
        raise LayoutSyntaxError(f"a layout is a string such as \"(dp b) s\", got {text!r}")
    bar = text.find("|")
    body = text if bar < 0 else text[:bar]
    missing_bar = re.search(rf"\b({'|'.join(REDUCE_OPS)})\(", body)
    if missing_bar:       # "a b sum(tp)" would read as the dims a, b, sum and (tp)
        before = body[:missing_bar.start()].rstrip()
        raise _fail(text, missing_bar.start(), missing_bar.end(1),
                    "a pending reduction comes after a bar", f'write "{before} | '
                    f'{text[missing_bar.start():].strip()}"')
    dims = _parse_dims(text, body)
    op, axes = (None, ()) if bar < 0 else _parse_reduce(text, bar)
    _check_unique(text, dims, axes)
    return Pattern(dims, op, axes)


def _tokens(text: str, start: int, end: int) -> list[tuple[int, int, str, int | None, str]]:
    """(start, end, name, size, punct) tokens of text[start:end]."""
    out = []
    pos = start
    while pos < end:
        m = _TOKEN_RE.match(text, pos, end)
        assert m, f"token regex must match at {pos} in {text!r}"
        if m.group(0).strip() == "":
            break
        tok_start = m.start(1) if m.group(1) else m.start(4)
        if m.group(1):
            if m.group(2) and len(m.group(3).lstrip("-0")) > 18:   # int() refuses 4300+ digits
                raise _fail(text, tok_start, m.end(), "this size is too large", "write x=2")
            size = int(m.group(3)) if m.group(2) else None
            if m.group(2) and m.group(3) is None:
                raise _fail(text, tok_start, m.end(), "expected a size after '='", "write x=2")
            out.append((tok_start, m.end(), m.group(1), size, ""))
        else:
            out.append((tok_start, m.end(), "", None, m.group(4)))
        pos = m.end()
    return out


def _factor(text: str, tok: tuple[int, int, str, int | None, str]) -> Factor:
    start, end, name, size, _ = tok
    if size is not None and size < 1:
        raise _fail(text, start, end, "a sized factor needs a size of at least 1", "write x=2")
    return Factor(name, size)


def _parse_dims(text: str, body: str) -> tuple[Dim, ...]:
    dims: list[Dim] = []
    group: list[Factor] | None = None
    open_at = 0
    zigzag = False
    toks = _tokens(text, 0, len(body))
    for i, tok in enumerate(toks):
        start, end, name, size, punct = tok
        if name == ZIGZAG and size is None and i + 1 < len(toks) and toks[i + 1][4] == "(":
            if group is not None:
                raise _fail(text, start, end, "a group cannot open inside another group",
                            "close the first group, e.g. \"zigzag(cp s) d\"")
            zigzag, open_at = True, start
            continue
        if name:
            factor = _factor(text, tok)
            if group is None:
                dims.append(Dim((factor,)))
            else:
                group.append(factor)
        elif punct == "(":
            if group is not None:
                raise _fail(text, start, end, "a group cannot open inside another group",
                            "close the first group, e.g. \"(dp b) s (tp h)\"")
            group, open_at = [], (open_at if zigzag else start)
        elif punct == ")":
            if group is None:
                raise _fail(text, start, end, "')' closes no group", "remove it or add '('")
            if not group:
                raise _fail(text, open_at, end, "an empty group names no factor",
                            "write at least one name, e.g. \"(dp b)\"")
            if zigzag and (len(group) < 2 or group[-1].size is not None
                           or any(f.size is not None for f in group)):
                raise _fail(text, open_at, end, "zigzag(...) holds mesh axes and one dim name,"
                            " the name last", "write e.g. \"zigzag(cp s)\"")
            dims.append(Dim(tuple(group), zigzag))
            group, zigzag = None, False
        else:
            why = "unexpected character" + (" (a size needs a name: x=2)"
                                            if punct.isdigit() else "")
            raise _fail(text, start, end, why, "dims are names or (groups of names)")
    if group is not None:
        raise _fail(text, open_at, len(body.rstrip()), "this group is never closed",
                    "add ')' at the end of the group")
    return tuple(dims)


def _parse_reduce(text: str, bar: int) -> tuple[str, tuple[str, ...]]:
    toks = _tokens(text, bar + 1, len(text))
    if not toks:
        raise _fail(text, bar, bar + 1, "'|' must be followed by a reduction",
                    "write e.g. \"... | sum(tp)\", or remove the '|'")
    ops: list[str] = []
    axes: list[str] = []
    i = 0
    while i < len(toks):
        start, end, name, size, punct = toks[i]
        if name not in REDUCE_OPS or size is not None:
            raise _fail(text, start, end, f"expected one of {', '.join(REDUCE_OPS)}",
                        "write e.g. \"| sum(tp)\"")
        i = _parse_reduce_axes(text, toks, i + 1, axes, end)
        ops.append(name)
    if len(set(ops)) > 1:
        raise _fail(text, bar, len(text), f"one layout can hold one pending reduction, got {ops}",
                    "resolve one reduction first (e.g. reshard to a layout without it)")
    return ops[0], tuple(axes)


def _parse_reduce_axes(text: str, toks: list[tuple[int, int, str, int | None, str]], i: int,
                       axes: list[str], after: int) -> int:
    if i >= len(toks) or toks[i][4] != "(":
        raise _fail(text, after, after + 1, "expected '(' and mesh axes", "write e.g. sum(tp)")
    i += 1
    want_name = True
    while i < len(toks):
        start, end, name, size, punct = toks[i]
        if want_name and name and size is None:
            axes.append(name)
        elif not want_name and punct == ",":
            pass
        elif not want_name and punct == ")":
            return i + 1
        else:
            why = "expected a mesh axis name" if want_name else "expected ',' or ')'"
            raise _fail(text, start, end, why, "write e.g. sum(tp, cp)")
        want_name = not want_name
        i += 1
    raise _fail(text, len(text.rstrip()) - 1, len(text.rstrip()), "the reduction is never closed",
                "add ')'")


def _check_unique(text: str, dims: tuple[Dim, ...], axes: tuple[str, ...]) -> None:
    seen: set[str] = set()
    for name in [f.name for d in dims for f in d.factors] + list(axes):
        if name in seen:
            at = [m.start() for m in re.finditer(rf"\b{re.escape(name)}\b", text)]
            raise _fail(text, at[-1] if at else 0, (at[-1] if at else 0) + len(name),
                        f'"{name}" appears twice; every name is used once',
                        "a mesh axis shards one dim or is pending; rename the dim")
        seen.add(name)
