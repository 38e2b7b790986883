# SPDX-License-Identifier: Apache-2.0
"""``stepforge-checkpoint``: inspect a checkpoint, or export its model weights as one Hugging Face directory
(what DeepSpeed's ``zero_to_fp32.py`` and DCP's ``dcp_to_torch_save`` do), offline, with no process group.

::

    stepforge-checkpoint inspect work_dir/iter_400          # plugin, world size, step, files, checksums
    stepforge-checkpoint inspect work_dir --json            # a work_dir: its last checkpoint
    stepforge-checkpoint export work_dir/iter_400 hf-model --config my-model/config.json \\
        --max-shard-size 2GB --dtype bfloat16

``export`` reads any stepforge model checkpoint: a Strategy checkpoint (DCP: its model, not the optimizer), any
other DCP directory (every tensor), ``Booster.save_model`` shards with their index or a single model file
(safetensors or ``torch.save``). It writes ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards
of at most ``--max-shard-size`` plus ``model.safetensors.index.json``, as transformers' ``save_pretrained``,
and ``config.json`` (``--config``, else the checkpoint's own), so ``AutoModelForCausalLM.from_pretrained`` loads
it. Every checksum is verified before anything is read; tensors are read one at a time (a DCP tensor through a
planner holding only that key), so the peak memory is about one output shard. The output is written into a
temporary directory and renamed into place with its own ``COMMIT.json``: a failure leaves nothing.
ZeRO's fp32 master weights are optimizer state: the export holds the model's saved weights.

Errors print one line, ``stepforge-checkpoint: error: <what> (<the fix>)``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..memory._specs import parse_size
from ._dcp import read_dcp_metadata, safe_dcp_load
from ._layout import (
    FILE_FORMAT,
    LAST_CHECKPOINT,
    MARKER,
    SIDECAR_SUFFIX,
    CheckpointError,
    find_latest_checkpoint,
    verify_save,
)
from ._model_io import INDEX_SUFFIX, files_to_read, is_safetensors, read_file, write_shards
from ._writer import check_target, commit_tmp_dir

__all__ = ["main", "parser", "inspect_checkpoint", "export_checkpoint"]

PROG = "stepforge-checkpoint"
#: where a Strategy checkpoint keeps the model in its DCP tree (``save_checkpoint``: ``tensors={"model": ...}``)
_MODEL_ROOT = "tensors.model."
_DISTCP = re.compile(r"__(\d+)_\d+\.distcp")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_VERIFY_FIX = "restore the file or use another checkpoint; nothing was written"


def _refused(what: str, fix: str) -> CheckpointError:
    """The one-line error the command prints: what is wrong and the fix."""
    return CheckpointError(f"{what} ({fix})")


def _resolve(path: str) -> str:
    """``path``, or the last committed checkpoint when it is a ``work_dir`` holding ``last_checkpoint``."""
    if not os.path.exists(path):
        raise _refused(f"no checkpoint at {path!r}", "check the path")
    if os.path.isfile(os.path.join(path, LAST_CHECKPOINT)):
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise _refused(f"{path!r} names no committed checkpoint", "pass a checkpoint directory")
        return latest
    return os.path.abspath(path)


def _dcp_model(path: str) -> tuple[str, dict[str, tuple[str, TensorStorageMetadata]]]:
    """The kind of DCP directory ``path`` and its model tensors: ``name -> (DCP key, storage metadata)``."""
    try:
        stored = read_dcp_metadata(path).state_dict_metadata
    except CheckpointError as exc:
        raise _refused(str(exc), _VERIFY_FIX) from exc
    tensors = {k: m for k, m in stored.items() if isinstance(m, TensorStorageMetadata)}
    if any(k.startswith(_MODEL_ROOT) for k in tensors):
        kind = "Strategy checkpoint (DCP)"
        model = {k.removeprefix(_MODEL_ROOT): (k, m) for k, m in tensors.items() if k.startswith(_MODEL_ROOT)}
    else:
        kind, model = "DCP directory", {k: (k, m) for k, m in tensors.items()}
    return kind, model


def _stream_dcp(path: str, model: dict[str, tuple[str, TensorStorageMetadata]]) -> Iterator[tuple[str, Any]]:
    for name, (key, info) in model.items():
        one = {key: torch.empty(tuple(info.size), dtype=info.properties.dtype)}
        try:  # only this key is planned, so only its bytes are read (the restricted reader: no code runs)
            safe_dcp_load(one, path, local=True)
        except CheckpointError as exc:
            raise _refused(str(exc), _VERIFY_FIX) from exc
        yield name, one[key]


def _stream_files(files: list[Path]) -> Iterator[tuple[str, Any]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            if not is_safetensors(file):  # a torch.save file is one pickle: read whole (weights_only), alone
                yield from read_file(file).items()
                continue
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (CheckpointError, OSError, ValueError, SafetensorError) as exc:
            raise _refused(f"{file} is unreadable ({exc})", _VERIFY_FIX) from exc


def _source(path: str) -> tuple[dict[str, Any], Iterator[tuple[str, Any]]]:
    """What ``inspect`` shows of checkpoint ``path`` (its checksums verified) and a lazy stream of its model
    tensors ``(name, tensor)``."""
    path = _resolve(path)
    try:  # every checksum before anything is read; record: COMMIT.json's, or a single file's manifest
        record = verify_save(path)
    except CheckpointError as exc:
        raise _refused(str(exc), _VERIFY_FIX) from exc
    manifest = None if record is None else MARKER
    if record is not None and record.get("format") == FILE_FORMAT:
        manifest = os.path.basename(path) + SIDECAR_SUFFIX
        record = {"files": {os.path.basename(path): record["data"]}, **record}
    meta: dict[str, Any] = dict((record or {}).get("meta") or {})
    if os.path.isdir(path) and record is None:
        names = [n for n in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, n))]
        listed = {n: {"size": os.path.getsize(os.path.join(path, n))} for n in names}
    else:
        listed = (record or {}).get("files") or {os.path.basename(path): {"size": os.path.getsize(path)}}
    info: dict[str, Any] = {
        "path": os.path.abspath(path),
        "kind": None,
        "manifest": manifest,
        "verified": record is not None,
        "plugin": meta.get("plugin"),
        "world_size": meta.get("world_size"),
        "iter": meta.get("iter"),
        "epoch": meta.get("epoch"),
        "precision": meta.get("precision"),
        "committed_at": (record or {}).get("committed_at"),
        "files": [{"name": n, "size": r["size"], "crc32": r.get("crc32")} for n, r in sorted(listed.items())],
    }
    if meta.get("kind") not in (None, "model"):
        raise _refused(
            f"{path!r} holds a stepforge {meta['kind']} save, not model weights", "export a model save"
        )
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        info["kind"], model = _dcp_model(path)
        ranks = {int(m.group(1)) for n in listed if (m := _DISTCP.fullmatch(os.path.basename(n)))}
        info["world_size"] = info["world_size"] or len(ranks) or None
        info["model_tensors"] = len(model)
        info["model_bytes"] = sum(m.size.numel() * m.properties.dtype.itemsize for _, m in model.values())
        return info, _stream_dcp(path, model)
    try:
        files = files_to_read(Path(path))
    except (OSError, ValueError) as exc:
        raise _refused(
            str(exc).removeprefix("load_model: "), "pass a stepforge checkpoint or model save"
        ) from exc
    info["kind"] = (
        "Hugging Face shards" if len(files) > 1 or path.endswith(INDEX_SUFFIX) else "single model file"
    )
    return info, _stream_files(files)


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Plugin, world size, step, files with sizes and CRC-32 of checkpoint ``path``, every checksum verified
    (:class:`CheckpointError` naming a damaged file and the fix)."""
    return _source(path)[0]


