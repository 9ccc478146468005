"""`run_ranks` inside a launched job (torchrun, `meshcomm launch`) runs in place: no child
processes, every rank gets every rank's result, and a job of the wrong size says what to do
at once instead of waiting for a rendezvous that never comes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import scaled

ROOT = Path(__file__).resolve().parents[2]
JOB = '''
import sys
import torch
import meshcomm as mc
from meshcomm.runtime.launch import run_ranks


def work(rank, world, scale):
    bound = mc.init_mesh("tp=%d" % world)
    y = mc.reshard(torch.full((2,), float(rank)), bound, "(tp b)", "b", shape=(2 * world,))
    return [v * scale for v in y.tolist()]


if __name__ == "__main__":
    out = run_ranks(work, int(sys.argv[1]), 10, timeout_s=60)
    print(f"RESULT {out}", flush=True)   # one write per line: the ranks share stdout
'''


def _run(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=scaled(180))
    return done, time.monotonic() - start


def test_torchrun_runs_the_ranks_in_place(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "job.py", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Each launched process printed the results of both ranks (in place, all-gathered).
    assert done.stdout.count("RESULT [[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]]") == 2


def test_meshcomm_launch_runs_the_ranks_in_place(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "-m", "meshcomm", "launch", "-n", "2", "job.py", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in (0, 1):    # each rank's lines carry its rank
        assert f"[rank{rank}]:RESULT [[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]]" \
            in done.stdout, done.stdout
    assert "OMP_NUM_THREADS" not in done.stdout + done.stderr    # no torchrun banner


def test_a_job_of_the_wrong_size_says_what_to_do_at_once(tmp_path: Path) -> None:
    done, seconds = _run(tmp_path, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", "job.py", "3")
    assert done.returncode != 0
    assert ("run_ranks(work, 3) runs in place inside a launched job (RANK and WORLD_SIZE are"
            " set), but the job has 2 processes; fix: launch 3") in done.stderr
    assert seconds < scaled(60), seconds    # no rendezvous wait (the in-job timeout is 60 s)


def test_plain_python_still_starts_its_own_processes(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "job.py", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("RESULT") == 1


# Every example that starts processes, run as torchrun users do: (script and arguments,
# processes, the line every rank prints when its checks pass).
LAUNCHED_EXAMPLES = [
    (("train_2d.py", "--steps", "2"), 4, "OK: largest relative difference"),
    (("moe_alltoall.py",), 4, "match the single-process reference"),
    (("reshard_checkpoint.py",), 4, "OK: every tensor gathered on the new mesh"),
    (("pipeline_handoff.py",), 8, "OK: "),
    (("train_llama.py", "--steps", "3"), 4, "OK: largest relative difference"),
]


@pytest.mark.parametrize("script, n, ok_line", LAUNCHED_EXAMPLES,
                         ids=[e[0][0] for e in LAUNCHED_EXAMPLES])
def test_an_example_runs_under_meshcomm_launch(tmp_path: Path, script: tuple[str, ...], n: int,
                                               ok_line: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "meshcomm", "launch", "-n", str(n),
                           str(ROOT / "examples" / script[0]), *script[1:]],
                          capture_output=True, text=True, cwd=tmp_path, timeout=scaled(300),
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]  # every rank's check
    # the report prints once, from rank 0 (issue 20 item 10: it printed n times)
    oks = [line for line in done.stdout.splitlines() if ok_line in line]
    assert oks and all(line.startswith("[rank0]:") for line in oks), done.stdout[-3000:]
    assert not any(line.startswith("[rank1]:") for line in done.stdout.splitlines())
    assert "FAIL" not in done.stdout


def test_every_rank_prints_when_asked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "meshcomm", "launch", "-n", "4",
                           str(ROOT / "examples" / "train_2d.py"), "--steps", "2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=scaled(300),
                          env={**env, "PYTHONPATH": str(ROOT), "MESHCOMM_PRINT_ALL": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in range(4):
        assert any(line.startswith(f"[rank{rank}]:") and "OK: largest relative" in line
                   for line in done.stdout.splitlines()), (rank, done.stdout[-3000:])


QUIET = '''
import meshcomm as mc    # first: its filter is in place before torch loads
from meshcomm.runtime.launch import run_ranks


def work(rank, world):
    import torch
    return rank


if __name__ == "__main__":
    print("RESULT", run_ranks(work, 2, timeout_s=60))
'''


def test_no_numpy_warning_from_meshcomm_or_its_ranks(tmp_path: Path) -> None:
    (tmp_path / "quiet.py").write_text(QUIET)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "PYTHONWARNINGS")}
    done = subprocess.run([sys.executable, "quiet.py"], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                          timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT [0, 1]" in done.stdout
    assert "NumPy" not in done.stderr, done.stderr
