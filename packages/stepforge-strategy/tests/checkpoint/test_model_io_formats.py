# SPDX-License-Identifier: Apache-2.0
"""``Booster.load_model`` reads what ``save_model`` wrote at any path, whatever its name.

The reader is chosen from the file's first bytes (a safetensors header, a torch zip archive, a legacy pickle),
never from its suffix: ``save_model(model, "ckpt/model")`` and ``save_model(model, "model.pt")`` write
safetensors by default and used to fail to load with an ``UnpicklingError``. Expected weights are the saved
model's own; loads are bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.strategy import Booster

PATHS = ["ckpt/model", "model.pt", "model.bin", "model.safetensors", "existing_dir"]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("name", PATHS)
def test_save_model_then_load_model_on_the_same_path(tmp_path, name, use_safetensors, shard):
    booster = Booster(plugin="single")
    saved = _model(0)
    path = tmp_path / name
    if name == "existing_dir":
        path.mkdir()
    booster.save_model(saved, path, shard=shard, use_safetensors=use_safetensors)
    target = _model(1)
    assert not torch.equal(target[0].weight, saved[0].weight)
    booster.load_model(target, path)
    for (key, p), q in zip(target.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(p, q), key


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_the_written_format_is_the_one_asked_for_whatever_the_name(tmp_path, use_safetensors):
    Booster(plugin="single").save_model(_model(0), tmp_path / "model.pt", use_safetensors=use_safetensors)
    head = (tmp_path / "model.pt").read_bytes()[:9]
    if use_safetensors:  # 8-byte little-endian header length, then the JSON header
        assert head[8:9] == b"{"
    else:  # torch.save's zip archive
        assert head[:4] == b"PK\x03\x04"


def test_a_file_of_neither_format_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="neither a safetensors file nor a torch.save"):
        Booster(plugin="single").load_model(_model(0), tmp_path / "model.safetensors")
