"""DTensor interop on real gloo processes: 4 ranks (dp=2 tp=2) and 8 ranks (a=2 b=2 c=2).

Every DTensor here is built by DTensor itself (`distribute_tensor(..., src_data_rank=None)`
splits locally, its own definition of each rank's shard; partial ones by `from_local` of
exact per-rank values), then checked against meshcomm: `from_dtensor` gives the expected
layout, reuses the local tensor and `full()` equals DTensor's `full_tensor()`;
`to_dtensor` gives back the same placements and local tensor; `mc.reshard(dt, dst)` gives
the exact shards of `dst` and equals `dt.redistribute` bit for bit wherever DTensor itself
is right (integer-valued data, so every reduction order gives the same bits). Torch 2.13
redistributes wrongly from and to a lone `_StridedShard` (cyclic "(b dp)", "(x=2 dp b)")
in some transitions; those pairs are checked against the exact shards only. Each spawn
costs seconds, so one run per world size checks everything and the tests read its report.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import torch

import meshcomm as mc
from meshcomm.core.reduce_ops import REDUCE_OPS
from meshcomm.executors.sim import scatter

from conftest import dtensor_placements, ints, ranks_fixture

# (placements, global shape, expected layout with dims named "b h" / "x y z").
# Blocks in any axis order: Shard, or the _StridedShard that encodes DTensor's shard order.
BLOCKS_4 = [
    ("R R", (8, 6), "b h"), ("S0 R", (8, 6), "(dp b) h"), ("R S0", (8, 6), "(tp b) h"),
    ("S1 R", (8, 6), "b (dp h)"), ("S0 S1", (8, 6), "(dp b) (tp h)"),
    ("S1 S0", (8, 6), "(tp b) (dp h)"), ("S0 S0", (8, 6), "(dp tp b) h"),
    ("SS0.2 S0", (8, 6), "(tp dp b) h"), ("S1 S1", (8, 6), "b (dp tp h)"),
    ("SS1.2 S1", (8, 6), "b (tp dp h)"),
    ("S0 R", (7, 5), "(dp b) h"), ("S0 S0", (7, 5), "(dp tp b) h"),
    ("SS0.2 S0", (7, 5), "(tp dp b) h"), ("S0 S1", (7, 5), "(dp b) (tp h)"),
    ("SS1.2 S1", (7, 5), "b (tp dp h)"), ("S0 S0", (3, 2), "(dp tp b) h"),   # empty shard
]
# One axis after local or sized factors: one _StridedShard that is no shard order.
STRIDED_4 = [
    ("SS0.4 R", (8, 6), "(b dp) h"), ("SS0.2 R", (8, 6), "(x=2 dp b) h"),
    ("S1 SS0.2", (8, 6), "(x=2 tp b) (dp h)"), ("SS0.4 S1", (8, 6), "(b dp) (tp h)"),
]
PARTIAL_4 = [
    ("S0 Psum", (8, 6), "(dp b) h | sum(tp)"), ("Pavg Pavg", (4, 3), "b h | avg(dp, tp)"),
    ("R Pmax", (4, 3), "b h | max(tp)"), ("Pmin S1", (4, 6), "b (tp h) | min(dp)"),
    ("SS0.4 Psum", (8, 6), "(b dp) h | sum(tp)"),
]
# Placements whose shards a layout describes but DTensor 2.13 mishandles: from_dtensor only.
FROM_ONLY_4 = [("S0 SS0.2", (8, 6), "(dp b tp) h"), ("SS0.2 SS0.2", (16, 2), "(x=2 dp tp b) h")]
DST_4 = ["b h", "(dp b) (tp h)", "(tp dp b) h", "b (dp tp h)", "(b dp) h", "(dp b) h | sum(tp)"]

BLOCKS_8 = [
    ("S0 S0 S0", (8, 4, 6), "(a b c x) y z"), ("SS0.4 SS0.2 S0", (8, 4, 6), "(c b a x) y z"),
    ("S2 S1 S0", (8, 4, 6), "(c x) (b y) (a z)"), ("SS1.2 S0 S1", (8, 4, 6), "(b x) (c a y) z"),
    ("SS0.4 S0 S0", (7, 5, 3), "(b c a x) y z"), ("S0 S1 S2", (7, 5, 3), "(a x) (b y) (c z)"),
    ("SS0.2 S0 S1", (7, 5, 3), "(b a x) (c y) z"),
]
STRIDED_8 = [("SS0.4 S2 S1", (8, 4, 6), "(x a) (c y) (b z)")]
PARTIAL_8 = [("Psum S0 Psum", (4, 2, 3), "(b x) y z | sum(a, c)")]
DST_8 = ["x y z", "(a b c x) y z", "(c x) (a y) (b z)", "(x a) (c y) (b z)"]


def make_dtensor(x: torch.Tensor, dm: Any, mesh: mc.Mesh, text: str, layout: str) -> Any:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if "P" not in text:
        return distribute_tensor(x, dm, dtensor_placements(text), src_data_rank=None)
    local = scatter(x, mesh, layout)[mesh.position(torch.distributed.get_rank())]
    stride = tuple(math.prod(x.shape[i + 1:]) for i in range(x.ndim))
    return DTensor.from_local(local, dm, dtensor_placements(text), run_check=False, shape=x.shape,
                              stride=stride)


# -- what every rank runs ----------------------------------------------------------------
def check_table(dm: Any, mesh: mc.Mesh, rows: list[tuple[str, tuple[int, ...], str]],
                names: str, convertible: bool) -> list[str]:
    """from_dtensor / full / to_dtensor on each row: problems as text."""
    problems = []
    pos = mesh.position(torch.distributed.get_rank())
    for i, (text, shape, want) in enumerate(rows):
        x = ints(shape, i)
        dt = make_dtensor(x, dm, mesh, text, want)
        where = f"[{text}] {shape} \"{want}\""
        s = mc.dtensor.from_dtensor(dt, names=names)
        if str(s.layout) != want:
            problems.append(f"{where}: from_dtensor gave \"{s.layout}\"")
        if s.local.data_ptr() != dt.to_local().data_ptr() or s.shape != shape:
            problems.append(f"{where}: local tensor copied or shape {s.shape}")
        if not torch.equal(dt.to_local(), scatter(x, mesh, want)[pos]):
            problems.append(f"{where}: DTensor's shard is not the layout's shard")
        if not torch.equal(s.full(), x):
            problems.append(f"{where}: full() differs from the global tensor")
        if not convertible:
            try:
                s.to_dtensor()
                problems.append(f"{where}: to_dtensor did not raise")
            except mc.errors.InteropError:
                pass
            continue
        if not torch.equal(dt.full_tensor(), s.full()):
            problems.append(f"{where}: full() differs from DTensor's full_tensor()")
        back = s.to_dtensor()
        if tuple(back.placements) != tuple(dt.placements) or back.device_mesh is not dm:
            problems.append(f"{where}: to_dtensor gave {back.placements}")
        if back.to_local().data_ptr() != dt.to_local().data_ptr():
            problems.append(f"{where}: to_dtensor copied the local tensor")
    return problems


def check_reshards(dm: Any, mesh: mc.Mesh, rows: list[tuple[str, tuple[int, ...], str]],
                   dsts: list[str], blocks: set[str]) -> tuple[list[str], int]:
    """mc.reshard(dt, dst) against the exact shards, and against dt.redistribute where the
    source and destination are blocks (where DTensor 2.13 is right)."""
    problems, compared = [], 0
    pos = mesh.position(torch.distributed.get_rank())
    for (text, shape, src), dst in itertools.product(rows, dsts):
        x = ints(shape, 99)
        dt = make_dtensor(x, dm, mesh, text, src)
        try:
            want_pl = mc.dtensor.to_placements(mesh, shape, dst)
        except mc.errors.ShapeError:
            continue    # dst does not fit this shape
        where = f"\"{src}\" {shape} -> \"{dst}\""
        y = mc.reshard(dt, dst)
        if tuple(y.placements) != want_pl or y.device_mesh is not dm or tuple(y.shape) != shape:
            problems.append(f"{where}: result DTensor has {y.placements} {tuple(y.shape)}")
        if mc.Layout(dst).reduce_op is None:
            if not torch.equal(y.to_local(), scatter(x, mesh, dst)[pos]):
                problems.append(f"{where}: shard differs from the exact one")
        elif not torch.equal(y.full_tensor(), x):
            problems.append(f"{where}: partial result does not reduce to the tensor")
        if src in blocks and dst in blocks and "|" not in src + dst:
            compared += 1
            z = dt.redistribute(dm, want_pl)
            if not torch.equal(z.to_local(), y.to_local()):
                problems.append(f"{where}: differs from dt.redistribute")
    return problems, compared


def check_shard_order(dm: Any, mesh: mc.Mesh) -> list[str]:
    """A DTensor whose spec holds an explicit shard order (plain Shard placements)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _dtensor_spec as ds

    x = ints((7, 6), 4)
    local = scatter(x, mesh, "(tp dp b) h")[mesh.position(torch.distributed.get_rank())]
    spec = ds.DTensorSpec(dm, dtensor_placements("S0 S0"),
                          shard_order=(ds.ShardOrderEntry(0, (1, 0)),),
                          tensor_meta=ds.TensorMeta(x.shape, x.stride(), x.dtype))
    dt = DTensor(local, spec, requires_grad=False)
    s = mc.dtensor.from_dtensor(dt, names="b h")
    problems = [] if str(s.layout) == "(tp dp b) h" else [f"shard order read as {s.layout}"]
    if not (torch.equal(s.full(), x) and torch.equal(dt.full_tensor(), x)):
        problems.append("explicit shard order: full() or full_tensor() differs")
    return problems


