# SPDX-License-Identifier: Apache-2.0
"""No code runs from a checkpoint: attacker-made files for every load entry point raise CheckpointError.

Each payload is a pickle whose ``__reduce__`` would create a marker file when unpickled by ``pickle.load`` or
``torch.load(weights_only=False)``; the test asserts the marker never appears and the live objects are unchanged.
The attacker also rewrites ``COMMIT.json`` (sizes, CRC-32 and its own CRC) so the integrity check passes and the
unpickling itself is what is tested.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cases import boost, boosted_steps
from _strategy_cases import full_params, make_strategy, prepare, train

from stepforge.strategy import CheckpointError
from stepforge.strategy import checkpoint as ck
from stepforge.strategy.checkpoint import _dcp
from stepforge.strategy.checkpoint._layout import MARKER


class Payload:
    """Unpickling this creates ``marker`` (``pathlib.Path.touch``): the stand-in for an arbitrary command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _crc(path: str) -> str:
    with open(path, "rb") as f:
        return f"{zlib.crc32(f.read()):08x}"


def _recommit(path: str) -> None:
    """What an attacker does after editing files: a COMMIT.json that matches them (sizes, CRC-32, own CRC)."""
    with open(os.path.join(path, MARKER), encoding="utf-8") as f:
        record = json.load(f)
    record.pop("crc32")
    names = [n for n in os.listdir(path) if n != MARKER]
    record["files"] = {
        n: {"size": os.path.getsize(os.path.join(path, n)), "crc32": _crc(os.path.join(path, n))}
        for n in names
    }
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    record["crc32"] = f"{zlib.crc32(body.encode()):08x}"
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True, separators=(",", ":")))


def _evil_metadata(path: str, marker: str) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)


def _plain_blob(obj, what):  # an attacker's writer: pickles anything, no weights_only check
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _raw_payload(marker):  # an attacker's writer: the payload itself becomes DCP's "objects" bytes entry
    return lambda obj, what: Payload(marker)


@pytest.fixture
def marker(tmp_path):
    path = str(tmp_path / "PWNED")
    yield path
    assert not os.path.exists(path), "a checkpoint ran code"


def _strategy_checkpoints(work: str, marker: str, monkeypatch) -> dict[str, str]:
    """A committed Strategy checkpoint with a payload in (a) .metadata, (b) the objects blob, (c) a DCP entry."""
    s = make_strategy(work)
    prepare(s)
    train(s, 0, 3, 0)
    meta_ckpt = s.save_checkpoint("meta_payload")
    _evil_metadata(meta_ckpt, marker)
    _recommit(meta_ckpt)
    out = {"metadata": meta_ckpt}
    for name, writer in (("blob", _plain_blob), ("dcp_entry", _raw_payload(marker))):
        with monkeypatch.context() as m:
            m.setattr(_dcp, "_blob", writer)
            out[name] = s.save_checkpoint(f"{name}_payload", extra_ckpt=dict(evil=Payload(marker)))
    assert not os.path.exists(marker)
    return out


@pytest.mark.parametrize("where", ["metadata", "blob", "dcp_entry"])
@pytest.mark.parametrize("entry", ["load_checkpoint", "resume"])
def test_strategy_loads_refuse_payloads(tmp_path, marker, monkeypatch, where, entry):
    path = _strategy_checkpoints(str(tmp_path / "work"), marker, monkeypatch)[where]
    victim = make_strategy(str(tmp_path / "victim"))
    prepare(victim, model_seed=7)
    before = full_params(victim.model)
    with pytest.raises(CheckpointError, match="refused|not a DCP metadata class|Unsupported|weights_only"):
        getattr(victim, entry)(path)
    after = full_params(victim.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_saving_an_object_a_load_could_not_read_is_refused(tmp_path, marker):
    s = make_strategy(str(tmp_path))
    prepare(s)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        s.save_checkpoint("x", extra_ckpt=dict(evil=Payload(marker)))
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".x.tmp-")]  # nothing left behind


def _optimizer_state(wrapper):
    return {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(wrapper.optimizer.state.values())}


def test_booster_load_optimizer_refuses_payloads(tmp_path, marker):
    booster, model, wrapper = boost("single", k=1)
    boosted_steps(model, wrapper, 1, 0, 1, 1)
    good = tmp_path / "o"
    booster.save_optimizer(wrapper.optimizer, good, shard=True)
    before = _optimizer_state(wrapper)
    # (a) .metadata names an arbitrary callable
    evil_meta = tmp_path / "o_meta"
    booster.save_optimizer(wrapper.optimizer, evil_meta, shard=True)
    _evil_metadata(str(evil_meta), marker)
    # without its COMMIT.json (an unmarked DCP directory, as torch's dcp.save writes) the checksums cannot catch
    # the change: the restricted reader must
    (evil_meta / "COMMIT.json").unlink()
    # (b) a non-tensor entry of the optimizer state (a param group's lr) is a payload
    _, osd = booster.plugin.get_state_dict(model, wrapper.optimizer)
    osd["param_groups"][0]["lr"] = Payload(marker)
    evil_entry = tmp_path / "o_entry"
    with pytest.warns(UserWarning):
        dcp.save({"optimizer": osd}, checkpoint_id=str(evil_entry), no_dist=True)
    for path in (evil_meta, evil_entry):
        with pytest.raises(
            CheckpointError, match="refused|not a DCP metadata class|Unsupported|weights_only"
        ):
            booster.load_optimizer(wrapper.optimizer, path)
        after = _optimizer_state(wrapper)
        assert all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    booster.load_optimizer(wrapper.optimizer, good)  # the genuine directory still loads


def test_booster_load_model_and_lr_scheduler_refuse_payloads(tmp_path, marker):
    booster, model, wrapper = boost("single", k=1)
    before = [p.detach().clone() for p in model.parameters()]
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save({"weight": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused"):
        booster.load_model(model, folder)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    sched = torch.optim.lr_scheduler.StepLR(wrapper.optimizer, 1, gamma=0.5)
    torch.save({"last_epoch": Payload(marker)}, tmp_path / "s.pt")
    with pytest.raises(CheckpointError, match="refused"):
        booster.load_lr_scheduler(sched, tmp_path / "s.pt")
    assert sched.last_epoch == 0
