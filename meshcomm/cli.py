"""`meshcomm show|plan|demo|launch|dryrun|pipeline|recipe`: parse arguments, call the API,
print with `display`.

Each subcommand is one `Command` in `COMMANDS`: a function adding its arguments
and a small handler returning the exit code. Exit codes: 0 success, 1 a check
failed, 2 bad input (any MeshcommError, printed without a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TextIO, cast

from .core.errors import LaunchError, MeshAxisError, MeshcommError, did_you_mean

# Parsing arguments and `--help` import no torch, rich or pydantic (they take over a
# second): each handler imports what it uses.
if TYPE_CHECKING:
    import torch

    from .core.layout import Shape
    from .core.mesh import Mesh
    from .executors import sim
    from .planner.values import CostModel, Plan
else:
    Shape = tuple

DEMO_MESH = "dp=2 tp=2"
DEMO_SHAPE = (8, 6)
DEMO_LAYOUTS = ("(dp b) (tp h)", "(b dp) h | sum(tp)", "(dp tp b) h")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool")            # torch dtype names
PerAxis = tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its one-line help, how it adds arguments, and its handler."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def parse_shape(text: str) -> Shape:
    """A shape from "8,6" (also "8 6" or "(8, 6)"); argparse names the flag on error."""
    items = [item for item in re.split(r"[,\s]+", text.strip().strip("()[]")) if item]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f'"{text}" is not a shape; write non-negative sizes separated by commas, e.g. 8,6'
        )
    return tuple(int(item) for item in items)


def parse_per_axis(text: str) -> float | PerAxis:
    """One number ("2e-6") or per-axis numbers ("dp=20e-6,tp=2e-6"; a bare number in the
    list is the default for the other axes); argparse names the flag on error."""
    items = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    pairs: list[tuple[str, float]] = []
    try:
        for item in items:
            name, _, value = item.rpartition("=")
            pairs.append((name.strip() or "*", float(value)))
    except ValueError:
        pairs = []
    names = [name for name, _ in pairs]
    if not pairs or len(set(names)) != len(names) or not all(math.isfinite(v) for _, v in pairs):
        raise argparse.ArgumentTypeError(
            f'"{text}" is not a number or a list of axis=number, e.g. 2e-6 or "dp=20e-6,tp=2e-6"'
        )
    return pairs[0][1] if names == ["*"] else tuple(pairs)


# -- show ------------------------------------------------------------------------
def _show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", required=True, help='mesh axes, e.g. "dp=2 tp=2"')
    parser.add_argument("--shape", required=True, type=parse_shape,
                        help="global tensor shape, e.g. 8,6")
    parser.add_argument("--layout", required=True, help='layout, e.g. "(dp b) (tp h)"')
    parser.add_argument("--svg", metavar="FILE", help="also write the picture to an SVG file")
    parser.add_argument("--width", type=int, help="output width in columns")


def _run_show(args: argparse.Namespace) -> int:
    from . import display
    from .core.layout import Layout
    from .core.mesh import Mesh

    mesh, layout = Mesh(args.mesh), Layout(args.layout)
    layout.placements(mesh, args.shape)
    display.show(mesh, args.shape, layout, width=args.width)
    if args.svg:
        display.export_svg(mesh, args.shape, layout, args.svg, width=args.width or 100)
        print(f"wrote {args.svg}")
    return 0


# -- plan ------------------------------------------------------------------------
def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", required=True, help='mesh axes, e.g. "dp=2 tp=4"')
    parser.add_argument("--shape", required=True, type=parse_shape,
                        help="global tensor shape, e.g. 8,16,32")
    parser.add_argument("--src", required=True, help='layout before, e.g. "(dp b) s (tp h)"')
    parser.add_argument("--dst", required=True, help='layout after, e.g. "b (dp s) (tp h)"')
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="element type (default float32)")
    parser.add_argument("--latency-s", type=parse_per_axis, metavar="S",
                        help='seconds per collective: 2e-6, or per axis "dp=20e-6,tp=2e-6"'
                             " (default 0)")
    parser.add_argument("--bandwidth", type=parse_per_axis, metavar="B_PER_S",
                        help='bytes per second: 100e9, or per axis "dp=25e9,tp=450e9"'
                             " (default 100e9)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON only")
    parser.add_argument("--width", type=int, help="output width in columns")


def _cost_model(mesh: Mesh, args: argparse.Namespace) -> CostModel:
    """The CostModel of the cost flags; per-axis names must be axes of `mesh`."""
    from .planner.values import CostModel

    given = {}
    for flag, value in (("--latency-s", args.latency_s), ("--bandwidth", args.bandwidth)):
        if isinstance(value, tuple):
            for name, _ in value:
                if name != "*" and name not in mesh.axis_names:
                    hint = did_you_mean(name, mesh.axis_names)
                    raise MeshAxisError(
                        f'{flag} names "{name}", not an axis of {mesh!r} (axes:'
                        f" {', '.join(mesh.axis_names)})" + (f"; fix: {hint}" if hint else ""))
            value = dict(value)
        if value is not None:
            given["latency_s" if flag == "--latency-s" else "bandwidth"] = value
    return CostModel(**given)


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from . import display
    from .core.mesh import Mesh
    from .planner.plan import plan

    mesh = Mesh(args.mesh)
    found = plan(mesh, args.shape, args.src, args.dst, dtype=getattr(torch, args.dtype),
                 cost_model=_cost_model(mesh, args))
    if args.json:
        print(json.dumps(found.to_json(), indent=2))
    else:
        display.show_plan(found, width=args.width)
    return 0


# -- demo ------------------------------------------------------------------------
DEMO_PROCESSES = 4
DEMO_TIMEOUT_S = 120.0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, help="output width in columns")


def _run_demo(args: argparse.Namespace) -> int:
    """Reshard a real tensor through the demo layouts on 4 local gloo processes.

    The processes return their shards and bytes; this process prints every picture and
    plan once (for all ranks) and checks each step against the simulator, bit for bit.
    """
    import torch

    from . import display
    from .core.mesh import Mesh
    from .executors import sim
    from .planner.plan import plan
    from .runtime.launch import run_ranks

    console = display.make_console(width=args.width)
    mesh = Mesh(DEMO_MESH)
    x = torch.arange(float(DEMO_SHAPE[0] * DEMO_SHAPE[1])).reshape(DEMO_SHAPE)
    for layout in DEMO_LAYOUTS:
        display.show(mesh, DEMO_SHAPE, layout, console=console)
        console.print()
    chain = list(zip(DEMO_LAYOUTS, DEMO_LAYOUTS[1:] + DEMO_LAYOUTS[:1]))
    console.print(f"running {len(chain)} reshards on {DEMO_PROCESSES} local processes"
                  f" (torch.distributed, gloo) bound to {mesh!r}", highlight=False)
    console.print()
    per_rank = run_ranks(_demo_rank, DEMO_PROCESSES, DEMO_MESH, x, chain,
                         timeout_s=DEMO_TIMEOUT_S)
    shards = sim.scatter(x, mesh, chain[0][0])
    ok = True
    for k, (src, dst) in enumerate(chain):
        p = plan(mesh, DEMO_SHAPE, src, dst, dtype=x.dtype)
        res = sim.execute(p, shards)
        real = [rank_steps[k] for rank_steps in per_rank]
        problem = _demo_problem(p, x, res) or _demo_mismatch(p, res, real)
        display.show_plan(p, console=console, pictures=False)
        done = (f"all {mesh.size} shards exact and equal to the simulator, bytes moved as"
                " planned")
        display.status(console, not problem, f'reshard "{src}" -> "{dst}": {problem or done}')
        console.print()
        ok = ok and not problem
        shards = list(res.outputs)
    return 0 if ok else 1


def _demo_rank(rank: int, world_size: int, mesh_spec: str, x: torch.Tensor,
               chain: list[tuple[str, str]]) -> list[tuple[torch.Tensor, int, int]]:
    """One process of the demo: each step's shard and the bytes it sent and received."""
    from .executors.distributed import ByteTrace
    from .runtime import init_mesh
    from .sharded import distribute, reshard

    bound = init_mesh(mesh_spec)
    local = distribute(x, bound, chain[0][0]).local
    steps = []
    for src, dst in chain:
        trace = ByteTrace()
        local = reshard(local, bound, src, dst, shape=tuple(x.shape), trace=trace) + 0
        steps.append((local, trace.send_bytes, trace.recv_bytes))
    return steps


