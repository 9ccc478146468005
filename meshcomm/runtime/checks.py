"""Check mode: before a reshard or collective, the ranks of its group agree on what they call.

Runtime layer (the process side, above the executors). Off by default; a choice of each
mesh and each call, never a switch that code flips behind the caller:
- per mesh: `mc.init_mesh(..., check=True)` (or `bind_device_mesh(..., check=True)`);
  `check=None`, the default, takes the environment's `MESHCOMM_CHECK` (1/true/yes/on);
- per call: `check=True` / `check=False` on `mc.reshard`, `mc.reshard_many`,
  `Sharded.reshard` and every group collective overrides the mesh's choice.
Every rank of a group must make the same choice (a rank that checks waits for a
collective the others never make). When checked, `mc.reshard`, `mc.reshard_many` and the
group collectives (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`,
`collective_permute`, `broadcast`) first compare a fingerprint of the call across their
group: a 16-byte hash of the whole call (operation, mesh, layouts, shape, dtype, plan) and
the start of its text, 256 bytes in all. The hashes travel first (one all_reduce of 32
bytes); when they differ, the fingerprints are all-gathered and every rank raises the same
`CollectiveMismatchError`, naming which ranks differ and how, instead of hanging or mixing
up data. Point-to-point calls (`send`, `recv`, `sendrecv`) are not checked: only two
members of the group take part. Under `torch.compile` nothing is checked (the traced
program has no extra collective).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from ..core.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    MeshcommError,
)
from ..core.mesh import AxisName
from ..executors.distributed.agreement import compare, gather
from ..executors.distributed.groups import Group
from ..executors.distributed.handlers import check_local
from ..planner.values import Plan
from .bind import BoundMesh, check_default

FINGERPRINT_BYTES = 256
HASH_BYTES = 16
TEXT_BYTES = FINGERPRINT_BYTES - HASH_BYTES
Fields = tuple[tuple[str, str], ...]   # (name, value) pairs, in the order they are shown


def checking(mesh: object, check: bool | None) -> bool:
    """Whether a call on `mesh` (a BoundMesh, or another group) with `check=` is checked:
    the call's choice, else the mesh's (`init_mesh(check=...)`), else the environment's."""
    if check is not None:
        return bool(check)
    return mesh.check if isinstance(mesh, BoundMesh) else check_default(None)


# -- the calls' descriptions -----------------------------------------------------------------
def reshard_fields(plan: Plan) -> tuple[Fields, str]:
    """What a reshard asks for (shown), and the plan's full steps (hashed only)."""
    steps = ", ".join(f"{s.kind}({' '.join(s.axes)})" if s.axes else s.kind
                      for s in plan.steps) or "none"
    fields = (("call", "reshard"), ("src", f'"{plan.src}"'), ("dst", f'"{plan.dst}"'),
              ("shape", str(plan.shape)), ("dtype", str(plan.dtype).replace("torch.", "")),
              ("mesh", repr(plan.mesh)), ("plan", steps))
    return fields, _steps_detail(plan)


def _steps_detail(plan: Plan) -> str:
    return repr(tuple((s.kind, s.axes, s.op, s.dim, s.pairs, str(s.before), str(s.after))
                      for s in plan.steps)) + repr(plan.dst_mesh)


class Fingerprint(NamedTuple):
    """A call's fingerprint, in the two forms that travel."""

    row: Tensor     # (1, 256) uint8: a hash of the whole call, then its text, cut to fit
    probe: Tensor   # (4,) int64: the hash as two 63-bit ints, then their negatives


@functools.lru_cache(maxsize=1024)
def _reshard_fingerprint(plan: Plan, device: torch.device) -> Fingerprint:
    fields, detail = reshard_fields(plan)
    return encode(fields, detail, device)