def check_submesh(dm: Any) -> list[str]:
    """A DTensor on the slice dm["tp"]: each rank's Mesh is its own tp row."""
    from torch.distributed.tensor import distribute_tensor

    x = ints((6, 4), 8)
    dt = distribute_tensor(x, dm["tp"], dtensor_placements("S1"), src_data_rank=None)
    s = mc.dtensor.from_dtensor(dt, names="b h")
    y = mc.reshard(dt, "(tp b) h")
    if str(s.layout) != "b (tp h)" or s.mesh.mesh.ranks != tuple(dm["tp"].mesh.tolist()):
        return [f"slice read as {s.layout} on {s.mesh.mesh!r}"]
    if not torch.equal(y.full_tensor(), x) or not torch.equal(s.full(), x):
        return ["reshard on a DeviceMesh slice differs"]
    return []


def check_errors(dm: Any, mesh: mc.Mesh) -> list[str]:
    """Interop errors fire on every rank, before any communication."""
    problems = []
    dt = make_dtensor(ints((8, 6), 1), dm, mesh, "S0 S1", "(dp b) (tp h)")
    for dst in ("(dp b tp) h", list(dtensor_placements("Psum Pmax"))):
        try:
            mc.reshard(dt, dst)
            problems.append(f"mc.reshard(dt, {dst}) did not raise")
        except mc.errors.InteropError:
            pass
    return problems