def _demo_mismatch(p: Plan, res: sim.SimResult,
                   real: list[tuple[torch.Tensor, int, int]]) -> str:
    """How the processes' results differ from the simulator's, or "" if they do not."""
    import torch

    bad = [r for r, (got, want) in enumerate(zip(real, res.outputs))
           if got[0].shape != want.shape or not torch.equal(got[0], want)]
    if bad:
        return f"ranks {bad} differ from the simulator"
    moved = (tuple(s for _, s, _ in real), tuple(r for _, _, r in real))
    if moved != (p.send_bytes, p.recv_bytes):
        return (f"the processes moved {moved[0]} B sent / {moved[1]} B received,"
                f" but the plan says {p.send_bytes} / {p.recv_bytes}")
    return ""


def _demo_problem(p: Plan, x: torch.Tensor, res: sim.SimResult) -> str:
    """What is wrong with the simulated result `res` of plan `p` on `x`, or "" if nothing."""
    import torch

    from .executors import sim

    mesh, dst = p.mesh, p.dst
    if dst.partial_axes:
        if not torch.equal(sim.gather(list(res.outputs), mesh, dst, p.shape), x):
            return "the reduced outputs differ from x"
    else:
        want = sim.scatter(x, mesh, dst)
        bad = [r for r, g, w in zip(mesh.ranks, res.outputs, want) if not torch.equal(g, w)]
        if bad:
            return f"ranks {bad} differ from scatter(x, dst)"
    if (res.send_bytes, res.recv_bytes) != (p.send_bytes, p.recv_bytes):
        return (f"moved {res.send_bytes} B sent / {res.recv_bytes} B received,"
                f" but the plan says {p.send_bytes} / {p.recv_bytes}")
    return ""


