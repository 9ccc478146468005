"""`mc.nn.attention` on drawn cases, 4 and 8 gloo ranks, float64: hypothesis draws the mesh
(1-3 axes over the world, size-1 axes included), the axes that split the sequence (one or
two, in either order), the split's form (contiguous "(cp s)", uneven lengths included;
striped "(s cp)"; zigzag when the notation has it), heads split over a `tp` axis or not,
batch over a `dp` axis or not, GQA, query and key lengths (equal, or not: documents only
when equal), the masks (causal, window, document ids, combined) and the strategy. The
output and the gradients of q, k and v equal one process's `mc.nn.attention_reference` on
the global tensors (relative error <= 1e-10).

The ranks are launched once per world; inside each rank one hypothesis loop (derandomized,
no database, no shrinking, no health checks: nothing that depends on time or on a result)
draws the same examples in the same order on every rank, so their collectives meet. A case
that fails is recorded, not raised, so every rank finishes every example.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.executors.sim import scatter
from meshcomm.nn.attention import STRATEGIES
from meshcomm.runtime.bind import BoundMesh

from conftest import ranks_fixture

TOLERANCE = 1e-10
EXAMPLES = {4: 200, 8: 40}
MIN_SEQ_AXES = {"hybrid": 2}      # a strategy that needs the sequence split over more axes


def _parses(text: str) -> bool:
    try:
        mc.Layout(text)
    except ValueError:
        return False
    return True


# The sequence's split forms: (layout text of the seq dim from its axes, what the sequence
# length must be a multiple of for a group of that size). Adding a form is one line.
SPLITS: dict[str, tuple[Callable[[str], str], Callable[[int], int]]] = {
    "contiguous": (lambda axes: f"({axes} s)", lambda group: 1),
    "striped": (lambda axes: f"(s {axes})", lambda group: group),
}
if _parses("zigzag(cp s) d"):
    SPLITS["zigzag"] = (lambda axes: f"zigzag({axes} s)", lambda group: 2 * group)


@dataclass(frozen=True)
class Case:
    mesh: str                  # e.g. "x=1 cp=2 dp=2"
    layout: str                # e.g. "(dp b) (tp h) (cp s) d"
    form: str                  # a key of SPLITS
    seq: str                   # the layout of the sequence dim alone
    strategy: str
    b: int
    hq: int
    hk: int
    sq: int
    sk: int
    causal: bool
    window: int | None
    docs: bool
    seed: int

    @property
    def doc_layout(self) -> str:
        return f"{'(dp b)' if self.layout.startswith('(dp b)') else 'b'} {self.seq}"


def _sizes(world: int, n: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `n` axis sizes whose product is `world` (1s included)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out: list[tuple[int, ...]] = [()]
    for _ in range(n):
        out = [t + (d,) for t in out for d in divisors]
    return [t for t in out if math.prod(t) == world]


@st.composite
def cases(draw: st.DrawFn, world: int) -> Case:
    n = draw(st.integers(1, 3))
    sizes = draw(st.sampled_from(_sizes(world, n)))
    roles = list(range(n))
    seq_axes = draw(st.lists(st.sampled_from(roles), min_size=1, max_size=min(2, n),
                             unique=True))                    # in their layout order
    rest = [i for i in roles if i not in seq_axes]
    heads_axis = draw(st.sampled_from([None, *rest]))
    rest = [i for i in rest if i != heads_axis]
    batch_axis = draw(st.sampled_from([None, *rest]))
    names = {i: ("cp", "cq")[seq_axes.index(i)] if i in seq_axes else
             "tp" if i == heads_axis else "dp" if i == batch_axis else f"x{i}"
             for i in roles}
    mesh = " ".join(f"{names[i]}={sizes[i]}" for i in roles)
    group = math.prod(sizes[i] for i in seq_axes)
    form, (write, multiple) = draw(st.sampled_from(sorted(SPLITS.items())))
    seq = write(" ".join(names[i] for i in seq_axes))
    tp = 1 if heads_axis is None else sizes[heads_axis]
    hk = tp * draw(st.integers(1, 2))                  # the kv heads a tp rank holds: whole
    hq = hk * draw(st.sampled_from([1, 2]))             # GQA or not
    b = (1 if batch_axis is None else sizes[batch_axis]) * draw(st.integers(1, 2))

    def length() -> int:
        m = multiple(group)
        return m * draw(st.integers(1, max(1, 16 // m)))
    sq = length()
    sk = sq if draw(st.booleans()) else length()
    layout = " ".join(["(dp b)" if batch_axis is not None else "b",
                       "(tp h)" if heads_axis is not None else "h", seq, "d"])
    runnable = [s for s in sorted(STRATEGIES) if len(seq_axes) >= MIN_SEQ_AXES.get(s, 1)]
    return Case(mesh, layout, form, seq, draw(st.sampled_from(runnable)), b, hq, hk, sq,
                sk, draw(st.booleans()), draw(st.sampled_from([None, 1, 3, 6])),
                sq == sk and draw(st.booleans()), draw(st.integers(0, 2**16)))


def _inputs(c: Case) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(c.seed)
    d = 4

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    q, w = randn(c.b, c.hq, c.sq, d), randn(c.b, c.hq, c.sq, d)
    k, v = randn(c.b, c.hk, c.sk, d), randn(c.b, c.hk, c.sk, d)
    doc = torch.randint(0, 3, (c.b, c.sq), generator=g).sort(dim=1).values
    return q, k, v, w, doc


def run_case(bound: BoundMesh, c: Case) -> float:
    """The largest error of output, dq, dk, dv on this rank, relative to each whole
    tensor's largest entry, at least 1: a rank's part may be exactly 0, and so may a whole
    gradient (dq when every query sees one key), where rounding is all there is."""
    q, k, v, w, doc = _inputs(c)
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = mc.nn.attention_reference(rq, rk, rv, causal=c.causal, window=c.window,
                                    document_ids=doc if c.docs else None)
    (ref * w).sum().backward()
    mesh, at = bound.mesh, bound.mesh.position(bound.rank)

    def mine(t: torch.Tensor, layout: str = c.layout) -> torch.Tensor:
        return scatter(t, mesh, layout)[at]
    lq, lk, lv = (mine(t).clone().requires_grad_() for t in (q, k, v))
    out = mc.nn.attention(lq, lk, lv, bound, c.layout, causal=c.causal, window=c.window,
                          document_ids=mine(doc, c.doc_layout) if c.docs else None,
                          strategy=c.strategy, shape=q.shape, kv_shape=k.shape)
    (out * mine(w)).sum().backward()
    worst = 0.0
    for got, want in ((out, ref), (lq.grad, rq.grad), (lk.grad, rk.grad), (lv.grad, rv.grad)):
        assert want is not None
        here = mine(want.detach())
        assert got is not None and got.shape == here.shape, (got, here.shape)
        if here.numel():
            scale = want.detach().abs().max().clamp_min(1.0)
            worst = max(worst, ((got.detach() - here).abs().max() / scale).item())
    return worst


def drawn(rank: int, world: int) -> list[tuple[Case, float | str]]:
    """Every drawn case and its error on this rank (or the exception, as text)."""
    bounds: dict[str, BoundMesh] = {}
    seen: list[tuple[Case, float | str]] = []

    @settings(max_examples=EXAMPLES[world], derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cases(world))
    def loop(c: Case) -> None:
        if c.mesh not in bounds:
            bounds[c.mesh] = mc.init_mesh(c.mesh)
        try:
            seen.append((c, run_case(bounds[c.mesh], c)))
        except Exception as exc:        # noqa: BLE001 - reported by the test, not here
            seen.append((c, f"{type(exc).__name__}: {exc}"))
    loop()
    return seen


four = ranks_fixture(drawn, 4)
eight = ranks_fixture(drawn, 8)


def check(results: list[list[tuple[Case, float | str]]], world: int) -> None:
    first = [c for c, _ in results[0]]
    assert all([c for c, _ in r] == first for r in results), "the ranks drew different cases"
    assert len(first) >= EXAMPLES[world] // 2, len(first)
    bad = []
    for i, c in enumerate(first):
        errors = [r[i][1] for r in results]
        failed = [e for e in errors if isinstance(e, str)]
        if failed or max(errors) > TOLERANCE:   # type: ignore[type-var]
            bad.append((c, failed[0] if failed else max(errors)))  # type: ignore[type-var]
    assert not bad, "\n".join(map(str, bad[:5]))


def test_drawn_cases_equal_one_process_on_4(four: list[Any]) -> None:
    check(four, 4)


def test_drawn_cases_equal_one_process_on_8(eight: list[Any]) -> None:
    check(eight, 8)


def test_the_draws_cover_every_form_and_strategy(four: list[Any], eight: list[Any]) -> None:
    """The fixed examples reach each split form, strategy, mask and mesh shape."""
    drawn_cases = [c for r in (four[0], eight[0]) for c, _ in r]
    assert {c.strategy for c in drawn_cases} == set(STRATEGIES)
    assert {c.form for c in drawn_cases} == set(SPLITS)
    assert any(c.docs for c in drawn_cases) and any(c.sq != c.sk for c in drawn_cases)
    assert any(c.causal and c.window for c in drawn_cases)
    assert any("=1" in c.mesh for c in drawn_cases)
    assert {len(c.mesh.split()) for c in drawn_cases} == {1, 2, 3}
    assert any("(tp h)" in c.layout for c in drawn_cases)
    assert any(c.hq != c.hk for c in drawn_cases)
    assert any(" cq" in c.seq for c in drawn_cases)
