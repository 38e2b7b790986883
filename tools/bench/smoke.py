# SPDX-License-Identifier: Apache-2.0
"""Run every bench under ``tools/bench/`` once at the seconds-long size it declares (``nox -s bench_smoke``).

A bench is a file ``tools/bench/<folder>/bench_<what>.py``. It declares its smoke run at module level, as literals
that are read here without importing the script (importing one would import torch and the packages):

    SMOKE_ARGS = ("--tiny", "--out", "{out}")  # a seconds-long run; {out} becomes a fresh folder for its files
    SMOKE_NEEDS_CUDA = True                     # optional: a bench that only runs on a CUDA device

Every bench is found by its file name, so a new one cannot be forgotten: a bench without ``SMOKE_ARGS`` (or
without ``{out}`` in it, or outside a topic folder) fails the whole run before anything starts. A run passes
when the script exits 0 and wrote a JSON file under ``{out}``. A ``SMOKE_NEEDS_CUDA`` bench on a machine without a
CUDA device must instead refuse: exit status 2 with ``cannot run here`` in its output (its imports and its options
are still checked); with a device it runs like the others.

Each script runs by its path from a temporary folder (never from the repository root), so an import that only
works from one working directory fails here.

    python tools/bench/smoke.py [--out DIR] [--timeout S] [NAME ...]   # NAME: zero, zero/bench_zero.py, bench_zero
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BENCH", "REFUSAL", "Smoke", "SmokeDeclarationError", "discover", "main", "run_one", "selected"]

#: the folder the benches live in (this file's)
BENCH = Path(__file__).resolve().parent
#: what a CUDA-only bench prints, with exit status 2, where it has no device
REFUSAL = "cannot run here"
_OUT = "{out}"


class SmokeDeclarationError(ValueError):
    """One or more benches do not declare a usable smoke run; the message names each script and the fix."""


@dataclass(frozen=True)
class Smoke:
    """One bench's declared smoke run."""

    path: Path
    args: tuple[str, ...]
    needs_cuda: bool = False

    @property
    def name(self) -> str:
        """The script's path relative to ``tools/bench/`` (``zero/bench_zero.py``)."""
        return self.path.relative_to(self.path.parents[1]).as_posix()

    def argv(self, out: Path) -> list[str]:
        """The command line: this Python, the script by its absolute path, the arguments with ``{out}`` filled."""
        return [sys.executable, str(self.path), *(a.replace(_OUT, str(out)) for a in self.args)]


def _declarations(path: Path) -> dict[str, object]:
    """The module-level ``SMOKE_*`` assignments of ``path``, as literals (``ast.literal_eval``)."""
    found: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id.startswith("SMOKE_"):
                try:
                    found[target.id] = ast.literal_eval(value)
                except ValueError:
                    found[target.id] = ValueError(f"{target.id} is not a literal")
    return found


def _check(rel: str, decl: dict[str, object]) -> list[str]:
    args = decl.get("SMOKE_ARGS")
    if args is None:
        return [f"{rel}: no SMOKE_ARGS; add e.g. SMOKE_ARGS = ('--tiny', '--out', '{_OUT}') at module level"]
    problems = []
    if not (isinstance(args, tuple) and all(isinstance(a, str) for a in args)):
        problems.append(f"{rel}: SMOKE_ARGS must be a tuple of str literals, got {args!r}")
    elif not any(_OUT in a for a in args):
        problems.append(f"{rel}: SMOKE_ARGS must send the output to '{_OUT}' (e.g. '--out', '{_OUT}')")
    cuda = decl.get("SMOKE_NEEDS_CUDA", False)
    if not isinstance(cuda, bool):
        problems.append(f"{rel}: SMOKE_NEEDS_CUDA must be True or False, got {cuda!r}")
    unknown = sorted(set(decl) - {"SMOKE_ARGS", "SMOKE_NEEDS_CUDA"})
    if unknown:
        problems.append(f"{rel}: unknown declarations {unknown} (SMOKE_ARGS, SMOKE_NEEDS_CUDA)")
    return problems


