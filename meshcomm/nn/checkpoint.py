"""Sharded checkpoints that load onto any mesh and layout through meshcomm plans.

`save_checkpoint(state_dict, folder)`: every rank writes the shards it holds of each tensor
(`rank<r>.pt`), once per distinct shard: a shard replicated over some mesh axes is written by
the ranks at coordinate 0 of those axes only. Global rank 0 writes `meshcomm.json`: per
tensor, the mesh that wrote it (axes and global ranks), its layout, global shape and dtype.
Nothing is gathered.

`load_checkpoint(state_dict, folder)`: per tensor, the move from the saved mesh and layout to
this one, with the saved ranks standing for the files: the transfers that the send_recv step
of `mc.plan(saved mesh, shape, saved layout, this layout, dst_mesh=this mesh)` gives this
rank, computed for this rank alone (`meshcomm.planner.receiver_blocks`: every saved
element has one writer, so nothing is balanced; the cost follows the saved ranks, not the
elements). They name which block of which file lands where: every element is read once, and
a rank opens (memory-mapped) only the files they name. Loading does not communicate, so it
works with another world size than saving did.

State dicts hold DTensors (`model.state_dict()` under `mc.nn.fully_shard`/`parallelize`, or
DCP's optimizer state dicts), `mc.Sharded` values, plain tensors (replicated: written by rank
0) and plain Python values (written by rank 0, put back as they are); nested mappings are
flattened with ".". docs/fsdp.md has the guide.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.errors import CheckpointError, ShapeError
from ..core.layout import Layout, Shape
from ..core.mesh import Mesh
from ..core.names import positional_names
from ..executors.local import grid, slices, take
from ..interop.placements import from_placements
from ..interop.runtime import global_shape, is_dtensor, placements_of
from ..planner import receiver_blocks
from ..planner.values import Transfer
from ..sharded import Sharded

FORMAT = "meshcomm-checkpoint/1"
META = "meshcomm.json"
_ONE = "one"          # the one-axis mesh of a tensor a single rank writes


@dataclass(frozen=True)
class CheckpointRead:
    """What `load_checkpoint` read on this rank: the saved ranks whose files it opened and
    the bytes it copied out of them (equal to the bytes of its own shards)."""

    files: tuple[int, ...]
    bytes: int
    tensors: int


@dataclass(frozen=True)
class _Placed:
    """A tensor value as meshcomm sees it: the mesh over its holders, its layout (dims named
    d0, d1, ...), the global shape and this rank's local tensor (None off the mesh)."""

    mesh: Mesh
    layout: Layout
    shape: Shape
    local: Tensor | None


# -- the one way a state-dict value is placed -------------------------------------------------
def _place(key: str, value: Any, rank: int, plain_rank: int) -> _Placed | None:
    """`value` as a mesh, layout and this rank's local tensor; None for a plain Python value
    (or a 0-dim tensor). A plain tensor is whole on the one rank `plain_rank`."""
    if is_dtensor(value):
        mesh = Mesh.from_device_mesh(value.device_mesh)
        shape = global_shape(value)
        layout = from_placements(mesh, shape, placements_of(value),
                                 names=positional_names(len(shape), mesh.axis_names))
        local = value._local_tensor if rank in mesh.ranks else None
        return _check_placed(key, _Placed(mesh, layout, shape, local))
    if isinstance(value, Sharded):
        mesh = value.mesh.mesh
        layout = _named_by_position(value.layout, mesh)
        local = value.local if value.mesh.in_mesh else None
        return _check_placed(key, _Placed(mesh, layout, tuple(value.shape), local))
    if isinstance(value, Tensor) and value.dim() > 0:
        shape = tuple(value.shape)
        return _Placed(Mesh({_ONE: 1}, ranks=[plain_rank]),
                       Layout.of_names(positional_names(len(shape), (_ONE,))), shape, value)
    return None


def _check_placed(key: str, placed: _Placed) -> _Placed:
    if placed.layout.partial_axes:
        raise ShapeError(f'checkpoint: {key} is a pending reduction ("{placed.layout}"); a'
                         " checkpoint holds values. fix: reduce it first (reshard to a layout"
                         " without \"| sum(...)\")")
    return placed


def _named_by_position(layout: Layout, mesh: Mesh) -> Layout:
    """`layout` with each dim's local name replaced by its position's name, d<i> (dim<i> on
    a mesh with axes d0, d1, ...), so layouts from any source plan against each other."""
    old = layout.dim_names(mesh)
    return layout.renamed(dict(zip(old, positional_names(len(old), mesh.axis_names))))


