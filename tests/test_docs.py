"""The docs are tested: every fenced block of README.md and docs/*.md runs, and what it prints
is compared with what the page shows, so the docs cannot drift from the code.

How a block is read, by the language of its fence:

- ```python with `>>> ` lines: doctest style. Each example runs; what it prints (or the
  value of an expression) must equal the lines under it. `...` inside an expected line
  matches anything (doctest's ELLIPSIS); trailing spaces are ignored; a wrapped output needs
  `# doctest: +NORMALIZE_WHITESPACE`. An example that raises shows either a standard
  traceback (`Traceback (most recent call last):`, `...`, `module.ErrorName: message`) or
  just `ErrorName: message`.
- ```python without `>>> `: a script block. It runs; what it prints is compared only when
  the page shows it in a block marked `output` (below).
- ```console (and ```bash/```sh with `$ ` lines): a shell session. Each `$ ` line is a
  command; the lines up to the next `$ ` are its expected standard output, compared exactly
  (trailing spaces ignored); a line `...` stands for any number of lines. Commands run in
  the repository root with NO_COLOR=1 and COLUMNS=100. `$ meshcomm ARGS` runs
  `meshcomm.cli.main(ARGS)` in this process (what the `meshcomm` script runs); `meshcomm
  demo`, `meshcomm launch`, `python ...` and commands with shell syntax (`|`, `2>&1`, `;`)
  run in a subprocess (bash, where `meshcomm` and `python` are this interpreter's). A
  command must exit 0 unless the page prints its status (`; echo "exit $?"`). The same
  command runs once per test session.
- ```text, ```toml and bare fences are not run (unless marked `output`).

Each page reads as one session: its in-process python blocks share one namespace, in page
order, which starts with `torch` and `mc` (`import meshcomm as mc`) imported, as docs/api.md
promises its examples. Python blocks run in a scratch directory (files they write go there).

Markers: an HTML comment on the line right above a fence, `<!-- run: MODE ARGS -->`.

- `launch N [unwaited-ok (REASON)] [ARGS]`: a python block that needs N processes. It runs
  for real, on gloo, under `meshcomm launch -n N`, with ARGS as its `sys.argv[1:]`. To keep
  the test quick, all launch blocks with the same N (of every page) run in one launched
  script, in page order; each page's launch blocks share one namespace of their own
  (`__name__` is "__main__"). A block fails when it raises on any rank, or when it leaves a
  collective unwaited on a rank (a functional collective whose result it never used; torch
  warns about those at exit), unless its marker says `unwaited-ok (REASON)`, which must then
  be needed. A failure ends the script; the blocks after it report that they were not
  reached.
- `output [rank R]`: this block (```text or bare) is what the python block before it on the
  page printed; for a launch block, rank R's lines (default 0). `...` lines match any lines.
- `slow (REASON)`: a ```console block whose commands take long (whole example programs
  that start 4 or 8 processes). It runs only when MESHCOMM_DOCS_SLOW=1 is set, so the suite
  stays quick; run the test that way after changing what such a command prints.
- `excerpt PATH`: a python block quoted from the file PATH (relative to the repository
  root): each run of lines between `...` lines must appear in PATH as it is (or less an
  indentation common to the run), in order. Not run.
- `skip (REASON)`: not run (install commands, placeholder scripts); the reason is required.

The test fails on a block that fails, on a marker with an unknown mode (or a malformed one,
or with no fence right under it), on a shell block without `$ ` prompts that is not marked
(write it as a session or mark it skip), and on an `output` block with no python block
before it. A failure names the page and line and shows what the block printed: after a
change that alters a printout, paste the new output into the page. `pytest
tests/test_docs.py -k crossmesh` checks one page. All pages run in one interpreter, so a
page may see modules that an earlier page imported.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import scaled

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODES = ("launch", "output", "slow", "excerpt", "skip")
SLOW = os.environ.get("MESHCOMM_DOCS_SLOW", "") not in ("", "0")
ENV = {"NO_COLOR": "1", "COLUMNS": "100"}
PYTHON = {"python", "py", "pycon"}
SHELL = {"console", "bash", "sh", "shell"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*run:\s*(\S+)\s*(.*?)\s*-->\s*$")
LAUNCH = re.compile(r"([1-9]\d*)(?:\s+unwaited-ok\s+\((.+?)\))?(\s.*)?")   # N, why, args
FLAGS = doctest.ELLIPSIS
SUBPROCESS_TIMEOUT_S = 300      # a guard against hangs: the slowest command takes ~20 s


# -- reading the pages ---------------------------------------------------------------------------
def shown(path: Path) -> str:
    """A path as failures show it: relative to the repository root."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int                    # the line of the opening fence, 1-based
    lang: str
    lines: tuple[str, ...]
    mode: str = ""               # the marker's mode ("" without a marker)
    arg: str = ""                # the rest of the marker

    @property
    def id(self) -> str:
        return f"{shown(self.page)}:{self.line}"

    @property
    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    @property
    def kind(self) -> str:
        """doctest, python, console, shell (commands without prompts) or text."""
        if self.lang in PYTHON:
            return "doctest" if any(s.startswith(">>> ") for s in self.lines) else "python"
        if self.lang in SHELL:
            return "console" if any(s.startswith("$ ") for s in self.lines) else "shell"
        return "text"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    outputs: dict[int, Block] = field(default_factory=dict)   # python block line -> output


