# SPDX-License-Identifier: Apache-2.0
"""Parts of ``bench_zero.py``: the GPT-shaped model it trains and the byte counter it charges every collective to
(ring cost per rank, see ``bench_zero.py``'s docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Block",
    "GPT",
    "Counter",
    "nbytes",
    "install_counter",
    "ddp_counting_hook",
    "reset_peak_rss",
    "peak_rss_mib",
    "save_plot",
]


# ---------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------------------
# byte counting
# ---------------------------------------------------------------------------------------------------------
class Counter:
    """Per-rank bytes of every collective call, charged at the ring cost (see the module docstring)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.reset()

    def reset(self) -> None:
        self.ring_bytes = 0.0
        self.payload_bytes = 0.0
        self.calls: dict[str, int] = {}

    def add(self, op: str, nbytes: float) -> None:
        n = self.world
        # all_to_all is charged what it sends to the other ranks (see _all_to_all_sent): factor 1
        factor = {"all_reduce": 2 * (n - 1) / n, "all_to_all": 1.0}.get(op, (n - 1) / n)
        self.ring_bytes += factor * nbytes
        self.payload_bytes += nbytes
        self.calls[op] = self.calls.get(op, 0) + 1


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def _all_to_all_sent(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Bytes an ``all_to_all_single`` call sends to other ranks: its input less the split it keeps for itself
    (equal splits when none are given)."""
    data = args[1] if len(args) > 1 else kwargs["input"]
    splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
    world = dist.get_world_size(kwargs.get("group"))
    if not splits:
        return nbytes(data) * (world - 1) / world
    own = splits[dist.get_rank(kwargs.get("group"))]
    return nbytes(data) * (1 - own / data.shape[0])


def install_counter(counter: Counter) -> dict[str, Any]:
    """Wrap the ``torch.distributed`` collectives so that every call is counted before it runs.

    Returns the original functions by name.
    """
    specs = {
        "all_reduce": ("all_reduce", lambda a, k: nbytes(a[0] if a else k["tensor"])),
        "broadcast": ("broadcast", lambda a, k: nbytes(a[0] if a else k["tensor"])),
        "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: nbytes(a[1] if len(a) > 1 else k["input"])),
        "all_gather_into_tensor": (
            "all_gather",
            lambda a, k: nbytes(a[0] if a else k["output_tensor"]),
        ),
        # torch 2.13's preferred names for the two above (FSDP2 and stepforge.zero call these when present)
        "reduce_scatter_single": ("reduce_scatter", lambda a, k: nbytes(a[1] if len(a) > 1 else k["input"])),
        "all_gather_single": ("all_gather", lambda a, k: nbytes(a[0] if a else k["output_tensor"])),
        "all_gather": ("all_gather", lambda a, k: sum(nbytes(t) for t in (a[0] if a else k["tensor_list"]))),
        # stepforge.zero's "all_to_all" reduce-scatter: each rank sends the other ranks' rows of its bucket
        "all_to_all_single": ("all_to_all", _all_to_all_sent),
        "reduce_scatter": (
            "reduce_scatter",
            lambda a, k: sum(nbytes(t) for t in (a[1] if len(a) > 1 else k["input_list"])),
        ),
    }
    originals = {}
    for name, (op, size) in specs.items():
        if not hasattr(dist, name):
            continue
        original = originals[name] = getattr(dist, name)

        def wrapped(*args: Any, _original=original, _op=op, _size=size, **kwargs: Any) -> Any:
            counter.add(_op, _size(args, kwargs))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
        setattr(dist.distributed_c10d, name, wrapped)
    return originals


def ddp_counting_hook(counter: Counter, all_reduce: Any):
    """DDP's default all-reduce (divide by the world size, then sum), counted once here (``all_reduce`` is
    the unwrapped function)."""

    # no annotations: DDP checks them, and this module's are strings (from __future__ import annotations)
    def hook(process_group, bucket):
        buffer = bucket.buffer()
        counter.add("all_reduce", nbytes(buffer))
        buffer.div_(counter.world)
        work = all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


# ---------------------------------------------------------------------------------------------------------
# memory and plot
# ---------------------------------------------------------------------------------------------------------
def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (``/proc/self/clear_refs``, Linux); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """The peak RSS since the last :func:`reset_peak_rss` (``VmHWM``), else since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_plot(path: Path, rows: list[dict[str, Any]], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * len(rows) + 2.4), sharey=True)
    labels = [f"{r['scheme']} N={r['world']}" for r in rows]
    y = list(range(len(rows)))
    panels = (
        ("step_ms_median", "step time, ms (median, slowest rank)", None),
        ("sent_mib_per_rank", "MiB sent per rank per step (bar) / theory (tick)", "theory_mib_per_rank"),
        ("state_mib_per_rank", "grad + optimizer state + master MiB per rank", None),
    )
    for ax, (key, label, tick) in zip(axes, panels, strict=True):
        ax.barh(y, [r[key] for r in rows], color="tab:blue")
        for yi, r in zip(y, rows, strict=True):
            ax.text(r[key], yi, f" {r[key]:.0f}", va="center", fontsize=8)
            if tick:
                ax.plot([r[tick]] * 2, [yi - 0.4, yi + 0.4], color="black", lw=2)
        ax.set_xlabel(label, fontsize=9)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
