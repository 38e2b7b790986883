# SPDX-License-Identifier: Apache-2.0
"""``ZeroRedundancyOptimizer``: mmengine's string-typed wrapper of torch's ZeRO-1, resolved through stepforge.

torch's :class:`torch.distributed.optim.ZeroRedundancyOptimizer` does the work; this subclass adds what mmengine's
wrapper gives (``optimizer_type`` as a registry name of :data:`stepforge.core.OPTIMIZERS`, a collective
``state_dict()`` returning the full state on the main process) and fixes what it lacks (torch's signature and
state-dict protocol too, a bounded wait instead of a hang when only some ranks call ``state_dict()``, a load at any
world size that leaves the caller's dict untouched).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeroRedundancyOptimizer

from stepforge.core import OPTIMIZERS, HyperParameterError, StepforgeError
from stepforge.core.torch_compat import default_store

__all__ = [
    "ZeroRedundancyOptimizer",
    "CollectiveCallError",
    "MissingArgumentError",
    "DEFAULT_CONSOLIDATE_TIMEOUT",
]

#: Seconds every rank of the group gets to enter ``state_dict()``/``consolidate_state_dict()``.
DEFAULT_CONSOLIDATE_TIMEOUT = 60.0

# Keys that make an optimizer compute a norm over *all* of its parameters: under ZeRO each rank's local
# optimizer sees only its own parameters, so such a norm would be wrong without any error.
_GLOBAL_NORM_KEYS = ("max_grad_norm",)


class MissingArgumentError(HyperParameterError, TypeError):
    """A required argument was not given: a ``TypeError``, as Python raises for a missing argument (mmengine's
    tests expect it for ``ZeroRedundancyOptimizer`` without ``optimizer_type``), and a
    :class:`~stepforge.core.HyperParameterError` whose message names the argument and the fix."""


class CollectiveCallError(StepforgeError, RuntimeError):
    """A collective call (``state_dict()``, ``consolidate_state_dict()``) was not made by every rank in time."""


class ZeroRedundancyOptimizer(_TorchZeroRedundancyOptimizer):
    """ZeRO-1 over ``torch.distributed``: each rank keeps the optimizer state of about ``1/world_size`` of
    the parameters, steps them, and broadcasts them to the other ranks.

    mmengine's signature and semantics (``mmengine.optim.ZeroRedundancyOptimizer``), built on torch's
    :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`. Use it beside
    :class:`~torch.nn.parallel.DistributedDataParallel`, which averages the gradients; every parameter is
    owned whole by one rank (sorted-greedy by size, per param group).

    Example::

        build_optimizer(dict(type="ZeroRedundancyOptimizer", optimizer_type="FusedAdam", lr=1e-3), model)

    - ``process_group``, ``parameters_as_bucket_view``, ``overlap_with_ddp``: torch's (the last only ``False``).

    Args:
        params: tensors or param-group dicts (all of one dense dtype, as torch requires).
        optimizer_type: the local optimizer, a registry name (``"AdamW"``, ``"FusedAdam"``, ``"Lamb"``;
            case, ``-`` and ``_`` ignored) or an optimizer class (positional: torch's ``optimizer_class``).
        optimizer_class: torch's keyword for the same (a class or a registry name); give one of the two.
        consolidate_timeout: seconds each rank waits for the others to enter ``state_dict()`` or
            ``consolidate_state_dict()`` before raising :class:`CollectiveCallError` (default 60); the group
            stays usable (gloo and NCCL alike).
        **kwargs: hyper-parameters of the local optimizer (``lr=...``).

    Raises:
        TypeError: ``params`` is a bare tensor (as torch's class); :class:`MissingArgumentError`: no local
            optimizer given (a ``TypeError``, as mmengine's tests expect, and a ``HyperParameterError``).
        HyperParameterError: a bad argument (``UnknownNameError``: an unregistered ``optimizer_type``), or a
            local optimizer that would clip by a global norm (``max_grad_norm``) it cannot see under sharding.
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    _instances: ClassVar[dict[tuple[int, ...], int]] = {}

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_type: str | type[torch.optim.Optimizer] | None = None,
        *,
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        consolidate_timeout: float = DEFAULT_CONSOLIDATE_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if isinstance(params, torch.Tensor):  # torch's check: list() would split it into its rows
            raise TypeError(
                "ZeroRedundancyOptimizer: params must be an iterable of tensors or param-group dicts, got a bare "
                f"{torch.typename(params)}; pass [tensor] or model.parameters()."
            )
        if overlap_with_ddp:
            raise HyperParameterError(
                "ZeroRedundancyOptimizer: overlap_with_ddp=True is not supported (as in mmengine): it needs a "
                "functional optimizer and a DDP communication hook; leave it False."
            )
        if optimizer_type is not None and optimizer_class is not None:
            raise HyperParameterError(
                "ZeroRedundancyOptimizer: pass the local optimizer once, as optimizer_type (mmengine's name) or "
                "optimizer_class (torch's), not both."
            )
        if optimizer_type is None and optimizer_class is None:
            raise MissingArgumentError(
                "ZeroRedundancyOptimizer: the local optimizer is missing; pass optimizer_type='AdamW' (mmengine) "
                "or optimizer_class=torch.optim.AdamW (torch)."
            )
        optimizer_type = optimizer_type if optimizer_type is not None else optimizer_class
        timeout = consolidate_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise HyperParameterError(
                f"ZeroRedundancyOptimizer: consolidate_timeout must be a number of seconds > 0, got {timeout!r}."
            )
        if isinstance(optimizer_type, str):
            optimizer_class = OPTIMIZERS.get(optimizer_type)
        elif isinstance(optimizer_type, type) and issubclass(optimizer_type, torch.optim.Optimizer):
            optimizer_class = optimizer_type
        else:
            raise HyperParameterError(
                "ZeroRedundancyOptimizer: optimizer_type must be an optimizer name such as 'AdamW' or 'FusedAdam' "
                f"(or an optimizer class), got {optimizer_type!r}."
            )
        for key in _GLOBAL_NORM_KEYS:
            if kwargs.get(key):
                raise HyperParameterError(_global_norm_message(key, kwargs[key]))
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ZeroRedundancyOptimizer needs torch.distributed to be initialised "
                "(torch.distributed.init_process_group(...) or torchrun) before it is built; on one process use "
                "the optimizer itself (dict(type=optimizer_type, ...))."
            )
        params = list(params)  # a generator must survive torch's checks
        super().__init__(
            params,
            optimizer_class,
            process_group=process_group,
            parameters_as_bucket_view=parameters_as_bucket_view,
            **kwargs,
        )
        for group in self.optim.param_groups:
            for key in _GLOBAL_NORM_KEYS:
                if group.get(key):
                    raise HyperParameterError(_global_norm_message(key, group[key], default=True))
        self.optimizer_type = optimizer_type if isinstance(optimizer_type, str) else optimizer_class.__name__
        self.consolidate_timeout = float(consolidate_timeout)
        # names this instance's arrival keys in the rendezvous store: the n-th optimizer built on a group
        ranks = tuple(dist.get_process_group_ranks(self.process_group))
        ZeroRedundancyOptimizer._instances[ranks] = ZeroRedundancyOptimizer._instances.get(ranks, 0) + 1
        self._instance = f"{'-'.join(map(str, ranks))}/{ZeroRedundancyOptimizer._instances[ranks]}"
        self._rounds = 0
        # the rank that an explicit consolidate_state_dict(to=...) gathered on, until the state changes
        self._consolidated_to: int | None = None

    # -- collectives -----------------------------------------------------------------------------------
    def _all_ranks_present(self, what: str) -> None:
        """Wait at most ``consolidate_timeout`` s for every rank of the group to reach ``what``.

        The check runs on the rendezvous store, not the process group's transport: a rank that gives up leaves
        no half-finished gloo/NCCL operation behind, so a later call made by every rank works. Each rank adds 1
        to a counter; the rank that brings it to ``world_size`` sets ``done``, the others wait for it. A rank that
        times out withdraws its arrival (an atomic ``add(-1)``), so a later round starts from a clean count; if
        the count had reached ``world_size`` first, the round completed and it goes on (no rank is left alone).
        """
        key = f"stepforge.zero.ZeroRedundancyOptimizer/{self._instance}/{self._rounds}"
        count, done, world, start = f"{key}/count", f"{key}/done", self.world_size, time.monotonic()
        if world > 1 and (store := default_store()).add(count, 1) >= world:
            store.set(done, "1")
        elif world > 1:
            try:
                store.wait([done], datetime.timedelta(seconds=self.consolidate_timeout))
            except (dist.DistStoreError, RuntimeError) as exc:
                arrived = store.add(count, -1) + 1
                if arrived < world:
                    raise CollectiveCallError(
                        f"ZeroRedundancyOptimizer.{what} is collective: every rank of the process group ({world} "
                        f"ranks) must call it, but rank {self.rank} waited {time.monotonic() - start:.1f} s "
                        f"(consolidate_timeout={self.consolidate_timeout:g}) and only {arrived} arrived. Call it "
                        "on every rank (not inside a main-process-only block such as mmengine's master_only save) "
                        "and write the result from the main process."
                    ) from exc
                store.wait([done], datetime.timedelta(seconds=max(self.consolidate_timeout, 1.0)))
        self._rounds += 1  # only once the round completed: a rank that gave up retries under the same key

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state on rank ``to`` (collective: :class:`CollectiveCallError` when not
        every rank calls it within ``consolidate_timeout`` seconds)."""
        if not isinstance(to, int) or not 0 <= to < self.world_size:
            raise HyperParameterError(
                f"consolidate_state_dict: to must be a rank of the group in [0, {self.world_size}), got {to!r}."
            )
        self._consolidate(to)
        self._consolidated_to = to

    def _consolidate(self, to: int) -> None:
        self._consolidated_to = None
        self._all_ranks_present("consolidate_state_dict()")
        super().consolidate_state_dict(to=to)

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """torch's step; a state consolidated before it is stale from then on."""
        self._consolidated_to = None
        return super().step(closure, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state on one rank, ``{}`` on the others (``torch.optim`` layout keyed by global
        parameter index: it loads at any world size and into the plain local optimizer), in two protocols:

        - torch's: after ``consolidate_state_dict(to=k)`` on every rank (and no step or load since), the state
          on rank ``k`` and ``{}`` elsewhere, with no collective (torch's class raises on the other ranks);
        - mmengine's: otherwise collective (every rank calls it; :class:`CollectiveCallError` when not all do
          within ``consolidate_timeout``), consolidated on and returned by rank 0 of the group.
        """
        if self._consolidated_to is not None:
            return super().state_dict() if self.rank == self._consolidated_to else {}
        self._consolidate(0)
        if self.rank != 0:
            return {}
        state = super().state_dict()
        self._all_state_dicts: list[dict[str, Any]] = []  # the gathered copies are not needed any more
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full state (:meth:`state_dict` on the main process; not a non-main rank's ``{}``) at any world
        size: every rank keeps the state of the parameters it owns; ``state_dict`` itself is not modified."""
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise HyperParameterError(
                "ZeroRedundancyOptimizer.load_state_dict: got an empty state; state_dict() returns the full "
                "state only on the main process (rank 0) and {} elsewhere: save rank 0's and load that on every "
                "rank."
            )
        if "state" not in state_dict or "param_groups" not in state_dict:
            raise HyperParameterError(
                "ZeroRedundancyOptimizer.load_state_dict: expected a torch.optim state dict with 'state' and "
                f"'param_groups', got keys {sorted(state_dict)}."
            )
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise HyperParameterError(
                f"ZeroRedundancyOptimizer.load_state_dict: the state has {len(state_dict['param_groups'])} param "
                f"groups, this optimizer {len(self.param_groups)}; build it with the same groups."
            )
        # torch's implementation overwrites entries of the dict it is given; give it a private copy
        copied = {
            **state_dict,
            "state": dict(state_dict["state"]),
            "param_groups": [dict(g) for g in state_dict["param_groups"]],
        }
        self._consolidated_to = None
        super().load_state_dict(copied)


def _global_norm_message(key: str, value: Any, *, default: bool = False) -> str:
    origin = " (the local optimizer's default)" if default else ""
    return (
        f"ZeroRedundancyOptimizer: {key}={value!r}{origin} clips by a norm over all parameters, but under ZeRO "
        f"each rank's local optimizer sees only its own shard, so the norm would be wrong. Pass {key}=0 (or "
        "None) and clip the full gradients before step(), e.g. torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "max_norm) after backward (DDP leaves every rank the full averaged gradients)."
    )
