"""Eager collectives on 4 gloo ranks call the functional op directly and never touch the
caller's tensor: a reshard of a partial source (all_reduce, reduce_scatter, avg, max, a plan
of several steps, async) leaves its input bit for bit as it was and returns a tensor of its
own, equal to the simulator's; no funcol wrapper runs for it. A collective that records a
gradient still goes through funcol, and its gradient is right."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from conftest import ranks_fixture

import meshcomm as mc

SHAPE = (8, 6)
CASES = [("b h | sum(dp, tp)", "b h"), ("b h | sum(tp)", "(tp b) h"), ("b h | avg(dp)", "b h"),
         ("b h | max(dp, tp)", "(dp b) h"), ("(dp b) h | sum(tp)", "(dp b) (tp h)"),
         ("b h | sum(dp)", "b (dp tp h)")]
FUNCOL = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
          "broadcast")


def count_funcol(calls: Counter[str]) -> None:
    """Wrap funcol's collectives to count the calls that go through them."""
    for name in FUNCOL:
        fn = getattr(funcol, name)

        def counted(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name,
                    **kwargs: Any) -> Any:
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(funcol, name, counted)


def worker(rank: int, world: int) -> dict[str, Any]:
    bound = mc.init_mesh("dp=2 tp=2")
    pos = bound.mesh.position(rank)
    calls: Counter[str] = Counter()
    count_funcol(calls)
    out: dict[str, Any] = {"problems": [], "kinds": []}
    full = (torch.arange(48, dtype=torch.float32).reshape(SHAPE) % 7) - 3
    for src, dst in CASES:
        out["kinds"].append([s.kind for s in mc.plan(bound.mesh, SHAPE, src, dst).steps])
        for async_op in (False, True):
            x = mc.sim.scatter(full, bound.mesh, src)[pos].clone()
            before = x.clone()
            y = mc.reshard(x, bound, src, dst, shape=SHAPE, async_op=async_op)
            want = mc.sim.scatter(full, bound.mesh, dst)[pos]
            what = f'"{src}" -> "{dst}" (async_op={async_op})'
            if not torch.equal(y, want):
                out["problems"].append(f"{what}: result differs from the simulator's")
            if not torch.equal(x, before):
                out["problems"].append(f"{what}: the input changed")
            y.add_(1)     # the result is the caller's own: writing it leaves the input alone
            if not torch.equal(x, before):
                out["problems"].append(f"{what}: the result shares the input's memory")
    out["reshard_funcol_calls"] = sum(calls.values())
    # recording a gradient: through funcol, whose backward all_reduces the gradients
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = mc.collectives.all_reduce(x, bound, ("dp", "tp"))
    (y * (rank + 1)).sum().backward()
    out["grad_funcol_calls"] = sum(calls.values()) - out["reshard_funcol_calls"]
    out["value"] = y.detach().tolist()
    out["grad"] = x.grad.tolist() if x.grad is not None else None
    # without a gradient: the op directly, the result waited on at first use
    z = mc.collectives.all_reduce(x.detach(), bound, ("dp", "tp"))
    out["lazy_type"] = type(z).__name__
    out["lazy_value"] = z.tolist()
    out["direct_funcol_calls"] = (sum(calls.values()) - out["reshard_funcol_calls"]
                                  - out["grad_funcol_calls"])
    return out


four = ranks_fixture(worker, 4)


def test_partial_sources_leave_the_input_untouched(four: list[dict[str, Any]]) -> None:
    problems = [p for r in four for p in r["problems"]]
    assert not problems, "\n".join(problems[:6])
    kinds = {k for ks in four[0]["kinds"] for k in ks}
    assert {"all_reduce", "reduce_scatter"} <= kinds, kinds


def test_eager_reshards_call_the_functional_ops_directly(four: list[dict[str, Any]]) -> None:
    assert [r["reshard_funcol_calls"] for r in four] == [0] * 4
    assert [r["direct_funcol_calls"] for r in four] == [0] * 4
    assert [r["lazy_type"] for r in four] == ["AsyncCollectiveTensor"] * 4
    assert all(r["lazy_value"] == [[10.0] * 3] * 2 for r in four)


def test_a_collective_that_records_a_gradient_goes_through_funcol(
        four: list[dict[str, Any]]) -> None:
    # forward: 1 + 2 + 3 + 4; backward: the sum of every member's output gradient (rank + 1)
    assert all(r["grad_funcol_calls"] == 1 for r in four)
    assert all(r["value"] == [[10.0] * 3] * 2 for r in four)
    assert all(r["grad"] == [[10.0] * 3] * 2 for r in four)
