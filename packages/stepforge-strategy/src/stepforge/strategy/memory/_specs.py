# SPDX-License-Identifier: Apache-2.0
"""Command-line spellings: memory sizes (``80GiB``), plugin variants (``zero2:cpu_offload=True``) and models
(``gpt-7b``, ``package.module:factory``, ``hf:<config name or path>``)."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from .gpt import GPT_SHAPES, gpt

__all__ = ["DEFAULT_PLUGINS", "parse_size", "parse_plugin", "plugin_label", "import_factory", "load_model"]

#: the plugins the command compares by default (``single`` only at world size 1)
DEFAULT_PLUGINS = (
    "single",
    "torch_ddp",
    "zero1",
    "zero2",
    "zero2:cpu_offload=True",
    "torch_fsdp",
    "gemini",
    "gemini:placement_policy='auto'",
)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"80G"`` (binary), ``"80GB"`` (decimal), ``"1.5TiB"`` or plain bytes, as bytes.

    Raises:
        ValueError: anything else (the message shows the accepted forms).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"a memory size like 80GiB, 80G, 80GB or 1.5TiB is expected, got {text!r}.")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_plugin(spec: str) -> tuple[str, dict[str, Any]]:
    """``"zero2:cpu_offload=True,reduce_bucket_size_in_m=8"`` -> ``("zero2", {...})`` (values are Python
    literals).

    Raises:
        ValueError: a setting that is not ``key=literal``.
    """
    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"plugin setting {item!r} in {spec!r} is not key=value.")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"plugin setting {item!r}: the value must be a Python literal ({exc}).") from exc
    return name.strip(), kwargs


def plugin_label(name: str, kwargs: dict[str, Any]) -> str:
    """``zero2 cpu_offload=True``."""
    return " ".join([name, *(f"{k}={v}" for k, v in kwargs.items())])


def import_factory(spec: str, what: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names (``what``: ``"model"``, ``"optimizer"``, for messages).

    Raises:
        ValueError: ``spec`` is not of that form, its module cannot be imported or has no such function; the
            message reads ``<what> (<the fix>)``.
    """
    module_name, colon, attr = spec.partition(":")
    if not (colon and module_name and attr):
        raise ValueError(
            f"{what} factory {spec!r} is not package.module:function (name a function to import)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what} factory {spec!r}: {exc} (install its package or add its folder to PYTHONPATH)"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(
            f"{what} factory {spec!r}: module {module_name!r} has no function {attr!r} (name one defined there)"
        )
    return cast(Callable[..., Any], factory)


def load_model(spec: str) -> nn.Module:
    """The model of a command-line spec, on the meta device: a GPT shape name (``gpt-7b``), a factory
    ``package.module:function`` (called without arguments), or ``hf:<name or folder>`` (a transformers config
    from a local folder or the local Hugging Face cache; needs transformers).

    Raises:
        ValueError: a spec that names no model; the message reads ``<what> (<the fix>)`` and lists the shapes.
    """
    from ._model import load_transformers_config, resolve_model

    if spec in GPT_SHAPES:
        return gpt(spec)
    if spec.startswith("hf:"):
        return resolve_model(load_transformers_config(spec[3:]))
    if ":" in spec:
        return resolve_model(import_factory(spec, "model"))
    raise ValueError(
        f"unknown model {spec!r} (use a GPT shape: {', '.join(GPT_SHAPES)}; package.module:factory; or "
        "hf:<config name or folder>)"
    )
