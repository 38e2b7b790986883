# SPDX-License-Identifier: Apache-2.0
"""CPU benchmark of stepforge-fused's optimizers against the best torch equivalents, side by side in one run.

    python tools/bench/fused/bench_fused_cpu.py                 # full run (~3-6 min on 2 cores)
    python tools/bench/fused/bench_fused_cpu.py --quick         # smaller sizes, 3 repeats: a smoke run (~30 s)
    python tools/bench/fused/bench_fused_cpu.py --cases adam,bitident --threads 2 --repeats 15 --out bench-out

What it measures (fp32 unless said; every contender gets the same initial values and gradients):

- the memory-bandwidth ceiling of the Adam access pattern (4 reads + 3 in-place writes, trivial math) and a
  STREAM-like triad and copy (each row shows its GB/s as % of each), so each kernel's effective GB/s can be
  read as a fraction of what the machine can move;
- ``adam``: ``CPUAdam`` vs ``torch.optim.AdamW(fused=True)`` (and ``foreach=True``) on one 50M-element tensor,
  on 2 000 x 10 000 and on 20 000 x 1 000 tensors;
- ``mixed``: bf16 params and grads with fp32 masters, ``CPUAdam(master_weights=True)`` vs the best torch
  composition (copy the bf16 grad into an fp32 master grad, fused AdamW on the masters, copy back to bf16);
- ``lamb``: ``FusedLAMB`` vs the pure-Python ``stepforge.optim.Lamb``;
- ``sgd``: ``FusedSGD`` (momentum 0.9) vs ``torch.optim.SGD(fused=True)``;
- ``fusedadam``: ``FusedAdam`` vs ``torch.optim.AdamW(fused=True)``;
- ``bitident``: ``FusedAdam``/``CPUAdam`` vs ``torch.optim.AdamW(fused=True)``, ``FusedSGD`` vs torch's for-loop
  ``SGD`` after a few steps, ``torch.equal`` (see ``_bitident.py``).

Gradients. The headline rows reuse the same ``p.grad`` tensors every step, refreshed in place -- what a loop with
``zero_grad(set_to_none=False)`` or gradients living in a DDP/ZeRO bucket has. Rows marked ``fresh`` hand the
optimizer a different set of gradient tensors (other objects at other addresses) on every step, as
``zero_grad(set_to_none=True)`` + ``backward()`` does; this catches a kernel whose pointer cache only pays off
when nothing changes. Creating those tensors is not timed.

Only ``optimizer.step()`` is timed: contenders run round-robin, median of ``--repeats`` after ``--warmup`` steps.
Effective GB/s = minimum bytes an ideal kernel moves / time (Adam fp32: 28 B per element; see tools/bench/README.md).
Results: a table on stdout, ``<out>/<stem>.json`` and ``<out>/<stem>.png``.

Layout: this file (options, the run, the JSON); ``_parts.py`` (sizes, tensors, one timed comparison, rows);
``_cases.py`` (the timed case groups); ``_bitident.py`` (``bitident``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _bandwidth, _machine, _report, _timing
from bench.fused._bitident import bit_identity
from bench.fused._cases import adam_cases, fusedadam_cases, lamb_cases, mixed_cases, sgd_cases
from bench.fused._parts import (
    BYTES,
    CASE_GROUPS,
    COLUMNS,
    FULL,
    HP,
    QUICK,
    apply_ceiling,
    copy_bandwidth,
    decorate,
    import_fused,
)

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): one warm-up-free timed step per contender, so every
#: code path runs, in seconds; no timing is judged
SMOKE_ARGS = ("--quick", "--no-plot", "--repeats", "1", "--warmup", "0", "--out", "{out}")


def _parse_cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASE_GROUPS]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; choose from {', '.join(CASE_GROUPS)} (comma separated)")
    return cases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and 3 repeats: a smoke run")
    p.add_argument(
        "--cases", default=",".join(CASE_GROUPS), help=f"comma-separated subset of {','.join(CASE_GROUPS)}"
    )
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: all usable cores)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed steps per contender (default 10, quick 3)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="output folder for JSON + PNG (default bench-out/)")
    p.add_argument("--stem", default=None, help="output file stem (default cpu-<date>-fused[-quick])")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    cases = _parse_cases(args.cases)
    sizes = QUICK if args.quick else FULL
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    threads = _timing.configure_threads(args.threads)
    started = time.perf_counter()
    info = _machine.machine_info(threads)
    print(f"machine: {info['device']}; torch {info['torch']}; threads {threads}; load {info['load_average']}")

    fused, err = import_fused()
    if fused is not None:
        features = getattr(fused, "cpu_features", None)
        try:
            info["stepforge_fused_cpu"] = features() if callable(features) else None
        except Exception as exc:  # a broken extension shows up in the rows below too
            info["stepforge_fused_cpu"] = f"{type(exc).__name__}: {exc}"
        print(
            f"stepforge.fused {info['stepforge'].get('stepforge-fused')} from {Path(fused.__file__ or '?').parent}"
        )
    else:
        print(f"WARNING: {err}; only the torch baselines run (ours columns stay empty).")

    print("measuring the bandwidth ceiling ...", flush=True)
    ceiling = _bandwidth.adam_pattern_ceiling(
        sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2)
    )
    triad = _bandwidth.triad_bandwidth(sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2))
    copy = copy_bandwidth(sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2))
    cgbs = ceiling["gb_per_s"]
    print(f"  STREAM-like copy: {copy['gb_per_s']:.1f} GB/s")
    print(
        f"  Adam-pattern ceiling (4R+3W, trivial math): {cgbs:.1f} GB/s   "
        f"triad: {triad['gb_per_s']:.1f} GB/s (numpy {triad['numpy_gb_per_s']:.1f}, torch {triad['torch_gb_per_s']:.1f})"
    )

    rows: list[dict[str, Any]] = []
    runners = {
        "adam": adam_cases,
        "mixed": mixed_cases,
        "lamb": lamb_cases,
        "sgd": sgd_cases,
        "fusedadam": fusedadam_cases,
    }
    identity: list[dict[str, Any]] = []
    for case in cases:
        print(f"[{case}]", flush=True)
        if case == "bitident":
            identity = bit_identity(args, fused, err)
            for r in identity:
                state = {True: "IDENTICAL", False: "DIFFERENT", None: "not run"}[r["equal"]]
                detail = r.get("error") or (
                    f"{r['mismatched_elements']} of {r['compared_elements']} differ, "
                    f"max |diff| {r['max_abs_diff']:.3g}, max rel {r['max_rel_diff']:.3g}"
                )
                want = "expected" if r["bit_identity_expected"] else "not expected"
                print(f"  {r['optimizer']} vs {r['reference']}: {state} [bit identity {want}] ({detail})")
        else:
            rows.extend(runners[case](args, sizes, cgbs, fused, err))
        gc.collect()

    # A ceiling is a maximum: measure again at the end (the load changes) and judge every row by the higher one.
    print("measuring the bandwidth ceiling again ...", flush=True)
    ceiling_end = _bandwidth.adam_pattern_ceiling(
        sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2)
    )
    ceiling["gb_per_s_start"] = cgbs
    ceiling["gb_per_s_end"] = ceiling_end["gb_per_s"]
    ceiling["gb_per_s"] = cgbs = max(cgbs, ceiling_end["gb_per_s"])
    stream = {"triad": triad["gb_per_s"], "copy": copy["gb_per_s"]}
    for row in rows:
        apply_ceiling(row, cgbs, stream)

    print()
    print(
        f"ceiling {cgbs:.1f} GB/s (Adam pattern, {threads} threads; start {ceiling['gb_per_s_start']:.1f}, "
        f"end {ceiling['gb_per_s_end']:.1f}), triad {triad['gb_per_s']:.1f} GB/s, copy {copy['gb_per_s']:.1f} GB/s; "
        f"load average {info['load_average']} (start) -> {_machine.load_average()} (end)"
    )
    print(_report.format_table([decorate(r) for r in rows], COLUMNS))
    for r in identity:
        print(f"bit-identical {r['optimizer']} vs {r['reference']}: {r['equal']}")

    info_end_load = _machine.load_average()
    date = info["date_utc"][:10]
    stem = args.stem or f"cpu-{date}-fused" + ("-quick" if args.quick else "")
    out = Path(args.out)
    payload = {
        "schema": "stepforge-bench/1",
        "bench": "bench_fused_cpu",
        "date_utc": info["date_utc"],
        "device": info["device"],
        "machine": info,
        "load_average_end": info_end_load,
        "config": {
            "quick": args.quick,
            "cases": cases,
            "threads": threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()},
            "timing": "median of repeats, round-robin (half in each order), only step() timed, gc off",
            "grads": "reuse = same p.grad tensors every step; fresh = alternate between two gradient sets",
            "bytes_per_element": BYTES,
        },
        "ceiling": ceiling,
        "triad": triad,
        "copy": copy,
        "rows": rows,
        "bit_identity": identity,
        "fused_error": err,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json_path = _report.save_json(out / f"{stem}.json", payload)
    print(f"wrote {json_path}")
    if not args.no_plot and rows:
        png = _report.save_ratio_plot(
            out / f"{stem}.png",
            rows=[decorate(r) | {"case": f"{r['case']} [{r['grads']}]"} for r in rows],
            title=f"stepforge-fused CPU vs torch {info['torch']} - {info['device']}, {threads} threads, {info['date_utc']}",
            ceiling_gb_per_s=cgbs,
        )
        print(f"wrote {png}")
    print(f"done in {payload['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
