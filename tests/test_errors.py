"""One full-message test per error kind: what, where (with a caret), what exists, the fix."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import meshcomm as mc
from meshcomm.core import errors
from meshcomm.core.errors import (LayoutSyntaxError, MeshAxisError, MeshcommError,
                                  MeshMismatchError, PlanError, RecipeError, ShapeError)

INPUT_ERRORS = (LayoutSyntaxError, MeshAxisError, ShapeError, MeshMismatchError, RecipeError,
                PlanError, errors.StyleError, errors.LaunchError)


@pytest.mark.parametrize("kind", INPUT_ERRORS, ids=lambda k: k.__name__)
def test_input_errors_are_meshcomm_and_value_errors(kind):
    assert issubclass(kind, MeshcommError)
    assert issubclass(kind, ValueError)
    assert getattr(mc.errors, kind.__name__) is kind


def test_every_error_class_derives_from_the_one_base():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == "meshcomm.errors"]
    assert set(INPUT_ERRORS) <= set(classes)
    for cls in classes:
        assert issubclass(cls, MeshcommError), cls


def check(call, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=re.escape(message)) as info:
        call()
    assert str(info.value) == message
    assert isinstance(info.value, MeshcommError)


def test_malformed_pattern_has_a_caret_under_the_bad_token():
    check(lambda: mc.Layout("(dp b s (tp h)"), LayoutSyntaxError,
          'cannot parse layout "(dp b s (tp h)"\n'
          "    (dp b s (tp h)\n"
          "            ^ a group cannot open inside another group\n"
          '  fix: close the first group, e.g. "(dp b) s (tp h)"')


def test_malformed_mesh_has_a_caret_under_the_bad_token():
    check(lambda: mc.Mesh("dp=2 tp4"), MeshAxisError,
          'cannot parse mesh "dp=2 tp4"\n'
          "    dp=2 tp4\n"
          "         ^^^ expected NAME=SIZE, e.g. dp=2\n"
          '  fix: write the axes as "dp=2 tp=4"')


def test_unknown_mesh_axis_in_a_group_says_did_you_mean():
    check(lambda: mc.Layout("(dq b) s (tp h)").placements(mc.Mesh("dp=2 tp=4"), (8, 16, 32)),
          MeshAxisError,
          'layout "(dq b) s (tp h)" on Mesh(dp=2, tp=4): "dq" is not a mesh axis\n'
          "    (dq b) s (tp h)\n"
          "     ^^ a group is one dim name plus mesh axes (dp, tp) or sized factors (x=2)\n"
          '  fix: did you mean "dp"?')


def test_unknown_mesh_axis_in_a_reduction():
    check(lambda: mc.Layout("b s | sum(cp)").placements(mc.Mesh("dp=2 tp=4"), (8, 16)),
          MeshAxisError,
          'layout "b s | sum(cp)" on Mesh(dp=2, tp=4): "cp" is not a mesh axis\n'
          "    b s | sum(cp)\n"
          "              ^^ a pending reduction is over mesh axes (dp, tp)\n"
          '  fix: did you mean "tp"?')
    # no close axis: no guess
    check(lambda: mc.Layout("b | avg(expert)").placements(mc.Mesh("dp=2 tp=4"), (8,)),
          MeshAxisError,
          'layout "b | avg(expert)" on Mesh(dp=2, tp=4): "expert" is not a mesh axis\n'
          "    b | avg(expert)\n"
          "            ^^^^^^ a pending reduction is over mesh axes (dp, tp)")


def test_unknown_mesh_axis_in_a_query():
    check(lambda: mc.Mesh("dp=2 tp=4").groups("tq"), MeshAxisError,
          '"tq" is not an axis of Mesh(dp=2, tp=4); axes are dp, tp\n  fix: did you mean "tp"?')


def test_duplicated_mesh_axis_in_a_mesh():
    check(lambda: mc.Mesh("dp=2 dp=4"), MeshAxisError,
          "mesh axis \"dp\" appears 2 times in ['dp', 'dp']; fix: give each axis a distinct name")


def test_duplicated_mesh_axis_in_a_layout():
    check(lambda: mc.Layout("(dp b) (dp s)"), LayoutSyntaxError,
          'cannot parse layout "(dp b) (dp s)"\n'
          "    (dp b) (dp s)\n"
          '            ^^ "dp" appears twice; every name is used once\n'
          "  fix: a mesh axis shards one dim or is pending; rename the dim")


def test_duplicated_dim_name():
    check(lambda: mc.Layout("b s b"), LayoutSyntaxError,
          'cannot parse layout "b s b"\n'
          "    b s b\n"
          '        ^ "b" appears twice; every name is used once\n'
          "  fix: a mesh axis shards one dim or is pending; rename the dim")


def test_factors_do_not_multiply_to_the_size():
    check(lambda: mc.Layout("(dp tp) s").placements(mc.Mesh("dp=2 tp=4"), (16, 16)), ShapeError,
          'layout "(dp tp) s" does not fit dim 0 of size 16: its factors (dp tp) multiply to 8.'
          ' fix: give the dim a name that takes the rest, e.g. "(dp tp x)"')


def test_sized_factor_conflicts_with_mesh_axis_size():
    check(lambda: mc.Layout("(tp=2 h)").placements(mc.Mesh("dp=2 tp=4"), (8,)), ShapeError,
          'layout "(tp=2 h)": "tp=2" in dim 0 gives mesh axis tp size 2, but Mesh(dp=2, tp=4)'
          " has tp=4. fix: write tp alone")


def test_non_dividing_size_where_uneven_is_not_allowed():
    check(lambda: mc.Layout("(b dp) s").placements(mc.Mesh("dp=4 tp=2"), (10, 16)), ShapeError,
          'layout "(b dp) s" does not fit dim 0 of size 10: (b dp) needs a multiple of 4; only'
          ' "(axes... name)" groups allow uneven shards. fix: use "(dp b)", or pad dim 0 to 12')


def test_dim_count_differs_from_shape():
    check(lambda: mc.Layout("(dp b) s").local_shape(mc.Mesh("dp=2"), (8, 16, 32), 0), ShapeError,
          'layout "(dp b) s" has 2 dims but the shape (8, 16, 32) has 3. fix: name one dim per'
          ' tensor dim, e.g. "a b c"')


def test_local_tensor_does_not_match_its_layout():
    mesh = mc.Mesh("dp=2 tp=4")
    locals_ = mc.sim.scatter(torch.zeros(8, 16), mesh, "(dp b) s")
    locals_[3] = locals_[3][:, :5]
    check(lambda: mc.sim.gather(locals_, mesh, "(dp b) s", (8, 16)), ShapeError,
          'locals_ on rank 3 has shape (4, 5), but layout "(dp b) s" of global shape (8, 16) on'
          " Mesh(dp=2, tp=4) gives it shape (4, 16). fix: pass the shard this rank holds, or the"
          " right global shape/layout")
    check(lambda: mc.Layout("(dp b) s").check_local(mesh, (8, 16), 0, (4, 15)), ShapeError,
          'local tensor on rank 0 has shape (4, 15), but layout "(dp b) s" of global shape'
          " (8, 16) on Mesh(dp=2, tp=4) gives it shape (4, 16). fix: pass the shard this rank"
          " holds, or the right global shape/layout")


def test_replicas_disagree_on_gather():
    mesh = mc.Mesh("dp=2 tp=2")
    locals_ = mc.sim.scatter(torch.zeros(4), mesh, "(dp b)")
    locals_[3] = locals_[3] + 1
    check(lambda: mc.sim.gather(locals_, mesh, "(dp b)", (4,)), ShapeError,
          'gather: rank 3 disagrees with another replica of layout "(dp b)" at 2 element(s);'
          " replicas must hold equal values")


def test_bad_ranks_grid():
    check(lambda: mc.Mesh("dp=2 tp=2", ranks=[[0, 1, 2], [3, 4, 5]]), ShapeError,
          "ranks= has shape (2, 3) but Mesh(dp=2, tp=2) needs shape (2, 2) (or a flat list of 4"
          " ranks)")


def test_plan_run_on_another_mesh():
    mesh = mc.Mesh("dp=2 tp=4")
    plan = mc.plan(mesh, (8, 16), "(dp b) s", "b s")
    locals_ = mc.sim.scatter(torch.zeros(8, 16), mesh, "(dp b) s")
    check(lambda: mc.sim.execute(plan, locals_, mc.Mesh("dp=4 tp=2")), MeshMismatchError,
          "plan was made for Mesh(dp=2, tp=4) but is run on Mesh(dp=4, tp=2). fix: plan with"
          " the mesh you run on")


def test_errors_come_before_any_work():
    """A bad layout fails at parse time, a bad shape before any shard is cut."""
    with pytest.raises(LayoutSyntaxError):
        mc.sim.scatter(torch.zeros(4), mc.Mesh("dp=2"), "(dp b")
    with pytest.raises(ShapeError):
        mc.sim.scatter(torch.zeros(5), mc.Mesh("dp=2"), "(b dp)")


def test_caret_and_did_you_mean_helpers():
    assert errors.caret("(dp b)", 1, 3, "here") == "    (dp b)\n     ^^ here"
    assert errors.caret("ab", 1) == "    ab\n     ^"
    assert errors.did_you_mean("tq", ["dp", "tp"]) == 'did you mean "tp"?'
    assert errors.did_you_mean("zzz", ["dp", "tp"]) == ""


def test_two_swapped_letters_are_one_typo() -> None:
    from meshcomm.core.errors import did_you_mean

    assert did_you_mean("pd", ["tp", "dp"]) == 'did you mean "dp"?'     # not "tp"
    assert did_you_mean("tpp", ["dp", "tp"]) == 'did you mean "tp"?'
    assert did_you_mean("xyz", ["dp", "tp"]) == ""
