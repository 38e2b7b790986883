# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's resnet example, its ``colossalai`` imports pointed at stepforge (``_colossalai_example.py``), runs
under ``torchrun --nproc-per-node 2`` on gloo: the dataset is "downloaded" once (``priority_execution``), rank 0
alone prints, training beats chance by far, and a run resumed from the epoch-2 checkpoint (and the data loader's
epoch, one added line: stepforge's loader reshuffles every epoch, ColossalAI's never does) ends on the same
weights, bit for bit, as the uninterrupted one."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from stepforge.testing.distributed import free_port, requires_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_colossalai_example.py")


def _torchrun(*args: str, data: str, cwd: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, *args,
    ]  # fmt: skip
    env = dict(os.environ, DATA=data, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _accuracy(stdout: str) -> float:
    lines = [
        line for line in stdout.splitlines() if line.startswith("Accuracy of the model on the test images")
    ]
    assert len(lines) == 1, stdout  # printed on rank 0 only
    return float(lines[0].split(":")[1].removesuffix("%").strip())


@requires_gloo
def test_colossalai_resnet_example_runs_on_stepforge(tmp_path):
    data, ckpt = str(tmp_path / "data"), str(tmp_path / "ckpt")
    first = _torchrun("--checkpoint", ckpt, "--epochs", "3", data=data, cwd=str(tmp_path))
    assert first.count("downloading train.pt") == 1 and first.count("downloading test.pt") == 1
    assert first.count("world size 2") == 1
    accuracy = _accuracy(first)
    assert accuracy > 50.0  # 10 classes: chance is 10 %
    for epoch in (1, 2, 3):
        assert os.path.isfile(f"{ckpt}/model_{epoch}.pth") and os.path.exists(f"{ckpt}/optimizer_{epoch}.pth")
    resumed = _torchrun("--checkpoint", ckpt, "--epochs", "3", "--resume", "2", data=data, cwd=str(tmp_path))
    assert "downloading" not in resumed  # the files are there
    assert _accuracy(resumed) == accuracy
    straight = torch.load(f"{ckpt}/model_3.pth", weights_only=True)
    again = torch.load(f"{ckpt}/resumed/model_3.pth", weights_only=True)
    after_two = torch.load(f"{ckpt}/model_2.pth", weights_only=True)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    assert not all(torch.equal(straight[k], after_two[k]) for k in straight)  # epoch 3 trained
