# SPDX-License-Identifier: Apache-2.0
"""A sharded save into a directory the user already filled: the Hugging Face workflow
(``config.save_pretrained(d)``, a tokenizer, then ``booster.save_model(model, d, shard=True)``, then
``AutoModel.from_pretrained(d)``, as ColossalAI's ``test_gemini_checkpoint_io.py::exam_state_dict_with_origin``).

The shards and the index go into the directory, the index after the shards and ``COMMIT.json`` (listing exactly
this save's files) last; every other file stays byte for byte; ``from_pretrained`` loads the result in both the
safetensors and the ``.bin`` form; a later save with fewer shards removes the shards it no longer lists (as
transformers' ``save_pretrained`` does) and nothing else; a failed save leaves the user's files whole; a damaged
shard is named at load."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from stepforge.strategy import Booster, CheckpointError  # noqa: E402
from stepforge.strategy import checkpoint as ck  # noqa: E402
from stepforge.strategy.checkpoint._layout import MARKER  # noqa: E402

USER_FILES = {"tokenizer.json": b'{"version": "1.0"}', "notes/README.md": b"# my model\n"}


def _model(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return transformers.GPT2Model(config)


def _user_dir(path, model) -> dict[str, bytes]:
    """What the user put there before the save: the config and a tokenizer-like file (and a folder)."""
    model.config.save_pretrained(str(path))
    for name, data in USER_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return {n: (path / n).read_bytes() for n in ["config.json", *USER_FILES]}


def _assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("size_per_shard", [0.01, 1024])  # MiB: four shards and an index, or one file
def test_hugging_face_workflow_loads_with_from_pretrained(tmp_path, use_safetensors, size_per_shard):
    model = _model(0)
    kept = _user_dir(tmp_path, model)
    booster = Booster(plugin="single")
    boosted, *_ = booster.boost(model)
    booster.save_model(boosted, str(tmp_path), shard=True, size_per_shard=size_per_shard,
                       use_safetensors=use_safetensors)  # fmt: skip

    assert {n: (tmp_path / n).read_bytes() for n in kept} == kept  # the user's files, byte for byte
    stem, ext = ("model", "safetensors") if use_safetensors else ("pytorch_model", "bin")
    ours = sorted(ck._layout.read_commit(str(tmp_path))["files"])
    if size_per_shard == 1024:
        assert ours == [f"{stem}.{ext}"]
    else:
        index = f"{stem}.{ext}.index.json"
        shards = [f"{stem}-{i:05d}-of-00004.{ext}" for i in range(1, 5)]
        assert ours == sorted([*shards, index])
        weight_map = json.loads((tmp_path / index).read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == shards and set(weight_map) == set(model.state_dict())
    assert sorted(os.listdir(tmp_path)) == sorted({*ours, "config.json", "tokenizer.json", "notes", MARKER})

    loaded = transformers.AutoModel.from_pretrained(str(tmp_path))
    _assert_same_weights(model, loaded)
    fresh = _model(1)
    booster.load_model(fresh, str(tmp_path))
    _assert_same_weights(model, fresh)


def test_a_re_save_removes_only_the_shards_it_no_longer_writes(tmp_path):
    model = _model(0)
    kept = _user_dir(tmp_path, model)
    # a shard of the same name written by another tool, and the user's own weights of another format
    (tmp_path / "model-00007-of-00009.safetensors").write_bytes(b"from an earlier save_pretrained")
    (tmp_path / "pytorch_model.bin").write_bytes(b"the user's own .bin")
    booster = Booster(plugin="single")
    booster.save_model(model, str(tmp_path), shard=True, size_per_shard=0.01, use_safetensors=True)
    assert not (tmp_path / "model-00007-of-00009.safetensors").exists()  # stale: transformers removes it too
    assert (tmp_path / "model-00004-of-00004.safetensors").is_file()

    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    booster.save_model(model, str(tmp_path), shard=True, size_per_shard=1024, use_safetensors=True)
    names = set(os.listdir(tmp_path))
    assert not any("-of-" in n for n in names) and "model.safetensors.index.json" not in names
    assert {"model.safetensors", "pytorch_model.bin", "config.json", "tokenizer.json", "notes"} <= names
    assert {n: (tmp_path / n).read_bytes() for n in kept} == kept
    assert (tmp_path / "pytorch_model.bin").read_bytes() == b"the user's own .bin"
    # this save's entry is what a load reads, whatever else lies in the folder
    fresh = _model(1)
    booster.load_model(fresh, str(tmp_path))
    _assert_same_weights(model, fresh)
    _assert_same_weights(model, transformers.AutoModel.from_pretrained(str(tmp_path)))


def test_a_failed_save_into_the_directory_leaves_the_user_files_and_the_earlier_save(tmp_path, monkeypatch):
    import safetensors.torch

    model = _model(0)
    kept = _user_dir(tmp_path, model)
    booster = Booster(plugin="single")
    booster.save_model(model, str(tmp_path), shard=True, size_per_shard=0.01, use_safetensors=True)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if (tmp_path / n).is_file()}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        booster.save_model(_model(3), str(tmp_path), shard=True, size_per_shard=0.01, use_safetensors=True)
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if (tmp_path / n).is_file()}
    assert after == before and {n: (tmp_path / n).read_bytes() for n in kept} == kept
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary directory left


def test_a_damaged_shard_is_named_at_load(tmp_path):
    model = _model(0)
    _user_dir(tmp_path, model)
    booster = Booster(plugin="single")
    booster.save_model(model, str(tmp_path), shard=True, size_per_shard=0.01, use_safetensors=True)
    victim = tmp_path / "model-00002-of-00004.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    fresh = _model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match="model-00002-of-00004.safetensors"):
        booster.load_model(fresh, str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_directory_with_user_files_is_never_replaced_as_a_whole(tmp_path):
    """A save that replaces its directory wholesale (a DCP optimizer save) refuses one holding other files, also
    after a model save made it a stepforge checkpoint."""
    model = _model(0)
    _user_dir(tmp_path, model)
    booster = Booster(plugin="single")
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    booster.save_model(boosted, str(tmp_path), shard=True, use_safetensors=True)
    with pytest.raises(CheckpointError, match="files no save of stepforge wrote"):
        booster.save_optimizer(optimizer, str(tmp_path), shard=True)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()
