"""What a destination rank makes of the blocks a transfer between meshes brings it.

Executor layer: it decides nothing; the step says it all. A plain transfer writes each
block where it belongs (`local.assemble`). A direct delivery of partials (action
"direct") brings every receiver its block once from a holder of each of the g partials
pending on the source mesh: the blocks of each partial are assembled apart, then the g
are reduced in group order (`op_reduce`, left to right), which is the order a
reduce_scatter over the same axes adds them in, so the simulator and gloo agree bit for
bit. A rank that only contributes to a pending reduction of the destination receives
nothing and holds that reduction's identity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from ..core.reduce_ops import op_reduce
from ..planner.values import Step, Transfer
from .local import _positions, assemble


def partial_of(step: Step, src: int) -> int:
    """Which of the g partials the source rank `src` holds in a direct delivery: its
    position in its group over the source's pending axes (first axis major). All of them
    are resolved: a pending reduction of the destination is over its own mesh's axes."""
    mesh = step.mesh
    assert mesh is not None, f"a transfer between meshes names its source mesh: {step}"
    coords = mesh.coords(src)
    out = 0
    for a in mesh.axis_names:
        if a in step.before.partial_axes:
            out = out * mesh.axis_size(a) + coords[a]
    return out


def partials(step: Step) -> int:
    """g: the partials a direct delivery reduces (1 for any other transfer)."""
    if step.action != "direct":
        return 1
    mesh = step.mesh
    assert mesh is not None, f"a transfer between meshes names its source mesh: {step}"
    return mesh.group_size(step.before.partial_axes)


def combine(step: Step, parts: Sequence[tuple[Transfer, Tensor]], out_shape: tuple[int, ...],
         like: Tensor, fresh: bool = False) -> Tensor:
    """This rank's output of the transfer `step` from the blocks it kept and received
    (`parts`: each with its Transfer); `fresh` as in `local.assemble`."""
    fill = step.after.reduce_op
    if step.action != "direct":
        return assemble(parts, out_shape, step.op, like, fresh)
    if not parts:      # a contributor of the destination's pending reduction
        return assemble((), out_shape, fill, like)
    by_partial: list[list[tuple[Transfer, Tensor]]] = [[] for _ in range(partials(step))]
    for t, part in parts:
        by_partial[partial_of(step, t.src)].append((t, part))
    op = step.before.reduce_op
    assert op is not None, f"a direct delivery resolves a pending reduction: {step}"
    return op_reduce([assemble(ps, out_shape, None, like) for ps in by_partial], op)


def unpacked(step: Step, transfers: Iterable[Transfer], order: Sequence[int], rank: int,
             flat: Tensor, out_shape: tuple[int, ...]) -> Tensor:
    """`combine` from one flat buffer holding `rank`'s blocks in source order (positions over
    `order`, the ranks of both meshes), as an all_to_all delivers them."""
    where = _positions(tuple(order))    # built once per rank list, not per call
    mine = sorted((t for t in transfers if t.dst == rank), key=lambda t: where[t.src])
    parts, at = [], 0
    for t in mine:
        parts.append((t, flat[at:at + t.numel]))
        at += t.numel
    return combine(step, parts, out_shape, flat)
