"""Test-wide settings and the helpers the test modules share.

Hypothesis profiles: `pytest` runs the CI-sized property tests, the same examples every run.
`pytest --hypothesis-profile=long` runs every property test with 20 times as many examples,
new ones each run (a long fuzz run).

Timeouts: every timeout in tests/ (`run_ranks`, `init_mesh(timeout_s=...)` inside rank
functions, subprocesses, a benchmark's `--timeout`) is `scaled(base)`, the base times the
one environment factor MESHCOMM_TEST_TIMEOUT_FACTOR. Unset, it follows the machine's load:
the one-minute load average per core, at least 1 (a machine running 30 jobs on 2 cores
waits 15 times as long), read when each timeout is set. Set it to fix the factor
(MESHCOMM_TEST_TIMEOUT_FACTOR=1 for the unscaled timeouts). The hang tests keep a short,
unscaled collective timeout on the one group that hangs; everything healthy around it
waits `scaled(...)`.

Test modules import the helpers by name: `from conftest import scaled, run_scaled`
(pytest puts tests/ on sys.path for this file, and spawned ranks inherit sys.path).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    import torch

    import meshcomm as mc

# The default profile draws the same examples on every run (derandomized): CI reruns what
# passed, and a red run is one anybody can reproduce. `--hypothesis-profile=long` draws new
# examples every run: the fuzz that finds what the fixed examples miss.
settings.register_profile("default", settings.get_profile("default"), derandomize=True)
settings.register_profile("long", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

LONG_FACTOR = 20
TIMEOUT_FACTOR_ENV = "MESHCOMM_TEST_TIMEOUT_FACTOR"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if settings.get_current_profile_name() != "long":
        return
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None:
            fn._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own, max_examples=own.max_examples * LONG_FACTOR, deadline=None)


# -- timeouts ----------------------------------------------------------------------------------
def load_factor() -> float:
    """The one-minute load average per core, at least 1 (1 where the platform has no load
    average): how much slower than idle this machine runs a test now."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def timeout_factor() -> float:
    """MESHCOMM_TEST_TIMEOUT_FACTOR as a number; unset or empty, `load_factor()`."""
    text = os.environ.get(TIMEOUT_FACTOR_ENV, "").strip()
    if not text:
        return load_factor()
    try:
        factor = float(text)
    except ValueError:
        factor = math.nan
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"{TIMEOUT_FACTOR_ENV}={text!r}: give a number > 0, e.g. 3 on a"
                         " loaded machine")
    return factor


def scaled(seconds: float) -> float:
    """`seconds` times `timeout_factor()`: the one way tests/ sets a timeout."""
    return seconds * timeout_factor()


def in_fresh_interpreter(module: str, function: str, timeout_s: float = 300) -> Any:
    """`tests/<module>.py`'s `function()` run in a new Python process (for work that sets
    process-wide state, such as torch's fake process group); its result comes back as JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import json, sys; sys.path.insert(0, 'tests'); import {module} as t;"
            f" print('RESULT' + json.dumps(t.{function}()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=scaled(timeout_s))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def run_scaled(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float,
               **kwargs: Any) -> list[Any]:
    """`run_ranks(fn, world_size, *args, **kwargs)` under `scaled(timeout_s)`, which also
    becomes the default process group's collective timeout on every rank."""
    from meshcomm.runtime.launch import run_ranks

    return run_ranks(fn, world_size, *args, timeout_s=scaled(timeout_s), **kwargs)


def ranks_fixture(fn: Callable[..., Any], world_size: int, *args: Any,
                  timeout_s: float = 240.0) -> Any:
    """A module-scoped fixture that runs `fn` once on `world_size` ranks (`run_scaled`) and
    gives its results, by rank, to every test that reads them: `four = ranks_fixture(
    four_ranks, 4)` in a test module. 240 s is several times what the 4- and 8-rank runs
    take on an idle 2-core machine."""

    @pytest.fixture(scope="module")
    def results() -> list[Any]:
        return run_scaled(fn, world_size, *args, timeout_s=timeout_s)

    return results


def set_group_timeout(bound: mc.BoundMesh, axes: str | tuple[str, ...], seconds: float) -> None:
    """Give this rank's group over `axes` its own collective timeout (the hang tests: a short
    one on the group that hangs, while `init_mesh(timeout_s=scaled(...))` covers the rest)."""
    import datetime

    from torch.distributed.distributed_c10d import _resolve_process_group, _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds),
                    _resolve_process_group(bound.group_name(axes)))


# -- data and placements -----------------------------------------------------------------------
def ints(shape: tuple[int, ...], seed: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Seeded integer-valued data (float32 unless `dtype`), so every reduction order gives
    the same bits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=gen).to(dtype or torch.float32)


