"""mc.nn vocab_parallel_cross_entropy on gloo, 4 ranks: equal to F.cross_entropy on the full
logits, gradients equal to the matching slice of the full gradient, O(positions) bytes.

One 4-rank spawn binds two meshes ("tp=4" and "dp=2 tp=2", vocabulary over "tp") and does
every check; the tests below read their own section of the reports. A dispatch mode records
every collective op the ranks call (mc.collectives takes no `trace=`), so the byte checks see
whatever reaches torch.distributed. Pre-communication errors are also checked in this
process, on a BoundMesh whose group names exist nowhere (any communication would fail).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import meshcomm as mc
from meshcomm.core.errors import MeshAxisError, MeshMismatchError, ShapeError
from meshcomm.core.layout import Layout
from meshcomm.core.mesh import Mesh
from meshcomm.runtime.bind import BoundMesh
from meshcomm.nn.losses import vocab_parallel_cross_entropy, vocab_range

from conftest import ranks_fixture

CE = vocab_parallel_cross_entropy
# loss tolerance against the float64 reference of the same (dtype-rounded) logits
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


class Collectives(TorchDispatchMode):
    """Every collective op this rank calls: (op name, bytes of its input buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._opname  # not the bookkeeping ops (wait_tensor, _wrap_tensor_autograd)
        if func.namespace in ("_c10d_functional", "c10d") and not name.startswith(("_", "wait")):
            x = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            size = x.numel() * x.element_size() if isinstance(x, Tensor) else -1
            self.calls.append((name, size))
        return func(*args, **(kwargs or {}))


# ---- the spawned body ---------------------------------------------------------------------

def data(bound: BoundMesh, shape: tuple[int, ...], vocab: int, seed: int, ignore: int,
         n_ignored: int) -> tuple[Tensor, Tensor]:
    """Full float64 logits and targets, equal across the "tp" group, different across "dp"."""
    other = sum(c * 7919 for a, c in bound.coords.items() if a != "tp")
    gen = torch.Generator().manual_seed(seed * 1000 + other)
    full = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, shape, generator=gen)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:n_ignored]] = ignore
    return full, target


def one_case(bound: BoundMesh, vocab: int, dtype: torch.dtype, reduction: str, *,
             shape: tuple[int, ...] = (3, 5), give_vocab: bool = True, ignore: int = -100,
             n_ignored: int = 3, seed: int = 0) -> tuple[list[str], list[float]]:
    """Loss and local gradient against F.cross_entropy on the full logits (float64 reference
    of the same, dtype-rounded values; bf16 also against F.cross_entropy in bf16)."""
    what = (f"rank {bound.rank} {bound.mesh} V={vocab} {dtype} {reduction} shape={shape}"
            f" vocab_size={'given' if give_vocab else 'inferred'} ignore={ignore}")
    fails: list[str] = []
    n, pos = bound.mesh.axis_size("tp"), bound.coords["tp"]
    full, target = data(bound, shape, vocab, seed, ignore, n_ignored)
    full = full.to(dtype)
    lo, hi = vocab_range(vocab, n, pos)
    local = full[..., lo:hi].clone().requires_grad_()
    ref_in = full.double().clone().requires_grad_()
    weight = torch.rand(shape, dtype=torch.float64) + 0.5  # the output gradient for "none"

    with Collectives() as wire:
        loss = CE(local, target, bound, "tp", ignore_index=ignore, reduction=reduction,
                  vocab_size=vocab if give_vocab else None)
    with Collectives() as back:
        (loss * weight.to(loss.dtype)).sum().backward() if reduction == "none" else loss.backward()
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), ignore_index=ignore,
                          reduction=reduction)
    ref = ref.reshape(shape) if reduction == "none" else ref
    (ref * weight).sum().backward() if reduction == "none" else ref.backward()

    half = dtype in (torch.bfloat16, torch.float16)
    want_dtype = torch.float32 if half else dtype
    if loss.dtype != want_dtype or loss.shape != ref.shape:
        fails.append(f"{what}: loss {loss.dtype} {tuple(loss.shape)}, want {want_dtype}"
                     f" {tuple(ref.shape)}")
    tol = TOL[dtype]
    if not torch.allclose(loss.double(), ref, rtol=tol, atol=tol, equal_nan=True):
        fails.append(f"{what}: loss {loss.tolist()} want {ref.tolist()}")
    grad, want = local.grad, ref_in.grad[..., lo:hi]
    if grad is None or grad.dtype != dtype or grad.shape != local.shape:
        fails.append(f"{what}: grad {None if grad is None else (grad.dtype, tuple(grad.shape))}")
    else:
        gtol = 1e-2 if half else tol  # half gradients are rounded to their dtype
        scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-3)
        err = (grad.double() - want).abs().max().item() if want.numel() else 0.0
        if not err <= gtol * scale:
            fails.append(f"{what}: grad off by {err:.3g} (scale {scale:.3g})")
    if half:  # close to PyTorch's own half-precision loss too
        ref16 = F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1), ignore_index=ignore,
                                reduction=reduction)
        if not torch.allclose(loss, ref16.float().reshape(loss.shape), rtol=2e-2, atol=2e-2):
            fails.append(f"{what}: {loss.tolist()} far from {dtype} F.cross_entropy"
                         f" {ref16.tolist()}")
    kinds = [k for k, _ in wire.calls]
    if kinds != ["all_reduce", "all_reduce"]:
        fails.append(f"{what}: forward called {wire.calls}, want two all_reduces")
    if back.calls:
        fails.append(f"{what}: backward called {back.calls}, want none")
    return fails, loss.detach().double().reshape(-1).tolist()


