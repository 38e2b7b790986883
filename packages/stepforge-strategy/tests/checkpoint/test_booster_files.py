# SPDX-License-Identifier: Apache-2.0
"""The Booster's saves go through the one writer: a single-file ``save_model`` stays a plain safetensors /
``torch.save`` file at the path asked for (readable by ``safetensors``, ``torch.load`` and ``load_model``) with a
sidecar manifest; sharded models and optimizers are committed directories with ``COMMIT.json``; every load checks
the checksum first and names the damaged file; a failed save leaves the earlier one byte for byte."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch
from test_writer_failures import _leftovers, _snapshot

from stepforge.strategy import Booster, CheckpointError
from stepforge.strategy import checkpoint as ck
from stepforge.strategy.checkpoint._layout import MARKER, SIDECAR_SUFFIX, verify_file


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x01]))


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_a_single_file_save_is_a_plain_file_with_a_sidecar_manifest(tmp_path, use_safetensors):
    saved, path = _model(0), str(tmp_path / "model.pt")
    Booster(plugin="single").save_model(saved, path, use_safetensors=use_safetensors)
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt" + SIDECAR_SUFFIX]
    if use_safetensors:  # any safetensors reader
        from safetensors.torch import load_file

        plain = load_file(path)
    else:  # ColossalAI's default: torch.load of the file itself
        plain = torch.load(path, weights_only=True)
    assert plain.keys() == saved.state_dict().keys()
    assert all(torch.equal(plain[k], v) for k, v in saved.state_dict().items())
    assert verify_file(path) is not None
    target = _model(1)
    Booster(plugin="single").load_model(target, path)
    assert _equal(target, saved)


@pytest.mark.parametrize("shard", [False, True])
def test_a_flipped_byte_in_a_model_file_is_refused_naming_it(tmp_path, shard):
    saved, path = _model(0), str(tmp_path / "ckpt")
    # safetensors named explicitly: the default is ColossalAI's use_safetensors=False
    Booster(plugin="single").save_model(saved, path, shard=shard, size_per_shard=0.0002, use_safetensors=True)
    files = [os.path.join(path, n) for n in os.listdir(path)] if shard else [path]
    weights = [f for f in files if f.endswith((".safetensors", "ckpt"))]
    assert weights and (not shard or len(weights) > 1)  # several shards: each one is checked
    if shard:
        assert MARKER in os.listdir(path)
    for victim in weights:
        _flip(victim, os.path.getsize(victim) // 2)
        target = _model(1)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(CheckpointError, match=os.path.basename(victim)):
            Booster(plugin="single").load_model(target, path)
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        _flip(victim, os.path.getsize(victim) // 2)
    Booster(plugin="single").load_model(target, path)
    assert _equal(target, saved)


def _boosted():
    model = _model(0)
    booster = Booster(plugin="single")
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    # torch cannot see the boosted optimizer's step: its order warning is moot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sched.step()
    return booster, model, opt, sched


def test_optimizer_and_scheduler_saves_are_committed_and_checked(tmp_path):
    booster, _, opt, sched = _boosted()
    opt_dir, sched_file = str(tmp_path / "optimizer"), str(tmp_path / "sched.pt")
    booster.save_optimizer(opt, opt_dir, shard=True)
    booster.save_lr_scheduler(sched, sched_file)
    record = ck._layout.read_commit(opt_dir)
    assert record["meta"] == {"kind": "optimizer"} and ".metadata" in record["files"]
    assert torch.load(sched_file, weights_only=True) == sched.state_dict()  # still a plain torch.save file
    data = next(n for n in os.listdir(opt_dir) if n.endswith(".distcp"))
    for victim, load in (
        (os.path.join(opt_dir, data), lambda: booster.load_optimizer(opt, opt_dir)),
        (sched_file, lambda: booster.load_lr_scheduler(sched, sched_file)),
    ):
        _flip(victim, os.path.getsize(victim) - 1)
        with pytest.raises(CheckpointError, match=os.path.basename(victim)):
            load()
        _flip(victim, os.path.getsize(victim) - 1)
        load()
    with open(os.path.join(opt_dir, MARKER), "a") as f:  # the marker itself is checked too
        f.write(" ")
    with pytest.raises(CheckpointError, match="COMMIT.json does not match its own CRC-32"):
        booster.load_optimizer(opt, opt_dir)


def _fail_writing(monkeypatch, module, name):
    real = getattr(module, name)

    def partial_then_enospc(obj, path, *args, **kwargs):
        real(obj, path, *args, **kwargs)  # a truncated file is on disk when the error comes
        with open(path, "r+b") as f:
            f.truncate(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, name, partial_then_enospc)


@pytest.mark.parametrize("what", ["model", "model_shards", "model_torch", "optimizer", "scheduler"])
def test_a_full_disk_leaves_the_earlier_save_and_no_temporary_file(tmp_path, monkeypatch, what):
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    booster, model, opt, sched = _boosted()
    path = str(tmp_path / "ckpt")
    save = {
        # safetensors named: the default is ColossalAI's use_safetensors=False
        "model": lambda: booster.save_model(model, path, use_safetensors=True),
        "model_shards": lambda: booster.save_model(
            model, path, shard=True, size_per_shard=0.0002, use_safetensors=True
        ),
        "model_torch": lambda: booster.save_model(model, path, use_safetensors=False),
        "optimizer": lambda: booster.save_optimizer(opt, path, shard=True),
        "scheduler": lambda: booster.save_lr_scheduler(sched, path),
    }[what]
    save()
    before = _snapshot(str(tmp_path))
    if what.startswith("model") and what != "model_torch":
        _fail_writing(monkeypatch, safetensors.torch, "save_file")
    elif what == "optimizer":
        monkeypatch.setattr(dcp, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    else:
        _fail_writing(monkeypatch, torch, "save")
    with pytest.raises(CheckpointError) as info:
        save()
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert _snapshot(str(tmp_path)) == before and _leftovers(str(tmp_path)) == []