def planned_calls(p: mc.Plan, rank: int) -> list[tuple[str, int, int]]:
    """The collective calls `rank` makes in plan `p`, as (kind, bytes sent, bytes received):
    each communicating step of its mesh, and a transfer between meshes on every rank of
    either; none on a rank in neither."""
    if rank not in p.ranks:
        return []
    i = p.ranks.index(rank)
    return [(s.kind, s.send_bytes[i], s.recv_bytes[i]) for s in p.collectives
            if rank in (p.ranks if s.dst_mesh is not None else (s.mesh or p.mesh).ranks)]


def sim_problems(where: str, p: mc.Plan, rank: int, got: torch.Tensor | None,
                 want: torch.Tensor | None, trace: Any) -> list[str]:
    """What differs on `rank` between running plan `p` and the simulator: the output (None
    where the rank gets nothing; dtype, shape and bits), the calls a `ByteTrace` counted
    against `planned_calls`, and its byte totals against the plan's for the rank."""
    import torch

    problems = []
    if (got is None) != (want is None):
        problems.append(f"{where}: got {type(got).__name__}, sim gives {type(want).__name__}")
    elif got is not None and want is not None and not (
            got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
        problems.append(f"{where}: output differs from sim\n{p}")
    counted = [(c.kind, c.send_bytes, c.recv_bytes) for c in trace.calls]
    if counted != planned_calls(p, rank):
        problems.append(f"{where}: calls {counted} but the plan has {planned_calls(p, rank)}")
    i = p.ranks.index(rank) if rank in p.ranks else None
    totals = (p.send_bytes[i], p.recv_bytes[i]) if i is not None else (0, 0)
    if (trace.send_bytes, trace.recv_bytes) != totals:
        problems.append(f"{where}: bytes {trace.send_bytes, trace.recv_bytes} != plan {totals}")
    return problems


def dtensor_placements(text: str) -> tuple[Any, ...]:
    """DTensor placements from short words, one per mesh axis: "S0 SS0.2 R Psum" ->
    (Shard(0), _StridedShard(0, split_factor=2), Replicate(), Partial("sum"))."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for word in text.split():
        if word == "R":
            out.append(Replicate())
        elif word.startswith("P"):
            out.append(Partial(word[1:]))
        elif word.startswith("SS"):
            dim, split = word[2:].split(".")
            out.append(_StridedShard(int(dim), split_factor=int(split)))
        elif word.startswith("S"):
            out.append(Shard(int(word[1:])))
        else:
            raise ValueError(f"placement word {word!r} in {text!r}: use R, S<dim>,"
                             " SS<dim>.<split> or P<op>")
    return tuple(out)


def outcome(call: Callable[[], Any]) -> str:
    """"ran" if `call()` returns, else the meshcomm error it raised as "Type: message" (for
    workers that report their errors back as plain data)."""
    import meshcomm as mc

    try:
        call()
        return "ran"
    except mc.errors.MeshcommError as err:
        return f"{type(err).__name__}: {err}"


def slow_wire(mp: pytest.MonkeyPatch, delay_s: float) -> None:
    """A slow wire (the overlap tests): every functional collective issued through meshcomm's
    wire module lands `delay_s` after it is issued; `wire.waited` sleeps until then; every
    batch of point-to-point messages (`wire.p2p`) carries one more work, done `delay_s`
    after the post, which `Posted.landed` waits for. Undo with `mp.undo()`."""
    import time

    from meshcomm.executors.distributed import wire

    issued: dict[int, float] = {}
    call, waited = wire.call, wire.waited

    def slow_call(fn: Any, x: Any, *args: Any, wait: bool = True) -> Any:
        y = call(fn, x, *args, wait=False)
        issued[id(y)] = time.perf_counter()
        return slow_waited(y) if wait else y

    def slow_waited(t: Any) -> Any:
        start = issued.pop(id(t), None)
        if start is not None:
            time.sleep(max(0.0, start + delay_s - time.perf_counter()))
        return waited(t)

    p2p = wire.p2p

    class Until:
        """A work that is done at `due` (perf_counter seconds)."""

        def __init__(self, due: float) -> None:
            self.due = due

        def wait(self) -> None:
            time.sleep(max(0.0, self.due - time.perf_counter()))

    def slow_p2p(*args: Any) -> Any:
        posted, measured = p2p(*args)
        return posted._replace(works=(*posted.works, Until(time.perf_counter() + delay_s))), \
            measured

    mp.setattr(wire, "call", slow_call)
    mp.setattr(wire, "waited", slow_waited)
    mp.setattr(wire, "p2p", slow_p2p)