def _writers(placed: _Placed) -> tuple[Mesh, Layout]:
    """The mesh of the ranks that write `placed`: one per distinct shard (coordinate 0 of
    every axis that only replicates), with the layout's axes only."""
    mesh = placed.mesh
    keep = [a for a in mesh.axis_names if a in placed.layout.sharded_axes(mesh)]
    if not keep:
        return Mesh({_ONE: 1}, ranks=[mesh.ranks[0]]), Layout(str(placed.layout))
    ranks = [r for r in mesh.ranks
             if all(c == 0 for a, c in mesh.coords(r).items() if a not in keep)]
    return Mesh({a: mesh.axis_size(a) for a in keep}, ranks=ranks), placed.layout


# -- flattening ------------------------------------------------------------------------------
def _flatten(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(flat key, value, (mapping, key) holding it) for every leaf; nested mappings join
    their keys with "."."""
    for k, v in state.items():
        if not isinstance(k, str):
            raise CheckpointError(f"checkpoint: state dict key {k!r} is not a string;"
                                  " fix: use string keys (as module.state_dict() does)")
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _flatten(v, key + ".")
        else:
            yield key, v, (state, k)


def _leaves(state: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for key, value, where in _flatten(state):
        if key in out:
            raise CheckpointError(f"checkpoint: two entries of the state dict flatten to"
                                  f" {key!r}; fix: rename one")
        out[key] = (value, where)
    return out


# -- saving ----------------------------------------------------------------------------------
def save_checkpoint(state_dict: Mapping[str, Any], folder: str | os.PathLike[str], *,
                    barrier: bool = True) -> Path:
    """Write this rank's shards of `state_dict` to `folder` (see the module doc); rank 0
    also writes the index `meshcomm.json`. Call it on every rank with the same keys.

    With `barrier` (the default) it ends with one `dist.barrier()` so that the checkpoint is
    complete on every rank when it returns; that is the only communication. Returns the
    folder.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mine: dict[str, Tensor] = {}
    objects: dict[str, Any] = {}
    index: dict[str, Any] = {}
    for key, (value, _) in _leaves(state_dict).items():
        placed = _place(key, value, rank, plain_rank=0)
        if placed is None:
            objects[key] = value.item() if isinstance(value, Tensor) else value
            index[key] = {"object": True, "tensor": isinstance(value, Tensor),
                          "dtype": str(value.dtype).removeprefix("torch.")
                          if isinstance(value, Tensor) else None}
            continue
        writers, layout = _writers(placed)
        index[key] = {"mesh": {a: writers.axis_size(a) for a in writers.axis_names},
                      "ranks": list(writers.ranks), "layout": str(layout),
                      "shape": list(placed.shape),
                      "dtype": str(_dtype(value)).removeprefix("torch.")}
        if rank in writers.ranks and placed.local is not None:
            mine[key] = placed.local.detach().cpu().contiguous()
    if mine or rank == 0:
        _write(torch.save, {"tensors": mine, "objects": objects if rank == 0 else {}},
               folder / f"rank{rank}.pt")
    if rank == 0:
        meta = {"format": FORMAT, "tensors": index}
        _write(lambda m, f: f.write(json.dumps(m, indent=1).encode()), meta, folder / META)
    if barrier and dist.is_initialized():
        dist.barrier()
    return folder


def _dtype(value: Any) -> torch.dtype:
    return value.local.dtype if isinstance(value, Sharded) else value.dtype


def _write(save: Any, obj: Any, path: Path) -> None:
    """Write through a temporary name, so that a file is there whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        save(obj, f)
    os.replace(tmp, path)


# -- loading ---------------------------------------------------------------------------------
def _missing_message(folder: Path, missing: list[str], saved: list[str], wanted: int) -> str:
    """Which keys are missing, what the checkpoint's keys look like (a prefix that differs
    is named), and a fix that loads something."""
    head = (f"load_checkpoint: {len(missing)} of the state dict's {wanted} key(s) are not in"
            f" {folder}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    first = missing[0]
    for key in saved:                  # "model.x" saved, "x" asked (or the other way round)
        if key.endswith("." + first):
            return (f"{head}; the checkpoint's keys carry the prefix"
                    f" {key[:-len(first)]!r} ({key!r}). fix: add that prefix to the state"
                    " dict's keys, or save without it")
        if first.endswith("." + key):
            return (f"{head}; the state dict's keys carry the prefix"
                    f" {first[:-len(key)]!r} that the checkpoint's lack ({key!r}). fix: strip"
                    " it (e.g. `_orig_mod.` of torch.compile, `module.` of DDP) before loading")
    near = difflib.get_close_matches(first, saved, n=1, cutoff=0.8)
    hint = f' (a saved key close to {first!r}: {near[0]!r})' if near else ""
    if len(missing) == wanted:
        return (f"{head}{hint}; none of them is in the checkpoint, whose keys look like"
                f" {saved[:3]}. fix: load into the model the checkpoint was saved from, with"
                " the same key names")
    return (f"{head}{hint}. fix: give them the saved names, or load with strict=False to fill"
            f" the other {wanted - len(missing)} key(s) and leave these as they are")


def load_checkpoint(state_dict: MutableMapping[str, Any], folder: str | os.PathLike[str], *,
                    strict: bool = True) -> CheckpointRead:
    """Fill `state_dict` in place from a checkpoint `save_checkpoint` wrote, on any mesh and
    layouts: DTensor/Sharded shards are copied into, plain tensors are overwritten with the
    saved values, plain values are replaced (see the module doc). Nothing is communicated.

    Every key and shape is checked against the index before any file is read: a key the
    checkpoint lacks raises `CheckpointError` (with `strict=False` it is left as it is),
    another global shape raises `ShapeError`. Dtypes are cast as `Tensor.copy_` does.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = Path(folder)
    meta = _read_index(folder)
    saved = meta["tensors"]
    leaves = _leaves(state_dict)
    missing = [k for k in leaves if k not in saved]
    if missing and strict:
        raise CheckpointError(_missing_message(folder, missing, list(saved), len(leaves)))
    work: list[tuple[str, Any, Any, _Placed | None]] = []
    for key, (value, where) in leaves.items():
        if key not in saved:
            continue
        info = saved[key]
        placed = _place(key, value, rank, plain_rank=rank)
        if info.get("object") or placed is None:
            if placed is not None or not info.get("object"):
                raise CheckpointError(f"load_checkpoint: {key} is a {type(value).__name__}"
                                      f" here but {'a value' if info.get('object') else 'a tensor'}"
                                      " in the checkpoint; fix: give the state dict entry"
                                      " the saved kind")
        elif tuple(info["shape"]) != placed.shape:
            raise ShapeError(f"load_checkpoint: {key} has global shape {placed.shape} here but"
                             f" {tuple(info['shape'])} in {folder}; fix: build the model with"
                             " the saved sizes")
        work.append((key, value, where, placed))
    files: dict[int, dict[str, Any]] = {}
    opened: set[int] = set()
    copied = 0
    count = 0
    for key, value, (holder, k), placed in work:
        info = saved[key]
        if placed is None:                          # a plain value: rank 0's file has it
            obj = _file(folder, 0, files)["objects"][key]
            device = value.device if isinstance(value, Tensor) else None
            holder[k] = (torch.tensor(obj, dtype=getattr(torch, info["dtype"]), device=device)
                         if info.get("tensor") else obj)
            opened.add(0)
            continue
        if placed.local is None:                   # this rank holds no shard of it
            continue
        count += 1
        for src, blocks in _reads(info, placed, rank).items():
            data = _file(folder, src, files)["tensors"][key]
            opened.add(src)
            with torch.no_grad():
                for t in blocks:
                    copied += _copy_block(data, t, placed.local)
    return CheckpointRead(tuple(sorted(opened)), copied, count)


