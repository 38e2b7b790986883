# SPDX-License-Identifier: Apache-2.0
"""Two "nodes" on loopback: two ``torchrun --nnodes 2 --node-rank i`` invocations with one process each
(static rendezvous on 127.0.0.1) reproduce the single-node ``torchrun --nproc-per-node 2`` result bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from stepforge.testing.distributed import free_port, requires_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the worker imports the shared _strategy_cases from there
WORKER = os.path.join(HERE, "_two_node_worker.py")


def _env() -> dict[str, str]:
    path = os.pathsep.join([HERE, TESTS, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def _torchrun(*flags: str, out: str, work: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *flags, WORKER, out, work]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, text[-4000:]


@requires_gloo
def test_two_nodes_on_loopback_match_one_node(tmp_path):
    single = str(tmp_path / "single.pt")
    port = free_port()
    _wait([_torchrun("--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                     out=single, work=str(tmp_path / "w1"))])  # fmt: skip
    multi = str(tmp_path / "multi.pt")
    port = free_port()
    nodes = [
        _torchrun("--nproc-per-node=1", "--nnodes=2", f"--node-rank={i}", "--master-addr=127.0.0.1",
                  f"--master-port={port}", out=multi, work=str(tmp_path / "w2"))
        for i in range(2)
    ]  # fmt: skip
    _wait(nodes)
    a, b = torch.load(single), torch.load(multi)
    assert a["losses"] == b["losses"] and len(a["losses"]) == 2 and a["losses"][0] != a["losses"][1]
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
