# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``: ZeRO-1/2 over ``torch.distributed`` with fp32 masters, loss scaling and CPU offload.

::

    opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(batch).loss)      # or loss.backward() when no fp16 loss scaling is needed
        opt.step()
        opt.zero_grad()

Each rank holds only its piece (``torch.chunk`` layout, see :mod:`stepforge.zero._partition`) of every
parameter's master weights, gradient and optimizer state; the inner optimizer steps those pieces, and the
updated pieces are all-gathered into the working parameters (one collective per (param group, dtype)).
Gradients are averaged over the ranks as DDP does. See ``docs/low_level.md`` for the trade-offs.

Gradient synchronisation happens once per step, at :meth:`LowLevelZeroOptimizer.sync_grads`: the first of
``scale_grads_``, ``unscale_``, ``clip_grad_norm_`` and ``step`` calls it, and the later ones find the step's
gradients already final (a backward in between re-opens it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError
from stepforge.core.precision import DynamicLossScaler, validate_loss_scaler_args

from ._algorithm import COLOSSAL_OPTIMIZER_BUCKET_SIZE, default_bucket_size, resolve_comm_algorithm
from ._args import check_args, force_dtype, group_facts, resolve_args, resolve_param_gather
from ._buckets import GradReducer
from ._colossal_members import ColossalAIMembers
from ._grad_members import GradientMembers
from ._grad_norm import check_clip_args
from ._grad_pieces import GradPieces, copy_hyperparameters
from ._offload import cpu_step_error, invalidate_cache, resolve_optimizer
from ._param_gather import GATHER_CHUNK, GatherInFlight, StagingBuffers, gather_params, launch_gather
from ._partition import ShardLayout, build_layout
from ._state_members import StateDictMembers

__all__ = ["LowLevelZeroOptimizer"]

#: ``verbose=True`` reports here at INFO (ColossalAI's "Found overflow. Skip step" and the sharding set-up)
logger = logging.getLogger("stepforge.zero")


class LowLevelZeroOptimizer(GradientMembers, ColossalAIMembers, StateDictMembers, torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any optimizer whose param groups hold the model's working parameters.

    ColossalAI's constructor, its names, order and defaults (``colossalai.zero.LowLevelZeroOptimizer``), plus
    stepforge's keyword-only names; a setting given under both names must agree. See the README's table.

    Args:
        optimizer: a built optimizer (``torch.optim``, stepforge, ...) over the working parameters, or a
            registry config such as ``dict(type="FusedAdam", lr=1e-3)`` together with ``params``.
        pg_to_param_list: ColossalAI's ``{group or (extra_dp_group, dp_group): parameters}`` with ONE group
            holding every parameter (several groups, MoE experts, are refused). A non-mapping here is read as
            ``params`` (stepforge's earlier second argument).
        initial_scale: the dynamic loss scaler (fp16 working parameters, or ``dtype_for_loss_scaling="fp16"``).
        min_scale: as ``initial_scale``.
        growth_factor: as ``initial_scale``.
        backoff_factor: as ``initial_scale``.
        growth_interval: as ``initial_scale``.
        hysteresis: as ``initial_scale``.
        max_scale: as ``initial_scale``.
        clip_grad_norm: clip the global gradient norm to this in every :meth:`step` (0: off); ``max_norm``.
        verbose: log skipped steps and the sharding set-up at INFO on the ``stepforge.zero`` logger.
        reduce_bucket_size: elements per gradient bucket (padded element count); ``None``: 4 Mi on gloo
            (measured, see ``_algorithm.GLOO_BUCKET_SIZE``), ColossalAI's 1 Mi elsewhere.
        communication_dtype: the dtype gradients are reduced in on the wire (``None``: their own).
        overlap_communication: launch the bucket reductions asynchronously during backward.
        partition_grad: ZeRO-2 (gradients reduce-scattered); ``stage``.
        cpu_offload: keep masters, gradient pieces and optimizer state on the CPU and step them there
            (an Adam-family config becomes stepforge-fused's ``CPUAdam`` when installed).
        dp_process_group: the data-parallel group (``None``: the default group); ``process_group``.
        extra_dp_group: with ``dp_process_group``: shard over the 2-D grid of both groups (see :mod:`._hybrid`;
            collective over the default group at construction).
        forced_dtype: convert every working parameter to this dtype first (in place).
        master_weights: fp32 masters for fp16/bf16 working parameters (``False``: the working pieces
            themselves are stepped; no fp32 copy).
        overlap_allgather: launch the gather of the updated pieces at the end of :meth:`step` and return; each
            module's next forward waits for its own parameters only (a global forward pre-hook), so the gather
            overlaps the next forward. Until then the working parameters are stale: read them through the
            plugin's model (its ``state_dict``/``unwrap`` wait) or call :meth:`wait_for_param_gather` first;
            this optimizer's own methods wait by themselves.
        fp8_communication: gradients travel as fp8 bytes and are summed in fp32 (see :mod:`._wire`).
        backward_context: a callable returning a context manager entered around each backward.
        params: the parameters (module, tensors or param-group dicts) for a config ``optimizer``.
        stage: 1 (gradients all-reduced, each rank keeps its piece) or 2 (reduce-scattered from backward hooks).
        max_norm: stepforge's name of ``clip_grad_norm``.
        process_group: stepforge's name of ``dp_process_group``.
        norm_type: the norm of ``max_norm`` clipping (2; ``inf`` allowed).
        dtype_for_loss_scaling: ``"fp16"`` forces loss scaling, ``None`` turns it on when a working parameter
            is fp16.
        param_gather: how updated pieces reach every rank: ``"all_gather"`` (one ``all_gather_into_tensor``
            per partition), ``"broadcast"`` (one broadcast per rank and partition; gloo's broadcast is several
            times faster than its all-gather on the CPU), ``None``: broadcast on gloo, all-gather elsewhere.
        comm_algorithm: ``"reduce_scatter"``, ``"all_reduce"`` (each rank reads its pieces of the reduced
            bucket: same 1/N memory), ``"all_to_all"`` (a reduce-scatter by ``all_to_all_single`` and a local sum:
            about twice as fast as either on gloo) or ``"auto"``; see :mod:`stepforge.zero._algorithm`.

    Attributes:
        last_step_skipped: whether the last :meth:`step` was skipped for an fp16 overflow.
        skipped_steps: how many steps were skipped so far.
    """

    _built = False  # set once the partitions exist: add_param_group is refused from then on

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Mapping[str, Any],
        pg_to_param_list: Any = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        max_scale: float = 2**24,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        reduce_bucket_size: int | None = None,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: Any = None,
        extra_dp_group: Any = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        overlap_allgather: bool = False,
        fp8_communication: bool = False,
        backward_context: Callable[[], AbstractContextManager[Any]] | None = None,
        *,
        params: Any = None,
        stage: int | None = None,
        max_norm: float | None = None,
        process_group: Any = None,
        norm_type: float = 2.0,
        dtype_for_loss_scaling: str | None = None,
        param_gather: str | None = None,
        comm_algorithm: str = "auto",
    ) -> None:
        if pg_to_param_list is not None and not isinstance(pg_to_param_list, Mapping) and params is None:
            params, pg_to_param_list = pg_to_param_list, None
        scaler_args = validate_loss_scaler_args(
            "LowLevelZeroOptimizer",
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
        inner = resolve_optimizer(optimizer, params, cpu_offload=cpu_offload)
        if inner.state:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: the inner optimizer already has state; wrap it before its first step and "
                "restore checkpoints through LowLevelZeroOptimizer.load_state_dict."
            )
        args = resolve_args(
            inner, stage=stage, partition_grad=partition_grad, max_norm=max_norm, clip_grad_norm=clip_grad_norm,
            process_group=process_group, dp_process_group=dp_process_group, extra_dp_group=extra_dp_group,
            pg_to_param_list=pg_to_param_list, communication_dtype=communication_dtype,
            fp8_communication=fp8_communication, forced_dtype=forced_dtype, backward_context=backward_context,
        )  # fmt: skip
        if reduce_bucket_size is None:
            reduce_bucket_size = default_bucket_size(
                args.process_group, elsewhere=COLOSSAL_OPTIMIZER_BUCKET_SIZE
            )
        check_args(args.stage, reduce_bucket_size, args.max_norm, dtype_for_loss_scaling, param_gather)
        self.norm_type = check_clip_args(1.0, norm_type)
        force_dtype(inner, args.forced_dtype)
        process_group = args.process_group
        self._world, self._rank = group_facts(process_group)
        self.process_group = process_group
        self.param_gather = resolve_param_gather(param_gather, self._world, process_group)
        self.comm_algorithm = resolve_comm_algorithm(
            comm_algorithm, stage=args.stage, world_size=self._world, process_group=process_group
        )
        self.stage = args.stage
        self.reduce_bucket_size = reduce_bucket_size
        self.overlap_communication = bool(overlap_communication)
        self.overlap_allgather = bool(overlap_allgather)
        self.cpu_offload = bool(cpu_offload)
        self.master_weights = bool(master_weights)
        self.max_norm = float(args.max_norm)
        self.verbose = bool(verbose)
        self.backward_context = backward_context
        self.communication = args.wire
        self.optim = inner

        working_groups = [dict(g) for g in inner.param_groups]
        super().__init__([{**g, "params": list(g["params"])} for g in working_groups], dict(inner.defaults))
        self._built = True
        self._layout = build_layout(
            self.param_groups,
            self._world,
            self._rank,
            group=process_group,
            master_weights=self.master_weights,
            master_device=torch.device("cpu") if self.cpu_offload else None,
        )
        for g, group in enumerate(inner.param_groups):
            group["params"] = [s.master for s in self._layout.group_slots(g) if s.valid > 0]
        invalidate_cache(inner)
        self._reducer = GradReducer(
            self._layout.slots,
            stage=self.stage,
            bucket_size=reduce_bucket_size,
            overlap=self.overlap_communication,
            group=process_group,
            world_size=self._world,
            rank=self._rank,
            wire=self.communication,
            algorithm=self.comm_algorithm,
        )
        self._pieces = GradPieces(self._layout, self._reducer)
        fp16 = any(s.param.dtype == torch.float16 for s in self._layout.slots)
        self._scaling = dtype_for_loss_scaling == "fp16" or fp16
        # the overflow verdict must be the same on every rank (each sees only its pieces)
        scaler_group = (
            None if self._world == 1 else process_group if process_group is not None else dist.group.WORLD
        )
        self.scaler = DynamicLossScaler(**scaler_args, process_group=scaler_group)
        self._stepped_on_cpu = False
        self._gather: GatherInFlight | None = None  # an overlapped parameter gather still on the wire
        self._staging = StagingBuffers()
        self.last_step_skipped = False
        self.skipped_steps = 0
        if self.verbose:
            logger.info("LowLevelZeroOptimizer: stage %d over %d ranks (rank %d), %d parameters, wire %s",
                        self.stage, self._world, self._rank, len(self._layout.slots), self.communication)  # fmt: skip

    # -- public flags --------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks in the data-parallel group."""
        return self._world

    @property
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._rank

    @property
    def layout(self) -> ShardLayout:
        """How the working parameters are sharded: slots (this rank's pieces, masters, reduced gradient
        pieces), partitions and the group (read-only view for checkpoints, tests and benchmarks)."""
        return self._layout

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when no loss scaling is in use)."""
        return self.scaler.get_scale() if self._scaling else 1.0

    @property
    def collective_counts(self) -> Any:
        """How many gradient reduce-scatters / all-reduces were launched so far, and how many times
        :meth:`sync_grads` completed a step's reduction (``syncs``)."""
        return self._reducer.counter

    @property
    def has_reduced_grads(self) -> bool:
        """Whether part of the current gradients already sits reduced in this rank's pieces (or in flight):
        true after a synchronised backward, false after :meth:`zero_grad` and while every backward since ran
        inside :meth:`no_sync` (then the window lives in the parameters' ``.grad``)."""
        return self._pieces.held

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the partitions are fixed once built."""
        if self._built:
            raise RuntimeError(
                "LowLevelZeroOptimizer: parameters are partitioned at construction; add the group to the inner "
                "optimizer before wrapping it."
            )
        super().add_param_group(param_group)

    # -- backward ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the loss scale when fp16 loss scaling is on."""
        if self._scaling:
            loss = self.scaler.scale(loss)
        with self._backward_context():
            loss.backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> None:
        """``torch.autograd.backward(tensor, grad)`` with ``grad`` scaled by the loss scale (fp16)."""
        if self._scaling:
            grad = self.scaler.scale(grad)
        with self._backward_context():
            torch.autograd.backward(tensor, grad, **kwargs)

    def _backward_context(self) -> AbstractContextManager[Any]:
        return self.backward_context() if self.backward_context is not None else nullcontext()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full local gradients in ``param.grad``; the next synchronised backward (or :meth:`step`)
        reduces the whole window once. Costs full-gradient memory for the window."""
        previous = self.require_grad_sync
        self.require_grad_sync = False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    # -- step ----------------------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronise (:meth:`sync_grads`), unscale (:meth:`unscale_`), skip on fp16 overflow (every rank
        agrees), clip (``max_norm``), step the pieces with the inner optimizer and all-gather them into the
        working parameters."""
        if self._closed:
            raise RuntimeError(
                "LowLevelZeroOptimizer.step(): the optimizer was closed (close()); build a new one."
            )
        if not self.require_grad_sync:
            raise RuntimeError(
                "LowLevelZeroOptimizer.step() was called inside no_sync(); step after the block, once the "
                "window's last backward ran with synchronisation on."
            )
        self.wait_for_param_gather()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.unscale_()  # synchronises first
        if self._scaling and self.scaler.found_inf:
            self.scaler.update()
            self.zero_grad(set_to_none=True)
            self.last_step_skipped = True
            self.skipped_steps += 1
            if self.verbose:
                logger.info("found overflow, step skipped (loss scale now %g)", self.loss_scale)
            return loss
        if self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm, self.norm_type)
        copy_hyperparameters(self.param_groups, self.optim.param_groups)
        slots = self._layout.slots
        for slot in slots:
            if slot.valid:
                slot.master.grad = slot.grad
        try:
            self.optim.step()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            if self.cpu_offload and not self._stepped_on_cpu:
                raise cpu_step_error(self.optim, exc) from exc
            raise
        finally:
            for slot in slots:
                slot.master.grad = None
        self._stepped_on_cpu = True
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        if self.overlap_allgather and self._world > 1:
            self._gather = launch_gather(
                self._layout, self.param_gather, chunk=GATHER_CHUNK, staging=self._staging
            )
            self._gather.wait_in_forward()
        else:
            gather_params(self._layout, self.param_gather, staging=self._staging)
        if self._scaling:
            self.scaler.update()
        self._pieces.unscaled = False
        self.last_step_skipped = False
        return loss

    def wait_for_param_gather(self) -> None:
        """Finish an overlapped parameter gather (``overlap_allgather``): afterwards every working parameter
        holds the last step's values. Nothing to do without one in flight."""
        if self._gather is not None:
            self._gather.wait_all()
            self._gather = None

    def __repr__(self) -> str:
        return (
            f"LowLevelZeroOptimizer(stage={self.stage}, world_size={self._world}, "
            f"cpu_offload={self.cpu_offload}, inner={type(self.optim).__name__})"
        )