def _config_file(checkpoint: str, config: str | None) -> str | None:
    if config is not None:
        found = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(found, encoding="utf-8") as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise _refused(
                f"--config {config!r} is not a readable config.json ({exc})",
                "pass the model's config.json, as model.config.save_pretrained(dir) writes it",
            ) from exc
        return found
    folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    own = os.path.join(folder, "config.json")
    return own if os.path.isfile(own) else None


def _out_dir(out: str, checkpoint: str, overwrite: bool) -> str:
    try:  # never "", ".", the working directory or its parents
        final = check_target(out, arg="OUT", where=f"{PROG} export", kind="files")
    except (ValueError, CheckpointError) as exc:
        raise _refused(str(exc), "name a new directory") from exc
    source = os.path.realpath(checkpoint)
    if os.path.commonpath([source, os.path.realpath(final)]) == os.path.realpath(final):
        raise _refused(f"OUT {out!r} holds the checkpoint being exported", "name a directory outside it")
    if os.path.isdir(final) and os.listdir(final) and not overwrite:
        raise _refused(
            f"OUT {out!r} exists and is not empty", "pass --overwrite to replace it, or a new directory"
        )
    return final


def _renamed(
    stream: Iterator[tuple[str, Any]], dtype: torch.dtype | None, strip: Sequence[str], count: list[int]
) -> Iterator[tuple[str, Any]]:
    """The stream with ``strip`` prefixes removed and floating-point tensors cast to ``dtype``; counts them."""
    seen: set[str] = set()
    for name, tensor in stream:
        for prefix in strip:
            name = name.removeprefix(prefix)
        if name in seen:
            raise _refused(f"two tensors are named {name!r} after --strip-prefix", "strip fewer prefixes")
        seen.add(name)
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    if not seen:
        raise _refused("the checkpoint holds no model tensors", "pass a checkpoint with model weights")
    count.append(len(seen))


