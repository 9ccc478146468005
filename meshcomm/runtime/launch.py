"""Run a function on N local processes joined by torch.distributed (the CLI's demo, tests,
benchmarks, examples).

Started with plain `python`, every process is a fresh "spawn" child with its own process
group on 127.0.0.1. `run_ranks` never hangs and never leaves a child behind: whatever
happens (an error on one rank, a rank stuck in a collective, a crash, Ctrl-C), the parent
stops every child before it returns or raises.

Inside a job that is already launched (torchrun, `meshcomm launch`: RANK and WORLD_SIZE
are set) it runs in place: this process is rank RANK of the job, and no child starts.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ..core.errors import RankFailure

_GRACE_S = 2.0      # how long a terminated child gets before it is killed
_POLL_S = 0.1
_ROOT_CAUSE_S = 10.0  # how long a consequence waits for the failure that caused it


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
              backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """The results of `fn(rank, world_size, *args, **kwargs)` on `world_size` processes, by rank.

    `fn` must be a top-level (picklable) function, and its result picklable. Each
    process initializes torch.distributed (`backend`, a TCP store on a free local
    port, collectives timing out after `timeout_s`) before calling `fn` and
    destroys the process group after. Raises `RankFailure` with the traceback of
    the rank whose `fn` raised (the root cause, even when a peer's resulting init or
    teardown error is reported first; the others follow one line each), or naming
    the ranks that had not finished when `timeout_s` (counted from the start,
    spawning included) ran out.

    >>> run_ranks(pow, 3)          # pow(rank, world_size) on each of 3 processes
    [0, 1, 8]

    Under torchrun or `meshcomm launch` (RANK and WORLD_SIZE set) it runs `fn` in this
    process, as rank RANK of the launched job, whose size must be `world_size`; the
    results of every rank are then all-gathered (pickled bytes in a uint8 tensor), so
    every rank returns the same list, as with spawned children.
    """
    if world_size < 1:
        raise ValueError(f"run_ranks needs world_size >= 1, got {world_size}")
    launched = launched_rank()
    if launched is not None:
        return _run_in_place(fn, world_size, launched, timeout_s, backend, args, kwargs)
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, name=f"meshcomm-rank-{rank}",
                         args=(fn, rank, world_size, port, backend, timeout_s, results_q,
                               args, kwargs))
             for rank in range(world_size)]
    try:
        with _quiet_numpy_warning():
            for proc in procs:
                proc.start()
        return _collect(procs, results_q, world_size, time.monotonic() + timeout_s, timeout_s)
    finally:
        _stop(procs)
        results_q.close()
        results_q.join_thread()


def _collect(procs: list[Any], results_q: Any, world_size: int, deadline: float,
             timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    silent_since: dict[int, float] = {}
    while len(results) < world_size:
        now = time.monotonic()
        if now >= deadline:
            missing = [r for r in range(world_size) if r not in results]
            raise RankFailure(
                f"run_ranks: rank(s) {missing} of {world_size} did not finish within"
                f" {timeout_s:g} s; all ranks were stopped. fix: if they are only slow (a"
                " loaded machine, a long job), raise timeout_s; if ranks may call different"
                " collectives, run with MESHCOMM_CHECK=1 (check mode names the ranks that"
                " disagree and what each asked for)")
        try:
            rank, ok, payload, in_fn = results_q.get(timeout=min(_POLL_S, deadline - now))
        except queue_mod.Empty:
            _check_dead(procs, results, silent_since, now)
            continue
        if not ok:
            first = (rank, payload, in_fn)
            _raise_failures([first] + _later_failures(results_q, first, set(results),
                                                        procs, deadline), world_size)
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(world_size)]


def _later_failures(results_q: Any, first: tuple[int, str, bool], done: set[int],
                    procs: list[Any], deadline: float) -> list[tuple[int, str, bool]]:
    """Every other failure reported within a moment (often consequences of the first).
    When the first is not `fn`'s own (a peer's init or teardown error), wait longer, up to
    _ROOT_CAUSE_S or the deadline, for the rank whose `fn` raised: on a loaded machine its
    report can come seconds after the errors it caused. The wait ends early once every
    rank has reported or exited (a crashed rank never reports)."""
    found: list[tuple[int, str, bool]] = []
    reported = done | {first[0]}
    start = time.monotonic()
    while len(reported) < len(procs):
        root_seen = first[2] or any(f[2] for f in found)
        end = min(start + (0.5 if root_seen else _ROOT_CAUSE_S), deadline)
        now = time.monotonic()
        if now >= end:
            break
        gone = all(p.exitcode is not None for r, p in enumerate(procs) if r not in reported)
        try:
            rank, ok, payload, in_fn = results_q.get(timeout=min(_POLL_S, end - now))
        except queue_mod.Empty:
            if gone:        # exited without a report, and nothing left in the pipe
                break
            continue
        reported.add(rank)
        if not ok:
            found.append((rank, payload, in_fn))
    return found


def _raise_failures(failures: list[tuple[int, str, bool]], world_size: int) -> None:
    """RankFailure with the full traceback of the root cause: the first rank whose `fn`
    raised (a peer's teardown error is a consequence), then one line per other failure."""
    first = next((f for f in failures if f[2]), failures[0])
    rank, payload, _ = first
    lines = [f"  rank {r}: {p.strip().splitlines()[-1]}" for r, p, _ in failures if r != rank]
    raise RankFailure(f"run_ranks: rank {rank} of {world_size} raised:\n{payload}"
                      + ("\nother ranks that failed too:\n" + "\n".join(lines) if lines else ""))


def _check_dead(procs: list[Any], results: dict[int, Any], silent_since: dict[int, float],
                now: float) -> None:
    """Raise for a child that exited without reporting (a crash, os._exit, a signal)."""
    for rank, proc in enumerate(procs):
        if rank in results or proc.exitcode is None:
            continue
        # A clean exit may still have its result in the pipe: give it a moment.
        first = silent_since.setdefault(rank, now)
        if proc.exitcode != 0 or now - first > _GRACE_S:
            raise RankFailure(
                f"run_ranks: rank {rank} exited with code {proc.exitcode} without a result"
                " (a crash or a signal; negative codes are signal numbers)")


def _stop(procs: list[Any]) -> None:
    """Terminate every child still running, kill those that ignore it, and reap them all."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.kill()
            proc.join()


# Variables torchrun sets for its children: a spawned rank of our own must not inherit them
# (TORCHELASTIC_USE_AGENT_STORE makes its rendezvous wait for an agent's store that our
# children never get).
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_ENABLE_FILE_TIMER",
               "TORCHELASTIC_TIMER_FILE")


@contextlib.contextmanager
def _quiet_numpy_warning() -> Iterator[None]:
    """Children start with PYTHONWARNINGS ignoring torch's "Failed to initialize NumPy"
    (they import torch before any meshcomm code runs); the parent's environment is
    restored at once."""
    before = os.environ.get("PYTHONWARNINGS")
    rule = "ignore:Failed to initialize NumPy:UserWarning"
    os.environ["PYTHONWARNINGS"] = f"{before},{rule}" if before else rule
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


PRINT_ALL_ENV = "MESHCOMM_PRINT_ALL"


def print_on_rank0() -> None:
    """Under a launcher (torchrun, `meshcomm launch`), keep only rank 0's standard output, so
    a report every rank would print alike prints once; errors (standard error) and exit
    codes stay every rank's. MESHCOMM_PRINT_ALL=1 keeps every rank's output. Plain `python`
    (one process that starts its own ranks) prints as usual, and so does a dry run
    (`meshcomm dryrun` sets MESHCOMM_PRINT_ALL: its one process is the rank to watch)."""
    launched = launched_rank()
    keep_all = os.environ.get(PRINT_ALL_ENV, "").strip() not in ("", "0")
    if launched is not None and launched[0] != 0 and not keep_all:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def launched_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when this process belongs to a launched job, else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return int(rank), int(world)
    except ValueError:
        raise RankFailure(f"RANK={rank!r} and WORLD_SIZE={world!r} are not integers; fix: unset"
                          " them, or launch with torchrun / meshcomm launch") from None


def _run_in_place(fn: Callable[..., Any], world_size: int, launched: tuple[int, int],
                  timeout_s: float, backend: str, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> list[Any]:
    """`fn` as rank RANK of the launched job; every rank's result, all-gathered."""
    import torch.distributed as dist

    rank, world = launched
    name = getattr(fn, "__name__", "fn")
    if world != world_size:
        raise RankFailure(
            f"run_ranks({name}, {world_size}) runs in place inside a launched job (RANK and"
            f" WORLD_SIZE are set), but the job has {world} processes; fix: launch"
            f" {world_size} (torchrun --nproc-per-node {world_size} or meshcomm launch -n"
            f" {world_size}), or run the script with plain python, which starts its own")
    own = not dist.is_initialized()
    if own:
        _init_in_place(backend, rank, world, timeout_s)
    try:
        try:
            mine: tuple[bool, Any] = (True, fn(rank, world, *args, **kwargs))
        except Exception:
            mine = (False, traceback.format_exc())
        reports = _all_gather_objects(mine, world)
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()   # free the groups now: one freed at interpreter exit can abort it
    failures = [(r, text, True) for r, (ok, text) in enumerate(reports) if not ok]
    if failures:
        _raise_failures(failures, world)
    return [value for _, value in reports]


_MASTER_STORE: list[Any] = []     # the store rank 0 hosts when no launcher agent does
_IN_PLACE_RUNS = [0]


def _init_in_place(backend: str, rank: int, world: int, timeout_s: float) -> None:
    """The default group for one in-place `run_ranks` call, on the launcher's store under a
    prefix of its own: every call of the job gets fresh keys (a group made again under the
    same keys cannot connect), and the group is destroyed after the call."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    if rank == 0 and not agent:      # this process hosts the store: once, kept for later calls
        if not _MASTER_STORE:
            _MASTER_STORE.append(TCPStore(host, port, world, is_master=True, timeout=timeout))
        base = _MASTER_STORE[0]
    else:                            # a client, owned by the group and released with it
        base = TCPStore(host, port, world, is_master=False, timeout=timeout)
    _IN_PLACE_RUNS[0] += 1       # the same count on every rank: they run the same program
    store = PrefixStore(f"meshcomm/run_ranks/{_IN_PLACE_RUNS[0]}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _all_gather_objects(obj: Any, world: int) -> list[Any]:
    """Every rank's `obj`, pickled into uint8 tensors (no numpy needed), on every rank."""
    import torch
    import torch.distributed as dist

    data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    top = max(int(s) for s in sizes)
    padded = torch.zeros(top, dtype=torch.uint8)
    padded[:data.numel()] = data
    rows = [torch.zeros(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(rows, padded)
    return [pickle.loads(bytes(row[:int(n)].tolist())) for row, n in zip(rows, sizes)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
            timeout_s: float, results_q: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> None:
    """Body of one child: init the group, run `fn`, report (rank, ok, pickled result or text,
    whether `fn` itself raised)."""
    in_fn = False
    try:
        for name in _LAUNCH_ENV:    # a child of ours, not of a launcher (see _LAUNCH_ENV)
            os.environ.pop(name, None)
        import torch
        import torch.distributed as dist

        # Ranks share a few cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        in_fn = True
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # reported before the group goes: its teardown fails the peers' collectives,
            # whose own reports must come after this one
            results_q.put((rank, False, traceback.format_exc(), True))
            in_fn = False
            with contextlib.suppress(Exception):    # the report above names the cause
                dist.destroy_process_group()
            return
        in_fn = False
        dist.destroy_process_group()
        results_q.put((rank, True, pickle.dumps(result), False))
    except BaseException:  # report everything, KeyboardInterrupt and SystemExit included
        results_q.put((rank, False, traceback.format_exc(), in_fn))