def check_autograd(dm: Any, mesh: mc.Mesh) -> list[str]:
    """Gradients flow through mc.reshard(dt, dst) as through dt.redistribute."""
    x = ints((8, 6), 5)
    grads = []
    for use_mc in (True, False):
        dt = make_dtensor(x, dm, mesh, "SS0.2 S1", "(x=2 dp b) (tp h)").requires_grad_(True)
        weight = ints((8, 6), 6)
        y = mc.reshard(dt, "b h") if use_mc else dt.redistribute(dm, dtensor_placements("R R"))
        (y.to_local() * weight).sum().backward()
        grads.append(dt.grad.to_local())
    return [] if torch.equal(grads[0], grads[1]) else ["gradients differ from DTensor's"]


def check_binding(mesh: mc.Mesh) -> list[str]:
    """init_mesh's BoundMesh gives a DeviceMesh without new groups (2x2 mesh); DTensors on it
    convert back to a Sharded that finds init_mesh's multi-axis group."""
    from torch.distributed import distributed_c10d as c10d

    problems = []
    bound = mc.init_mesh(mesh)
    before = len(c10d._world.pg_group_ranks)
    dm = bound.device_mesh
    if len(c10d._world.pg_group_ranks) != before or bound.device_mesh is not dm:
        problems.append("device_mesh created groups or was built twice")
    if mc.Mesh.from_device_mesh(dm) != mesh or dm.mesh_dim_names != mesh.axis_names:
        problems.append(f"device_mesh is over {mc.Mesh.from_device_mesh(dm)!r}")
    x = ints((8, 6), 3)
    s = mc.distribute(x, bound, "(tp b) h | sum(dp)")
    dt = s.to_dtensor()
    if not torch.equal(dt.full_tensor(), x):
        problems.append("to_dtensor on init_mesh's device_mesh: full_tensor differs")
    back = mc.dtensor.from_dtensor(dt, names="b h")
    axes = tuple(mesh.axis_names)
    if back.mesh.group_name(axes) != bound.group_name(axes) or back.layout != s.layout:
        problems.append("from_dtensor did not find init_mesh's groups")
    if not torch.equal(back.reshard("b (dp tp h)").full(), x):
        problems.append("reshard after from_dtensor differs")
    return problems


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = mc.Mesh("dp=2 tp=2")
    dm = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.axis_names)
    report: dict[str, Any] = {"mesh": mc.Mesh.from_device_mesh(dm) == mesh}
    report["table"] = (check_table(dm, mesh, BLOCKS_4 + STRIDED_4 + PARTIAL_4, "b h", True)
                       + check_table(dm, mesh, FROM_ONLY_4, "b h", False))
    blocks = {row[2] for row in BLOCKS_4} | set(DST_4[:4])
    report["reshard"], report["compared"] = check_reshards(
        dm, mesh, BLOCKS_4 + STRIDED_4 + PARTIAL_4[:1], DST_4, blocks)
    report["errors"] = (check_errors(dm, mesh) + check_shard_order(dm, mesh)
                        + check_submesh(dm))
    report["autograd"] = check_autograd(dm, mesh)
    report["binding"] = check_binding(mesh)
    report["unnamed"] = check_unnamed()
    report["unnamed_partial"] = check_unnamed_partial()
    report["dtypes"] = check_dtypes(dm)
    report["grad_placements"] = check_gradient_placements(dm)
    report["spec_shape"] = check_spec_over_shape(dm)
    report["outside"] = check_outside()
    return report


