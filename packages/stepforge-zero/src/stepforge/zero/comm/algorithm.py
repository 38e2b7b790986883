# SPDX-License-Identifier: Apache-2.0
"""Which collectives move gradients and parameters, and the bucket size: chosen per backend (the rules take the
backend's name, so a memory plan applies them without a live group), or forced for tests and benchmarks.

Both algorithms leave every rank with the same averaged pieces (bucket laid out rank-major, divided by the world
size before the sum):

- ``"reduce_scatter"``: ``reduce_scatter_tensor`` -- each rank receives only its row. The fewest bytes
  ((N-1)/N of the bucket per rank on a ring); NCCL's is as fast as its all-reduce per byte, so it is the
  choice there.
- ``"all_reduce"``: ``all_reduce`` of the whole bucket, then each rank reads its pieces out of it and the bucket
  is reused, so between steps a rank still holds only its pieces. Twice the ring bytes of a reduce-scatter;
  gloo's all-reduce is still about twice as fast as its own reduce-scatter on the CPU (208 MiB, 2 ranks: 147 ms
  against 274 ms; see ``tools/bench/zero/bench_zero.py``'s collective table).
- ``"all_to_all"``: a reduce-scatter made of ``all_to_all_single`` (rank ``r`` receives every other rank's row
  ``r``; its own row stays put) and a local sum of the ``N`` rows: the reduce-scatter's (N-1)/N bytes, moved by
  gloo's pairwise exchange, which is about twice as fast as its all-reduce (2 ranks, 32 MiB: 17.7 ms against
  31.4 ms; 4 ranks: 39.1 against 93.6 ms). Costs a receive buffer of (N-1)/N of the bucket while it is in flight.

``"auto"`` picks ``all_to_all`` on gloo, elsewhere ``all_reduce`` for stage 1 (ColossalAI's stage-1 arithmetic)
and ``reduce_scatter`` for stage 2 (NCCL's reduce-scatter is as fast per byte as its all-reduce). The environment variable ``STEPFORGE_ZERO_COMM_ALGORITHM`` overrides ``"auto"`` (not an
explicit argument), so a plugin-built optimizer can be forced too.
"""

from __future__ import annotations

import os
from typing import Any

from stepforge.core import HyperParameterError

__all__ = [
    "COMM_ALGORITHMS",
    "COMM_ALGORITHM_ENV",
    "COLOSSAL_BUCKET_SIZE",
    "COLOSSAL_OPTIMIZER_BUCKET_SIZE",
    "GLOO_BUCKET_SIZE",
    "check_comm_algorithm",
    "comm_algorithm_for",
    "bucket_size_for",
    "param_gather_for",
]

COMM_ALGORITHMS = ("auto", "all_reduce", "reduce_scatter", "all_to_all")
COMM_ALGORITHM_ENV = "STEPFORGE_ZERO_COMM_ALGORITHM"

#: ColossalAI's ``reduce_bucket_size`` (elements) of ``LowLevelZeroPlugin`` (``reduce_bucket_size_in_m=12``) and of
#: ``LowLevelZeroOptimizer`` itself: the defaults off gloo
COLOSSAL_BUCKET_SIZE = 12 * 1024**2
COLOSSAL_OPTIMIZER_BUCKET_SIZE = 1024**2
#: the default on gloo (elements). ``tools/bench/zero/bench_zero.py`` times gloo's all-reduce at 16 MiB as fast per
#: byte as at 48 or 100 MiB (2 ranks: 16.8 ms against 48.3 ms for three times the bytes), and a smaller bucket
#: leaves less of the reduction for after backward: zero2 on the bench's GPT ran 0.93x DDP with it, 1.48x with
#: ColossalAI's 12 Mi elements (2 ranks, same run).
GLOO_BUCKET_SIZE = 4 * 1024**2


def bucket_size_for(backend: str | None, world_size: int, *, elsewhere: int = COLOSSAL_BUCKET_SIZE) -> int:
    """The default ``reduce_bucket_size``: :data:`GLOO_BUCKET_SIZE` on gloo over several ranks, else ``elsewhere``
    (the caller's ColossalAI default)."""
    return GLOO_BUCKET_SIZE if world_size > 1 and backend == "gloo" else elsewhere


def check_comm_algorithm(value: Any, *, source: str = "comm_algorithm") -> str:
    """``value`` if it is one of :data:`COMM_ALGORITHMS`, else a :class:`HyperParameterError` naming ``source``."""
    if value not in COMM_ALGORITHMS:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: {source} must be one of {', '.join(map(repr, COMM_ALGORITHMS))}, got "
            f"{value!r}."
        )
    return str(value)


def comm_algorithm_for(value: str, *, stage: int, world_size: int, backend: str | None) -> str:
    """The concrete algorithm for ``value`` on ``world_size`` ranks on ``backend`` (see the module doc)."""
    check_comm_algorithm(value)
    if value == "auto":
        forced = os.environ.get(COMM_ALGORITHM_ENV, "").strip()
        if forced:
            value = check_comm_algorithm(forced, source=f"the environment variable {COMM_ALGORITHM_ENV}")
    if value != "auto":
        return value
    if world_size > 1 and backend == "gloo":
        return "all_to_all"
    return "all_reduce" if stage == 1 else "reduce_scatter"


def param_gather_for(backend: str | None) -> str:
    """The automatic ``param_gather`` on ``backend`` (``None``: one rank): ``"broadcast"`` on gloo (several times
    faster than gloo's all-gather on the CPU), else ``"all_gather"``."""
    return "broadcast" if backend == "gloo" else "all_gather"
