# SPDX-License-Identifier: Apache-2.0
"""The GPT demo's report (used by ``train_gpt_demo.py``): the resume check, the loss plot and the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpt_demo_model import BITS_PER_NAT

__all__ = ["BITWISE_PLUGINS", "compare_runs", "plot_losses", "print_summary", "write_summary"]

#: plugins whose resume is documented bit-identical at the same world size (stepforge-strategy's README,
#: "Resume guarantees"; tested there in fp32): for these the demo's bound is 0, any difference fails it
BITWISE_PLUGINS = frozenset(
    {"single", "torch_ddp", "torch_fsdp", "gemini", "zero1", "zero2", "low_level_zero"}
)
#: the bound for any other plugin: a relative difference of the per-step loss
OTHER_PLUGIN_RTOL = 1e-4


def compare_runs(reference: dict[str, Any], resumed: dict[str, Any], save_at: int) -> dict[str, Any]:
    """Largest |loss difference| between the uninterrupted run and the resumed one over the steps after
    ``save_at`` (the per-step train losses and the final validation loss), the bound it must meet and whether it
    does. Raises ``ValueError`` when the two runs did not log the same steps (a resume at the wrong iteration)."""
    ref = {h["step"]: h["loss"] for h in reference["history"] if h["step"] > save_at}
    res = {h["step"]: h["loss"] for h in resumed["history"]}
    if sorted(ref) != sorted(res):
        raise ValueError(
            f"the resumed run logged steps {sorted(res)[:3]}..{sorted(res)[-3:]} but the uninterrupted run "
            f"{sorted(ref)[:3]}..{sorted(ref)[-3:]}: the resume did not continue at step {save_at + 1}"
        )
    diffs = [abs(ref[s] - res[s]) for s in ref] + [abs(reference["val_loss"] - resumed["val_loss"])]
    max_diff = max(diffs)
    plugin = reference["plugin"]
    if plugin in BITWISE_PLUGINS:
        bound, kind = 0.0, f"bitwise: {plugin} guarantees a bit-identical resume at the same world size"
    else:
        bound = OTHER_PLUGIN_RTOL * max(abs(v) for v in ref.values())
        kind = f"relative {OTHER_PLUGIN_RTOL:g}: {plugin} documents no bit-identical resume"
    return dict(
        resume_max_abs_diff=max_diff, resume_bound=bound, resume_bound_kind=kind,
        resume_identical=max_diff == 0.0, resume_within_bound=max_diff <= bound, resume_steps_compared=len(ref),
    )  # fmt: skip


def plot_losses(
    out: Path, reference: dict[str, Any], resumed: dict[str, Any], save_at: int, title: str, note: str
) -> str:
    """``out/gpt_demo_loss.png``: the uninterrupted run as a line, the resumed run as markers on top of it, and
    ``note`` (the resume check) in a box. Returns the path, or a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ref_steps = [h["step"] for h in reference["history"]]
    ax.plot(ref_steps, [h["loss"] * BITS_PER_NAT for h in reference["history"]], color="C0", lw=2.5,
            label="uninterrupted run (saves at the checkpoint and goes on)")  # fmt: skip
    ax.plot([h["step"] for h in resumed["history"]], [h["loss"] * BITS_PER_NAT for h in resumed["history"]],
            ls="none", marker="o", ms=4, mfc="none", color="C1",
            label="resumed from the checkpoint in new processes")  # fmt: skip
    ax.axvline(save_at, color="grey", ls="--", lw=1, label=f"checkpoint @ step {save_at}")
    ax.axhline(8.0, color="C3", ls=":", lw=1, label="uniform bytes (8 bits)")
    ax.axhline(reference["unigram_bpb"], color="C2", ls=":", lw=1,
               label=f"unigram baseline ({reference['unigram_bpb']:.2f} bits)")  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="train loss (bits per byte)", title=title)
    ax.set_xlim(0, max(ref_steps) + 1)
    ax.set_ylim(top=max(8.0, ax.get_ylim()[1]) + 0.6)  # room for the note
    ax.legend(fontsize=8, loc="center right")
    # top right: above the uniform line, where the falling curve never is
    ax.text(0.98, 0.97, note, transform=ax.transAxes, fontsize=8, ha="right", va="top",
            bbox=dict(facecolor="white", alpha=0.8))  # fmt: skip
    fig.tight_layout()
    path = out / "gpt_demo_loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def print_summary(summary: dict[str, Any]) -> None:
    """The one-screen summary (every line names what it measures)."""
    s = summary
    print("\n" + "=" * 78)
    print(
        f" ByteGPT demo: {s['n_params'] / 1e6:.2f} M params, {s['steps']} optimizer steps, {s['tokens']:,} tokens"
    )
    print(f" plugin {s['plugin']} ({s['plugin_note']}); precision {s['precision']}; optimizer {s['optimizer']}, "
          f"accumulative_counts={s['accumulative_counts']}; world size {s['world_size']} (torchrun, {s['backend']})")  # fmt: skip
    gpu = f" ({s['gpu']})" if s.get("gpu") else ""
    print(f" device {s['device']}{gpu}")
    print(f" stepforge-fused CPU ISA path: {s['isa']}")
    print(f" resume: checkpoint at step {s['save_at']}, resumed in new processes at iter {s['resumed_at_iter']}; "
          f"largest |loss difference| to the uninterrupted run over {s['resume_steps_compared']} steps "
          f"+ validation = {s['resume_max_abs_diff']:.3g} "
          f"({'bit-identical' if s['resume_identical'] else 'NOT bit-identical'}; bound {s['resume_bound']:g}, "
          f"{s['resume_bound_kind']}) -> {'OK' if s['resume_within_bound'] else 'FAILED'}")  # fmt: skip
    print(f" bits per byte: validation {s['val_bpb']:.3f}, final train {s['final_train_bpb']:.3f} | unigram "
          f"baseline {s['unigram_bpb']:.3f} (byte entropy of the training text) | uniform 8")  # fmt: skip
    print(
        f" throughput {s['tokens_per_s']:,.0f} tokens/s on {s['device']}; optimizer step {s['step_ms']:.1f} ms"
    )
    for r, m in enumerate(s["memory"]):
        cuda = f", peak CUDA memory {m['cuda_peak_mb']:.0f} MB" if m.get("cuda_peak_mb") is not None else ""
        print(f" rank {r}: peak RSS {m['rss_mb']:.0f} MB{cuda}, params {m['param_mb']:.2f} MB, "
              f"optimizer state {m['optim_state_mb']:.2f} MB")  # fmt: skip
    print(f" loss curve: {s['png']}")
    print(" sample:", repr(s["sample"]))
    print("=" * 78)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``out/gpt_demo.json``: the summary's fields, for tests and tools."""
    (out / "gpt_demo.json").write_text(json.dumps(summary, indent=1))
