"""What a step needs of the whole group is worked out once, and what runs per call is O(1):
`per_step` (handlers' memo by step identity), `op_reduce_rows` (op_reduce's bits from one
stacked buffer), `chunk_size` (one position's torch.chunk size) and wire's split copies.
The per-step host time these keep flat is measured by benchmarks/host_scale.py (its Python
line counts are asserted in tests/test_host_scale_bench.py)."""

from __future__ import annotations

import pytest
import torch

import meshcomm as mc
from meshcomm.core.reduce_ops import chunk_size, chunk_sizes, op_reduce, op_reduce_rows
from meshcomm.executors.distributed import wire
from meshcomm.executors.distributed.handlers import per_step

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)


def _data(dtype: torch.dtype, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (k, 5, 3), generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(k, 5, 3, generator=gen) * 1e3).to(dtype)   # not integer-valued
    info = torch.iinfo(dtype)                                          # sums overflow
    return torch.randint(max(info.min, -2**40), min(info.max, 2**40) + 1, (k, 5, 3),
                         generator=gen, dtype=torch.int64).to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bool else x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_reduce_rows_gives_op_reduce_bits(dtype: torch.dtype) -> None:
    ops = ["sum", "max", "min", "avg"]
    if dtype.is_complex:
        ops = ["sum", "avg"]
    elif not dtype.is_floating_point:
        ops = ["sum", "max", "min"]
    for op in ops:
        for k in (1, 2, 3, 8, 37):
            x = _data(dtype, k, seed=k)
            want = op_reduce(list(x.unbind(0)), op)
            got = op_reduce_rows(x, op)
            assert got.dtype == want.dtype and got.shape == want.shape, (op, k)
            assert torch.equal(_bits(got), _bits(want)), (dtype, op, k)


def test_op_reduce_rows_is_one_call_for_integers_and_a_fold_for_floats() -> None:
    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func._opname)
            return func(*args, **(kwargs or {}))

    ints, floats = torch.ones(64, 4, dtype=torch.int32), torch.ones(64, 4)
    with Count():
        op_reduce_rows(ints, "sum")
    assert calls == ["sum"]
    calls.clear()
    with Count():
        op_reduce_rows(floats, "sum")
    assert calls.count("add") == 63       # ((t0 + t1) + t2) ...: floats keep the group order


def test_op_reduce_rows_keeps_its_input_and_names_a_bad_op() -> None:
    x = torch.arange(6).view(3, 2)
    out = op_reduce_rows(x, "max")
    out += 1
    assert x.tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(mc.errors.ShapeError, match="unknown reduce op 'prod'"):
        op_reduce_rows(x, "prod")


def test_chunk_size_is_one_entry_of_chunk_sizes() -> None:
    for n in range(0, 30):
        for g in range(1, 11):
            assert tuple(chunk_size(n, g, p) for p in range(g)) == chunk_sizes(n, g), (n, g)


def test_per_step_builds_once_per_step_and_key() -> None:
    p = mc.plan(mc.Mesh("dp=2 tp=4"), (8, 16), "(dp a) (tp b)", "(dp tp a) b")
    step = p.steps[0]
    built: list[int] = []

    def build() -> int:
        built.append(1)
        return len(built)

    assert per_step(step, "t", (3, (4, 4)), build) == 1
    assert per_step(step, "t", (3, (4, 4)), build) == 1        # a dict lookup, no rebuild
    assert per_step(step, "t", (5, (4, 4)), build) == 2        # another rank or shape
    assert per_step(step, "u", (5, (4, 4)), build) == 3        # another value of the step
    twin = mc.plan(mc.Mesh("dp=2 tp=4"), (8, 16), "(dp a) (tp b)", "(dp tp a) b",
                   cost_model=mc.CostModel(latency_s=1e-3)).steps[0]
    if twin is not step:                                       # kept by identity, not equality
        assert per_step(twin, "t", (5, (4, 4)), build) == 4


def test_wire_split_copies_are_c_level_for_flat_buffers() -> None:
    splits = [3] * 4096
    got = wire._elements(splits, 1)
    assert got == tuple(splits)
    kept = tuple(splits)
    assert wire._elements(kept, 1) is kept                     # a tuple passes as it is
    assert wire._elements(splits[:3], 5) == (15, 15, 15)
    assert wire._elements(None, 4) == wire._elements([], 4) == ()
    assert wire._plus_one(kept, 2)[:4] == [3, 3, 4, 3] and kept[2] == 3