def encode(fields: Fields, detail: str, device: torch.device) -> Fingerprint:
    """The fingerprint of a call shown as `fields`, whose hash also covers `detail`."""
    text = _text(fields).encode()
    digest = hashlib.blake2b(text + b"\0" + detail.encode(), digest_size=HASH_BYTES).digest()
    raw = digest + text[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0")
    row = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(1, -1)
    h = torch.frombuffer(bytearray(digest), dtype=torch.int64) & (2**63 - 1)
    return Fingerprint(row.to(device), torch.cat([h, -h]).to(device))


def _text(fields: Fields) -> str:
    return "\x1f".join(f"{k}={v}" for k, v in fields)


def decode(row: Sequence[int]) -> tuple[bytes, Fields]:
    """(hash, the fields that fit) of one fingerprint; a field cut short is dropped."""
    raw = bytes(row)
    text = raw[HASH_BYTES:].rstrip(b"\0").decode(errors="ignore")
    parts = text.split("\x1f")
    if len(raw[HASH_BYTES:].rstrip(b"\0")) >= TEXT_BYTES:
        parts = parts[:-1]   # the last field may be cut
    fields = tuple((k, v) for k, _, v in (p.partition("=") for p in parts if "=" in p))
    return raw[:HASH_BYTES], fields


# -- the agreement ---------------------------------------------------------------------------
def agree_reshard(x: Tensor, bound: BoundMesh, plan: Plan) -> None:
    """Raise on every rank of `bound`'s mesh unless all of them asked for this reshard.
    A rank whose own input checks fail still takes part (`raise_together`), so the others
    raise too instead of waiting for it."""
    try:
        check_local(plan, x, bound)
    except MeshcommError as err:
        raise_together(bound, err, "reshard")
    _agree_on_mesh(bound, _reshard_fingerprint(plan, bound.device), f"reshard on {bound.mesh!r}")


def raise_together(bound: BoundMesh, err: MeshcommError, call: str) -> NoReturn:
    """Check mode, on a rank whose call failed its checks before communicating: take part
    in the call's agreement with a fingerprint of the error, then raise `err`. The other
    ranks of the mesh see a different fingerprint and raise CollectiveMismatchError naming
    this rank and its error, at once: no rank is left waiting for one that raised.
    Without a bound mesh this rank is in, there is no agreement to join: raises `err`."""
    if not isinstance(bound, BoundMesh) or not bound.in_mesh:
        raise err
    fields: Fields = (("call", call), ("error", f"{type(err).__name__}: {err}"))
    try:
        _agree_on_mesh(bound, encode(fields, "", bound.device), f"{call} on {bound.mesh!r}")
    except CollectiveMismatchError:
        pass
    raise err


def _agree_on_mesh(bound: BoundMesh, mine: Fingerprint, what: str) -> None:
    """`agree` over the group of the whole mesh."""
    axes = bound.mesh.axis_names
    ranks = bound.mesh.groups(*axes)[0]
    agree(Group(bound.group_name(axes), len(ranks), ranks.index(bound.rank)), ranks, mine, what)


def agree_world(fields: Fields, detail: str, device: torch.device, what: str) -> None:
    """`agree` over every rank of the job (a pipeline's stages span several meshes)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    group = Group(dist.group.WORLD.group_name, world, rank)   # type: ignore[union-attr]
    agree(group, tuple(range(world)), encode(fields, detail, device), what)


def agree_many(jobs: Sequence[tuple[Tensor, BoundMesh, Plan]]) -> None:
    """`agree_reshard` for `reshard_many`: one check per bound mesh, over its items."""
    by_mesh: dict[int, tuple[BoundMesh, list[Plan]]] = {}
    for x, bound, plan in jobs:
        try:
            check_local(plan, x, bound)
        except MeshcommError as err:   # the others agree over the first item's mesh first
            raise_together(jobs[0][1], err, "reshard_many")
        by_mesh.setdefault(id(bound), (bound, []))[1].append(plan)
    for bound, plans in by_mesh.values():
        fields: Fields = (("call", "reshard_many"), ("items", str(len(plans))))
        fields += tuple((f"item{k}", f'"{p.src}" -> "{p.dst}" {p.shape}'
                         f" {str(p.dtype).replace('torch.', '')}") for k, p in enumerate(plans))
        detail = "".join(_steps_detail(p) for p in plans)
        _agree_on_mesh(bound, encode(fields, detail, bound.device),
                       f"reshard_many on {bound.mesh!r}")


def agree_collective(fn: str, group: Group, pg_ranks: Sequence[int], where: str,
                     x: Tensor, args: Fields) -> None:
    """Raise on every member unless all of them called `fn` over this group with the same
    dtype and the same `args` (each collective passes those that must agree)."""
    fields = (("call", fn), ("group", where), ("dtype", str(x.dtype).replace("torch.", ""))) + args
    agree(group, tuple(pg_ranks), _collective_fingerprint(fields, x.device), f"{fn} {where}")


@functools.lru_cache(maxsize=1024)
def _collective_fingerprint(fields: Fields, device: torch.device) -> Fingerprint:
    return encode(fields, "", device)


def agree(group: Group, ranks: Sequence[int], mine: Fingerprint, what: str) -> None:
    """Compare `mine` across `group` (members `ranks`, in group order) and raise
    `CollectiveMismatchError` on every member when the fingerprints differ.

    One all_reduce(max) of the probe (h, -h) gives (max h, -min h): it equals this rank's
    probe on every rank when all hashes agree, and differs on every rank otherwise (32 bytes
    a rank instead of 256; `executors.distributed.agreement.compare`). Only then are the rows
    gathered, to say who asked for what."""
    got = _compare(group, ranks, mine, what)
    if got is None:
        return
    raise CollectiveMismatchError(mismatch_message(what, ranks, got))


def _compare(group: Group, ranks: Sequence[int], mine: Fingerprint, what: str
             ) -> list[list[int]] | None:
    """`compare` of `mine` across `group`: None when every member passed the same hash, else
    every member's row; a member that died or never came raises a CollectiveError."""
    try:
        got = compare(mine.probe, mine.row, group)
    except RuntimeError as err:
        raise _broken(err, what, ranks) from err
    return None if got is None else got.cpu().tolist()


def _broken(err: RuntimeError, what: str, ranks: Sequence[int]) -> CollectiveError:
    kind = CollectiveTimeout if "timed out" in str(err).lower() else CollectiveError
    return kind(f"{what}: check mode could not compare the call across the group"
                f" ({ranks_text(ranks)}): a rank of the group died, hangs, or never made"
                f" this call. cause: {type(err).__name__}: {str(err).strip()}\n  fix: look"
                " for a rank that failed earlier or skipped this call (its own error comes"
                " first)")


# -- values every rank of a group must hold alike (gradients of replicated parameters) -------
class Disagreement(NamedTuple):
    """Where the ranks' tables differ: the items (rows of the table) that differ, first
    one first; for the first one, the classes of ranks that hold the same values of it,
    largest class first (lowest rank on a tie), and each class's row."""

    items: tuple[int, ...]
    classes: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, ...], ...]

    def describe(self, show: Callable[[tuple[int, ...]], str]) -> str:
        """Each class of ranks and what `show` makes of its row: "ranks 0, 2: ...; rank 1:
        ..."."""
        return "; ".join(f"{ranks_text(ranks)}: {show(row)}"
                         for ranks, row in zip(self.classes, self.rows))