def export_checkpoint(
    checkpoint: str,
    out: str,
    *,
    config: str | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    strip_prefixes: Sequence[str] = (),
    overwrite: bool = False,
) -> dict[str, Any]:
    """Export the model weights of ``checkpoint`` into Hugging Face directory ``out`` (see the module docstring);
    returns ``{"out", "entry", "tensors", "config"}`` (``config``: whether ``config.json`` was written).
    :class:`CheckpointError` for a damaged or unsupported checkpoint or an ``out`` that may not be replaced (the
    message says what and the fix); nothing is written then."""
    info, stream = _source(checkpoint)
    final = _out_dir(out, info["path"], overwrite)
    found = _config_file(info["path"], config)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    try:
        count: list[int] = []
        entry = write_shards(_renamed(stream, dtype, strip_prefixes, count), tmp, None, max_shard_size, True)[
            -1
        ]
        if found is not None:
            shutil.copyfile(found, os.path.join(tmp, "config.json"))
        meta = {"kind": "model", "format": "safetensors", "entry": entry, "exported_from": info["path"]}
        commit_tmp_dir(tmp, final, meta)  # COMMIT.json, then the rename: OUT appears whole or not at all
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _refused(
                f"writing {final!r} failed ({exc})", "check the space and permissions there"
            ) from exc
        raise
    return {"out": final, "entry": entry, "tensors": count[0], "config": found is not None}


def _size(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} B" if units[0] == "B" else f"{n:.1f} {units[0]}"


def _table(info: dict[str, Any]) -> str:
    def shown(value: Any) -> str:
        return "-" if value is None else str(value)

    when = info["committed_at"]
    rows = [
        ("checkpoint", info["path"]),
        ("kind", info["kind"]),
        ("plugin", shown(info["plugin"])),
        ("world size", shown(info["world_size"])),
        ("step", f"iter {shown(info['iter'])}, epoch {shown(info['epoch'])}"),
        ("precision", shown(info["precision"])),
        ("committed", "-" if when is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))),
    ]
    if "model_tensors" in info:
        rows.append(("model", f"{info['model_tensors']} tensors, {_size(info['model_bytes'])}"))
    total = sum(f["size"] for f in info["files"])
    check = f"CRC-32 verified against {info['manifest']}" if info["verified"] else "no manifest: not verified"
    rows.append(("files", f"{len(info['files'])}, {_size(total)}, {check}"))
    lines = [f"{k:<11} {v}" for k, v in rows]
    width = max(len(f["name"]) for f in info["files"])
    for f in info["files"]:
        lines.append(f"  {f['name']:<{width}}  {_size(f['size']):>10}  {shown(f['crc32']):>8}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a stepforge checkpoint, or export its model as one Hugging Face directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("::", 1)[1].split("``export``", 1)[0] if __doc__ else None,
    )
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="plugin, world size, step, files, sizes; verifies every checksum")
    ins.add_argument("path", help="a checkpoint directory or file (a work_dir: its last checkpoint)")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    exp = sub.add_parser("export", help="the model as safetensors shards + index + config.json")
    exp.add_argument("checkpoint", help="a checkpoint directory or file (a work_dir: its last checkpoint)")
    exp.add_argument("out", help="the Hugging Face directory to write (new or empty, or --overwrite)")
    exp.add_argument("--config", help="config.json (or its directory) when the checkpoint holds none")
    exp.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="e.g. 5GB, 500MB, 2GiB (default 5GB)"
    )
    exp.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors (default: as saved)"
    )
    exp.add_argument(
        "--strip-prefix",
        action="append",
        default=[],
        help="remove this leading prefix from names (repeatable)",
    )
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0, or 2 after a one-line error)."""
    args = parser().parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect_checkpoint(args.path)
            print(json.dumps(info, indent=2) if args.json else _table(info))
            return 0
        done = export_checkpoint(
            args.checkpoint, args.out, config=args.config, max_shard_size=args.max_shard_size,
            dtype=_DTYPES.get(args.dtype), strip_prefixes=args.strip_prefix, overwrite=args.overwrite,
        )  # fmt: skip
    except CheckpointError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {done['tensors']} tensors to {done['out']} ({done['entry']})")
    if not done["config"]:
        print(
            f"{PROG}: warning: no config.json (the checkpoint has none and --config was not given); "
            "from_pretrained needs one: pass --config PATH",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
