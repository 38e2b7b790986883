# SPDX-License-Identifier: Apache-2.0
"""``stepforge-estimate``: memory per rank and bytes per step of several plugins side by side, before launch.

::

    stepforge-estimate gpt-7b --world-size 64 --precision bf16 --optimizer AdamW \\
        --batch 1 --seq-len 2048 --device-memory 80GiB --host-memory 256GiB
    stepforge-estimate mypkg.models:build --plugin zero2 --plugin "zero2:cpu_offload=True" --format json
    stepforge-estimate gpt-7b --world-size 64 --accumulation-steps 4 --batch 1 --seq-len 2048
    stepforge-estimate --what-fits > docs/what-fits.md

The model is a GPT shape (``gpt-1.3b``, ``gpt-7b``, ``gpt-70b``), an importable factory ``package.module:function``
(called on the meta device) or ``hf:<config name or folder>`` (a transformers config from a folder or the local
Hugging Face cache; the network is never used). ``--plugin`` (repeatable) is a registry name with optional
settings, ``name:key=value,...`` (Python literals); by default every plugin. ``--optimizer`` is a registered name,
``none``, or a factory ``package.module:function`` that builds the optimizer from the parameters it is given.
With ``--batch``/``--seq-len`` an int64 token batch is traced for activations; a GPT shape without them traces
batch 1 at its context length (2048 tokens), and any other model gets no activations and "fits: unknown".
``--accumulation-steps N`` plans N micro-batches per optimizer step (the gradients each plugin keeps between
them, under its ``no_sync``, count in the peak and in a "window" column). ``--device-memory`` and
``--host-memory`` add a "fits" column; the exit status is 0 when at least one plugin fits or may fit (or none was
asked), 3 when none does, 2 for a bad argument (one line on standard error: ``stepforge-estimate: error: <what>
(<the fix>)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from stepforge.core import OPTIMIZERS, PLUGINS, OptimizerStateError, StepforgeError, UnknownNameError

from ._compare import estimate_plugins
from ._estimate import make_plugin
from ._specs import DEFAULT_PLUGINS, import_factory, load_model, parse_plugin, parse_size
from ._table import estimate_table, markdown_table
from .gpt import GPT_SHAPES

__all__ = ["main", "parser", "estimate_plugins"]

#: exit status when no plugin fits the given memory
NONE_FITS = 3
#: exit status of a bad argument (argparse's)
USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, with every error one line: ``stepforge-estimate: error: <what> (<the fix>)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        fix = "" if message.endswith(")") else " (see stepforge-estimate --help)"
        self.exit(USAGE, f"{self.prog}: error: {message}{fix}\n")


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = _Parser(
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
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"), help="default bf16")
    p.add_argument(
        "--optimizer", default="AdamW", help="a registered name, 'none', or package.module:factory(params)"
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--momentum", type=float, default=None, help="for SGD/Lars")
    p.add_argument(
        "--batch", type=int, default=None, help="micro-batch per rank (traces activations; GPT default 1)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (GPT default: its context)")
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


def _optimizer(name: str, lr: float, momentum: float | None, model: torch.nn.Module) -> Any:
    """``--optimizer``: ``None`` for ``none``, a config of a registered name, or what a factory builds from the
    model's parameters."""
    if name.lower() == "none":
        return None
    if ":" in name:
        built = import_factory(name, "optimizer")(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer factory {name!r} returned {type(built).__name__} (return a torch.optim.Optimizer "
                "built from the parameters it is given)"
            )
        return built
    try:
        OPTIMIZERS.get(name)
    except UnknownNameError:
        raise ValueError(
            f"unknown optimizer {name!r} (available: {', '.join(OPTIMIZERS.names())}; none; or "
            "package.module:factory building one from the parameters it is given)"
        ) from None
    config: dict[str, Any] = dict(type=name, lr=lr)
    if momentum is not None:
        config["momentum"] = momentum
    return config


def _plugins(specs: Sequence[str], args: argparse.Namespace) -> list[str]:
    """``--plugin`` specs, each checked by building it as the estimate will."""
    for spec in specs:
        name, kwargs = parse_plugin(spec)
        try:
            PLUGINS.get(name)
        except UnknownNameError:
            raise ValueError(f"unknown plugin {name!r} (available: {', '.join(PLUGINS.names())})") from None
        try:
            make_plugin(name, device=args.device, precision=args.precision, **kwargs)
        except (TypeError, ValueError, StepforgeError) as exc:
            raise ValueError(
                f"--plugin {spec!r}: {str(exc).rstrip('.')} (see the plugin's settings)"
            ) from exc
    return list(specs)


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Refuse (one line, exit status 2) what argparse's types cannot."""
    if args.model is None:
        p.error("a model is needed (a GPT shape, package.module:factory or hf:<config>; or --what-fits)")
    if (args.batch is None) != (args.seq_len is None):
        p.error("--batch and --seq-len go together (give both, or neither)")
    counts = {
        "--world-size": (args.world_size, "the number of ranks to plan for"),
        "--accumulation-steps": (args.accumulation_steps, "micro-batches per optimizer step"),
        "--batch": (args.batch, "samples per micro-batch"),
        "--seq-len": (args.seq_len, "tokens per sample"),
    }
    for flag, (value, meaning) in counts.items():
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value} ({meaning})")
    if not 0 <= args.rank < args.world_size:
        p.error(f"--rank must lie in [0, {args.world_size}), got {args.rank} (rank 0 holds the most)")


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor | None, str | None]:
    """The example token batch and, when it is the default, the sentence that says so."""
    if args.batch is not None:
        return torch.zeros((args.batch, args.seq_len), dtype=torch.int64, device="meta"), None
    shape = GPT_SHAPES.get(args.model)
    if shape is None:
        return None, None
    note = (
        f"activations: batch 1 x {shape.context} tokens ({args.model}'s context; --batch/--seq-len to change)"
    )
    return torch.zeros((1, shape.context), dtype=torch.int64, device="meta"), note


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 with one line on standard error for a bad argument)."""
    p = parser()
    args = p.parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout  # closed below
    try:
        return _run(args, p, out)
    finally:
        if args.out:
            out.close()


def _run(args: argparse.Namespace, p: argparse.ArgumentParser, out: Any) -> int:
    if args.what_fits:
        from ._what_fits import what_fits_page

        out.write(what_fits_page(accuracy=args.accuracy))
        return 0
    _check(args, p)
    try:
        model = load_model(args.model)
        optimizer = _optimizer(args.optimizer, args.lr, args.momentum, model)
        plugins = _plugins(args.plugin or DEFAULT_PLUGINS, args)
    except (ValueError, ImportError, TypeError, StepforgeError) as exc:
        p.error(str(exc))
    inputs, note = _inputs(args)
    try:
        estimates = estimate_plugins(
            model,
            plugins,
            world_size=args.world_size,
            precision=args.precision,
            optimizer=optimizer,
            inputs=inputs,
            device=args.device,
            backend=args.backend,
            rank=args.rank,
            accumulation_steps=args.accumulation_steps,
            activation_checkpointing=args.activation_checkpointing,
        )
    except StepforgeError as exc:  # the optimizer's state cannot be read, a setting a plan refuses
        p.error(f"--optimizer {args.optimizer}: {exc}" if isinstance(exc, OptimizerStateError) else str(exc))
    checked = args.device_memory is not None or args.host_memory is not None
    fits = [_fits(e, args.device_memory, args.host_memory) for e in estimates] if checked else None
    if args.format == "json":
        payload = [
            dict(e.to_dict(), fits=None if fits is None else "unknown" if fits[i] is None else fits[i])
            for i, e in enumerate(estimates)
        ]
        out.write(json.dumps(payload, indent=2) + "\n")
    elif args.format == "markdown":
        out.write(markdown_table(estimates, fits=fits) + "\n" + (f"\n{note}\n" if note else ""))
    else:
        out.write(estimate_table(estimates, fits=fits) + "\n" + (f"{note}\n" if note else ""))
    return NONE_FITS if fits is not None and all(f is False for f in fits) else 0


def _fits(est: Any, device: int | None, host: int | None) -> bool | None:
    """Whether ``est`` fits; ``None`` (unknown) when its model states fit but its activations were not traced."""
    fits: bool = est.fits(device, host)
    return None if fits and est.activations is None else fits


if __name__ == "__main__":
    raise SystemExit(main())