def compare_values(bound: BoundMesh, axis: AxisName, names: Sequence[str], table: Tensor,
                   compared: int, what: str) -> Disagreement | None:
    """None when every rank of this rank's group over `axis` holds the same first
    `compared` columns of `table` (int64, one row per name, the same names on every rank);
    otherwise where they first differ, the same on every rank.

    Costs what a checked call costs: one 32-byte all_reduce of a hash of the names and the
    compared columns. Only when the hashes differ are the fingerprints gathered (to make
    sure the ranks compared the same names; else `CollectiveMismatchError`), then the
    tables."""
    ranks = bound.group_ranks(axis)
    group = Group(bound.group_name(axis), len(ranks), ranks.index(bound.rank))
    assert table.dtype == torch.int64 and table.shape[0] == len(names), \
        f"a table of int64 rows, one per name: {table.dtype} {tuple(table.shape)}, {len(names)}"
    listing = "\n".join(names) + repr(tuple(table.shape))
    names_hash = hashlib.blake2b(listing.encode(), digest_size=8).hexdigest()
    fields: Fields = (("call", what), ("items", str(len(names))), ("names", names_hash))
    values = table[:, :compared].cpu().numpy().tobytes().hex()
    got = _compare(group, ranks, encode(fields, listing + values, bound.device), what)
    if got is None:
        return None
    if len({decode(row)[1] for row in got}) > 1:    # not the same names: nothing to compare
        lines = mismatch_message(what, ranks, got).split("\n")[:-1]
        raise CollectiveMismatchError("\n".join(lines) + "\n  fix: the ranks compare different"
                                      " items (their count or names differ): build the same"
                                      " model, the same way, on every rank of the group")
    try:
        tables = gather(table.reshape(1, -1), group).view(len(ranks), *table.shape).cpu()
    except RuntimeError as err:
        raise _broken(err, what, ranks) from err
    return _first_difference(tables, compared, ranks)


