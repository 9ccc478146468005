"""`meshcomm show|demo`: parse arguments, call the API, print with `display`.

Each subcommand is one `Command` in `COMMANDS`: a function adding its arguments
and a small handler returning the exit code. Exit codes: 0 success, 1 a check
failed, 2 bad input (any MeshcommError, printed without a traceback).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import display, sim
from .errors import MeshcommError
from .layout import Layout, Shape
from .mesh import Mesh

DEMO_MESH = "dp=2 tp=2"
DEMO_SHAPE = (8, 6)
DEMO_LAYOUTS = ("(dp b) (tp h)", "(b dp) h | sum(tp)", "(dp tp b) h")


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
    """Reshard simulated shards of `x` from `src` to `dst`; True if every rank is exact.

    For now: gather to the global tensor and scatter again (the reference path).
    """
    shards = sim.scatter(x, mesh, src)
    rebuilt = sim.gather(shards, mesh, src, tuple(x.shape))
    got = sim.scatter(rebuilt, mesh, dst)
    want = sim.scatter(x, mesh, dst)
    bad = [r for r, g, w in zip(mesh.ranks, got, want) if not torch.equal(g, w)]
    what = f'reshard "{src}" -> "{dst}" on {mesh!r} (via gather + scatter)'
    if bad:
        display.status(console, False, f"{what}: ranks {bad} differ from scatter(x, dst)")
    else:
        display.status(console, True, f"{what}: all {mesh.size} shards exact")
    return not bad


COMMANDS: dict[str, Command] = {
    "show": Command("draw which rank holds which part of a tensor", _show_arguments, _run_show),
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
