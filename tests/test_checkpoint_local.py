"""mc.nn.save_checkpoint / load_checkpoint in one process (no torch.distributed): plain
tensors and values round-trip, and every bad input is refused before any file is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import meshcomm as mc
from meshcomm.errors import ShapeError


def state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(4, generator=gen)},
            "step": 7, "lr": torch.tensor(0.5), "empty": torch.zeros(0, 3)}


def zeros() -> dict[str, object]:
    return {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(4)}, "step": 0,
            "lr": torch.tensor(0.0), "empty": torch.ones(0, 3)}


def test_round_trip_in_place(tmp_path: Path) -> None:
    saved = state()
    mc.nn.save_checkpoint(saved, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meshcomm.json", "rank0.pt"]
    target = zeros()
    w = target["model"]["w"]    # type: ignore[index]
    read = mc.nn.load_checkpoint(target, tmp_path)
    assert target["model"]["w"] is w and torch.equal(w, saved["model"]["w"])  # type: ignore[index]
    assert torch.equal(target["model"]["b"], saved["model"]["b"])  # type: ignore[index]
    assert target["step"] == 7 and torch.equal(target["lr"], torch.tensor(0.5))  # type: ignore[arg-type]
    assert read == mc.nn.CheckpointRead(files=(0,), bytes=(15 + 4) * 4, tensors=3)


def test_missing_key_names_it_and_the_closest_saved_key(tmp_path: Path) -> None:
    mc.nn.save_checkpoint(state(), tmp_path)
    target = zeros()
    target["model"]["wq"] = target["model"].pop("w")  # type: ignore[union-attr,attr-defined]
    with pytest.raises(mc.nn.CheckpointError, match=r"1 of the state dict's 5 key\(s\).*"
                       r"\['model.wq'\] \(a saved key close to 'model.wq': 'model.w'\).*"
                       r"strict=False to fill the other 4 key\(s\)"):
        mc.nn.load_checkpoint(target, tmp_path)
    assert torch.equal(target["model"]["b"], torch.zeros(4))  # type: ignore[index]  # nothing read
    mc.nn.load_checkpoint(target, tmp_path, strict=False)
    assert torch.equal(target["model"]["wq"], torch.zeros(5, 3))  # type: ignore[index]
    assert target["step"] == 7


def test_missing_keys_under_a_prefix_or_none_matching_say_so(tmp_path: Path) -> None:
    """A prefix that differs (torch.compile's `_orig_mod.`, DDP's `module.`) is named;
    when no key matches, strict=False (which would load nothing) is not suggested."""
    mc.nn.save_checkpoint(state(), tmp_path)
    target = {"_orig_mod." + k: v for k, v in zeros().items()}
    with pytest.raises(mc.nn.CheckpointError,
                       match=r"the state dict's keys carry the prefix '_orig_mod\.'"):
        mc.nn.load_checkpoint(target, tmp_path)
    saved_prefixed = tmp_path / "prefixed"
    mc.nn.save_checkpoint({"net": state()}, saved_prefixed)
    with pytest.raises(mc.nn.CheckpointError, match=r"the checkpoint's keys carry the prefix"
                       r" 'net\.'"):
        mc.nn.load_checkpoint(zeros(), saved_prefixed)
    with pytest.raises(mc.nn.CheckpointError, match=r"none of them is in the checkpoint") as info:
        mc.nn.load_checkpoint({"other": torch.zeros(2)}, tmp_path)
    assert "strict=False" not in str(info.value)


def test_other_shape_or_kind_is_refused_before_reading(tmp_path: Path) -> None:
    mc.nn.save_checkpoint(state(), tmp_path)
    target = zeros()
    target["model"]["w"] = torch.zeros(5, 4)  # type: ignore[index]
    with pytest.raises(ShapeError, match=r"model.w has global shape \(5, 4\) here but \(5, 3\)"):
        mc.nn.load_checkpoint(target, tmp_path)
    assert target["step"] == 0
    target = zeros()
    target["step"] = torch.zeros(2)
    with pytest.raises(mc.nn.CheckpointError, match="step is a Tensor here but a value"):
        mc.nn.load_checkpoint(target, tmp_path)


def test_not_a_checkpoint_folder(tmp_path: Path) -> None:
    with pytest.raises(mc.nn.CheckpointError, match="meshcomm.json does not exist.*DCP"):
        mc.nn.load_checkpoint(zeros(), tmp_path)
    (tmp_path / "meshcomm.json").write_text(json.dumps({"format": "other/9", "tensors": {}}))
    with pytest.raises(mc.nn.CheckpointError, match="format 'other/9'"):
        mc.nn.load_checkpoint(zeros(), tmp_path)


def test_keys_that_cannot_be_flattened(tmp_path: Path) -> None:
    with pytest.raises(mc.nn.CheckpointError, match="flatten to 'a.b'"):
        mc.nn.save_checkpoint({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, tmp_path)
    with pytest.raises(mc.nn.CheckpointError, match="key 3 is not a string"):
        mc.nn.save_checkpoint({3: torch.zeros(1)}, tmp_path)  # type: ignore[dict-item]
    assert not (tmp_path / "meshcomm.json").exists()