def _first_difference(tables: Tensor, compared: int, ranks: Sequence[int]) -> Disagreement:
    differ = (tables[:, :, :compared] != tables[:1, :, :compared]).any(dim=2).any(dim=0)
    assert bool(differ.any()), "the hashes differ, so the compared values do"
    items = tuple(int(i) for i in differ.nonzero().flatten())
    item = items[0]
    classes: dict[tuple[int, ...], list[int]] = {}
    for rank, rows in zip(ranks, tables[:, item].tolist()):
        classes.setdefault(tuple(rows[:compared]), []).append(rank)
    order = sorted(classes, key=lambda k: (-len(classes[k]), min(classes[k])))
    full = {rank: tuple(rows) for rank, rows in zip(ranks, tables[:, item].tolist())}
    return Disagreement(items, tuple(tuple(classes[k]) for k in order),
                        tuple(full[classes[k][0]] for k in order))


def mismatch_message(what: str, ranks: Sequence[int], rows: Sequence[Sequence[int]]) -> str:
    """Which ranks asked for what: the largest class of equal calls (lowest rank on a tie)
    against each other class, field by field, then every class's call in full."""
    classes: dict[bytes, list[int]] = {}
    shown: dict[bytes, Fields] = {}
    for rank, row in zip(ranks, rows):
        digest, fields = decode(row)
        classes.setdefault(digest, []).append(rank)
        shown.setdefault(digest, fields)
    order = sorted(classes, key=lambda d: (-len(classes[d]), min(classes[d])))
    ref = order[0]
    lines = [f"{what}: {_differ(classes[d], shown[d], classes[ref], shown[ref])}"
             for d in order[1:]]
    width = max(len(ranks_text(classes[d])) for d in order) + 1
    lines += [f"  {(ranks_text(classes[d]) + ':').ljust(width)} "
              + " ".join(f"{k}={v}" if k != "call" else v for k, v in shown[d]) for d in order]
    shapes = {dict(shown[d]).get("shape") for d in order}
    if len(shapes) > 1 and None not in shapes and all(
            {k: v for k, v in shown[d] if k != "shape"} ==
            {k: v for k, v in shown[ref] if k != "shape"} for d in order):
        lines.append("  fix: the ranks disagree on the global shape only: pass shape=(...),"
                     " the global shape, on every rank (without it each rank infers the"
                     " shape from its own shard, and uneven shards infer different ones)")
    else:
        lines.append("  fix: every rank of the group must make the same calls in the same"
                     " order; look for a branch on the rank, or on data that differs between"
                     " ranks, before this call")
    return "\n".join(lines)


def _differ(ranks: list[int], fields: Fields, ref_ranks: list[int], ref: Fields) -> str:
    mine, theirs = dict(fields), dict(ref)
    for failed, values, others in ((ranks, mine, ref_ranks), (ref_ranks, theirs, ranks)):
        if "error" in values:     # see raise_together
            return (f"{ranks_text(failed)} raised {values['error']} before communicating;"
                    f" {ranks_text(others)} raise with it instead of waiting for it")
    if mine.get("call") != theirs.get("call"):
        keys = ["call"]
    else:
        keys = [k for k in mine if k in theirs and mine[k] != theirs[k]]
    if not keys:
        return (f"{ranks_text(ranks)} asked for a different {mine.get('call', 'call')} than"
                f" {ranks_text(ref_ranks)} (it differs past the part of the call that is"
                " shown, e.g. in the plan's steps)")
    call = theirs.get("call", "")

    def ask(values: dict[str, str]) -> str:
        if keys == ["call"]:
            return values.get("call", "?")
        return f"{call} " + ", ".join(f"{k}={values[k]}" for k in keys[:3])
    return f"{ranks_text(ranks)} asked for {ask(mine)} but {ranks_text(ref_ranks)} asked for" \
           f" {ask(theirs)}"


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as messages name them: 'rank 3', 'ranks 0-2', 'ranks 0, 2, 5-7'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)
