# SPDX-License-Identifier: Apache-2.0
"""Optimizer state dicts keyed by parameter FQN, read and written without stepping the optimizer.

``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` first give a never-stepped
optimizer its state with a zero-lr ``step()`` on zero gradients (``_init_optim_state``): Adam's step count is 1
before any real step, a save before training changes the training that follows, and when any parameter already
has a ``.grad`` it skips that and a load silently drops every saved state entry. These functions do only the
key translation (parameter index <-> FQN, as torch names them) around ``Optimizer.state_dict`` and
``Optimizer.load_state_dict``: a never-stepped optimizer gives ``"state": {}``, and a checkpoint's entries are
placed by whoever builds the ``dcp.load`` template (from the checkpoint's metadata and the parameters' shapes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["param_fqns", "optimizer_state_dict", "load_optimizer_state_dict"]

# the wrapper modules torch's state-dict API strips from a parameter's name (DDP, torch.compile, activation
# checkpointing, FSDP1), so the optimizer's keys equal the model state dict's
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def param_fqns(model: nn.Module) -> dict[nn.Parameter, str]:
    """Every parameter of ``model`` (shared ones once) -> its name in the model's state dict."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    out: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if ddp and parts[0] == "module":
            parts = parts[1:]
        out[param] = ".".join(p for p in parts if p not in _WRAPPER_PARTS)
    return out


def optimizer_state_dict(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`` of ``optimizers`` (their
    groups concatenated in order). The tensors are the optimizers' own (DTensors for FSDP2 shards); nothing is
    stepped, so a never-stepped optimizer gives an empty ``"state"``.

    Raises:
        ValueError: an optimizer holds a parameter that is not ``model``'s.
    """
    fqns = param_fqns(model)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optim in optimizers:
        osd = optim.state_dict()
        params = [p for g in optim.param_groups for p in g["params"]]
        names = []
        for index, param in enumerate(params):
            if param not in fqns:
                raise ValueError(
                    f"optimizer {type(optim).__name__} holds parameter {index} (shape {tuple(param.shape)}), which "
                    "is not a parameter of the model: build the optimizer from model.parameters()"
                )
            names.append(fqns[param])
        for index, entry in osd["state"].items():
            state[names[index]] = entry
        for group in osd["param_groups"]:
            groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], state_dict: Mapping[str, Any]
) -> None:
    """Load :func:`optimizer_state_dict`'s form into ``optimizers`` with ``Optimizer.load_state_dict`` (the
    state is replaced: a parameter without an entry comes back unstepped).

    Raises:
        ValueError: the groups do not name the same parameters in the same order (checked for every optimizer
            before any is loaded).
    """
    fqns = param_fqns(model)
    saved_groups = list(state_dict.get("param_groups", []))
    saved_state = state_dict.get("state", {})
    live_groups = sum(len(o.param_groups) for o in optimizers)
    if live_groups != len(saved_groups):
        raise ValueError(
            f"the optimizer state holds {len(saved_groups)} parameter groups, the optimizers {live_groups}: build "
            "them with the groups they were saved with"
        )
    plans: list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []
    start = 0
    for optim in optimizers:
        mine = saved_groups[start : start + len(optim.param_groups)]
        start += len(optim.param_groups)
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for i, (live, saved) in enumerate(zip(optim.param_groups, mine, strict=True)):
            want = [fqns.get(p, "?") for p in live["params"]]
            if list(saved["params"]) != want:
                raise ValueError(
                    f"parameter group {i} of the optimizer state names {list(saved['params'])[:4]}..., the optimizer "
                    f"{want[:4]}...: load it into the model and optimizer it was saved from"
                )
            ids = list(range(index, index + len(want)))
            for pid, name in zip(ids, want, strict=True):
                if name in saved_state:
                    state[pid] = saved_state[name]
            groups.append({**saved, "params": ids})
            index += len(want)
        plans.append((optim, {"state": state, "param_groups": groups}))
    for optim, osd in plans:
        optim.load_state_dict(osd)
