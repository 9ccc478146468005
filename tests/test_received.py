"""`executors.local.received`: a send_recv's output from the buffer a rank received, as a view
of that buffer (or one gather) reduced by `op_reduce_rows`, gives the bits of writing each
element to its output position and folding the partials with `op_reduce` in group order
(how it was computed before, and how the simulator's oracle folds), on every rank of plans
with even and uneven blocks."""

from __future__ import annotations

import pytest
import torch

import meshcomm as mc
from meshcomm.core.reduce_ops import op_reduce
from meshcomm.executors.local import Exchange, View, exchange, received, strided_view

CASES = [   # mesh, global shape, src, dst: each plan has a send_recv (not a tree)
    ("dp=16 tp=8", (256, 64), "(dp a) b | sum(tp)", "a (dp b)"),        # host_scale's
    ("dp=2 tp=2", (5, 7), "(dp a) b | sum(tp)", "a (dp b)"),            # uneven: a gather
    ("dp=2 tp=4", (6, 10), "(dp a) b | max(tp)", "(tp a) (dp b)"),
    ("x=3 y=2", (7, 5, 3), "(x a) (y b) c", "c (x y a) b"),
    ("x=2 y=3", (12, 6), "(x a) b | sum(y)", "(y x a) b"),
    ("x=2 y=3", (12, 6), "(x a) b | min(y)", "(y x a) b"),
    ("x=4", (9, 5), "(x a) b", "a (x b)"),
    ("x=2 y=2 z=2", (8, 8, 4), "(x a) b c | sum(y, z)", "a (z y b) c"),
    ("x=2 y=2 z=2", (8, 8, 4), "(x a) b c | avg(y, z)", "a (z y b) c"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.bool)


def _before(ex: Exchange, flat: torch.Tensor, out_shape: tuple[int, ...],
            op: str | None) -> torch.Tensor:
    """What `received` computed before (and the meaning it keeps): each element written at
    its output position, then the slots folded left to right."""
    numel = 1
    for n in out_shape:
        numel *= n
    out = flat.new_empty(ex.slots * numel)
    out[ex.recv] = flat
    if op is None:
        return out.reshape(out_shape)
    return op_reduce(list(out.reshape(ex.slots, *out_shape).unbind(0)), op)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bool else x.contiguous().view(torch.uint8)


def _flat(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_floating_point:      # float sums depend on their order at these magnitudes
        return (torch.randn(n, generator=gen) * torch.logspace(-3, 3, 7)[
            torch.randint(0, 7, (n,), generator=gen)]).to(dtype)
    return torch.randint(-2**30, 2**30, (n,), generator=gen, dtype=torch.int64).to(dtype)


def _exchanges(case):  # type: ignore[no-untyped-def]
    m, shape, src, dst = case
    mesh = mc.Mesh(m)
    [step] = [s for s in mc.plan(mesh, shape, src, dst).steps if s.kind == "send_recv"]
    assert step.action != "tree", case
    for r in mesh.ranks:
        out_shape = step.after.local_shape(mesh, shape, r)
        yield step, exchange(step, r, mesh, mesh, step.before.local_shape(mesh, shape, r),
                             out_shape, torch.device("cpu")), out_shape


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}:{c[2]}->{c[3]}")
def test_received_gives_the_bits_of_an_index_put_and_a_left_fold(case) -> None:  # type: ignore[no-untyped-def]
    paths = set()
    for step, ex, out_shape in _exchanges(case):
        paths.add("view" if ex.view is not None else "gather")
        assert (ex.view is None) != (ex.gather is None), (case, ex)
        for i, dtype in enumerate(DTYPES):
            if step.op == "avg" and not dtype.is_floating_point:
                continue
            if dtype == torch.bool and step.op == "sum":
                continue
            flat = _flat(len(ex.recv), dtype, seed=i)
            want = _before(ex, flat, out_shape, step.op)
            got = received(ex, flat, out_shape, step.op)
            assert got.shape == want.shape and got.dtype == want.dtype, (case, dtype)
            assert torch.equal(_bits(got), _bits(want)), (case, dtype)
    if case[1] == (5, 7):
        assert paths == {"gather"}, paths     # uneven blocks: no strided view
    elif case[1] == (256, 64):
        assert paths == {"view"}, paths


def test_host_scale_exchange_is_a_view_of_the_received_buffer() -> None:
    """Each of the 8 partials a rank adds is a strided view of the buffer it received:
    `received` runs no gather, only the fold (one clone and 7 adds)."""
    step, ex, out_shape = next(_exchanges(CASES[0]))
    assert ex.view == View((16, 8, 64), (1, 0, 2)), ex.view
    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func._opname)
            return func(*args, **(kwargs or {}))

    flat = _flat(len(ex.recv), torch.float32, seed=0)
    with Count():
        received(ex, flat, out_shape, "sum")
    assert calls.count("add_") == 7 and calls.count("clone") == 1, calls
    assert not {"index", "index_put", "index_put_", "index_select", "gather"} & set(calls), calls


@pytest.mark.parametrize("sizes,perm", [((6,), (0,)), ((2, 3), (1, 0)), ((4, 3, 5), (1, 0, 2)),
                                        ((2, 3, 4), (2, 0, 1)), ((3, 1, 2), (2, 1, 0))])
def test_strided_view_finds_a_permuted_reshape(sizes, perm) -> None:  # type: ignore[no-untyped-def]
    gather = torch.arange(torch.Size(sizes).numel()).reshape(sizes).permute(perm).reshape(-1)
    slots = sizes[perm[0]]
    view = strided_view(gather, slots)
    assert view is not None, (sizes, perm)
    flat = torch.randn(len(gather))
    made = flat.reshape(view.sizes).permute(view.perm)
    assert made.shape[0] == slots
    assert torch.equal(made.reshape(-1), flat[gather])


def test_strided_view_is_none_where_no_permuted_reshape_is() -> None:
    assert strided_view(torch.tensor([0, 1, 2, 4, 5, 3]), 1) is None       # uneven runs
    assert strided_view(torch.tensor([3, 2, 1, 0]), 1) is None             # a reversal
    assert strided_view(torch.tensor([0, 2, 1, 3, 5, 4]), 2) is None       # slots differ