CASES: list[tuple[str, dict[str, Any]]] = [
    *[(f"V={v} {str(d)[6:]} {r}", {"vocab": v, "dtype": d, "reduction": r})
      for v, d, r in itertools.product((64, 50, 5), (torch.float64, torch.float32),
                                       ("mean", "sum", "none"))],
    *[(f"V=50257 {str(d)[6:]} {r}", {"vocab": 50257, "dtype": d, "reduction": r,
                                     "shape": (2, 3), "n_ignored": 1})
      for d, r in itertools.product((torch.float64, torch.float32), ("mean", "sum", "none"))],
    *[(f"V={v} bfloat16 {r}", {"vocab": v, "dtype": torch.bfloat16, "reduction": r,
                               "shape": (2, 3), "n_ignored": 1})
      for v, r in itertools.product((64, 50257), ("mean", "none"))],
    ("V=50 float16 sum", {"vocab": 50, "dtype": torch.float16, "reduction": "sum"}),
    ("V=64 inferred mean", {"vocab": 64, "dtype": torch.float64, "reduction": "mean",
                            "give_vocab": False}),
    ("V=64 inferred none", {"vocab": 64, "dtype": torch.float32, "reduction": "none",
                            "give_vocab": False}),
    ("ignore_index=7 (a class)", {"vocab": 50, "dtype": torch.float64, "reduction": "mean",
                                  "ignore": 7}),
    ("no ignored", {"vocab": 50, "dtype": torch.float64, "reduction": "mean", "n_ignored": 0}),
    ("all ignored mean (nan)", {"vocab": 50, "dtype": torch.float64, "reduction": "mean",
                                "n_ignored": 15}),
    ("all ignored sum (0)", {"vocab": 50, "dtype": torch.float64, "reduction": "sum",
                             "n_ignored": 15}),
    ("1-d positions", {"vocab": 50, "dtype": torch.float64, "reduction": "sum", "shape": (7,)}),
    ("3-d positions", {"vocab": 50, "dtype": torch.float32, "reduction": "none",
                       "shape": (2, 2, 3)}),
]


def check_values(bound: BoundMesh) -> tuple[list[str], dict[str, list[float]]]:
    fails, losses = [], {}
    for seed, (label, kw) in enumerate(CASES):
        got, values = one_case(bound, seed=seed, **kw)
        fails += got
        losses[label] = values
    return fails, losses