def discover(bench: Path = BENCH) -> list[Smoke]:
    """Every ``bench_*.py`` under ``bench`` with its declared smoke run, sorted by path.

    Raises :class:`SmokeDeclarationError` naming every script that sits outside a topic folder
    (``<bench>/<folder>/bench_<what>.py``) or lacks a usable ``SMOKE_ARGS``.
    """
    smokes, problems = [], []
    for path in sorted(bench.rglob("bench_*.py")):
        rel = path.relative_to(bench)
        if "__pycache__" in rel.parts:
            continue
        if len(rel.parts) != 2 or rel.parts[0] == "tests":
            problems.append(
                f"{rel.as_posix()}: a bench lives one folder deep, in its topic folder (fused/, zero/, ...)"
            )
            continue
        decl = _declarations(path)
        found = _check(rel.as_posix(), decl)
        if found:
            problems += found
            continue
        args, cuda = decl["SMOKE_ARGS"], decl.get("SMOKE_NEEDS_CUDA", False)
        assert isinstance(args, tuple) and isinstance(cuda, bool)  # _check made sure
        smokes.append(Smoke(path.resolve(), args, cuda))
    if problems:
        raise SmokeDeclarationError("benches without a usable smoke run:\n  " + "\n  ".join(problems))
    if not smokes:
        raise SmokeDeclarationError(f"no bench_*.py under {bench}: the runner looks at the wrong folder")
    return smokes


def selected(smokes: Sequence[Smoke], names: Sequence[str]) -> list[Smoke]:
    """The smokes that ``names`` pick (a folder, a path relative to tools/bench, or a script's stem); all if none."""
    if not names:
        return list(smokes)
    picked = [s for s in smokes if {s.name, s.name.split("/")[0], s.path.stem} & set(names)]
    unknown = [n for n in names if not any(n in {s.name, s.name.split("/")[0], s.path.stem} for s in smokes)]
    if unknown:
        raise SystemExit(f"smoke: no bench matches {unknown}; benches: {[s.name for s in smokes]}")
    return picked


def _cuda_available() -> bool:
    import torch  # only here: discovery and the tests of this module need no torch

    return bool(torch.cuda.is_available())


def run_one(smoke: Smoke, out: Path, *, cuda: bool, timeout: float) -> str | None:
    """Run one smoke from a scratch working directory; ``None`` when it passed, else why it failed."""
    out = out.resolve()  # the script runs elsewhere: a relative path would land in its scratch folder
    out.mkdir(parents=True, exist_ok=True)
    refuse = smoke.needs_cuda and not cuda
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-smoke-cwd-") as cwd:
        # its own session: on a timeout the whole group goes (multi-process benches spawn ranks)
        proc = subprocess.Popen(
            smoke.argv(out),
            cwd=cwd,
            start_new_session=True,
            stdout=subprocess.PIPE if refuse else None,
            stderr=subprocess.STDOUT if refuse else None,
            text=True,
        )
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"still running after {timeout:.0f} s (killed)"
    if refuse:
        print(text, end="", flush=True)
        if proc.returncode == 2 and REFUSAL in text:
            return None
        return f"needs CUDA and there is none: expected exit 2 and {REFUSAL!r}, got exit {proc.returncode}"
    if proc.returncode != 0:
        return f"exit status {proc.returncode}"
    if not any(p.stat().st_mtime >= started for p in out.rglob("*.json")):  # this run's, not an earlier one's
        return f"exit 0 but no JSON written under {out}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only these benches: a folder, folder/bench_x.py or bench_x")
    ap.add_argument(
        "--out", type=Path, default=None, help="keep what the benches write here (default: discarded)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one bench may take (default 600)")
    args = ap.parse_args(argv)
    try:
        smokes = selected(discover(), args.names)
    except SmokeDeclarationError as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return 1
    cuda = _cuda_available()
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as scratch:
        out_root = args.out or Path(scratch)
        rows: list[tuple[str, float, str | None]] = []
        start = time.perf_counter()
        for smoke in smokes:
            mode = (
                "refusal expected (no CUDA device)" if smoke.needs_cuda and not cuda else " ".join(smoke.args)
            )
            print(f"\n=== smoke: {smoke.name} {mode}", flush=True)
            t0 = time.perf_counter()
            why = run_one(smoke, out_root / smoke.name.removesuffix(".py"), cuda=cuda, timeout=args.timeout)
            rows.append((smoke.name, time.perf_counter() - t0, why))
        print(f"\n=== smoke: {len(rows)} benches in {time.perf_counter() - start:.0f} s")
    for name, seconds, why in rows:
        print(f"  {name:<40} {seconds:6.1f} s  {'ok' if why is None else 'FAILED: ' + why}")
    return 1 if any(why is not None for _, _, why in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
