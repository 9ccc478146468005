"""Bind a Mesh to torch.distributed: one process group per set of mesh axes.

Runtime layer (the process side, above the executors). Every rank of the world calls
`init_mesh` with the same mesh, and it creates, in one fixed order on every rank, the
process groups of every non-empty set of mesh axes taken in mesh order (several axes = one
flattened group, first axis major, ranks in mesh order, never re-sorted). Collectives then
address a group by its name only, so traced programs hold no process-group object. NCCL and
gloo share every line here: only the backend name differs.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import inspect
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from ..core.errors import MeshAxisError, MeshMismatchError
from ..core.mesh import AxisName, Mesh
from ..executors.distributed.groups import Groups, resolve_group
from ..executors.distributed.groups import require_bound as require_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def require_bound(value: object, who: str, argument: str = "a mesh") -> BoundMesh:
    """`value`, which must be a BoundMesh; otherwise the one error every public call raises
    for it (`executors.distributed.groups.require_bound`)."""
    return cast(BoundMesh, require_groups(value, who, argument))


@dataclass(frozen=True, eq=False)
class BoundMesh(Groups):
    """A Mesh bound to live process groups on this rank.

    `group_name(axes)` is the name of this rank's group for a collective over
    `axes` (a str that functional collectives accept); ranks outside the mesh
    have no groups.
    """

    mesh: Mesh
    backend: str
    device: torch.device
    rank: int
    _names: dict[tuple[AxisName, ...], str] = field(repr=False)
    check: bool = False   # check mode for calls on this mesh (docs/errors.md § Check mode)
    _subs: dict[tuple[AxisName, ...], BoundMesh] = field(default_factory=dict, repr=False,
                                                         compare=False)

    @property
    def in_mesh(self) -> bool:
        return self.rank in self.mesh      # one dict lookup, whatever the mesh's size

    @property
    def coords(self) -> dict[AxisName, int]:
        return self.mesh.coords(self.rank)

    def group_name(self, axes: tuple[AxisName, ...] | AxisName) -> str:
        """Name of this rank's group over `axes`, given in mesh order (first axis major)."""
        key = (axes,) if isinstance(axes, str) else tuple(axes)
        try:
            return self._names[key]
        except KeyError:
            for a in key:
                self.mesh.axis_size(a)  # raises MeshAxisError for an unknown axis
            if not self.in_mesh:
                raise MeshMismatchError(
                    f"rank {self.rank} is not in {self.mesh!r}; only its ranks"
                    f" {list(self.mesh.ranks)} run its collectives") from None
            in_order = tuple(a for a in self.mesh.axis_names if a in key)
            if in_order == key:   # a mesh bound from a DeviceMesh holds only existing groups
                raise MeshAxisError(
                    f"no process group over {list(key)} is bound on rank {self.rank} for"
                    f" {self.mesh!r}; fix: mc.reshard(dtensor, ...) creates the groups its"
                    f" plan needs; else call mc.dtensor.bind_device_mesh(dm,"
                    f" flatten=True) on every rank once (it creates every group), or bind"
                    f" with mc.init_mesh(...)") from None
            raise MeshAxisError(
                f"axes {list(key)} are not in mesh order or name an axis twice; groups over"
                f" several axes follow {self.mesh!r}: fix: use {list(in_order)}") from None

    def sub(self, axes: tuple[AxisName, ...] | AxisName) -> BoundMesh:
        """This rank's slice of the mesh over `axes` (the ranks that differ from it along
        those axes only), bound to the same groups.

        >>> bound.sub("tp").mesh          # rank 5 of dp=2 tp=4          # doctest: +SKIP
        Mesh(tp=4, ranks=[4, 5, 6, 7])

        Plans on it know nothing of the other axes, so they never use them: the mesh for a
        tensor that differs along the other axes, e.g. an activation of a data-parallel
        batch (on the whole mesh, "b h | sum(tp)" says the tensor is the same on every dp
        rank, and a plan may split work over dp). Built once per set of axes.
        """
        key = (axes,) if isinstance(axes, str) else tuple(axes)
        found = self._subs.get(key)
        if found is None:
            order = tuple(a for a in self.mesh.axis_names if a in key)
            ranks = self.group_ranks(order)         # raises for an unknown axis
            mesh = Mesh({a: self.mesh.axis_size(a) for a in order}, ranks=list(ranks))
            names = {sub: self._names[sub] for sub in self._names if set(sub) <= set(order)}
            found = self._subs[key] = BoundMesh(mesh, self.backend, self.device, self.rank,
                                                names, self.check)
        return found

    def group_ranks(self, axes: tuple[AxisName, ...] | AxisName) -> tuple[int, ...]:
        """Global ranks of this rank's group over `axes`, in group order."""
        key = (axes,) if isinstance(axes, str) else tuple(axes)
        return _group_ranks(self.mesh, self.rank, key)

    @functools.cached_property
    def device_mesh(self) -> DeviceMesh:
        """A torch DeviceMesh over this mesh's own process groups (built once, on first use).

        >>> dt = DTensor.from_local(x, bound.device_mesh, [Shard(0), Replicate()])  # doctest: +SKIP

        `DeviceMesh.from_group` wraps the groups `init_mesh` made, one per axis: no process
        group is created and nothing is communicated, so any rank may ask at any time.
        DTensor sees no flattened (multi-axis) group on it.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if not self.in_mesh:
            raise MeshMismatchError(f"rank {self.rank} is not in {self.mesh!r}, so it has no"
                                    " DeviceMesh over it")
        groups = [resolve_group(self.group_name(a)) for a in self.mesh.axis_names]
        grid = torch.tensor(self.mesh.ranks, dtype=torch.int).reshape(self.mesh.shape)
        return DeviceMesh.from_group(groups, self.device.type, mesh=grid,
                                     mesh_dim_names=self.mesh.axis_names)


GROUP_DESC = "meshcomm:"   # + the axes: the description of every group meshcomm makes


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@functools.lru_cache(maxsize=4096)
def _group_ranks(mesh: Mesh, rank: int, axes: tuple[AxisName, ...]) -> tuple[int, ...]:
    """`BoundMesh.group_ranks`, found once per mesh, rank and axes (it scans the mesh's
    groups: O(world), so not on every call, e.g. check mode's per-backward comparisons)."""
    return next(g for g in mesh.groups(*axes) if rank in g)


def _ensure_world(backend: str, timeout_s: float | None) -> None:
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise MeshMismatchError(
            f"torch.distributed is not initialized and {', '.join(missing)} not set;"
            " fix: run under `meshcomm launch -n N script.py` or torchrun, or call"
            " torch.distributed.init_process_group first")
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    # We opened the default group, so we close it: a gloo group left open at interpreter
    # exit can abort the process ("terminate called without an active exception").
    atexit.register(_close_world)


def _close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()   # free the groups before interpreter teardown (it can abort otherwise)


def init_mesh(mesh: Mesh | str, *, ranks: Sequence[int] | None = None,
              backend: str | None = None, timeout_s: float | None = None,
              check: bool | None = None) -> BoundMesh:
    """Bind `mesh` to process groups on every rank (call it on every rank of the world).

    Initializes the default group from the standard environment variables when
    needed (backend nccl with CUDA, else gloo, unless `backend` says; in a world that is
    open already, the world's backend: torchrun's, or a dry run's "fake"). `check` turns check
    mode on for calls on this mesh (default: the environment's `MESHCOMM_CHECK`).
    `ranks` with a spec string is `Mesh(spec, ranks=ranks)`: a mesh over some ranks of the
    world, e.g. `init_mesh("tp=4", ranks=[4, 5, 6, 7])`.

    >>> bound = init_mesh("dp=2 tp=2")          # doctest: +SKIP  (inside a 4-rank job)
    >>> bound.group_name("tp")                  # doctest: +SKIP
    """
    if isinstance(mesh, str):
        mesh = Mesh(mesh, ranks=None if ranks is None else list(ranks))
    elif ranks is not None:
        spec = " ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.shape))
        raise MeshMismatchError(
            f"init_mesh(ranks=...) goes with a spec string; {mesh!r} has its ranks already."
            f" fix: mc.init_mesh({spec!r}, ranks=[...]) or leave ranks out")
    if not isinstance(mesh, Mesh):
        raise MeshMismatchError(f"init_mesh needs a Mesh or a spec string such as"
                                f' "dp=2 tp=2", got {type(mesh).__name__}')
    if backend is None:   # a world opened already (torchrun's, a dry run's) sets it
        backend = dist.get_backend() if dist.is_initialized() else default_backend()
    _ensure_world(backend, timeout_s)
    world = dist.get_world_size()
    if max(mesh.ranks) >= world:
        raise MeshMismatchError(
            f"{mesh!r} needs ranks up to {max(mesh.ranks)} but the world has {world} ranks;"
            f" fix: launch {max(mesh.ranks) + 1} processes or use a smaller mesh")
    rank = dist.get_rank()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    subsets = [subset for k in range(1, len(mesh.axis_names) + 1)
               for subset in itertools.combinations(mesh.axis_names, k)]
    names = create_groups(mesh, subsets, backend=backend, timeout=timeout)
    return BoundMesh(mesh, backend, backend_device(backend), rank, names, check_default(check))


def backend_device(backend: str) -> torch.device:
    """The device a mesh over `backend` computes on: this process's current GPU for NCCL,
    and for the fake backend (dry runs, host benchmarks) where torch sees one; else the CPU."""
    if "nccl" in backend or (backend == "fake" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def create_groups(mesh: Mesh, subsets: Sequence[tuple[AxisName, ...]], *,
                  backend: str | None = None, timeout: datetime.timedelta | None = None
                  ) -> dict[tuple[AxisName, ...], str]:
    """Create the process groups over each set of axes in `subsets` (every group of each
    set, ranks in mesh order) and return this rank's group name per set it belongs to.

    A collective over the whole world: every rank of the world calls it with the same
    arguments, in the same order (torch.distributed.new_group's rule). A group whose
    ranks are the whole world in order is the default group, not a new one.
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    names: dict[tuple[AxisName, ...], str] = {}
    made = [(subset, group, _unsorted(mesh, subset, group))       # refusals first
            for subset in subsets for group in mesh.groups(*subset)]
    new_group: Callable[..., dist.ProcessGroup | None] = dist.new_group   # order: by version
    for subset, group, order in made:
        if list(group) == list(range(world)):
            pg = dist.group.WORLD
            if timeout is not None:  # the reused default group gets our timeout too
                dist.distributed_c10d._set_pg_timeout(timeout, pg)
        else:
            pg = new_group(list(group), timeout=timeout, backend=backend,
                           group_desc=GROUP_DESC + ",".join(subset), **order)
        if rank in group:
            assert pg is not None, f"rank {rank} is in group {group}, so it has a handle"
            names[subset] = pg.group_name
    return names


def _unsorted(mesh: Mesh, subset: tuple[AxisName, ...], group: Sequence[int]
              ) -> dict[str, bool]:
    """new_group's argument that keeps a group's ranks in mesh order (torch >= 2.12). An
    older torch always sorts them: fine where mesh order is sorted (every mesh whose ranks
    rise along each axis), refused before any group is made where it is not."""
    if _SORT_RANKS:
        return {"sort_ranks": False}
    if list(group) != sorted(group):
        raise MeshMismatchError(
            f"{mesh!r}: the group over {', '.join(subset)} is ranks {list(group)} in mesh"
            f" order, and torch {torch.__version__} orders a group's ranks by number"
            " (new_group has no sort_ranks before torch 2.12). fix: upgrade torch, or give"
            " the mesh ranks that rise along each axis")
    return {}


_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def check_default(check: bool | None) -> bool:
    """`check`, or the environment's MESHCOMM_CHECK when it is None."""
    if check is not None:
        return bool(check)
    value = os.environ.get("MESHCOMM_CHECK", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")
