"""What an executor needs of a mesh bound to process groups, and the one check for it.

Executor layer. The bound mesh itself (`meshcomm.runtime.bind.BoundMesh`, made by
`mc.init_mesh`) lives in the runtime above; executors see it as `Groups`: its mesh, this
rank, its device, and the name of this rank's group over some axes. One call's group as
the wire module takes it is a `Group`; `resolve_group` turns a group's name back into its
process group. This module never communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ...core.errors import MeshMismatchError
from ...core.mesh import AxisName, Mesh

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class Group(NamedTuple):
    """This rank's group for one call: its funcol name, its size, this rank's position."""

    name: str
    size: int
    pos: int


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group named `name` (functional collectives address groups by name)."""
    from torch.distributed import distributed_c10d as c10d

    resolve: Callable[[c10d.GroupName], dist.ProcessGroup] = getattr(
        c10d, "_resolve_process_group")
    return resolve(c10d.GroupName(name))


class Groups:
    """A mesh bound to live process groups on this rank (`BoundMesh` is the one kind).

    `group_name(axes)` is the name of this rank's group for a collective over `axes` (a str
    that functional collectives accept); ranks outside the mesh have no groups.
    """

    __slots__ = ()
    mesh: Mesh
    rank: int
    device: torch.device

    @property
    def in_mesh(self) -> bool:
        return self.rank in self.mesh      # one dict lookup (`Mesh.__contains__`)

    def group_name(self, axes: tuple[AxisName, ...] | AxisName) -> str:
        raise NotImplementedError


def require_bound(value: object, who: str, argument: str = "a mesh") -> Groups:
    """`value`, which must be a bound mesh (`mc.init_mesh`); otherwise the one error every
    public call raises for it: "reshard needs a mesh bound to torch.distributed, got the
    Mesh Mesh(dp=2); fix: bound = mc.init_mesh('dp=2') on every rank, then pass bound"."""
    if isinstance(value, Groups):
        return value
    what = f"the Mesh {value!r}" if isinstance(value, Mesh) else f"a {type(value).__name__}"
    spec = str(value) if isinstance(value, Mesh) or "=" in str(value) else "dp=2 tp=4"
    raise MeshMismatchError(f"{who} needs {argument} bound to torch.distributed, got {what};"
                            f" fix: bound = mc.init_mesh({spec!r}) on every rank, then pass"
                            " bound")
