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
from meshcomm.executors.distributed import handlers, wire
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
    # ((t0 + t1) + t2) ...: floats keep the group order, added into one accumulator
    assert calls.count("add_") == 63 and "add" not in calls


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
    handlers._MEMO.clear()      # a memo filled by earlier tests may empty itself midway
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
    # one process playing several ranks (a dry run, a simulation) keeps each rank's value:
    # going back to rank 3 builds nothing
    assert per_step(step, "t", (3, (4, 4)), build) == 1
    assert per_step(step, "t", (5, (4, 4)), build) == 2
    assert len(built) == 4 if twin is not step else len(built) == 3


def test_wire_split_copies_are_c_level_for_flat_buffers() -> None:
    splits = [3] * 4096
    got = wire._elements(splits, 1)
    assert got == tuple(splits)
    kept = tuple(splits)
    assert wire._elements(kept, 1) is kept                     # a tuple passes as it is
    assert wire._elements(splits[:3], 5) == (15, 15, 15)
    assert wire._elements(None, 4) == wire._elements([], 4) == ()
    assert wire._plus_one(kept, 2)[:4] == [3, 3, 4, 3] and kept[2] == 3


# one rank of a 1,024-rank fake job: meshes of 128 and 1,024 ranks; a step's Python lines in
# meshcomm (sys.settrace) must not grow with the group (a loop over it adds ~900)
LINES = r'''
import os, sys, json
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import meshcomm as mc
from torch.utils._python_dispatch import TorchDispatchMode
ROOT = os.path.dirname(mc.__file__)

class Splits(TorchDispatchMode):
    """The longest split list handed to a process group's all_to_all (or its functional op)."""
    most = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname == "alltoall_base_":
            self.most = max(self.most, len(args[3]), len(args[4]))
        if func._opname == "all_to_all_single":
            self.most = max(self.most, len(args[1]), len(args[2]))
        return func(*args, **(kwargs or {}))

def lines(fn):
    count = [0]
    def local(f, e, a):
        count[0] += e == "line"
        return local
    def calls(f, e, a):
        return local if f.f_code.co_filename.startswith(ROOT) else None
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0]

dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=1024)
cases = [("a b | sum(dp)", "(dp a) b", torch.int64, lambda n: (n // 8 * 2 + 3, 8)),
         ("(dp a) b", "a b", torch.float32, lambda n: (n // 8 * 2 + 3, 8)),
         ("(dp tp a) b", "(tp dp a) b", torch.float32, lambda n: (n * 2, 8)),
         ("(dp a) b | sum(tp)", "a (dp b)", torch.float32, lambda n: (n * 2, 64)),
         ("(dp a) b | sum(tp)", "a (dp b)", torch.float32, lambda n: (n * 2, 1024))]
out = []
for src, dst, dtype, shape_of in cases:
    row = []
    for n in (128, 1024):
        bound = mc.init_mesh(f"dp={n // 8} tp=8", ranks=list(range(n)))
        shape = shape_of(n)
        p = mc.plan(bound.mesh, shape, src, dst, dtype=dtype)
        x = torch.zeros(p.src.local_shape(bound.mesh, shape, 3), dtype=dtype)
        call = lambda: mc.reshard(x, bound, src, dst, shape=shape)
        call()
        call()
        with Splits() as mode:
            call()
        row.append([[s.kind, s.wire] for s in p.steps] + [mode.most, lines(call)])
    out.append([src, dst, str(dtype), row])
print(json.dumps(out))
'''


def test_a_step_runs_the_same_python_lines_on_128_and_1024_ranks() -> None:
    import json
    import subprocess
    import sys

    from conftest import scaled

    done = subprocess.run([sys.executable, "-c", LINES], capture_output=True, text=True,
                          timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    kinds = set()
    for src, dst, dtype, (small, big) in cases:
        assert small[:-2] == big[:-2], (src, dst, small, big)      # the same plan
        assert big[-1] <= small[-1] + 10, (src, dst, dtype, small, big)
        kinds.update(tuple(k) for k in small[:-2])
    # even splits travel as none (torch's functional op reads a list of N sizes per call)
    even = cases[-1][3]
    assert even[0][-2] == even[1][-2] == 0, even
    assert cases[-2][3][1][-2] == 1024, cases[-2]   # uneven: a size per member of its group
    # the cases run every per-step path: uneven reduce_scatter (integers: one reduction
    # call) and all_gather, a permute, an even and an uneven send_recv
    assert {("reduce_scatter", "all_to_all"), ("all_gather", "all_to_all"),
            ("collective_permute", "all_to_all"), ("send_recv", "all_to_all")} <= kinds