def _read_index(folder: Path) -> dict[str, Any]:
    path = folder / META
    if not path.exists():
        raise CheckpointError(f"load_checkpoint: {path} does not exist; fix: give the folder"
                              " that mc.nn.save_checkpoint wrote (a DCP checkpoint loads with"
                              " torch.distributed.checkpoint.load)")
    meta: dict[str, Any] = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"load_checkpoint: {path} has format {meta.get('format')!r},"
                              f" this meshcomm reads {FORMAT!r}")
    return meta


def _file(folder: Path, rank: int, files: dict[int, dict[str, Any]]) -> dict[str, Any]:
    if rank not in files:
        files[rank] = torch.load(folder / f"rank{rank}.pt", mmap=True, weights_only=True)
    return files[rank]


def _reads(info: Mapping[str, Any], placed: _Placed, rank: int) -> dict[int, list[Transfer]]:
    """The blocks this rank reads, by saved rank: the send_recv transfers of the plan from
    the saved mesh and layout to `placed`'s that this rank receives (the saved ranks are
    files here). Every saved element has one writer, so there is nothing to balance and
    the planner computes this rank's blocks alone (`planner.receiver_blocks`)."""
    saved = Mesh(info["mesh"], ranks=info["ranks"])
    out: dict[int, list[Transfer]] = {}
    for t in receiver_blocks(saved, Layout(info["layout"]), placed.mesh, placed.layout,
                             tuple(placed.shape), rank):
        out.setdefault(t.src, []).append(t)
    return out


def _copy_block(data: Tensor, t: Transfer, out: Tensor) -> int:
    """Copy block `t` of a saved shard into `out`; the bytes copied. Runs of consecutive
    positions are read as slices (only their pages of the mapped file are touched)."""
    src = slices(t.src_index)
    block = data[src] if src is not None else take(data, t.src_index)
    dst = slices(t.dst_index)
    if not t.dst_index:
        out.copy_(block)
    elif dst is not None:
        out[dst] = block
    else:
        out[grid(t.dst_index, out.device)] = block.to(out.device)
    return math.prod(block.shape) * data.element_size()
