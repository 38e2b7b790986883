# SPDX-License-Identifier: Apache-2.0
"""``stepforge-estimate``: memory per rank and bytes per step of several plugins side by side, before launch.

::

    stepforge-estimate gpt-7b --world-size 64 --precision bf16 --optimizer AdamW \\
        --batch 1 --seq-len 2048 --device-memory 80GiB --host-memory 256GiB
    stepforge-estimate mypkg.models:build --plugin zero2 --plugin "zero2:cpu_offload=True" --format json
    stepforge-estimate gpt-7b --world-size 64 --accumulation-steps 4 --batch 1 --seq-len 2048
    stepforge-estimate --what-fits > docs/what-fits.md

The model is a GPT shape (``gpt-1.3b``, ``gpt-7b``, ``gpt-70b``), an importable factory ``package.module:function``
(called on the meta device) or ``hf:<config name or path>`` (a transformers config). ``--plugin`` (repeatable)
is a registry name with optional settings, ``name:key=value,...`` (Python literals); by default every plugin.
With ``--batch``/``--seq-len`` an int64 token batch is traced for activations; ``--accumulation-steps N`` plans
N micro-batches per optimizer step (the gradients each plugin keeps between them, under its ``no_sync``, count
in the peak and in a "between micro-batches" row). ``--device-memory`` and
``--host-memory`` add a "fits" row; the exit status is 0 when at least one plugin fits (or none was asked), 3
when none does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ._compare import estimate_plugins
from ._specs import DEFAULT_PLUGINS, load_model, parse_size
from ._table import estimate_table, markdown_table

__all__ = ["main", "parser", "estimate_plugins"]

#: exit status when no plugin fits the given memory
NONE_FITS = 3


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(
        prog="stepforge-estimate",
        description="Memory per rank (device and host) and bytes communicated per step, for several plugins.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("::", 1)[1].split("The model is", 1)[0] if __doc__ else None,
    )
    p.add_argument(
        "model", nargs="?", help="gpt-1.3b | gpt-7b | gpt-70b | package.module:factory | hf:<config>"
    )
    p.add_argument("--plugin", action="append", help="name[:key=value,...]; repeat (default: every plugin)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0, help="the rank described (0 holds the most)")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    p.add_argument("--optimizer", default="AdamW", help="a registered optimizer name, or 'none'")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--momentum", type=float, default=None, help="for SGD/Lars")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size per rank (traces activations)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (with --batch)")
    p.add_argument(
        "--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step (default 1)"
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="estimate with every block's activations recomputed in backward (with --batch)",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu: the device being planned for")
    p.add_argument("--backend", default=None, help="nccl or gloo (default: by device)")
    p.add_argument("--device-memory", type=parse_size, default=None, help="e.g. 80GiB: say which fit")
    p.add_argument("--host-memory", type=parse_size, default=None, help="host memory per rank, e.g. 256GiB")
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    p.add_argument("--what-fits", action="store_true", help="print the docs page docs/what-fits.md")
    p.add_argument(
        "--accuracy",
        nargs="+",
        default=None,
        help="with --what-fits: the bench_estimate JSON results to quote",
    )
    p.add_argument("--out", default=None, help="write to this file instead of standard output")
    return p


def _optimizer(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.optimizer.lower() == "none":
        return None
    config: dict[str, Any] = dict(type=args.optimizer, lr=args.lr)
    if args.momentum is not None:
        config["momentum"] = args.momentum
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args = parser().parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout  # closed below
    try:
        return _run(args, out)
    finally:
        if args.out:
            out.close()


def _run(args: argparse.Namespace, out: Any) -> int:
    if args.what_fits:
        from ._what_fits import what_fits_page

        out.write(what_fits_page(accuracy=args.accuracy))
        return 0
    if args.model is None:
        parser().error("a model is needed (or --what-fits)")
    if (args.batch is None) != (args.seq_len is None):
        parser().error("--batch and --seq-len go together")
    if args.accumulation_steps < 1:
        parser().error(f"--accumulation-steps must be >= 1, got {args.accumulation_steps}")
    model = load_model(args.model)
    inputs = None
    if args.batch is not None:
        inputs = torch.zeros((args.batch, args.seq_len), dtype=torch.int64, device="meta")  # token ids
    estimates = estimate_plugins(
        model,
        args.plugin or DEFAULT_PLUGINS,
        world_size=args.world_size,
        precision=args.precision,
        optimizer=_optimizer(args),
        inputs=inputs,
        device=args.device,
        backend=args.backend,
        rank=args.rank,
        accumulation_steps=args.accumulation_steps,
        activation_checkpointing=args.activation_checkpointing,
    )
    checked = args.device_memory is not None or args.host_memory is not None
    fits = [e.fits(args.device_memory, args.host_memory) for e in estimates] if checked else None
    if args.format == "json":
        payload = [dict(e.to_dict(), fits=None if fits is None else fits[i]) for i, e in enumerate(estimates)]
        out.write(json.dumps(payload, indent=2) + "\n")
    elif args.format == "markdown":
        out.write(markdown_table(estimates, fits=fits) + "\n")
    else:
        out.write(estimate_table(estimates, fits=fits) + "\n")
    return NONE_FITS if fits is not None and not any(fits) else 0


if __name__ == "__main__":
    raise SystemExit(main())