def read_page(path: Path) -> Page:
    page = Page(path)
    rel = shown(path)
    lines = path.read_text().splitlines()
    marker: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = MARKER.match(line)
        if found or re.match(r"\s*<!--\s*run", line):
            if not found:
                page.errors.append(f"{rel}:{i + 1}: malformed marker {line!r}; write"
                                   " <!-- run: MODE ARGS -->")
            elif i + 1 == len(lines) or not FENCE.match(lines[i + 1]):
                page.errors.append(f"{rel}:{i + 1}: marker {line!r} is not right above a fence")
            else:
                marker = (found.group(1), found.group(2))
            i += 1
            continue
        fence = FENCE.match(line)
        if fence:
            end = i + 1
            while end < len(lines) and lines[end].rstrip() != "```":
                end += 1
            if end == len(lines):
                page.errors.append(f"{rel}:{i + 1}: the fence is never closed")
            mode, arg = marker or ("", "")
            page.blocks.append(Block(path, i + 1, fence.group(1), tuple(lines[i + 1:end]),
                                     mode, arg))
            marker = None
            i = end + 1
            continue
        i += 1
    source: Block | None = None                # the python block an output block belongs to
    for block in page.blocks:
        if block.kind != "text":
            source = block if block.kind == "python" and block.mode in ("", "launch") else None
        elif block.mode == "output":
            if source is None or source.line in page.outputs:
                page.errors.append(f"{block.id}: an output block needs a python block before"
                                   " it (one output block each)")
            else:
                page.outputs[source.line] = block
    return page


def marker_errors(block: Block) -> list[str]:
    """What is wrong with a block's marker, or with an unmarked block that needs one."""
    where, mode, arg = block.id, block.mode, block.arg
    if not mode:
        if block.kind == "shell":
            return [f"{where}: a ```{block.lang} block without `$ ` prompts: write it as a"
                    " session ($ command, then its output) or mark it <!-- run: skip (why) -->"]
        return []
    if mode not in MODES:
        return [f"{where}: unknown marker mode {mode!r}; the modes are {', '.join(MODES)}"]
    if mode in ("skip", "slow") and not re.fullmatch(r"\(.+\)", arg):
        return [f"{where}: {mode} needs a reason: <!-- run: {mode} (why) -->"]
    if mode in ("launch", "excerpt") and block.kind != "python":
        return [f"{where}: {mode} is for ```python blocks without >>> examples"]
    if mode == "slow" and block.kind != "console":
        return [f"{where}: slow is for ```console blocks"]
    if mode == "launch" and not LAUNCH.fullmatch(arg):
        return [f"{where}: launch takes a process count, then unwaited-ok (why) if the block"
                " may leave collectives unwaited, then the script's arguments: <!-- run:"
                " launch 4 -->"]
    if mode == "output" and (block.kind != "text" or not re.fullmatch(r"(rank \d+)?", arg)):
        return [f"{where}: output marks a ```text or bare block: <!-- run: output [rank R] -->"]
    if mode == "excerpt" and not (ROOT / arg).is_file():
        return [f"{where}: excerpt names {arg!r}, which is not a file of the repository"]
    return []


PAGE_OF = {path: read_page(path) for path in PAGES}
BLOCKS = [b for page in PAGE_OF.values() for b in page.blocks
          if b.kind != "text" or b.mode not in ("", "output")]


