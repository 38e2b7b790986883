# SPDX-License-Identifier: Apache-2.0
"""``torch.compile`` for boosted models (``compile=`` of ``Booster.boost`` and ``Strategy.prepare``,
mmengine's values), in place: FSDP2 models per innermost unit, because FSDP2's hooks are
``torch._dynamo.disable``-d and a graph spanning them would break at every block; nothing wraps the module, so
state-dict keys stay the eager model's. The package README's section "torch.compile" has the details."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import WrappedModel
from stepforge.core.torch_compat import fsdp2_modules, is_compiled_module

__all__ = [
    "CompileConfig",
    "apply_compile",
    "compile_config",
    "compile_model",
    "refuse_compiled_wrapper",
    "user_module",
]

#: the keys of a ``compile`` dict that are not ``torch.compile`` arguments
_OWN_KEYS = frozenset({"target", "disable"})


@dataclass(frozen=True)
class CompileConfig:
    """A checked ``compile`` option: the method to compile and the ``torch.compile`` keyword arguments."""

    target: str = "forward"
    options: Mapping[str, Any] = field(default_factory=dict)


def compile_config(compile: Any, *, where: str) -> CompileConfig | None:
    """Check ``compile`` (``False``/``None``/``True``/dict); ``None`` when nothing is to be compiled. The
    caller's dict is not changed (mmengine pops ``target`` out of it, so a second use loses it)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return CompileConfig()
    if not isinstance(compile, Mapping):
        raise TypeError(
            f"{where}: compile must be True/False or a dict of torch.compile arguments (with optional 'target' and "
            f"'disable'), got {type(compile).__name__}"
        )
    # torch.compile's keyword arguments, read from the installed torch
    allowed = _OWN_KEYS | (frozenset(inspect.signature(torch.compile).parameters) - {"model"})
    unknown = sorted(set(compile) - allowed)
    if unknown:
        raise ValueError(f"{where}: compile has unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    options = dict(compile)
    disable = options.pop("disable", False)
    if not isinstance(disable, bool):
        raise TypeError(f"{where}: compile['disable'] must be True or False, got {disable!r}")
    if disable:
        return None
    target = options.pop("target", "forward")
    if not isinstance(target, str) or not target:
        raise TypeError(f"{where}: compile['target'] must be a method name such as 'forward', got {target!r}")
    return CompileConfig(target=target, options=options)


def refuse_compiled_wrapper(model: Any, *, where: str) -> None:
    """Raise a ``TypeError`` naming the fix when ``compile=`` meets what ``torch.compile(module)`` returns."""
    if is_compiled_module(model):
        raise TypeError(
            f"{where}: model is already a torch.compile() wrapper (OptimizedModule) and compile= would compile it "
            "again; pass the eager module with compile=True (or compile=dict(...)), or your compiled model "
            "without compile="
        )


def user_module(model: nn.Module) -> nn.Module:
    """The model the user gave, under the Booster's and the plugins' wrappers (``ModelWrapper``, DDP, ZeRO's
    model; FSDP2 changes the module in place, so it is the module itself)."""
    for _ in range(16):
        if isinstance(model, WrappedModel):
            inner = model.unwrap()
        elif isinstance(model, DistributedDataParallel):
            inner = model.module
        else:
            return model
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


def apply_compile(model: nn.Module, config: CompileConfig, *, where: str = "compile") -> list[str]:
    """Compile ``config.target`` on the user's model inside ``model`` in place (see the module docstring);
    returns the qualified names of the compiled methods (``"forward"``, ``"blocks.0.forward"``...)."""
    root = user_module(model)
    refuse_compiled_wrapper(root, where=where)
    units = {id(m) for m in fsdp2_modules(root)} - {id(root)} if config.target == "forward" else set()
    # the FSDP2 units below the root that hold no other unit (else the root itself)
    innermost = [
        (name, m)
        for name, m in root.named_modules()
        if id(m) in units and not any(id(inner) in units for inner in m.modules() if inner is not m)
    ] or [("", root)]
    for _, module in innermost:
        method = getattr(module, config.target, None)
        if not callable(method):
            raise ValueError(
                f"{where}: compile target {config.target!r} is not a method of {type(module).__name__}; name a "
                "method of your model (default 'forward')"
            )
        setattr(module, config.target, torch.compile(method, **config.options))  # an instance attribute
    return [f"{name}.{config.target}" if name else config.target for name, _ in innermost]


def compile_model(model: nn.Module, compile: Any, *, where: str = "compile") -> list[str]:
    """:func:`compile_config` then :func:`apply_compile`; ``[]`` when ``compile`` is off."""
    config = compile_config(compile, where=where)
    return [] if config is None else apply_compile(model, config, where=where)