def check_bytes(bound: BoundMesh) -> list[str]:
    """Per call: an all_reduce(max) of N values and an all_reduce(sum) of 2N, whatever V; +2
    values in the max when vocab_size is inferred; backward: no collective."""
    fails, n, pos = [], bound.mesh.axis_size("tp"), bound.coords["tp"]
    rows = 6
    for vocab, give in ((64, True), (50257, True), (64, False)):
        full, target = data(bound, (2, 3), vocab, 99, -100, 1)
        lo, hi = vocab_range(vocab, n, pos)
        local = full[..., lo:hi].float().requires_grad_()
        with Collectives() as wire:
            loss = CE(local, target, bound, "tp", vocab_size=vocab if give else None)
            loss.backward()
        want = [("all_reduce", 4 * (rows + (0 if give else 2))), ("all_reduce", 4 * 2 * rows)]
        if wire.calls != want:
            fails.append(f"rank {bound.rank} {bound.mesh} V={vocab} vocab_size"
                         f" {'given' if give else 'inferred'}: calls {wire.calls}, want {want}")
    return fails


def error_calls(bound: BoundMesh) -> list[tuple[str, Callable[[], Any]]]:
    """Bad calls, each raising on every rank (all before communicating but the last two).
    51 classes split unevenly over tp=4 (13 13 13 12) and tp=2 (26 25)."""
    n, pos = bound.mesh.axis_size("tp"), bound.coords["tp"]
    lo, hi = vocab_range(51, n, pos)
    x = torch.randn(2, 3, hi - lo)
    t = torch.randint(0, 51, (2, 3))
    bad_t = t.clone()
    bad_t[1, 2] = 64
    return [
        ("axis", lambda: CE(x, t, bound, "tq", vocab_size=51)),
        ("target shape", lambda: CE(x, t[:, :2], bound, "tp", vocab_size=51)),
        ("target dtype", lambda: CE(x, t.float(), bound, "tp", vocab_size=51)),
        ("local size", lambda: CE(torch.randn(2, 3, 13), t, bound, "tp", vocab_size=52 + n)),
        ("reduction", lambda: CE(x, t, bound, "tp", vocab_size=51, reduction="avg")),
        ("target range", lambda: CE(x, bad_t, bound, "tp", vocab_size=51)),
        ("uneven without vocab_size", lambda: CE(x, t, bound, "tp")),
        ("target range inferred", lambda: CE(torch.randn(2, 3, 64 // n), bad_t, bound, "tp")),
    ]


def check_errors(bound: BoundMesh) -> dict[str, str]:
    out = {}
    for label, call in error_calls(bound):
        with Collectives() as wire:
            try:
                call()
                out[label] = "no error"
            except Exception as err:  # noqa: BLE001  (the test compares the type and text)
                out[label] = f"{type(err).__name__}: {err}"
        out[label + " calls"] = str(len(wire.calls))
    # the ranks are still in step: a good call works (a stray collective would mismatch)
    fails, _ = one_case(bound, 50, torch.float64, "mean", seed=123)
    out["after"] = "\n".join(fails)
    return out


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # any rank-dependent draw in the function would show
    report: dict[str, Any] = {}
    for spec in ("tp=4", "dp=2 tp=2"):
        bound = mc.init_mesh(spec)
        fails, losses = check_values(bound)
        report[spec] = {"values": fails, "losses": losses, "bytes": check_bytes(bound),
                        "errors": check_errors(bound), "dp": bound.coords.get("dp", 0)}
    return report


four = ranks_fixture(four_ranks, 4)
SPECS = ("tp=4", "dp=2 tp=2")


@pytest.mark.parametrize("spec", SPECS)
def test_loss_and_gradient_equal_cross_entropy_on_the_full_logits(
        four: list[dict[str, Any]], spec: str) -> None:
    assert "\n".join(line for rep in four for line in rep[spec]["values"]) == ""


@pytest.mark.parametrize("spec", SPECS)
def test_the_loss_is_the_same_on_every_rank_of_the_group(four: list[dict[str, Any]],
                                                          spec: str) -> None:
    groups: dict[int, list[dict[str, list[float]]]] = {}
    for rep in four:
        groups.setdefault(rep[spec]["dp"], []).append(rep[spec]["losses"])
    assert len(groups) == (1 if spec == "tp=4" else 2)
    for members in groups.values():
        for label in members[0]:
            values = [[v if not math.isnan(v) else "nan" for v in m[label]] for m in members]
            assert all(v == values[0] for v in values), (label, values)
    if spec == "dp=2 tp=2":  # the two dp replicas had different data
        a, b = groups.values()
        assert a[0]["V=64 float64 mean"] != b[0]["V=64 float64 mean"]


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_per_rank_depend_on_positions_not_vocabulary(four: list[dict[str, Any]],
                                                           spec: str) -> None:
    assert "\n".join(line for rep in four for line in rep[spec]["bytes"]) == ""


ERRORS = {
    "axis": ("MeshAxisError", 0, 'axis="tq" is not an axis of'),
    "target shape": ("ShapeError", 0, "target has shape (2, 2), but logits of shape"),
    "target dtype": ("ShapeError", 0, "target has dtype torch.float32; expected integer"),
    "local size": ("ShapeError", 0, "has 13 classes in its last dim, but vocab_size="),
    "reduction": ("ShapeError", 0, "reduction='avg'; expected one of mean, sum, none"),
    "target range": ("ShapeError", 0, "target holds 1 class indices outside [0, 51) (e.g. 64)"),
    "uneven without vocab_size": ("ShapeError", 1, "the vocabulary is split unevenly"),
    "target range inferred": ("ShapeError", 1, "outside [0, 64) (e.g. 64)"),
}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("label", list(ERRORS))
def test_bad_input_raises_on_every_rank(four: list[dict[str, Any]], spec: str,
                                        label: str) -> None:
    kind, calls, text = ERRORS[label]
    for rep in four:
        got = rep[spec]["errors"]
        assert got[label].startswith(kind + ": vocab_parallel_cross_entropy: "), got[label]
        assert text in got[label], got[label]
        assert got[label + " calls"] == str(calls), (label, got[label + " calls"])
        assert got["after"] == ""


# ---- in this process ------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, parts", [(64, 4), (50, 4), (50257, 4), (5, 4), (3, 4), (7, 2),
                                          (1, 1), (10, 3)])
def test_vocab_range_is_the_layouts_shard_of_the_vocabulary(vocab: int, parts: int) -> None:
    mesh = Mesh(f"tp={parts}")
    ranges = [vocab_range(vocab, parts, p) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for p, (lo, hi) in enumerate(ranges):
        assert tuple(range(lo, hi)) == Layout("b (tp v)").indices(mesh, (2, vocab), p)[1]
        assert hi - lo == torch.arange(vocab).tensor_split(
            [min(k * -(-vocab // parts), vocab) for k in range(1, parts)])[p].numel()


def test_vocab_range_rejects_bad_arguments() -> None:
    with pytest.raises(ShapeError, match=r"position=4 is not in 0\.\.3"):
        vocab_range(50, 4, 4)
    with pytest.raises(ShapeError, match="parts=0"):
        vocab_range(50, 0, 0)


def fake_bound(spec: str, rank: int) -> BoundMesh:
    """A BoundMesh whose group names exist nowhere: any communication would fail."""
    mesh = Mesh(spec)
    names = {s: "fake-" + "-".join(s) for k in range(1, len(mesh.axis_names) + 1)
             for s in itertools.combinations(mesh.axis_names, k)}
    return BoundMesh(mesh, "gloo", torch.device("cpu"), rank, names)


B = fake_bound("dp=2 tp=4", 7)        # tp position 3: classes [39, 50) of 50
X = torch.randn(2, 3, 11)
T = torch.randint(0, 50, (2, 3))

LOCAL_ERRORS = [
    (lambda: CE(X, T, "tp"), MeshMismatchError,  # type: ignore[arg-type]
     "vocab_parallel_cross_entropy needs a mesh bound to torch.distributed, got a str; fix:"
     " bound = mc.init_mesh('dp=2 tp=4') on every rank, then pass bound"),
    (lambda: CE(X, T, B, "tq", vocab_size=50), MeshAxisError,
     'vocab_parallel_cross_entropy: axis="tq" is not an axis of Mesh(dp=2, tp=4); axes are dp,'
     ' tp\n  fix: did you mean "tp"?'),
    (lambda: CE(X, T, B, ("dp", "tp"), vocab_size=50), MeshAxisError,  # type: ignore[arg-type]
     "vocab_parallel_cross_entropy: axis=('dp', 'tp') must name one mesh axis of Mesh(dp=2,"
     ' tp=4), e.g. "tp"; the vocabulary is split over one axis'),
    (lambda: CE(X, T, fake_bound("tp=4", 5), "tp", vocab_size=50), MeshMismatchError,
     "vocab_parallel_cross_entropy: rank 5 is not in Mesh(tp=4); only its ranks [0, 1, 2, 3]"
     " call it"),
    (lambda: CE(X.long(), T, B, vocab_size=50), ShapeError,
     "vocab_parallel_cross_entropy: logits has dtype torch.int64; expected float16, bfloat16,"
     " float32 or float64. fix: logits.float()"),
    (lambda: CE(X, T.reshape(6), B, vocab_size=50), ShapeError,
     "vocab_parallel_cross_entropy: target has shape (6,), but logits of shape (2, 3, 11) need"
     " target.shape == logits.shape[:-1] == (2, 3). fix: one class index per position,"
     " vocabulary dim last"),
    (lambda: CE(X, T.float(), B, vocab_size=50), ShapeError,
     "vocab_parallel_cross_entropy: target has dtype torch.float32; expected integer class"
     " indices (class probabilities are not supported). fix: target.long()"),
    (lambda: CE(X, T, B, vocab_size=52), ShapeError,
     'vocab_parallel_cross_entropy: logits on rank 7 (position 3 of 4 along "tp") has 11'
     " classes in its last dim, but vocab_size=52 split over 4 gives it classes [39, 52) (13)."
     " fix: pass this rank's shard full_logits[..., 39:52], or the global vocab_size"),
    (lambda: CE(X, T, B, vocab_size=0), ShapeError,
     "vocab_parallel_cross_entropy: vocab_size=0 is not an int >= 1 (the global number of"
     " classes)"),
    (lambda: CE(X, T, B, vocab_size=50, reduction="Sum"), ShapeError,
     "vocab_parallel_cross_entropy: reduction='Sum'; expected one of mean, sum, none\n"
     '  fix: did you mean "sum"?'),
    (lambda: CE(X, T, B, vocab_size=50, ignore_index=None), ShapeError,  # type: ignore[arg-type]
     "vocab_parallel_cross_entropy: ignore_index=None is not an int"),
    (lambda: CE(X, torch.tensor([[0, 1, 2], [3, -1, 49]]), B, vocab_size=50), ShapeError,
     "vocab_parallel_cross_entropy: target holds 1 class indices outside [0, 50) (e.g. -1) that"
     " are not ignore_index=-100; fix: clamp or mask them, or set them to ignore_index"),
]


@pytest.mark.parametrize("call, error, message", LOCAL_ERRORS,
                         ids=[m[30:70] for *_, m in LOCAL_ERRORS])
def test_errors_come_before_any_communication(call: Callable[[], Any], error: type,
                                               message: str) -> None:
    with Collectives() as wire, pytest.raises(error, match="^" + re.escape(message) + "$"):
        call()
    assert wire.calls == []


def test_ignore_index_and_in_range_targets_pass_the_local_checks() -> None:
    # with valid input the checks pass and the call reaches its first collective, which
    # fails on the fake group: proof that nothing above raised
    t = torch.tensor([[0, 1, -100], [39, 49, 12]])
    with pytest.raises(Exception) as info:
        CE(X, t, B, vocab_size=50)
    assert not isinstance(info.value, (ShapeError, MeshAxisError, MeshMismatchError))
