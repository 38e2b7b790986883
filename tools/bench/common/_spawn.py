# SPDX-License-Identifier: Apache-2.0
"""Shared by the benches that start N gloo processes: a free port for the rendezvous, and the way out of a rank.

A rank that returns to the interpreter while gloo's threads are still alive can abort at exit ("terminate called
without an active exception", SIGABRT), which fails a bench whose numbers were already written. The exit here is
the one ``stepforge.testing.distributed`` uses: the caller first drops what holds the group (DDP models,
optimizers, work handles), then this collects reference cycles, meets at a barrier, destroys the group while the
interpreter is alive and leaves through ``os._exit(0)``.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch.distributed as dist

__all__ = ["free_port", "leave_process_group"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def leave_process_group() -> None:
    """End this rank: gc, barrier, ``destroy_process_group``, flush, ``os._exit(0)``. Never returns."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