# -- comparing output ----------------------------------------------------------------------------
def clean(text: str) -> list[str]:
    """Lines without trailing spaces, without trailing blank lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def lines_match(want: list[str], got: list[str]) -> bool:
    """Line by line equality, where a line `...` matches any run of lines (also none)."""
    states = {0}                                   # positions in `got` reachable so far
    for w in want:
        if w.strip() == "...":
            states = set(range(min(states), len(got) + 1)) if states else set()
        else:
            states = {j + 1 for j in states if j < len(got) and got[j] == w}
    return len(got) in states


def mismatch(what: str, want: list[str], got: list[str]) -> str:
    return (f"{what}\n--- the page shows:\n" + "\n".join(want)
            + "\n--- it printed:\n" + "\n".join(got))


def same_output(want: str, got: str, flags: int) -> bool:
    return doctest.OutputChecker().check_output(
        "\n".join(clean(want)) + "\n", "\n".join(clean(got)) + "\n", flags)


# -- running in this process ----------------------------------------------------------------------
@contextlib.contextmanager
def doc_env(cwd: Path, extra: dict[str, str] | None = None) -> Iterator[None]:
    """NO_COLOR=1, COLUMNS=100 (and `extra`), in `cwd`, for the duration."""
    env = {**ENV, **(extra or {})}
    saved = {k: os.environ.get(k) for k in env}
    here = os.getcwd()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compiled(source: str, block: Block, first_line: int, mode: str) -> object:
    """`source` compiled so that tracebacks name the page and the line in it."""
    return compile("\n" * (first_line - 1) + source, str(block.page), mode)


def complete(source: str) -> bool:
    try:
        return compile(source, "<doc>", "single") is not None
    except SyntaxError:
        return False


def run_doctest(block: Block, ns: dict[str, object]) -> str | None:
    """Run a block's `>>>` examples in `ns`; the first failure as text, or None."""
    for ex in doctest.DocTestParser().get_examples(block.text):
        first, *rest = ex.source.splitlines()
        if rest and not any(rest) and complete(first):
            return (f"{block.id}: the output of {first!r} starts with a line `...`, which"
                    " doctest reads as a continuation of the code: show its first line")
        flags = FLAGS
        for flag, on in ex.options.items():
            flags = flags | flag if on else flags & ~flag
        if flags & doctest.SKIP:
            continue
        line = block.line + 1 + ex.lineno
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compiled(ex.source, block, line, "single"), ns)
        except Exception as err:  # noqa: BLE001 - the page may show the error
            if ex.exc_msg is not None:             # a standard traceback: compare its last line
                want, got = ex.exc_msg, "".join(traceback.format_exception_only(type(err), err))
            else:                                  # the short form: "ErrorName: message"
                want, got = ex.want, out.getvalue() + f"{type(err).__name__}: {err}\n"
            if not same_output(want, got, flags):
                return (f"{shown(block.page)}:{line}: {ex.source.strip()}\n"
                        f"--- the page shows:\n{want}--- it raised:\n"
                        + "".join(traceback.format_exception(err)))
            continue
        want, got = ex.want, out.getvalue()
        if ex.exc_msg is not None:
            want = "Traceback (most recent call last):\n...\n" + ex.exc_msg
        if not same_output(want, got, flags):
            return (f"{shown(block.page)}:{line}: {ex.source.strip()}\n"
                    f"--- the page shows:\n{want}--- it printed:\n{got}")
    return None


def run_script(block: Block, ns: dict[str, object], output: Block | None) -> str | None:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compiled(block.text, block, block.line + 1, "exec"), ns)
    except Exception:  # noqa: BLE001
        return f"{block.id} raised:\n{traceback.format_exc()}"
    if output is not None and not lines_match(clean(output.text), clean(out.getvalue())):
        return mismatch(f"{block.id} printed other output than {output.id} shows",
                        clean(output.text), clean(out.getvalue()))
    return None