# -- launch ----------------------------------------------------------------------
def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                        help="number of local processes")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run_launch(args: argparse.Namespace) -> int:
    return launch(args.nproc, args.script, args.args)


def launch(nproc: int, script: str, script_args: Sequence[str] = ()) -> int:
    """Run `script` on `nproc` local processes with torch's own launcher (torchrun
    --standalone); returns 0 when every process succeeds, else 1.

    Each process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so `mc.init_mesh`
    joins them (gloo without CUDA, nccl with it). Every line a process prints starts with
    its rank ("[rank0]:"); OMP_NUM_THREADS defaults to 1.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if nproc < 1:
        raise LaunchError(f"launch needs -n of at least 1, got {nproc}")
    if not Path(script).is_file():
        raise LaunchError(f"launch: script {script!r} is not a file (from {Path.cwd()});"
                            " fix: give the path of a Python script, e.g."
                            " meshcomm launch -n 4 examples/train_2d.py")
    # Each line of a rank's output is prefixed "[rank<i>]:"; one intra-op thread per process,
    # as torchrun would set, without its banner about it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    streams = sys.stdout, sys.stderr
    # torchrun's tee writes each rank's lines to sys.stdout/sys.stderr as it finds them.
    sys.stdout, sys.stderr = (cast(TextIO, OnePrefix(sys.stdout)),
                              cast(TextIO, OnePrefix(sys.stderr)))
    try:
        torchrun.main(["--standalone", f"--nproc-per-node={nproc}", "--tee", "3",
                       "--role", "rank", script, *script_args])
    except ChildFailedError as err:
        print(f"meshcomm launch: {err}", file=sys.stderr)
        return 1
    finally:
        sys.stdout, sys.stderr = streams
    return 0


_DOUBLED_PREFIX = re.compile(r"^(\[rank\d+\]:)\1", re.MULTILINE)


class OnePrefix:
    """A text stream that writes to `stream`, with a doubled rank prefix made one:
    torch's own log lines start "[rank0]:" once a process group exists, and the
    launcher's tee puts "[rank0]:" before every line again."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(_DOUBLED_PREFIX.sub(r"\1", text))

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


