"""`meshcomm show|plan|demo`: parse arguments, call the API, print with `display`.

Each subcommand is one `Command` in `COMMANDS`: a function adding its arguments
and a small handler returning the exit code. Exit codes: 0 success, 1 a check
failed, 2 bad input (any MeshcommError, printed without a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import display, sim
from .errors import MeshAxisError, MeshcommError, did_you_mean
from .layout import Layout, Shape
from .mesh import Mesh
from .plan import CostModel, Plan, plan

DEMO_MESH = "dp=2 tp=2"
DEMO_SHAPE = (8, 6)
DEMO_LAYOUTS = ("(dp b) (tp h)", "(b dp) h | sum(tp)", "(dp tp b) h")
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool")}
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
    mesh = Mesh(args.mesh)
    found = plan(mesh, args.shape, args.src, args.dst, dtype=DTYPES[args.dtype],
                 cost_model=_cost_model(mesh, args))
    if args.json:
        print(json.dumps(found.to_json(), indent=2))
    else:
        display.show_plan(found, width=args.width)
    return 0


# -- demo ------------------------------------------------------------------------
def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, help="output width in columns")


def _run_demo(args: argparse.Namespace) -> int:
    console = display.make_console(width=args.width)
    mesh = Mesh(DEMO_MESH)
    x = torch.arange(float(DEMO_SHAPE[0] * DEMO_SHAPE[1])).reshape(DEMO_SHAPE)
    for layout in DEMO_LAYOUTS:
        display.show(mesh, DEMO_SHAPE, layout, console=console)
        console.print()
    pairs = zip(DEMO_LAYOUTS, DEMO_LAYOUTS[1:] + DEMO_LAYOUTS[:1])
    results = [_demo_reshard(mesh, x, Layout(src), Layout(dst), console) for src, dst in pairs]
    return 0 if all(results) else 1


def _demo_reshard(mesh: Mesh, x: torch.Tensor, src: Layout, dst: Layout,
                  console: display.Console) -> bool:
    """Run the planned reshard of `x` from `src` to `dst` on simulated ranks and print the
    plan; True if every rank's output is exact and the bytes moved are the plan's."""
    p = plan(mesh, tuple(x.shape), src, dst, dtype=x.dtype)
    res = sim.execute(p, sim.scatter(x, mesh, src))
    problem = _demo_problem(p, x, res)
    display.show_plan(p, console=console, pictures=False)
    what = f'reshard "{src}" -> "{dst}"'
    done = f"all {mesh.size} shards exact, bytes moved as planned"
    display.status(console, not problem, f"{what}: {problem or done}")
    console.print()
    return not problem


def _demo_problem(p: Plan, x: torch.Tensor, res: sim.SimResult) -> str:
    """What is wrong with the simulated result `res` of plan `p` on `x`, or "" if nothing."""
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


COMMANDS: dict[str, Command] = {
    "show": Command("draw which rank holds which part of a tensor", _show_arguments, _run_show),
    "plan": Command("print the cheapest collectives between two layouts, with their cost",
                    _plan_arguments, _run_plan),
    "demo": Command("show three layouts of an (8, 6) tensor on dp=2 tp=2 and check reshards",
                    _demo_arguments, _run_demo),
}


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