def check_outside() -> list[str]:
    """A DTensor on DeviceMesh("cpu", [0, 2]): ranks 1 and 3 are outside it and do nothing,
    as with DTensor's redistribute; ranks 0 and 2 get redistribute's result."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sub = DeviceMesh("cpu", [0, 2], mesh_dim_names=("tp",))
    x = ints((6, 4), 9)
    problems = []
    for dst in ([Replicate()], "b (tp h)"):
        dt = distribute_tensor(x, sub, [Shard(0)], src_data_rank=None)
        got = mc.reshard(dt, dst)
        want = dt.redistribute(sub, [Replicate()] if dst == [Replicate()] else [Shard(1)])
        if tuple(got.placements) != tuple(want.placements) or \
                not torch.equal(got.to_local(), want.to_local()) or got.shape != want.shape:
            problems.append(f"rank {torch.distributed.get_rank()}: reshard on a sub-mesh to"
                            f" {dst} gave {got.placements} {tuple(got.to_local().shape)}")
    # from_dtensor agrees: outside ranks get a Sharded that holds nothing and does nothing
    dt = distribute_tensor(x, sub, [Shard(0)], src_data_rank=None)
    s = mc.dtensor.from_dtensor(dt, names="b h")
    moved = s.reshard("b (tp h)")
    full, want = s.full(), dt.full_tensor()
    rank = torch.distributed.get_rank()
    inside = rank in (0, 2)
    if s.mesh.in_mesh != inside or s.local.data_ptr() != dt.to_local().data_ptr():
        problems.append(f"rank {rank}: from_dtensor on a sub-mesh: in_mesh {s.mesh.in_mesh}")
    mine = x[:, 2 * (rank // 2):2 * (rank // 2) + 2] if inside else dt.to_local()
    if not torch.equal(full, want) or not torch.equal(moved.local, mine):
        problems.append(f"rank {rank}: from_dtensor on a sub-mesh: full {tuple(full.shape)},"
                        f" DTensor's {tuple(want.shape)}; reshard {tuple(moved.local.shape)}")
    back = moved.to_dtensor()
    if tuple(back.placements) != (Shard(1),) or back.device_mesh is not sub:
        problems.append(f"rank {rank}: to_dtensor on a sub-mesh gave {back.placements}")
    return problems


def check_flattened_sub_mesh() -> list[str]:
    """A 2x2 DeviceMesh over ranks [[0, 2], [4, 6]] of 8: the plan needs a group over both
    axes (ranks 0 2 4 6, not the world). Every rank, outside ones too, makes it inside
    mc.reshard; ranks outside do nothing; `bind_device_mesh(flatten=True)` makes the rest
    and gives outside ranks a mesh they are not in."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = torch.distributed.get_rank()
    sub = DeviceMesh("cpu", [[0, 2], [4, 6]], mesh_dim_names=("p", "q"))
    mesh = mc.Mesh.from_device_mesh(sub)
    x = ints((8, 3), 5)
    problems = []
    dt = make_dtensor(x, sub, mesh, "S0 S0", "(p q x) y")
    if [s.axes for s in mc.plan(mesh, (8, 3), "(p q x) y", "(q p x) y").steps] != [("p", "q")]:
        problems.append("the plan does not run over the flattened (p, q) group")
    got = mc.reshard(dt, "(q p x) y")
    if rank in mesh.ranks:
        if not torch.equal(got.to_local(), scatter(x, mesh, "(q p x) y")[mesh.position(rank)]):
            problems.append(f"rank {rank}: wrong shard on the sub-mesh")
    elif got.to_local().numel() != 0:
        problems.append(f"rank {rank}: outside the mesh but holds {got.to_local().shape}")
    bound = mc.dtensor.bind_device_mesh(sub, flatten=True)
    if bound.in_mesh != (rank in mesh.ranks):
        problems.append(f"rank {rank}: bind_device_mesh in_mesh={bound.in_mesh}")
    if bound.in_mesh and bound.group_ranks(("p", "q")) != (0, 2, 4, 6):
        problems.append(f"rank {rank}: (p, q) group {bound.group_ranks(('p', 'q'))}")
    if bound.in_mesh:
        bound.group_name(("p", "q"))      # bound, so a plan over it can run
    return problems


