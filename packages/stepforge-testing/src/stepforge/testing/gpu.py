# SPDX-License-Identifier: Apache-2.0
"""GPU test helpers: a ``requires_cuda`` marker and a pytest hook that turns GPU skips into failures.

Tests that need a CUDA device are marked ``@pytest.mark.gpu`` (or decorated with :data:`requires_cuda`, which
adds the marker and a skip condition). On machines without a device they skip with a reason that says what is
missing. Under ``STEPFORGE_REQUIRE_CUDA=1`` (the ``tests_gpu`` nox session) a skipped ``gpu`` test is reported
as a failure instead, so a GPU job that silently found no device cannot pass.

Wire it into a test directory from its ``conftest.py``::

    from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401

(a non-root conftest may not use ``pytest_plugins``; importing the hook functions registers them for that
directory only).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Mapping
from typing import Any

import pytest
import torch

__all__ = [
    "REQUIRE_CUDA_ENV",
    "cuda_skip_reason",
    "optional_skip",
    "require_cuda_enabled",
    "requires_cuda",
    "pytest_collection_modifyitems",
    "pytest_runtest_makereport",
    "run_on_one_gpu",
    "relative_error",
]

REQUIRE_CUDA_ENV = "STEPFORGE_REQUIRE_CUDA"
# A skip whose reason starts with this prefix is allowed even under STEPFORGE_REQUIRE_CUDA=1 (for example a
# test that needs more device memory than the GPU has); everything else becomes a failure there.
_OPTIONAL_PREFIX = "[optional] "


def require_cuda_enabled() -> bool:
    """Whether ``STEPFORGE_REQUIRE_CUDA`` is set to a true value (``1``, ``true``, ``yes``)."""
    return os.environ.get(REQUIRE_CUDA_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@functools.cache
def cuda_skip_reason() -> str | None:
    """Why CUDA tests cannot run here, or ``None`` when a usable CUDA device is present.

    Returns:
        A one-line reason naming what is missing (a CPU-only torch build, no driver, no device).
    """
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"torch {torch.__version__} is a CPU-only build (no CUDA runtime); install a CUDA build of torch"
        )
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # a broken driver install raises from inside torch
        return f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
    if not available:
        return "no CUDA device visible (torch.cuda.is_available() is False; check the driver and CUDA_VISIBLE_DEVICES)"
    return None


requires_cuda = pytest.mark.gpu
"""Marker for tests that need a CUDA device; the hooks below skip (or fail) them when there is none."""


def optional_skip(reason: str) -> None:
    """Skip a GPU test for a reason that is acceptable even under ``STEPFORGE_REQUIRE_CUDA=1``.

    Args:
        reason: why the test cannot run on this device (e.g. not enough device memory).
    """
    pytest.skip(_OPTIONAL_PREFIX + reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add a skip with the reason from :func:`cuda_skip_reason` to every ``gpu`` test when CUDA is missing."""
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if reason is None:
            reason = cuda_skip_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Under ``STEPFORGE_REQUIRE_CUDA=1``, report a skipped ``gpu`` test as failed (keeping the reason)."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or not require_cuda_enabled() or item.get_closest_marker("gpu") is None:
        return
    if hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if _OPTIONAL_PREFIX.strip() in reason:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{REQUIRE_CUDA_ENV}=1 but this GPU test was skipped: {reason}\n"
        "(a GPU job must run its GPU tests; unset the variable to allow skipping)"
    )


def run_on_one_gpu(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 300.0,
    backend: str = "nccl",
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``fn(0, 1, *args)`` in one spawned process whose default group is a 1-rank NCCL group; its result.

    :func:`stepforge.testing.distributed.run_distributed` with one rank: a fresh process per call (NCCL state
    and the CUDA context never leak between tests), torchrun's variables set (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...), and ``timeout`` seconds for the whole run, also the process-group timeout, so a hung
    collective fails the test. NCCL's bootstrap is pinned to the loopback interface (``NCCL_SOCKET_IFNAME=lo``
    unless set): the GPU machine may have no other network.

    Args:
        fn: a module-level (picklable) function ``fn(rank, world_size, *args)``; return CPU tensors.
        *args: picklable arguments after ``rank`` and ``world_size``.
        timeout: seconds for the whole run.
        backend: the process-group backend (``"gloo"`` runs the same function on the CPU, for trying it out).
        env: extra environment variables for the child.

    Returns:
        What ``fn`` returned.
    """
    from stepforge.testing.distributed import run_distributed

    child_env = {
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        **(dict(env) if env else {}),
    }
    return run_distributed(fn, 1, *args, timeout=timeout, backend=backend, env=child_env)[0]


def relative_error(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]
) -> float:
    """How far ``got`` is from ``expected``, relative to how far training moved ``expected`` from ``start``.

    ``||got - expected|| / ||expected - start||`` over all tensors together (fp32). A step that does nothing
    scores 1.0 (``got == start``), an exact one 0.0: a bound well below 1 fails a do-nothing implementation
    while leaving room for bf16/fp16 rounding.

    Args:
        got: name -> tensor (any dtype or device) after the steps under test.
        expected: name -> tensor of the reference run, same names and shapes.
        start: name -> the tensors before the first step.

    Raises:
        ValueError: the names differ, or the reference did not move (the ratio would mean nothing).
    """
    if set(got) != set(expected) or set(expected) != set(start):
        raise ValueError(
            f"relative_error: names differ: {sorted(got)} / {sorted(expected)} / {sorted(start)}"
        )
    err = moved = 0.0
    for name, ref in expected.items():
        ref32 = ref.detach().float().cpu()
        err += float((got[name].detach().float().cpu() - ref32).square().sum())
        moved += float((ref32 - start[name].detach().float().cpu()).square().sum())
    if moved == 0.0:
        raise ValueError("relative_error: the reference did not move from start; nothing to compare against")
    return float((err / moved) ** 0.5)
