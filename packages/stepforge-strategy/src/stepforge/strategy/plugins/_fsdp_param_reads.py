# SPDX-License-Identifier: Apache-2.0
"""Blocks whose parameters are read outside their own forward (``F.linear(x, self.fc1.weight)`` in a parent),
where FSDP2 has them sharded: found by tracing with ``torch.fx`` and left in the parent's unit, or for an
untraceable forward turned into an error naming the parameter and the fix (:class:`OutsideReadGuard`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from stepforge.core.torch_compat import tree_flatten

__all__ = ["blocks_read_outside", "OutsideReadGuard"]


def blocks_read_outside(model: nn.Module, blocks: list[nn.Module]) -> set[int] | None:
    """``id`` of each block whose parameters ``model``'s forward reads outside the block's own forward;
    ``None`` when the forward cannot be traced."""
    import torch.fx

    if not blocks:
        return set()
    block_ids = {id(b) for b in blocks}
    named = [n.split(".") for n, m in model.named_modules() if id(m) in block_ids]
    around = {id(model.get_submodule(".".join(parts[:i]))) for parts in named for i in range(len(parts))}

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return id(m) in block_ids or id(m) not in around

    traced = [m for m in model.modules() if id(m) in around]
    # per module: a shallow copy of its attributes, and each own buffer with a copy of its value
    saved = [
        (
            dict(vars(m)),
            {n: (b, b.detach().clone()) for n, b in m.named_buffers(recurse=False) if b is not None},
        )
        for m in traced
    ]
    try:
        graph = _Tracer().trace(model)
    except Exception:  # any trace failure (control flow on values, unsupported ops) means "cannot tell"
        return None
    finally:
        # symbolic tracing still runs what the forward does to real objects: an in-place update of a buffer
        # (``self.seen.add_(1)``) or a Python attribute (``self.calls += 1``); preparing must not train
        with torch.no_grad():
            for m, (attrs, buffers) in zip(traced, saved, strict=True):
                vars(m).clear()
                vars(m).update(attrs)
                for name, (buffer, value) in buffers.items():
                    setattr(
                        m, name, buffer
                    )  # the same tensor object as before (a forward may have rebound it)
                    buffer.copy_(value)
    owner: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owner.setdefault(id(p), id(block))
    read: set[int] = set()
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = model.get_parameter(str(node.target))
        except AttributeError:
            continue  # a buffer or constant
        if id(value) in owner:
            read.add(owner[id(value)])
    return read


class _SeeShardedParams(TorchFunctionMode):
    def __init__(self, sharded: dict[int, str]) -> None:
        super().__init__()
        self.sharded = sharded

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [
            value for value in tree_flatten((args, kwargs or {}))[0] if isinstance(value, torch.Tensor)
        ]
        # only an op mixing a sharded parameter with a plain tensor fails: FSDP2's own bookkeeping touches the
        # sharded parameters alone (``.data``, ``to_local``...) and must pass
        plain = any(not isinstance(value, DTensor) for value in tensors)
        for value in tensors if plain else ():
            name = self.sharded.get(id(value))
            if name is not None:
                raise RuntimeError(
                    f"parameter {name!r} is read outside the forward of the fully_shard unit that holds it "
                    "(e.g. a parent calling F.linear(x, self.child.weight)); FSDP2 has it sharded there. Boost "
                    "with shard_modules=() (one unit for the whole model) or a shard_modules predicate that "
                    "leaves that module in its parent's unit."
                )
        return func(*args, **(kwargs or {}))


class OutsideReadGuard:
    """Watch ``root``'s first forward (inside FSDP2's hooks, so only the blocks' parameters are sharded): a
    torch op given one of ``block_params`` raises a ``RuntimeError`` naming it and the fix."""

    def __init__(self, root: nn.Module, block_params: set[str]) -> None:
        self._root = root
        self._names = block_params
        self._inner = root.forward
        root.forward = self._watched

    def _watched(self, *args: Any, **kwargs: Any) -> Any:
        self.close()
        sharded = {id(p): n for n, p in self._root.named_parameters() if n in self._names}
        with _SeeShardedParams(sharded):
            return self._inner(*args, **kwargs)

    def close(self) -> None:
        """Stop watching before the first forward (idempotent)."""
        if "forward" in vars(self._root):
            del self._root.forward