class Session:
    """One page's in-process python blocks, run in page order in one namespace."""

    def __init__(self, page: Page, scratch: Path) -> None:
        import torch

        import meshcomm as mc

        self.page, self.scratch = page, scratch
        self.ns: dict[str, object] = {"__name__": "__docs__", "torch": torch, "mc": mc}
        self.results: dict[int, str | None] = {}

    def result(self, block: Block) -> str | None:
        """Run every in-process block up to `block` not run yet; `block`'s failure or None."""
        for b in self.page.blocks:
            if b.line > block.line:
                break
            if b.line in self.results or b.mode or b.kind not in ("doctest", "python"):
                continue
            with doc_env(self.scratch):
                self.results[b.line] = (run_doctest(b, self.ns) if b.kind == "doctest" else
                                        run_script(b, self.ns, self.page.outputs.get(b.line)))
        failure = self.results[block.line]
        earlier = [f"{shown(self.page.path)}:{line}" for line, r in
                   self.results.items() if r is not None and line < block.line]
        if failure and earlier:
            failure += f"\n(earlier blocks of this page failed too: {', '.join(earlier)})"
        return failure


SESSIONS: dict[Path, Session] = {}


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docs")


# -- running commands ---------------------------------------------------------------------------
def run_process(argv: list[str], cwd: Path, timeout_s: float,
                env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `argv` in a session of its own; on timeout, kill that whole process group."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, **ENV, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -1, out, err + f"\n(killed after {timeout_s:.0f} s)"
    return proc.returncode, out, err


# bash runs `meshcomm` and `python` as this interpreter's
BASH_PRELUDE = ('meshcomm() { "$DOCS_PYTHON" -m meshcomm "$@"; }; '
                'python() { "$DOCS_PYTHON" "$@"; }; ')
COMMANDS: dict[str, tuple[int, str, str]] = {}


def run_command(command: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one `$ ` command of a page, run once per session."""
    if command in COMMANDS:
        return COMMANDS[command]
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    shell = any(re.fullmatch(r"[();<>|&]+", w) for w in words)
    timeout = scaled(SUBPROCESS_TIMEOUT_S)
    if not shell and words[:1] == ["meshcomm"] and words[1:2] not in (["demo"], ["launch"]):
        from meshcomm import cli

        out, err = io.StringIO(), io.StringIO()
        with doc_env(ROOT, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(words[1:])
        result = (status, out.getvalue(), err.getvalue())
    elif not shell and words[:1] == ["meshcomm"]:
        result = run_process([sys.executable, "-m", "meshcomm", *words[1:]], ROOT, timeout, env)
    elif not shell and words[:1] == ["python"]:
        result = run_process([sys.executable, *words[1:]], ROOT, timeout, env)
    else:
        result = run_process(["bash", "-c", BASH_PRELUDE + command], ROOT, timeout,
                             {"DOCS_PYTHON": sys.executable})
    COMMANDS[command] = result
    return result


def run_console(block: Block) -> str | None:
    session: list[tuple[int, str, list[str]]] = []
    for k, line in enumerate(block.lines):
        if line.startswith("$ "):
            session.append((block.line + 1 + k, line[2:], []))
        elif session:
            session[-1][2].append(line)
        elif line.strip():
            return f"{block.id}: output before the first `$ ` command: {line!r}"
    for line, command, want in session:
        status, out, err = run_command(command)
        where = f"{shown(block.page)}:{line}: $ {command}"
        if status != 0:
            return f"{where}\nexited {status}\n--- stdout:\n{out}--- stderr:\n{err}"
        if not lines_match(clean("\n".join(want)), clean(out)):
            return mismatch(where, clean("\n".join(want)), clean(out))
    return None


# -- launched blocks ------------------------------------------------------------------------------
LAUNCH_SCRIPT = '''\
import os, sys, traceback
import torch
import meshcomm as mc
from torch._C import _distributed_c10d as c10d

# functional collectives not yet waited on (torch warns about them at exit)
NONE = lambda: 0  # noqa: E731
unwaited = getattr(c10d, "_get_work_registry_size", NONE)
namespaces = {}


def mark(block_id, what):
    # one write of a whole line: print() writes its pieces one by one, and the launcher's
    # rank prefix can land between them ("@@docs-block[rank0]: README.md:96 end")
    sys.stdout.write(f"@@docs-block {block_id} {what}\\n")
    sys.stdout.flush()


for block_id, page, line, source, args, allowed in BLOCKS:
    ns = namespaces.setdefault(page, {"__name__": "__main__", "torch": torch, "mc": mc})
    sys.argv = [page, *args]
    mark(block_id, "begin")
    try:
        before = unwaited()
        exec(compile("\\n" * line + source, page, "exec"), ns)
        left = unwaited() - before
        if left and not allowed:
            raise RuntimeError(f"{block_id} left {left} collective(s) unwaited on this rank:"
                               " use every result (that waits on it)")
        if allowed and not left and unwaited is not NONE:
            raise RuntimeError(f"{block_id} left no collective unwaited on this rank: remove"
                               " unwaited-ok from its marker")
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        mark(block_id, "failed")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    mark(block_id, "end")
'''


def launch_count(block: Block) -> int:
    return int(block.arg.split()[0])


def launch_args(block: Block) -> tuple[list[str], bool]:
    """The script arguments of a launch marker, and whether it allows unwaited collectives."""
    found = LAUNCH.fullmatch(block.arg)
    assert found is not None
    return shlex.split(found.group(3) or ""), found.group(2) is not None


@dataclass
class LaunchRun:
    status: int
    stdout: str
    stderr: str
    printed: dict[str, dict[int, list[str]]]     # block id -> rank -> its lines
    done: dict[str, set[int]]                    # block id -> ranks that finished it
    failed: dict[str, set[int]]                  # block id -> ranks that raised in it


LAUNCHES: dict[int, LaunchRun] = {}


def launch_run(n: int, scratch: Path) -> LaunchRun:
    """Every launch block with `n` processes, run once in one `meshcomm launch -n n` job."""
    if n in LAUNCHES:
        return LAUNCHES[n]
    blocks = [b for b in BLOCKS if b.mode == "launch" and not marker_errors(b)
              and launch_count(b) == n]
    payload = [(b.id, str(b.page), b.line, b.text, *launch_args(b)) for b in blocks]
    script = scratch / f"launch_{n}.py"
    script.write_text(f"BLOCKS = {payload!r}\n" + LAUNCH_SCRIPT)
    status, out, err = run_process([sys.executable, "-m", "meshcomm", "launch", "-n", str(n),
                                    str(script)], scratch, scaled(SUBPROCESS_TIMEOUT_S))
    run = LaunchRun(status, out, err, {}, {}, {})
    current: dict[int, str] = {}
    for raw in out.splitlines():
        found = re.match(r"\[rank(\d+)\]:(.*)$", raw)
        if not found:
            continue
        rank, text = int(found.group(1)), found.group(2)
        mark = re.fullmatch(r"@@docs-block (\S+) (begin|end|failed)", text)
        if mark and mark.group(2) == "begin":
            current[rank] = mark.group(1)
            run.printed.setdefault(mark.group(1), {})[rank] = []
        elif mark:
            (run.done if mark.group(2) == "end" else run.failed).setdefault(
                mark.group(1), set()).add(rank)
        elif rank in current:
            run.printed[current[rank]][rank].append(text)
    LAUNCHES[n] = run
    return run


def check_launch(block: Block, scratch: Path) -> str | None:
    n = launch_count(block)
    run = launch_run(n, scratch)
    printed = run.printed.get(block.id, {})
    if run.done.get(block.id) != set(range(n)):
        failed = sorted(run.failed.get(block.id, ()))
        if failed:
            lines = "\n".join(f"[rank{r}] {s}" for r in failed for s in printed[r])
            return f"{block.id} raised on rank(s) {failed} under meshcomm launch -n {n}:\n{lines}"
        first = next((b for b, ranks in run.failed.items() if ranks), None)
        reason = (f"block {first} failed before it" if first and block.id not in run.printed
                  else f"the launch exited {run.status}")
        return (f"{block.id} did not finish on all {n} ranks ({reason})\n--- stdout (tail):\n"
                + run.stdout[-4000:] + "\n--- stderr (tail):\n" + run.stderr[-4000:])
    output = PAGE_OF[block.page].outputs.get(block.line)
    if output is not None:
        rank = int(output.arg.split()[1]) if output.arg else 0
        got = clean("\n".join(printed.get(rank, [])))
        if not lines_match(clean(output.text), got):
            return mismatch(f"{block.id} on rank {rank} printed other output than {output.id}"
                            " shows", clean(output.text), got)
    return None


def check_excerpt(block: Block) -> str | None:
    source = [line.rstrip() for line in (ROOT / block.arg).read_text().splitlines()]
    chunks: list[list[str]] = [[]]
    for line in block.lines:
        if line.strip() == "...":
            chunks.append([])
        else:
            chunks[-1].append(line.rstrip())
    at = 0
    for chunk in filter(None, chunks):
        start = next((i for i in range(at, len(source) - len(chunk) + 1)
                      if quoted(chunk, source[i:i + len(chunk)])), None)
        if start is None:
            return (f"{block.id}: these lines are not in {block.arg} (after line {at}) as"
                    " shown:\n" + "\n".join(chunk))
        at = start + len(chunk)
    return None


def quoted(chunk: list[str], lines: list[str]) -> bool:
    """Whether `chunk` is `lines`, less one indentation common to all of them."""
    def width(line: str) -> int:
        return len(line) - len(line.lstrip())

    extra = width(lines[0]) - width(chunk[0])
    indent = lines[0][:extra]
    return extra >= 0 and all(line == (indent + c if c else "") for c, line in zip(chunk, lines))


# -- the tests ------------------------------------------------------------------------------------
def test_pages_and_markers_are_well_formed() -> None:
    errors = [e for page in PAGE_OF.values() for e in page.errors]
    errors += [e for page in PAGE_OF.values() for b in page.blocks for e in marker_errors(b)]
    assert not errors, "\n".join(errors)
    assert len(BLOCKS) > 100        # the parser found the blocks


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, scratch: Path) -> None:
    errors = marker_errors(block)
    assert not errors, "\n".join(errors)
    if block.mode == "skip":
        pytest.skip(f"{block.id} is marked skip {block.arg}")
    if block.mode == "slow" and not SLOW:
        pytest.skip(f"{block.id} is marked slow {block.arg}; MESHCOMM_DOCS_SLOW=1 runs it")
    if block.mode == "excerpt":
        failure = check_excerpt(block)
    elif block.mode == "launch":
        failure = check_launch(block, scratch)
    elif block.kind == "console":
        failure = run_console(block)
    else:
        page = PAGE_OF[block.page]
        if block.page not in SESSIONS:
            work = scratch / block.page.stem
            work.mkdir(exist_ok=True)
            SESSIONS[block.page] = Session(page, work)
        failure = SESSIONS[block.page].result(block)
    assert failure is None, failure


def test_bad_markers_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- run: launch 4 -->\ntext\n\n<!-- runs: skip -->\n```python\nx = 1\n```\n"
                    "```console\n$ echo 1\n1\n```\n<!-- run: output -->\n```text\n1\n```\n"
                    "<!-- run: lunch 4 -->\n```python\nx = 1\n```\n```bash\nrm -rf /\n```\n")
    found = read_page(page)
    errors = found.errors + [e for b in found.blocks for e in marker_errors(b)]
    wanted = ["marker '<!-- run: launch 4 -->' is not right above a fence",
              "malformed marker '<!-- runs: skip -->'", "an output block needs a python block",
              "unknown marker mode 'lunch'", "a ```bash block without `$ ` prompts"]
    assert len(errors) == len(wanted), errors
    assert all(w in e for w, e in zip(wanted, errors)), errors


def test_the_matchers() -> None:
    assert lines_match(["a", "...", "d"], ["a", "b", "c", "d"])
    assert lines_match(["a", "...", "b"], ["a", "b"])
    assert lines_match(["...", "b"], ["a", "b"]) and lines_match(["a", "..."], ["a"])
    assert not lines_match(["a", "...", "d"], ["a", "b", "c"])
    assert not lines_match(["a", "b"], ["a", "b", "c"]) and not lines_match(["a"], [])
    assert clean("x  \ny\n\n") == ["x", "y"]
    page = ROOT / "docs" / "x.md"
    block = Block(page, 1, "python", ('>>> print("a b")', "a b", ">>> int('x')",
                                      "ValueError: invalid literal for int() with base 10: 'x'"))
    assert block.kind == "doctest" and run_doctest(block, {}) is None
    wrong = Block(page, 1, "python", (">>> 1 + 1", "3"))
    assert "the page shows" in (run_doctest(wrong, {}) or "")
    assert marker_errors(Block(page, 1, "python", ("x = 1",), "lunch", "4"))
    assert marker_errors(Block(page, 1, "python", ("x = 1",), "skip", ""))
    assert marker_errors(Block(page, 1, "bash", ("pip install x",)))
    assert not marker_errors(Block(page, 1, "bash", ("pip install x",), "skip", "(install)"))
    assert not marker_errors(Block(page, 1, "python", ("x = 1",), "launch", "2 --steps 3"))
    ok = Block(page, 1, "python", ("x = 1",), "launch", "4 unwaited-ok (a bug) --n 3")
    assert not marker_errors(ok) and launch_args(ok) == (["--n", "3"], True)
    assert marker_errors(Block(page, 1, "python", ("x = 1",), "launch", "four"))