def check_spec_over_shape(dm: Any) -> list[str]:
    """A DTensor whose wrapper `.shape` disagrees with its spec (PyTorch's shard-order test
    helpers swap `_spec` on a built DTensor): meshcomm reads the spec on every rank, so all
    ranks plan the same and the reshard is the spec's tensor (it used to raise on some
    ranks and hang the others)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x7 = ints((7, 6), 3)
    uneven = distribute_tensor(x7, dm, [Shard(0), Shard(1)], src_data_rank=None)
    dt = distribute_tensor(ints((8, 6), 4), dm, [Shard(0), Shard(1)], src_data_rank=None)
    dt._spec, dt._local_tensor = uneven._spec, uneven._local_tensor
    problems = []
    if tuple(dt.shape) != (8, 6):
        problems.append(f"the test's DTensor did not keep its wrapper shape: {tuple(dt.shape)}")
    got = mc.reshard(dt, [Replicate(), Replicate()])
    if not torch.equal(got.to_local(), x7) or tuple(got.shape) != (7, 6):
        problems.append(f"reshard read {tuple(got.shape)}, not the spec's (7, 6)")
    if mc.dtensor.from_dtensor(dt).shape != (7, 6):
        problems.append("from_dtensor did not read the spec's shape")
    return problems


def check_gradient_placements(dm: Any) -> list[str]:
    """The input's gradient has redistribute's placements and local values: a Partial
    source stays Partial where the output's gradient is Partial (P -> P passes it on
    without communicating), and becomes Replicate where it is not."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank = torch.distributed.get_rank()
    problems = []
    cases = [("P R", "P R", "P R"), ("P R", "P R", "R R"), ("P R", "R R", "R R"),
             ("P R", "S0 R", "S0 R"), ("P S1", "P S0", "P S0"), ("P S1", "R S0", "S1 R"),
             ("S0 P", "S0 P", "S0 P")]
    for src, dst, grad in cases:
        pl = {"P": Partial(), "R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
        src_p, dst_p, grad_p = ([pl[t] for t in text.split()] for text in (src, dst, grad))
        got = []
        for fn in ("redistribute", "meshcomm"):
            local = torch.arange(24.0).reshape(4, 6) + rank
            dt = DTensor.from_local(local, dm, src_p, run_check=False).detach().requires_grad_()
            y = dt.redistribute(dm, dst_p) if fn == "redistribute" else mc.reshard(dt, dst_p)
            g_local = torch.arange(float(y.to_local().numel())).reshape(y.to_local().shape) * (
                rank + 1)
            g = DTensor.from_local(g_local, dm, dst_p, run_check=False)
            if grad_p != dst_p:
                g = g.redistribute(dm, grad_p)
            y.backward(g)
            got.append((tuple(dt.grad.placements), dt.grad.to_local()))
        (want_p, want), (mine_p, mine) = got
        if want_p != mine_p or not torch.equal(want, mine):
            problems.append(f"[{src}] -> [{dst}] with a [{grad}] gradient: meshcomm gives"
                            f" {mine_p}, redistribute {want_p} (or other values)")
    return problems


def check_dtypes(dm: Any) -> list[str]:
    """forward_dtype / backward_dtype as DTensor.redistribute: values, dtypes, gradients."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    problems = []
    x = ints((8, 6), 11)
    for fwd, bwd in ((torch.float64, None), (torch.float64, torch.float64),
                     (None, torch.float64)):
        for dst in ([Replicate(), Replicate()], [Shard(1), Shard(0)]):
            ours = distribute_tensor(x, dm, [Shard(0), Shard(1)], src_data_rank=None)
            theirs = distribute_tensor(x, dm, [Shard(0), Shard(1)], src_data_rank=None)
            ours.requires_grad_(True)
            theirs.requires_grad_(True)
            a = mc.reshard(ours, dst, forward_dtype=fwd, backward_dtype=bwd)
            b = theirs.redistribute(dm, dst, forward_dtype=fwd, backward_dtype=bwd)
            where = f"forward_dtype={fwd} backward_dtype={bwd} -> {dst}"
            if a.dtype != b.dtype or not torch.equal(a.to_local(), b.to_local()):
                problems.append(f"{where}: forward differs ({a.dtype} vs {b.dtype})")
            grad = ints(tuple(a.to_local().shape), 3).to(a.dtype)
            a.to_local().backward(grad)
            b.to_local().backward(grad)
            ga, gb = ours.grad.to_local(), theirs.grad.to_local()
            if ga.dtype != gb.dtype or not torch.equal(ga, gb):
                problems.append(f"{where}: gradient differs ({ga.dtype} vs {gb.dtype})")
    return problems


def check_unnamed() -> list[str]:
    """An unnamed DeviceMesh (init_device_mesh("cpu", (2, 2))): axes d0, d1; reshards equal
    DTensor's redistribute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dm = init_device_mesh("cpu", (2, 2))
    problems = []
    if mc.Mesh.from_device_mesh(dm) != mc.Mesh("d0=2 d1=2"):
        problems.append(f"unnamed mesh read as {mc.Mesh.from_device_mesh(dm)!r}")
    x = ints((8, 6), 7)
    dt = distribute_tensor(x, dm, [Shard(0), Shard(1)], src_data_rank=None)
    layout = mc.dtensor.from_dtensor(dt, names="b h").layout
    if layout != mc.Layout("(d0 b) (d1 h)"):
        problems.append(f"unnamed mesh: from_dtensor gave {layout}")
    for dst in ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()]):
        got, want = mc.reshard(dt, dst), dt.redistribute(dm, dst)
        if tuple(got.placements) != tuple(want.placements) or \
                not torch.equal(got.to_local(), want.to_local()):
            problems.append(f"unnamed mesh: reshard to {dst} differs from redistribute")
    if not torch.equal(mc.reshard(dt, "b h").to_local(), x):
        problems.append("unnamed mesh: reshard to \"b h\" is not the global tensor")
    return problems


