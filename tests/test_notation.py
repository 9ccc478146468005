"""Layout notation: canonical printing, exact syntax errors, fuzzing, round trips."""

from __future__ import annotations

import pickle
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshcomm import Layout
from meshcomm.core.layout import as_layout
from meshcomm.errors import LayoutSyntaxError, MeshcommError, ShapeError
from meshcomm.core import notation
from meshcomm.core.notation import Dim, Factor, Pattern

CANONICAL = [
    ("(dp b) s (tp h)", "(dp b) s (tp h)"),
    ("( dp  b ) s|sum(tp)", "(dp b) s | sum(tp)"),
    ("(dp tp b)", "(dp tp b)"),
    ("(tp dp b)", "(tp dp b)"),
    ("(b dp)", "(b dp)"),
    ("(x=2 tp b)", "(x=2 tp b)"),
    ("(x = 2 tp b)", "(x=2 tp b)"),
    ("(x=02 b)", "(x=2 b)"),
    ("(b)", "b"),
    ("( b )  s", "b s"),
    ("x=2", "x=2"),
    ("(dp x=2)", "(dp x=2)"),
    ("b", "b"),
    ("", ""),
    ("   ", ""),
    ("|sum(tp)", "| sum(tp)"),
    ("b|sum(tp,cp)", "b | sum(tp, cp)"),
    ("b | avg( tp , cp )", "b | avg(tp, cp)"),
    ("b | max(tp)", "b | max(tp)"),
    ("b | min(tp)", "b | min(tp)"),
    ("b | sum(tp) sum(cp)", "b | sum(tp, cp)"),
    ("\tb\n s ", "b s"),
    ("b\n", "b"),                      # trailing newline (was an AssertionError)
    ("\n", ""),
    ("(dp b)\n| sum(tp)\n", "(dp b) | sum(tp)"),
    ("(x=000000000000000000000002 b)", "(x=2 b)"),
    ("_a a1 A_1", "_a a1 A_1"),
]


@pytest.mark.parametrize("text, canonical", CANONICAL)
def test_canonical_form(text, canonical):
    layout = Layout(text)
    assert str(layout) == canonical
    assert repr(layout) == f"Layout({canonical!r})"
    assert Layout(canonical) == layout and hash(Layout(canonical)) == hash(layout)
    assert str(notation.parse(text)) == canonical


def test_structure():
    layout = Layout("(dp b) s (x=2 tp h) | avg(cp, ep)")
    assert layout.ndim == 3
    assert layout.dims == (Dim((Factor("dp"), Factor("b"))), Dim((Factor("s"),)),
                           Dim((Factor("x", 2), Factor("tp"), Factor("h"))))
    assert layout.reduce_op == "avg"
    assert layout.partial_axes == ("cp", "ep")
    assert layout.dim_names() == ("b", "s", "h")
    assert Layout("b s").reduce_op is None and Layout("b s").partial_axes == ()


def test_parsed_once_cached_and_frozen():
    assert Layout("(dp b) s") is Layout("(dp b) s")
    assert notation.parse("(dp b) s") is notation.parse("(dp b) s")
    layout = Layout("(dp b) s")
    assert Layout(layout) is layout and Layout.parse(layout) is layout
    assert as_layout("(dp b) s") is layout
    with pytest.raises(AttributeError):
        layout.pattern = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        layout.other = 1  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert eval(repr(layout), {"Layout": Layout}) == layout
    assert {Layout("(dp  b) s"): 1}[Layout("(dp b) s")] == 1
    assert Layout("(dp b) s") != Layout("(b dp) s")
    assert Layout("(dp b) s") != "(dp b) s"


def test_a_dim_named_like_an_op_still_parses():
    assert str(Layout("sum (dp b)")) == "sum (dp b)"       # a space: a dim "sum", then a group


def test_as_layout_rejects_other_types():
    with pytest.raises(ShapeError, match=re.escape(
            "layout must be a layout string or Layout, got int")):
        as_layout(3)  # type: ignore[arg-type]


