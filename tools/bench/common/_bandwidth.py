# SPDX-License-Identifier: Apache-2.0
"""Memory bandwidth the optimizer kernels are judged against (see tools/bench/README.md).

:func:`adam_pattern_ceiling` measures the Adam access pattern with trivial math (the ceiling of a memory-bound
Adam kernel); :func:`triad_bandwidth` a STREAM-like triad. Imported by the scripts as ``_bandwidth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common._timing import time_interleaved

__all__ = ["ADAM_PATTERN_BYTES", "TRIAD_BYTES", "adam_pattern_ceiling", "triad_bandwidth"]

ADAM_PATTERN_BYTES = 28  # fp32 p, g, m, v read (16 B) + p, m, v written back in place (12 B)
TRIAD_BYTES = 12  # STREAM convention: b, c read + a written (the write-allocate read is not counted)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def adam_pattern_ceiling(
    n: int = 50_000_000,
    *,
    threads: int = 2,
    repeats: int = 5,
    chunks: Sequence[int] = (32_768, 65_536, 131_072),
) -> dict[str, Any]:
    """Bandwidth of the Adam access pattern with trivial math: the ceiling for a memory-bound Adam kernel.

    Per element four fp32 arrays ``p, g, m, v`` are read once from DRAM and ``p, m, v`` written back in place
    (28 B). Each of ``threads`` Python threads walks its own contiguous slice in cache-sized chunks and runs
    ``m += g; v += g; p += m`` on each chunk with numpy (which releases the GIL): the second and third
    touches hit L2, so DRAM sees exactly the 4-read/3-write pattern. The best chunk size wins (a ceiling).

    Returns:
        ``{"gb_per_s", "ms", "elements", "bytes_per_element", "threads", "chunk", "by_chunk"}``.
    """
    import numpy as np
    import torch

    # torch-allocated memory viewed by numpy: the page size the optimizers' tensors have (numpy itself would
    # ask for transparent huge pages on large arrays, torch does not unless THP_MEM_ALLOC_ENABLE=1)
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = (torch.randn(n, generator=gen).mul_(1e-3).numpy() for _ in range(4))

    def work(lo: int, hi: int, chunk: int) -> None:
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            pb, gb, mb, vb = p[s:e], g[s:e], m[s:e], v[s:e]
            np.add(mb, gb, out=mb)
            np.add(vb, gb, out=vb)
            np.add(pb, mb, out=pb)

    by_chunk: dict[int, float] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for chunk in chunks:

            def run(chunk: int = chunk) -> None:
                for f in [pool.submit(work, lo, hi, chunk) for lo, hi in _split(n, threads)]:
                    f.result()

            by_chunk[chunk] = time_interleaved({"x": run}, warmup=1, repeats=repeats)["x"].median_ms
    best = min(by_chunk, key=by_chunk.__getitem__)
    ms = by_chunk[best]
    return {
        "gb_per_s": ADAM_PATTERN_BYTES * n / (ms * 1e-3) / 1e9,
        "ms": ms,
        "elements": n,
        "bytes_per_element": ADAM_PATTERN_BYTES,
        "threads": threads,
        "chunk": best,
        "by_chunk_ms": {str(k): v for k, v in by_chunk.items()},
        "method": "numpy m+=g; v+=g; p+=m on L2-sized chunks of torch-allocated arrays, one thread per core",
    }


def triad_bandwidth(n: int = 50_000_000, *, threads: int = 2, repeats: int = 5) -> dict[str, Any]:
    """STREAM-like triad ``a = b + s * c`` (fp32), counted as 12 B per element, two ways.

    ``numpy``: one Python thread per core over its slice, ``s * c`` into an L1-sized scratch buffer first.
    ``torch``: ``torch.add(b, c, alpha=s, out=a)`` on the whole arrays (torch's own threading).

    Returns:
        ``{"gb_per_s"(best of both), "numpy_gb_per_s", "torch_gb_per_s", ...}``.
    """
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(1)
    a = torch.zeros(n).numpy()  # torch-allocated, as in adam_pattern_ceiling
    b = torch.randn(n, generator=gen).numpy()
    c = torch.randn(n, generator=gen).numpy()
    chunk = 65_536

    def work(lo: int, hi: int) -> None:
        tmp = np.empty(chunk, dtype=np.float32)
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            t = tmp[: e - s]
            np.multiply(c[s:e], np.float32(3.0), out=t)
            np.add(b[s:e], t, out=a[s:e])

    ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
    with ThreadPoolExecutor(max_workers=threads) as pool:

        def run_np() -> None:
            for f in [pool.submit(work, lo, hi) for lo, hi in _split(n, threads)]:
                f.result()

        t = time_interleaved(
            {"numpy": run_np, "torch": lambda: torch.add(tb, tc, alpha=3.0, out=ta)},
            warmup=1,
            repeats=repeats,
        )
    gbs = {k: TRIAD_BYTES * n / (v.median_ms * 1e-3) / 1e9 for k, v in t.items()}
    return {
        "gb_per_s": max(gbs.values()),
        "numpy_gb_per_s": gbs["numpy"],
        "torch_gb_per_s": gbs["torch"],
        "elements": n,
        "bytes_per_element": TRIAD_BYTES,
        "threads": threads,
    }