# -- dryrun ----------------------------------------------------------------------
def _dryrun_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                        help="ranks in the job the process pretends to belong to")
    parser.add_argument("--rank", type=int, default=0, help="which rank it is (default 0)")
    parser.add_argument("script", help="the Python script the rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run_dryrun(args: argparse.Namespace) -> int:
    return dryrun(args.nproc, args.rank, args.script, args.args)


def dryrun(nproc: int, rank: int, script: str, script_args: Sequence[str] = ()) -> int:
    """Run `script` in this process as rank `rank` of an `nproc`-rank job over torch's fake
    process group (`mc.dryrun`) and print what the rank did, step by step: collectives
    with their bytes, peak tensor memory, host time. 0 when the script succeeds.

    RANK, WORLD_SIZE and LOCAL_RANK are set as a launcher would, so the script takes its
    launched path; `mc.dryrun.active()` tells it that it runs dry (build on meta, skip
    checks that need other ranks' data).
    """
    import runpy

    from . import dryrun as dry

    if not Path(script).is_file():
        raise LaunchError(f"dryrun: script {script!r} is not a file (from {Path.cwd()});"
                            " fix: give the path of a Python script, e.g. meshcomm dryrun"
                            " -n 1024 --rank 5 examples/train_llama.py --size 8b")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                       "MESHCOMM_PRINT_ALL": "1"})    # the one rank here prints its report
    def script_main() -> int:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:     # sys.exit(main()): the script's own exit code
            return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        return 0

    saved_argv = sys.argv
    sys.argv = [script, *script_args]
    try:
        code, report = dry.run(script_main, world_size=nproc, rank=rank)
    finally:
        sys.argv = saved_argv
    print(report)
    if code:
        print(f"meshcomm dryrun: the script exited with {code}", file=sys.stderr)
    return 1 if code else 0


# -- pipeline --------------------------------------------------------------------
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v")


def _pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", default="1f1b", choices=PIPELINE_SCHEDULES,
                        help="the schedule to build (default 1f1b)")
    parser.add_argument("--ranks", type=int, default=4, metavar="P",
                        help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, metavar="M",
                        help="microbatches per step (default 8)")
    parser.add_argument("--stages-per-rank", type=int, metavar="V",
                        help="interleaved_1f1b only: stages per rank (default 2)")
    parser.add_argument("--from-csv", metavar="FILE", help="read the schedule from a CSV file"
                        " in PyTorch's action notation instead of building one")
    parser.add_argument("--forward", type=float, default=1.0, metavar="S",
                        help="seconds of a stage's forward per microbatch (default 1)")
    parser.add_argument("--backward", type=float, default=2.0, metavar="S",
                        help="seconds of a stage's full backward per microbatch (default 2)")
    parser.add_argument("--weight", type=float, metavar="S", help="seconds of the weight"
                        " gradient (W) within --backward (default: half of it in schedules"
                        " that split backward, else 0)")
    parser.add_argument("--send", type=float, default=0.0, metavar="S",
                        help="seconds of each hand-off between ranks (default 0)")
    parser.add_argument("--activation-bytes", type=int, default=2**20, metavar="B",
                        help="bytes a stage holds per microbatch in flight (default 1 MiB:"
                             " the peak reads as microbatches held)")
    parser.add_argument("--csv", action="store_true", help="print the schedule as CSV in"
                        " PyTorch's notation (what torch.distributed.pipelining reads)")
    parser.add_argument("--comms", action="store_true",
                        help="with --csv: with the SEND/RECV actions written out")
    parser.add_argument("--trace", metavar="FILE", help="also write the timeline as a Chrome /"
                        " Perfetto trace (JSON; open it in ui.perfetto.dev)")
    parser.add_argument("--width", type=int, help="output width in columns")