def _msg(text: str, caret_line: str, fix: str) -> str:
    return f'cannot parse layout "{text}"\n    {text}\n    {caret_line}\n  fix: {fix}'


BAD = [
    ("(dp b s (tp h)", _msg("(dp b s (tp h)", "        ^ a group cannot open inside another group",
                            'close the first group, e.g. "(dp b) s (tp h)"')),
    ("((b))", _msg("((b))", " ^ a group cannot open inside another group",
                   'close the first group, e.g. "(dp b) s (tp h)"')),
    ("(dp b", _msg("(dp b", "^^^^^ this group is never closed", "add ')' at the end of the group")),
    ("dp b)", _msg("dp b)", "    ^ ')' closes no group", "remove it or add '('")),
    ("()", _msg("()", "^^ an empty group names no factor",
                'write at least one name, e.g. "(dp b)"')),
    ("b, s", _msg("b, s", " ^ unexpected character", "dims are names or (groups of names)")),
    ("b 2", _msg("b 2", "  ^ unexpected character (a size needs a name: x=2)",
                 "dims are names or (groups of names)")),
    ("b é", _msg("b é", "  ^ unexpected character", "dims are names or (groups of names)")),
    ("(x= b)", _msg("(x= b)", "  ^ unexpected character", "dims are names or (groups of names)")),
    ("(x=0 b)", _msg("(x=0 b)", " ^^^ a sized factor needs a size of at least 1", "write x=2")),
    ("(x=1234567890123456789 b)", _msg("(x=1234567890123456789 b)",
                                       " ^^^^^^^^^^^^^^^^^^^^^ this size is too large",
                                       "write x=2")),
    ("(x=-1 b)", _msg("(x=-1 b)", " ^^^^ a sized factor needs a size of at least 1", "write x=2")),
    ("b b", _msg("b b", '  ^ "b" appears twice; every name is used once',
                 "a mesh axis shards one dim or is pending; rename the dim")),
    ("(dp b) (dp s)", _msg("(dp b) (dp s)", '        ^^ "dp" appears twice; every name is used'
                           " once", "a mesh axis shards one dim or is pending; rename the dim")),
    ("(tp b) s | sum(tp)", _msg("(tp b) s | sum(tp)", '               ^^ "tp" appears twice;'
                                " every name is used once",
                                "a mesh axis shards one dim or is pending; rename the dim")),
    ("b | sum(tp, tp)", _msg("b | sum(tp, tp)", '            ^^ "tp" appears twice; every name is'
                             " used once",
                             "a mesh axis shards one dim or is pending; rename the dim")),
    ("b |", _msg("b |", "  ^ '|' must be followed by a reduction",
                 "write e.g. \"... | sum(tp)\", or remove the '|'")),
    ("|", _msg("|", "^ '|' must be followed by a reduction",
               "write e.g. \"... | sum(tp)\", or remove the '|'")),
    ("b | foo(tp)", _msg("b | foo(tp)", "    ^^^ expected one of sum, avg, max, min",
                         'write e.g. "| sum(tp)"')),
    ("b || sum(tp)", _msg("b || sum(tp)", "   ^ expected one of sum, avg, max, min",
                          'write e.g. "| sum(tp)"')),
    ("b | sum(tp) s", _msg("b | sum(tp) s", "            ^ expected one of sum, avg, max, min",
                           'write e.g. "| sum(tp)"')),
    ("b | sum tp", _msg("b | sum tp", "       ^ expected '(' and mesh axes", "write e.g. sum(tp)")),
    ("b | sum(tp", _msg("b | sum(tp", "         ^ the reduction is never closed", "add ')'")),
    ("b | sum(tp cp)", _msg("b | sum(tp cp)", "           ^^ expected ',' or ')'",
                            "write e.g. sum(tp, cp)")),
    ("b | sum(tp,)", _msg("b | sum(tp,)", "           ^ expected a mesh axis name",
                          "write e.g. sum(tp, cp)")),
    ("b | sum()", _msg("b | sum()", "        ^ expected a mesh axis name",
                       "write e.g. sum(tp, cp)")),
    ("b | sum(tp=2)", _msg("b | sum(tp=2)", "        ^^^^ expected a mesh axis name",
                           "write e.g. sum(tp, cp)")),
    ("a b sum(tp)", _msg("a b sum(tp)", "    ^^^ a pending reduction comes after a bar",
                         'write "a b | sum(tp)"')),
    ("b | sum(tp) max(cp)", _msg("b | sum(tp) max(cp)", "  ^^^^^^^^^^^^^^^^^ one layout can hold"
                                 " one pending reduction, got ['sum', 'max']",
                                 "resolve one reduction first (e.g. reshard to a layout without"
                                 " it)")),
]