def check_unnamed_partial() -> list[str]:
    """Issue 34: Partial sources (every reduce op) on unnamed DeviceMeshes, (4,) and (2, 2),
    whose axes d0, d1 collided with the planner's own dim names; forward as redistribute,
    and backward too for sum and avg (test_replicate_to_local_partial_grad's case: P -> R,
    then to_local)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank = torch.distributed.get_rank()
    problems = []
    meshes = ((init_device_mesh("cpu", (4,)), [("P", "R"), ("P", "S0"), ("P", "S1")]),
              (init_device_mesh("cpu", (2, 2)), [("P R", "R R"), ("P S1", "R S0"),
                                                 ("S0 P", "S1 R"), ("P P", "R R")]))
    for (dm, cases), op, shape in itertools.product(meshes, REDUCE_OPS, ((8, 6), (13, 5))):
        for src, dst in cases:
            pl = {"P": Partial(op), "R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
            src_p, dst_p = ([pl[t] for t in text.split()] for text in (src, dst))
            held = [Replicate() if isinstance(p, Partial) else p for p in src_p]
            local_shape = DTensor.from_local(torch.zeros(shape), dm, [Replicate()] * dm.ndim,
                                             run_check=False).redistribute(dm, held).to_local().shape
            got = []
            for fn in ("redistribute", "meshcomm"):
                local = (torch.arange(float(math.prod(local_shape))).reshape(local_shape) % 7
                         + rank)
                dt = DTensor.from_local(local, dm, src_p, run_check=False, shape=shape,
                                        stride=torch.empty(shape).stride()).detach()
                dt.requires_grad_(op in ("sum", "avg"))
                y = dt.redistribute(dm, dst_p) if fn == "redistribute" else mc.reshard(dt, dst_p)
                out = y.to_local()
                if dt.requires_grad:
                    (out * (torch.arange(float(out.numel())).reshape(out.shape) + rank)).sum(
                        ).backward()
                got.append((tuple(y.placements), out.detach(),
                            dt.grad.to_local() if dt.grad is not None else None))
            (want_p, want, want_g), (mine_p, mine, mine_g) = got
            where = f"unnamed {tuple(dm.shape)} {op} {shape} [{src}] -> [{dst}]"
            if want_p != mine_p or not torch.allclose(want, mine):
                problems.append(f"{where}: forward differs ({mine_p} vs {want_p})")
            if (want_g is None) != (mine_g is None) or (
                    want_g is not None and not torch.allclose(want_g, mine_g)):
                problems.append(f"{where}: gradient differs")
    return problems


def eight_ranks(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = mc.Mesh("a=2 b=2 c=2")
    dm = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.axis_names)
    report: dict[str, Any] = {}
    # No user-made flattened group: mc.reshard makes on every rank the groups its plan needs.
    report["no_flatten"] = []
    x = ints((8, 4, 6), 0)
    dt = make_dtensor(x, dm, mesh, "S0 S0 S0", "(a b c x) y z")
    y = mc.reshard(dt, "(c b a x) y z")
    pos = mesh.position(torch.distributed.get_rank())
    if not torch.equal(y.to_local(), scatter(x, mesh, "(c b a x) y z")[pos]):
        report["no_flatten"].append("(a b c x) -> (c b a x): wrong shard")
    steps = mc.plan(mesh, (8, 4, 6), "(a b c x) y z", "(c b a x) y z").steps
    report["multi_axis_steps"] = [s.axes for s in steps if len(s.axes) > 1]
    # the case: [S0, S1, S0] -> [S1, S0, S0] on an unflattened 2x2x2 mesh
    src, dst = dtensor_placements("S0 S1 S0"), dtensor_placements("S1 S0 S0")
    dt = make_dtensor(x, dm, mesh, "S0 S1 S0", "(a c x) (b y) z")
    got, want = mc.reshard(dt, dst), dt.redistribute(dm, dst)
    if tuple(got.placements) != tuple(want.placements) or \
            not torch.equal(got.to_local(), want.to_local()):
        report["no_flatten"].append(f"{src} -> {dst} differs from redistribute")
    report["sub_mesh"] = check_flattened_sub_mesh()
    report["table"] = check_table(dm, mesh, BLOCKS_8 + STRIDED_8 + PARTIAL_8, "x y z", True)
    blocks = {row[2] for row in BLOCKS_8} | set(DST_8[:3])
    report["reshard"], report["compared"] = check_reshards(
        dm, mesh, BLOCKS_8[:5] + STRIDED_8, DST_8, blocks)
    return report


# one spawn per world size; the tests read its report
four = ranks_fixture(four_ranks, 4)
eight = ranks_fixture(eight_ranks, 8)


def test_from_dtensor_full_and_back_on_2x2(four: list[dict[str, Any]]) -> None:
    assert all(r["mesh"] for r in four)
    problems = [p for r in four for p in r["table"]]
    assert not problems, "\n".join(problems[:10])


def test_reshard_dtensor_equals_exact_shards_and_redistribute_on_2x2(
        four: list[dict[str, Any]]) -> None:
    problems = [p for r in four for p in r["reshard"]]
    assert not problems, "\n".join(problems[:10])
    assert four[0]["compared"] >= 40


def test_forward_and_backward_dtype_as_redistribute(four: list[dict[str, Any]]) -> None:
    assert [r["dtypes"] for r in four] == [[]] * 4


def test_the_spec_s_shape_wins_over_the_wrapper_s(four: list[dict[str, Any]]) -> None:
    assert [r["spec_shape"] for r in four] == [[]] * 4


def test_gradient_placements_as_redistribute(four: list[dict[str, Any]]) -> None:
    assert [r["grad_placements"] for r in four] == [[]] * 4


def test_ranks_outside_a_dtensors_mesh_do_nothing(four: list[dict[str, Any]]) -> None:
    assert [r["outside"] for r in four] == [[]] * 4


def test_an_unnamed_device_mesh_has_axes_d0_d1(four: list[dict[str, Any]]) -> None:
    assert [r["unnamed"] for r in four] == [[]] * 4


def test_partial_sources_on_unnamed_device_meshes_as_redistribute(
        four: list[dict[str, Any]]) -> None:
    problems = [p for r in four for p in r["unnamed_partial"]]
    assert not problems, "\n".join(problems[:10])


def test_interop_errors_autograd_and_binding_on_2x2(four: list[dict[str, Any]]) -> None:
    problems = [p for r in four for key in ("errors", "autograd", "binding") for p in r[key]]
    assert not problems, "\n".join(problems[:10])


def test_a_3d_device_mesh_needs_no_user_made_flattened_group(
        eight: list[dict[str, Any]]) -> None:
    """The DeviceMesh is `init_device_mesh("cpu", (2, 2, 2))` and nobody calls `_flatten()`:
    plans over several axes (here (a, c) among them) run on groups meshcomm makes."""
    assert [r["no_flatten"] for r in eight] == [[]] * 8
    assert ("a", "c") in eight[0]["multi_axis_steps"]
    assert [r["sub_mesh"] for r in eight] == [[]] * 8


def test_from_dtensor_and_reshard_on_2x2x2(eight: list[dict[str, Any]]) -> None:
    problems = [p for r in eight for key in ("table", "reshard") for p in r[key]]
    assert not problems, "\n".join(problems[:10])
    assert eight[0]["compared"] >= 10