def _run_pipeline(args: argparse.Namespace) -> int:
    from .core.errors import ScheduleError
    from .planner.pipeline import Schedule, StageCosts, build, simulate

    if args.from_csv:
        try:
            text = Path(args.from_csv).read_text()
        except OSError as err:
            raise ScheduleError(f"--from-csv {args.from_csv}: {err.strerror}") from None
        schedule = Schedule.from_csv(text, name=Path(args.from_csv).name)
    else:
        if args.stages_per_rank is not None and args.schedule != "interleaved_1f1b":
            raise ScheduleError(f"--stages-per-rank goes with --schedule interleaved_1f1b, not"
                                f" {args.schedule} (zero_bubble_v has 2 by construction)")
        kw = ({"v": args.stages_per_rank or 2} if args.schedule == "interleaved_1f1b"
              else {})
        schedule = build(args.schedule, args.ranks, args.microbatches, **kw)
    if args.csv:
        print(schedule.to_csv(comms=args.comms), end="")
        return 0
    weight = args.weight
    if weight is None:
        weight = args.backward / 2 if schedule.split_backward else 0.0
    if not 0 <= weight <= args.backward:
        raise ScheduleError(f"--weight {weight:g}: the weight gradient is part of the"
                            f" backward, so expected 0 <= weight <= --backward {args.backward:g}")
    costs = StageCosts.uniform(schedule.n_stages, forward=args.forward,
                               backward=args.backward, weight=weight, send=args.send,
                               activation_bytes=args.activation_bytes)
    timeline = simulate(schedule, costs)
    from . import display

    display.show_timeline(timeline, width=args.width)
    if args.trace:
        Path(args.trace).write_text(json.dumps(timeline.chrome_trace()))
        print(f"wrote {args.trace} ({len(timeline.events)} events; open it in"
              " ui.perfetto.dev)")
    return 0


COMMANDS: dict[str, Command] = {
    "show": Command("draw which rank holds which part of a tensor", _show_arguments, _run_show),
    "plan": Command("print the cheapest collectives between two layouts, with their cost",
                    _plan_arguments, _run_plan),
    "demo": Command("reshard an (8, 6) tensor through three layouts on 4 local processes"
                    " (dp=2 tp=2) and check it", _demo_arguments, _run_demo),
    "launch": Command("run a script on N local processes joined by torch.distributed",
                      _launch_arguments, _run_launch),
    "dryrun": Command("run a script alone as one rank of an N-rank job (fake process group)"
                      " and print its collectives, bytes, peak memory and host time",
                      _dryrun_arguments, _run_dryrun),
    "pipeline": Command("draw a pipeline schedule's simulated timeline (step time, bubbles,"
                        " peak activations), or print it as CSV", _pipeline_arguments,
                        _run_pipeline),
}


# -- recipe ----------------------------------------------------------------------
def parse_shape_of(text: str) -> tuple[str, Shape]:
    """A (tensor name, shape) pair from "wq=16,8"; argparse names the flag on error."""
    name, sep, shape = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
        raise argparse.ArgumentTypeError(f'"{text}" is not NAME=SHAPE, e.g. wq=16,8')
    return name.strip(), parse_shape(shape)


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    sub.add_parser("list", help="list the built-in recipes", description="list the built-in"
                   " recipes")
    show = sub.add_parser("show", help="print every named tensor's layout and picture",
                          description="print every named tensor's layout and picture")
    show.add_argument("name", help='a built-in name ("fsdp_tp") or a path to a .toml file')
    show.add_argument("--mesh", help="mesh axes, e.g. \"dp=2 tp=2\" (default: the recipe's"
                      " example mesh); axes the recipe names but the mesh lacks are dropped")
    show.add_argument("--shape-of", action="append", default=[], type=parse_shape_of,
                      metavar="NAME=SHAPE", help="example shape of a named tensor, e.g. wq=16,8")
    show.add_argument("--tensor", action="append", default=[], metavar="NAME",
                      help="show only this named tensor (repeatable)")
    show.add_argument("--no-pictures", action="store_true", help="print the table only")
    show.add_argument("--width", type=int, help="output width in columns")
    check = sub.add_parser("check", help="validate a recipe file (exit 0 OK, 2 with the error)",
                           description="validate a recipe file (exit 0 OK, 2 with the error)")
    check.add_argument("file", help="a path to a .toml file (or a built-in name)")
    check.add_argument("--mesh", help="also check every named tensor on this mesh")