@pytest.mark.parametrize("text, message", BAD)
def test_syntax_errors_exact(text, message):
    with pytest.raises(LayoutSyntaxError, match=re.escape(message)) as info:
        Layout(text)
    assert str(info.value) == message
    with pytest.raises(LayoutSyntaxError, match=re.escape(message)):
        notation.parse(text)


def test_not_a_string():
    with pytest.raises(LayoutSyntaxError, match=re.escape(
            'a layout is a string such as "(dp b) s", got 3')):
        Layout(3)  # type: ignore[arg-type]


# -- fuzzing -------------------------------------------------------------------------
ALPHABET = st.sampled_from("abcdpstxyzAB_0123456789 ()|=,") | st.characters()
OPS = ("sum", "avg", "max", "min")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(ALPHABET, max_size=40) | st.sampled_from([t for t, _ in BAD])
       | st.sampled_from(["b\n", "\n", "(b\n", "b |\n", "(x=" + "9" * 5000 + " b)"]))
def test_fuzz_any_text_parses_or_raises_a_meshcomm_error(text):
    try:
        layout = Layout(text)
    except MeshcommError as err:
        assert isinstance(err, LayoutSyntaxError)
        assert str(err).startswith(f'cannot parse layout "{text}"\n') or "a layout is" in str(err)
        return
    assert Layout(str(layout)) == layout
    assert str(Layout(str(layout))) == str(layout)


NAMES = [f"{a}{b}" for a in "abdhpstxy_" for b in ("", "1", "p", "_z")]


@st.composite
def patterns(draw) -> tuple[str, str]:
    """A valid layout written with random spacing, and its canonical form built by hand."""
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=10))
    n_reduce = draw(st.integers(0, min(3, len(names))))
    reduce_names, names = names[:n_reduce], names[n_reduce:]
    dims: list[list[str]] = []
    while names:
        k = draw(st.integers(1, min(4, len(names))))
        group = [n if not draw(st.booleans()) else f"{n}={draw(st.integers(1, 99))}"
                 for n in names[:k]]
        names = names[k:]
        dims.append(group)
    space = st.sampled_from(["", " ", "  ", "\t"])
    sep = st.sampled_from([" ", "  ", "\n"])
    written, canonical = [], []
    for group in dims:
        paren = len(group) > 1 or draw(st.booleans())
        parts = [f.replace("=", draw(space) + "=" + draw(space)) for f in group]
        inner = draw(sep).join(parts)
        written.append(f"({draw(space)}{inner}{draw(space)})" if paren else inner)
        canonical.append(f"({' '.join(group)})" if len(group) > 1 else group[0])
    text = draw(space) + draw(sep).join(written) + draw(space)
    canon = " ".join(canonical)
    if reduce_names:
        op = draw(st.sampled_from(OPS))
        text += f"{draw(space)}|{draw(space)}{op}({draw(space)}" + \
            f"{draw(space)},{draw(space)}".join(reduce_names) + f"{draw(space)}){draw(space)}"
        tail = f"| {op}({', '.join(reduce_names)})"
        canon = f"{canon} {tail}" if canon else tail
    return text, canon


@settings(max_examples=300, deadline=None)
@given(patterns())
def test_generated_layouts_print_canonically_and_round_trip(case):
    text, canonical = case
    layout = Layout(text)
    assert str(layout) == canonical
    assert Layout(str(layout)) == layout
    assert notation.parse(str(layout)) == layout.pattern
    assert isinstance(layout.pattern, Pattern)
