# SPDX-License-Identifier: Apache-2.0
"""Does a plain DDP + gradient-accumulation script abort at process exit?

A user's script, not a test: two gloo processes (fresh interpreters, as ``torchrun`` starts them), a DDP model,
a few accumulation windows, then a normal interpreter exit (no ``os._exit``). The parent prints each child's
exit code / signal and exits 1 if any child did not exit 0, so a shell loop can tally aborts::

    for i in $(seq 50); do timeout 120 python tools/repro/ddp_accum_exit.py --impl stepforge; echo "rc=$?"; done

``--impl stepforge`` accumulates with ``stepforge.accum.OptimWrapper`` (forward inside ``optim_context``);
``--impl torch`` does the same with plain torch (``model.no_sync()`` and ``loss / k``), importing no stepforge.
``--teardown destroy`` ends with ``dist.destroy_process_group()`` (torch's documented clean shutdown),
``--teardown none`` leaves the group to interpreter exit, ``--teardown barrier-destroy`` puts a barrier first,
``--teardown release-destroy`` drops the DDP model and the tensors given to collectives, runs ``gc.collect()``,
then destroys the group (the workaround: the gloo worker threads are joined before interpreter teardown).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import signal
import socket
import subprocess
import sys

K = 4  # micro-batches per window
MICRO = 12  # micro-batches in the run (3 windows)


def _data(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(MICRO)]


def _train_stepforge(model: object, data: list, weighted: bool) -> None:
    import torch
    from torch import nn

    from stepforge.accum import OptimWrapper

    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=K)
    for x, y in data:
        with wrapper.optim_context(model):
            loss = nn.functional.mse_loss(model(x), y)
        wrapper.update_params(loss, num_items=x.shape[0] if weighted else None)


def _train_torch(model: object, data: list, weighted: bool) -> None:
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data, start=1):
        last = i % K == 0
        ctx = model.no_sync() if not last else _null()
        with ctx:
            loss = nn.functional.mse_loss(model(x), y) / K
            loss.backward()
        if last:
            opt.step()
            opt.zero_grad()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _child(rank: int, world: int, port: int, impl: str, teardown: str, weighted: bool, hook: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    if hook:  # torch's stock Python comm hook: its future callback runs on a gloo worker thread
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    (_train_stepforge if impl == "stepforge" else _train_torch)(model, _data(rank), weighted)
    # every rank must end with the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered), "ranks diverged"
    print(f"rank {rank}: trained", file=sys.stderr, flush=True)
    if teardown == "barrier-destroy":
        dist.barrier()
    if teardown == "release-destroy":
        # the workaround: drop everything that holds the process group (DDP's reducer, work handles,
        # tensors given to collectives), then destroy it, so ~ProcessGroupGloo joins its worker threads now,
        # while the interpreter is fully alive
        del model, flat, gathered
        gc.collect()
    if teardown in ("destroy", "barrier-destroy", "release-destroy"):
        dist.destroy_process_group()
    print(f"rank {rank}: returning to the interpreter", file=sys.stderr, flush=True)
    # normal return: interpreter teardown runs


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("stepforge", "torch"), default="stepforge")
    ap.add_argument(
        "--teardown", choices=("destroy", "none", "barrier-destroy", "release-destroy"), default="destroy"
    )
    ap.add_argument("--weighted", action="store_true", help="stepforge: num_items (async weight all-reduce)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--comm-hook", action="store_true", help="register torch's default allreduce_hook on DDP")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # set in the children
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    a = _parse()
    if a.rank >= 0:  # a child: train, then return and let the interpreter exit normally
        _child(a.rank, a.world, a.port, a.impl, a.teardown, a.weighted, a.comm_hook)
        return 0
    # The parent imports no torch: each rank is a fresh interpreter (as under torchrun) whose exit is a
    # normal interpreter teardown; its return code is negative when a signal (SIGABRT: -6) killed it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    argv = [sys.executable, os.path.abspath(__file__), "--impl", a.impl, "--teardown", a.teardown]
    argv += ["--world", str(a.world), "--port", str(port)] + (["--weighted"] if a.weighted else [])
    argv += ["--comm-hook"] if a.comm_hook else []
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(a.world)
    ]
    codes, notes = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            notes.append("timeout")
        codes.append(p.returncode)
        keep = ("terminate", "Error", "rank ")
        notes += [line.strip()[:160] for line in err.splitlines() if any(k in line for k in keep)][:4]
    ok = all(c == 0 for c in codes)
    verdict = "OK" if ok else ("SIGABRT" if -signal.SIGABRT in codes else "FAIL")
    what = f"impl={a.impl} teardown={a.teardown} weighted={a.weighted} comm_hook={a.comm_hook}"
    print(f"{what} returncodes={codes} {verdict} {notes}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