def _run_recipe(args: argparse.Namespace) -> int:
    from . import recipes
    if args.recipe_command == "list":
        return _recipe_list(recipes)
    if args.recipe_command == "check":
        return _recipe_check(recipes, args)
    return _recipe_show(recipes, args)


def _recipe_list(recipes: ModuleType) -> int:
    """One recipe a line, its description wrapped to the terminal's width (COLUMNS, or the
    terminal's); into a pipe without COLUMNS, one line each (for grep)."""
    import shutil
    import textwrap

    names = recipes.builtin_recipes()
    width = max(map(len, names), default=0)
    columns = (shutil.get_terminal_size().columns
               if os.environ.get("COLUMNS") or sys.stdout.isatty() else None)
    for name in names:
        found = recipes.recipe(name)
        head = f"{name:<{width}}  {str(found.mesh):<18}  "
        room = max((columns or 10**6) - len(head), 20)
        lines = textwrap.wrap(found.description, room, break_on_hyphens=False) or [""]
        print(head + lines[0])
        for line in lines[1:]:
            print(" " * len(head) + line)
    return 0


def _recipe_check(recipes: ModuleType, args: argparse.Namespace) -> int:
    from . import display
    from .core.mesh import Mesh

    found = recipes.recipe(args.file)
    meshes = [found.mesh] + ([Mesh(args.mesh)] if args.mesh else [])
    for mesh in meshes:
        found.check(mesh)
    where = " and ".join(repr(m) for m in meshes)
    text = (f'{found.source}: recipe "{found.name}" ({len(found.rules)} rules,'
            f" {len(found.tensors)} named tensors) resolves on {where}")
    display.status(display.make_console(width=max(100, len(text) + 8)), True, text)
    return 0


def _recipe_show(recipes: ModuleType, args: argparse.Namespace) -> int:
    from . import display
    from .core.mesh import Mesh

    found = recipes.recipe(args.name)
    mesh = Mesh(args.mesh) if args.mesh else found.mesh
    shapes = {t.name: t.shape for t in found.tensors}
    for name, shape in args.shape_of:
        shapes[found.tensor(name).name] = shape
    chosen = [found.tensor(n) for n in args.tensor] or list(found.tensors)
    rows = [(t, found.layout(t.logical, mesh), shapes[t.name]) for t in chosen]
    for _, layout, shape in rows:
        if shape is not None:
            layout.placements(mesh, shape)       # every error before any output
    print(f'recipe "{found.name}": {found.description}\nfile: {found.source}')
    print(f"mesh: {mesh!r}" + (" (the recipe's example mesh)" if mesh == found.mesh else ""))
    print("rules:")
    pad = max((len(name) for name, _ in found.rules), default=0)
    for name, axes in found.rules:
        dropped = [a for a in axes if a not in mesh.axis_names]
        print(f"  {name:<{pad}} -> {', '.join(axes) or '(replicated)'}"
              + (f"  ({', '.join(dropped)} not in the mesh: dropped)" if dropped else ""))
    print("tensors:")
    table = [("name", "kind", "logical dims", "layout", "shape")] + [
        (t.name, t.kind, t.logical, str(layout), str(shape) if shape else "-")
        for t, layout, shape in rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not args.no_pictures:
        console = display.make_console(width=args.width)
        for t, layout, shape in rows:
            if shape is not None:
                print(f"\n{t.name} ({t.kind}): \"{t.logical}\"" + (f" - {t.about}" if t.about
                                                                  else ""))
                display.show(mesh, shape, layout, console=console)
    return 0


COMMANDS["recipe"] = Command("list, show or check layout recipes (logical dims -> mesh axes)",
                             _recipe_arguments, _run_recipe)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per entry of `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="meshcomm", description="Sharded tensors you can reason about.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help,
                                             description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `meshcomm` command line; returns the exit code.

    >>> main(["show", "--mesh", "dp=2", "--shape", "4", "--layout", "(dp b)"])  # doctest: +SKIP
    0
    """
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command].run(args)
    except MeshcommError as err:
        print(f"meshcomm: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
