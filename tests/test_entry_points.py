"""Friendlier entry points: `mc.plan` takes a BoundMesh, `init_mesh` takes `ranks=`, and
`meshcomm launch` checks its script before starting anything."""

from __future__ import annotations

import torch
import pytest

import meshcomm as mc
from meshcomm import cli
from conftest import scaled


def bound(mesh: mc.Mesh) -> mc.BoundMesh:
    return mc.BoundMesh(mesh, "gloo", torch.device("cpu"), mesh.ranks[0], {})


def test_plan_takes_a_bound_mesh_as_its_mesh() -> None:
    mesh = mc.Mesh("dp=2 tp=2")
    assert mc.plan(bound(mesh), (8, 6), "(dp b) h", "b h") is mc.plan(mesh, (8, 6), "(dp b) h",
                                                                     "b h")
    other = mc.Mesh("tp=4", ranks=[4, 5, 6, 7])
    assert mc.plan(bound(mesh), (8, 6), "(dp b) h", "(tp b) h", dst_mesh=bound(other)) == \
        mc.plan(mesh, (8, 6), "(dp b) h", "(tp b) h", dst_mesh=other)


def test_plan_still_refuses_what_is_not_a_mesh() -> None:
    with pytest.raises(mc.errors.PlanError, match="mesh must be a meshcomm Mesh, got str"):
        mc.plan("dp=2", (8,), "(dp b)", "b")  # type: ignore[arg-type]


def test_init_mesh_ranks_go_with_a_spec_string_only() -> None:
    # Raised before any process group is touched (no world exists in this process).
    with pytest.raises(mc.errors.MeshMismatchError, match="goes with a spec string"):
        mc.init_mesh(mc.Mesh("tp=2"), ranks=[2, 3])
    with pytest.raises(mc.errors.MeshMismatchError, match="needs a Mesh or a spec string"):
        mc.init_mesh(4)  # type: ignore[arg-type]


def test_launch_checks_that_the_script_exists(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", "-n", "2", "no/such/script.py"]) == 2
    err = capsys.readouterr().err
    assert "LaunchError: launch: script 'no/such/script.py' is not a file" in err and "fix:" in err


def test_forward_dtype_goes_with_a_dtensor() -> None:
    with pytest.raises(mc.errors.ShapeError, match="go with a DTensor"):
        mc.reshard(torch.zeros(2), bound(mc.Mesh("tp=2")), "(tp b)", "b",
                   forward_dtype=torch.float64)


# -- import cost: what `import meshcomm` and `meshcomm --help` load ---------------------
def _modules_after(code: str) -> set[str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                           "print('MODULES:', *sys.modules)"],
                          capture_output=True, text=True, check=True, timeout=scaled(120))
    return set(done.stdout.split("MODULES:")[-1].split())


def test_help_loads_no_torch_rich_or_pydantic() -> None:
    """`meshcomm --help` answers in about 0.1 s: argument parsing imports none of the heavy
    packages (torch alone takes over a second)."""
    loaded = _modules_after("from meshcomm import cli\n"
                            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass")
    assert "meshcomm.cli" in loaded
    assert not {m.split(".")[0] for m in loaded} & {"torch", "rich", "pydantic"}


def test_import_meshcomm_loads_names_on_first_use() -> None:
    loaded = _modules_after("import meshcomm")
    assert "torch" not in loaded
    loaded = _modules_after("import meshcomm as mc\nmc.reshard, mc.Mesh, mc.dtensor, mc.nn")
    assert "torch.distributed" in loaded and "meshcomm.sharded" in loaded
    assert "torch._dynamo" not in loaded      # marked for torch.compile only when dynamo loads


@pytest.mark.parametrize("dynamo_first", [True, False])
def test_reshard_is_marked_for_dynamo_whenever_dynamo_loads(dynamo_first: bool) -> None:
    """`reshard` under torch.compile calls one function that Dynamo must see as
    nonstrict_trace. It is marked when torch._dynamo finishes loading, before or after
    meshcomm (tests/dist/test_autograd_compile.py runs the compiled graph)."""
    import subprocess
    import sys

    order = ["import torch._dynamo", "import meshcomm.sharded.local as s"]
    code = "\n".join(order if dynamo_first else order[::-1]) + (
        "\nfrom torch._dynamo import trace_rules as t"
        "\nprint(id(s._reshard_traced) in t._nonstrict_trace_callable_ids,"
        " s._reshard_traced is not s._reshard_opaque)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=scaled(120))
    assert done.stdout.split() == ["True", "True"], done.stderr
