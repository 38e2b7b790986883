# SPDX-License-Identifier: Apache-2.0
"""Shutting down with asynchronous saves pending. A checkpoint IO that is finalised (garbage collected) on one
rank while its saves are pending neither blocks nor issues a collective of its own (the other rank's next
collective pairs with the right one); a script that returns without ``_sync_io`` or ``destroy_process_group``
exits with status 0 on every rank (no SIGABRT, no "terminate called"), after its pending saves were finished
and committed by the writer thread, while the interpreter was still whole."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from stepforge.strategy import GeneralCheckpointIO
from stepforge.strategy.checkpoint import _optim_io, verify_dir
from stepforge.strategy.checkpoint._layout import read_commit
from stepforge.testing.distributed import free_port, requires_gloo

SCRIPT = os.path.join(os.path.dirname(__file__), "_exit_script.py")


@requires_gloo
def test_a_script_leaving_async_saves_pending_exits_cleanly_with_the_saves_committed(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    start = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(rank), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outcomes = []
    for proc in ranks:
        try:
            _, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            _, err = proc.communicate()
        outcomes.append((proc.returncode, err))
    elapsed = time.monotonic() - start
    for rank, (code, err) in enumerate(outcomes):
        assert code == 0 and f"rank {rank}: returning" in err and "terminate called" not in err, (
            rank,
            code,
            err,
        )
    assert elapsed < 120
    # both saves were finished and committed at exit (the next load checks every file against its commit)
    for name, entry in (("model", "model.safetensors"), ("optimizer", ".metadata")):
        folder = str(tmp_path / name)
        assert verify_dir(folder, required=True, where="test") and entry in read_commit(folder)["files"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no uncommitted temporary directory


def test_a_finalised_checkpoint_io_waits_for_its_writes_without_raising(tmp_path, monkeypatch, caplog):
    """Garbage collection of a checkpoint IO with a failed write pending logs the failure and returns."""
    import gc

    import torch

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_optim_io, "write_plain_optimizer", disk_full)
    net = torch.nn.Linear(2, 2)
    io = GeneralCheckpointIO()
    io.save_optimizer(torch.optim.SGD(net.parameters(), lr=0.1), str(tmp_path / "o.pt"), use_async=True)
    with caplog.at_level("ERROR", logger="stepforge.strategy"):
        del io
        gc.collect()
    assert "No space left on device" in caplog.text


def test_every_checkpoint_io_has_the_waits_a_subclass_included():
    """ColossalAI's users subclass ``CheckpointIO``; ``_sync_d2h``, ``_sync_io`` and ``async_writers`` work on such a
    subclass too, also one whose ``__init__`` does not call ``CheckpointIO.__init__``."""
    from stepforge.strategy import CheckpointIO

    class MyCheckpointIO(CheckpointIO):
        def __init__(self) -> None:  # ColossalAI's own subclasses call super().__init__(); this one forgets
            self.calls: list[str] = []

        def save_model(self, *args, **kwargs):
            self.calls.append("save_model")

        def load_model(self, model, *args, **kwargs):
            return model

        def save_optimizer(self, *args, **kwargs):
            self.calls.append("save_optimizer")

        def load_optimizer(self, *args, **kwargs):
            self.calls.append("load_optimizer")

    io = MyCheckpointIO()
    io._sync_d2h()
    io._sync_io()
    io.synchronize()
    assert io.async_writers == [] and io.calls == []
