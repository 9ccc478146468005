"""Concepts written once: check mode names ranks one way (`runtime.checks.ranks_text`) in
every message, the drift check's included, and the executors read a step's rearranges as
the planner's own `Rearrange`, not a second description of it."""

from __future__ import annotations

import typing

import torch
from torch import nn

import meshcomm as mc
from meshcomm.executors import local
from meshcomm.nn.drift import Watch
from meshcomm.planner.rearrange import Rearrange
from meshcomm.runtime.checks import Disagreement, ranks_text


def test_the_drift_message_names_ranks_as_every_check_does() -> None:
    bound = mc.BoundMesh(mc.Mesh("tp=4"), "gloo", torch.device("cpu"), 1, {}, True)
    watch = Watch(nn.Linear(1, 1), bound, "tp", ["replicated_grad_sum"])
    found = Disagreement((0,), ((0, 2, 3), (1,)), ((1, 7, 8, 0), (0, 0, 0, 0)))
    message = watch.message(["norm.weight"], found)
    assert f"the ranks that hold its copies ({ranks_text((0, 1, 2, 3))}):" in message
    assert "(ranks 0-3): ranks 0, 2, 3: gradient sum 0; rank 1: no gradient" in message


def test_the_executors_rearrange_with_the_planners_value() -> None:
    assert typing.get_type_hints(local.rearranged)["r"] is Rearrange
    r = Rearrange(split=((2, 3),), perm=(1, 0), merge=(2,))
    assert local.rearranged(r, torch.arange(6)).tolist() == r.apply(torch.arange(6)).tolist()
