# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``: ZeRO-1/2 over ``torch.distributed`` with fp32 masters, loss scaling and CPU offload.

``opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)``, then per batch
``opt.backward(loss)`` (or ``loss.backward()`` without fp16 loss scaling), ``opt.step()``, ``opt.zero_grad()``.
Each rank holds only its piece (:mod:`stepforge.zero.state.partition`) of every trainable parameter's master
weights, gradient and optimizer state; the inner optimizer steps those pieces, and the updated pieces are
gathered into the working parameters (:mod:`stepforge.zero.comm.param_gather`). Gradients are averaged over the
ranks as DDP does, in buckets reduced from backward hooks (:mod:`stepforge.zero.comm.grad_reducer`), and become
final once per step, at :meth:`LowLevelZeroOptimizer.sync_grads`. See ``docs/low_level.md`` for the trade-offs.

Why this module runs past 400 lines: it is one class with ColossalAI's whole public member list (``torch.optim``
interface, gradients, master weights, state dicts, lifetime: 45 members, each with its docstring), and each
member is a few lines over the modules that do the work; the step itself is here (the reducer's sync, the inner
optimizer's step over the pieces, the gather: ``docs/design.md``'s step route).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import OPTIMIZERS, HyperParameterError
from stepforge.core.precision import DynamicLossScaler, validate_loss_scaler_args

from .comm.algorithm import bucket_size_for, comm_algorithm_for, param_gather_for
from .comm.grad_reducer import CollectiveCounter, GradReducer, WireFormat
from .comm.param_gather import GATHER_CHUNK, GatherInFlight, StagingBuffers, launch_gather
from .config import LowLevelZeroConfig, disagree, resolve_group, resolve_optimizer
from .phases import PhaseObserver, no_phase
from .state import dicts
from .state.partition import build_layout, managed_param_groups, padding

__all__ = ["LowLevelZeroOptimizer"]

#: ``verbose=True`` reports here at INFO (ColossalAI's "Found overflow. Skip step" and the sharding set-up)
logger = logging.getLogger("stepforge.zero")


class LowLevelZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any optimizer whose param groups hold the model's working parameters.

    ColossalAI's constructor, names, order and defaults (``colossalai.zero.LowLevelZeroOptimizer``; the README's
    table says where each one differs), plus stepforge's keyword-only names; a setting given under both names
    must agree. As in ColossalAI, only parameters that require grad are managed. The settings are kept as
    :class:`~stepforge.zero.config.LowLevelZeroConfig` (:attr:`config`).

    - ``initial_scale``, ``min_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``,
      ``max_scale``: the dynamic loss scaler (fp16 parameters or ``dtype_for_loss_scaling``).
    - ``communication_dtype``, ``fp8_communication``: the gradients' wire
      (:mod:`stepforge.zero.comm.grad_reducer`).
    - ``partition_grad``, ``stage``: ZeRO-2 (gradients reduce-scattered from backward hooks), or stage 1 or 2.
    - ``dp_process_group``, ``process_group``: the data-parallel group (``None``: the default group);
      ``extra_dp_group``: shard over the 2-D grid of both (:mod:`stepforge.zero.comm.grid`; collective).
    - ``clip_grad_norm``, ``max_norm``, ``norm_type``: clip the global gradient norm to this in every
      :meth:`step` (0: off).
    - ``param_gather``, ``comm_algorithm``: the collectives (``None``/``"auto"``: chosen per backend,
      :mod:`stepforge.zero.comm.algorithm`).

    Args:
        optimizer: a built optimizer over the working parameters, or a registry config such as
            ``dict(type="FusedAdam", lr=1e-3)`` together with ``params``.
        pg_to_param_list: ColossalAI's ``{group or (extra_dp_group, dp_group): parameters}`` with ONE group
            holding every parameter (MoE's several groups are refused); a non-mapping here is read as ``params``.
        reduce_bucket_size: padded elements per gradient bucket; ``None``: 4 Mi on gloo
            (``stepforge.zero.comm.algorithm.GLOO_BUCKET_SIZE``), ColossalAI's 1 Mi elsewhere.
        cpu_offload: masters, gradient pieces and optimizer state on the CPU, stepped there (an Adam-family
            config becomes stepforge-fused's ``CPUAdam`` when installed).
        forced_dtype: convert every working parameter to this dtype first (in place).
        master_weights: fp32 masters for fp16/bf16 working parameters (``False``: the working pieces are stepped).
        overlap_communication: launch the bucket reductions asynchronously during backward.
        overlap_allgather: :meth:`step` launches the gather of the updated pieces and returns; each module's next
            forward waits for its own parameters (read them before through :meth:`wait_for_param_gather`).
        backward_context: a callable returning a context manager entered around each backward.
        dtype_for_loss_scaling: ``"fp16"`` forces loss scaling, ``None`` turns it on for fp16 parameters.
        verbose: log skipped steps and the sharding set-up at INFO on the ``stepforge.zero`` logger.

    Attributes:
        last_step_skipped, skipped_steps: whether the last :meth:`step` was skipped for an fp16 overflow, and how
            many were.
    """

    _built = False  # set once the partitions exist: add_param_group is refused from then on
    #: whether :meth:`close` ran (the parameters' gradients are no longer taken by this optimizer)
    closed = False
    _last_grad_norm: float | None = None  # set by clip_grad_norm_ (and so by a step with max_norm > 0)

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
        if not isinstance(partition_grad, bool):
            raise HyperParameterError(
                f"LowLevelZeroOptimizer: partition_grad must be a bool (True: ZeRO-2), got {partition_grad!r}."
            )
        if stage is None:
            stage = 2 if partition_grad else 1
        elif partition_grad and stage != 2:
            raise disagree("stage", stage, "partition_grad", partition_grad)
        if max_norm is None:
            max_norm = clip_grad_norm
        elif clip_grad_norm not in (0, 0.0) and clip_grad_norm != max_norm:
            raise disagree("max_norm", max_norm, "clip_grad_norm", clip_grad_norm)
        scaler = validate_loss_scaler_args(
            "LowLevelZeroOptimizer", initial_scale=initial_scale, min_scale=min_scale,
            growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
            hysteresis=hysteresis, max_scale=max_scale,
        )  # fmt: skip
        config = LowLevelZeroConfig(
            stage=stage, reduce_bucket_size=reduce_bucket_size,
            communication_dtype=communication_dtype, fp8_communication=fp8_communication,
            comm_algorithm=comm_algorithm, param_gather=param_gather, overlap_communication=overlap_communication,
            overlap_allgather=overlap_allgather, cpu_offload=cpu_offload, master_weights=master_weights,
            forced_dtype=forced_dtype, max_norm=max_norm, norm_type=norm_type,
            dtype_for_loss_scaling=dtype_for_loss_scaling, scaler=scaler, verbose=verbose,
            backward_context=backward_context,
        )  # fmt: skip
        inner = resolve_optimizer(optimizer, params, cpu_offload=cpu_offload)
        group = resolve_group(
            inner, process_group, dp_process_group, extra_dp_group, pg_to_param_list, fp8_communication
        )
        self._build(inner, config, group)

    @classmethod
    def from_config(
        cls, optimizer: torch.optim.Optimizer, config: LowLevelZeroConfig, process_group: Any = None
    ) -> LowLevelZeroOptimizer:
        """ZeRO around ``optimizer`` with a :class:`~stepforge.zero.config.LowLevelZeroConfig` checked where it
        was made (``LowLevelZeroPlugin`` builds one and passes it to every optimizer it prepares), sharded over
        ``process_group`` (``None``: the default group)."""
        zero = cls.__new__(cls)
        zero._build(resolve_optimizer(optimizer, None, cpu_offload=config.cpu_offload), config, process_group)
        return zero

    def _build(self, inner: torch.optim.Optimizer, config: LowLevelZeroConfig, group: Any) -> None:
        """Derive what depends on the group, partition the trainable parameters, point the inner optimizer at
        this rank's master pieces and hook the gradient reduction."""
        if config.forced_dtype is not None:  # ColossalAI's: in place, the model keeps its parameter objects
            for param in (p for g in inner.param_groups for p in g["params"]):
                param.data = param.data.to(config.forced_dtype)
        self.config = config
        self.process_group = group
        #: the data-parallel group's size and this process's rank in it
        self.world_size, self.rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        elif group is not None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first."
            )
        backend = dist.get_backend(group) if self.world_size > 1 else None
        #: resolved for the group: padded elements per bucket, the wire, the bucket collective, the gather
        self.reduce_bucket_size = config.reduce_bucket_size or bucket_size_for(
            backend, self.world_size, elsewhere=config.default_bucket_size
        )
        self.communication = WireFormat(config.communication_dtype, config.fp8_communication)
        self.comm_algorithm = comm_algorithm_for(
            config.comm_algorithm, stage=config.stage, world_size=self.world_size, backend=backend
        )
        self.param_gather = config.param_gather or param_gather_for(backend)
        self.optim = inner
        super().__init__(managed_param_groups(inner.param_groups), dict(inner.defaults))
        self._built = True
        #: how the working parameters are sharded: slots (this rank's pieces, masters, reduced gradient pieces),
        #: partitions and the group (read-only, for checkpoints, tests and benchmarks)
        self.layout = build_layout(
            self.param_groups, self.world_size, self.rank, group=group, master_weights=config.master_weights,
            master_device=torch.device("cpu") if config.cpu_offload else None,
        )  # fmt: skip
        for g, group_ in enumerate(inner.param_groups):
            group_["params"] = [s.master for s in self.layout.group_slots(g) if s.valid > 0]
        dicts.invalidate_cache(inner)
        self._reducer = GradReducer(
            self.layout.slots, stage=config.stage, bucket_size=self.reduce_bucket_size,
            overlap=config.overlap_communication, group=group, world_size=self.world_size,
            rank=self.rank, wire=self.communication, algorithm=self.comm_algorithm,
        )  # fmt: skip
        fp16 = any(s.param.dtype == torch.float16 for s in self.layout.slots)
        self._scaling = config.dtype_for_loss_scaling == "fp16" or fp16
        # the overflow verdict must be the same on every rank (each sees only its pieces)
        world_group = group if group is not None else dist.group.WORLD
        self.scaler = DynamicLossScaler(
            **config.scaler, process_group=None if self.world_size == 1 else world_group
        )
        self._stepped_on_cpu = False
        self._gather: GatherInFlight | None = None  # an overlapped parameter gather still on the wire
        self._staging = StagingBuffers()
        self._phase: PhaseObserver = no_phase
        self.last_step_skipped = False
        self.skipped_steps = 0
        if config.verbose:
            logger.info("LowLevelZeroOptimizer: stage %d over %d ranks (rank %d), %d parameters, wire %s",
                        config.stage, self.world_size, self.rank, len(self.layout.slots), self.communication)  # fmt: skip

    # -- facts ---------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when no loss scaling is in use)."""
        return self.scaler.get_scale() if self._scaling else 1.0

    @property
    def collective_counts(self) -> CollectiveCounter:
        """How many gradient reduce-scatters / all-reduces were launched so far, and how many times
        :meth:`sync_grads` completed a step's reduction (``syncs``)."""
        return self._reducer.counter

    @property
    def has_reduced_grads(self) -> bool:
        """Whether part of the current gradients already sits reduced in this rank's pieces (or in flight):
        true after a synchronised backward, false after :meth:`zero_grad` and while every backward since ran
        inside :meth:`no_sync` (then the window lives in the parameters' ``.grad``)."""
        return self._reducer.held

    @property
    def require_grad_sync(self) -> bool:
        """Whether backward reduces gradients (``False`` inside ``no_sync``; a plugin may set it)."""
        return self._reducer.enabled

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        self._reducer.enabled = bool(value)

    @property
    def communication_buffer_bytes(self) -> int:
        """Bytes of communication buffers kept between steps for reuse, beside the gradient pieces (1/N of the
        gradients): the bucket buffers (at most the buckets in flight plus one) and the parameter gather's
        staging tables (the parameters below ``DIRECT_MIN`` elements, gathered through one table per chunk)."""
        return self._reducer.pool.held_bytes + self._staging.held_bytes

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the partitions are fixed once built."""
        if self._built:
            raise RuntimeError(
                "LowLevelZeroOptimizer: parameters are partitioned at construction; add the group to the inner "
                "optimizer before wrapping it."
            )
        super().add_param_group(param_group)

    # -- backward and gradients ----------------------------------------------------------------------------
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
        context = self.config.backward_context
        return context() if context is not None else nullcontext()

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

    def sync_grads(self) -> bool:
        """Make this step's gradients final: reduce what :meth:`no_sync` left in ``param.grad``, wait for the
        buckets in flight and add them into this rank's pieces. The one synchronisation point of a step: the
        first of :meth:`scale_grads_`, :meth:`unscale_`, :meth:`clip_grad_norm_` and :meth:`step` calls it, and
        it does nothing again until the next backward reaches a managed parameter or :meth:`zero_grad` runs.
        Inside :meth:`no_sync` it only waits for reductions in flight. Returns whether it synchronised."""
        return self._reducer.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the reduced gradient pieces and any local ``param.grad`` (waits for reductions in flight)."""
        self._reducer.zero_(set_to_none)

    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient the next step will use by ``factor`` (stepforge-accum's window weight)."""
        self.sync_grads()
        self._reducer.scale_(factor)

    def unscale_(self) -> None:
        """Divide the step's gradient pieces by the loss scale, once per step (no-op without fp16 scaling);
        ``scaler.found_inf`` then says whether any rank overflowed (the step will be skipped)."""
        self.sync_grads()
        self._reducer.unscale_(self.scaler if self._scaling else None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every rank's gradient pieces (one small all-reduce); returns that norm, by
        ``torch.nn.utils.clip_grad_norm_``'s rule ``min(1, max_norm / (norm + 1e-6))``, unscaled first."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
            raise HyperParameterError(f"clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}.")
        norm_type = float(norm_type)
        if not (norm_type > 0 or math.isinf(norm_type)):
            raise HyperParameterError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}.")
        self.unscale_()
        self._last_grad_norm = float(norm := self._reducer.clip_(max_norm, norm_type))
        return norm

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: object) -> float | None:
        """The global gradient norm of the last clipping (ColossalAI's member; ``norm_type`` and ``kwargs``
        are ignored there as here), recorded by every :meth:`step` with ``max_norm > 0``; ``None`` before any
        (without clipping stepforge skips that all-reduce, where ColossalAI always makes it)."""
        return self._last_grad_norm

    def get_param_grad(self, working_param: torch.Tensor) -> torch.Tensor | None:
        """The full reduced (averaged) gradient of ``working_param``, shaped and typed like it (ColossalAI's
        member; collective: every rank asks for the same parameter, synchronised first). Before ``unscale_`` it
        carries the fp16 loss scale; ``None`` without a backward since ``zero_grad``; ``KeyError`` for a parameter
        this optimizer does not manage."""
        slot = self.layout.slot_of(working_param)
        if slot is None:
            raise KeyError(
                "get_param_grad: working_param is not one of this optimizer's parameters; pass a parameter "
                "of the model the optimizer was built over."
            )
        return self._reducer.full_grad(slot)

    # -- step ----------------------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronise (:meth:`sync_grads`), unscale (:meth:`unscale_`), skip on fp16 overflow (every rank
        agrees), clip (``max_norm``), step the pieces with the inner optimizer and gather them into the
        working parameters."""
        if self.closed:
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
            if self.config.verbose:
                logger.info("found overflow, step skipped (loss scale now %g)", self.loss_scale)
            return loss
        if self.config.max_norm > 0:
            self.clip_grad_norm_(self.config.max_norm, self.config.norm_type)
        with self._phase("inner_step"):
            # the inner optimizer steps the master pieces: the wrapper's hyper-parameters go in (schedulers and
            # users edit param_groups), each reduced piece is its master's .grad for this step only, and what the
            # inner optimizer keeps in its groups (a per-group step count) comes back
            dicts.copy_hyperparameters(self.param_groups, self.optim.param_groups)
            for slot in self.layout.slots:
                if slot.valid:
                    slot.master.grad = slot.grad
            try:
                self.optim.step()
            except (RuntimeError, TypeError, NotImplementedError) as exc:
                if self.config.cpu_offload and not self._stepped_on_cpu:
                    hint = (
                        "install stepforge-fused and use CPUAdam (dict(type='CPUAdam', ...))"
                        if "CPUAdam" not in OPTIMIZERS
                        else "use dict(type='CPUAdam', ...) or a torch.optim optimizer without fused/capturable "
                        "CUDA options"
                    )
                    raise RuntimeError(
                        "LowLevelZeroOptimizer(cpu_offload=True): the inner optimizer "
                        f"{type(self.optim).__name__} cannot step the CPU-resident master shards "
                        f"({type(exc).__name__}: {exc}); {hint}, or set cpu_offload=False."
                    ) from exc
                raise
            finally:
                for slot in self.layout.slots:
                    slot.master.grad = None
            self._stepped_on_cpu = True
            dicts.copy_hyperparameters(self.optim.param_groups, self.param_groups)
        with self._phase("param_gather"):
            # overlapped: launched in chunks, each module's next forward waits for its own parameters
            overlap = self.config.overlap_allgather and self.world_size > 1
            gather = launch_gather(
                self.layout,
                self.param_gather,
                chunk=GATHER_CHUNK if overlap else None,
                staging=self._staging,
            )
            if overlap:
                gather.wait_in_forward()
                self._gather = gather
            else:
                gather.wait_all()
        if self._scaling:
            self.scaler.update()
        self._reducer.unscaled = False
        self.last_step_skipped = False
        return loss

    def wait_for_param_gather(self) -> None:
        """Finish an overlapped parameter gather (``overlap_allgather``): afterwards every working parameter
        holds the last step's values. Nothing to do without one in flight."""
        if self._gather is not None:
            self._gather.wait_all()
            self._gather = None

    def observe_phases(self, observer: PhaseObserver | None) -> None:
        """Run each phase of the step inside ``observer(name)`` (:mod:`stepforge.zero.phases`), e.g. to time
        ``cpu_offload``'s copies and CPU step; ``None`` removes the observer."""
        self._phase = observer if observer is not None else no_phase
        self._reducer.phase = self._phase

    def _force_wait_all_gather(self) -> None:
        """ColossalAI's name of :meth:`wait_for_param_gather` (its tests and plugins call it)."""
        self.wait_for_param_gather()

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop managing the working parameters: remove the backward hooks (a later backward fills
        ``param.grad`` as without ZeRO), finish the reductions in flight and drop the gradient pieces, so
        nothing but this object keeps the masters. Idempotent; a :meth:`step` afterwards raises."""
        if self.closed:
            return
        self.closed = True
        self.wait_for_param_gather()
        self._reducer.close()
        self._staging.clear()

    def __del__(self) -> None:
        # the hooks hold the reducer (and through it the masters) and would keep taking the gradients of a dead
        # optimizer's parameters; ColossalAI removes them here as well. No collective waits in a finaliser.
        reducer = self.__dict__.get("_reducer")  # absent when __init__ failed before building it
        if reducer is not None:
            reducer.remove_hooks()

    # -- master weights (ColossalAI's members) -------------------------------------------------------------
    @property
    def working_to_master_param(self) -> dict[int, torch.Tensor]:
        """ColossalAI's ``id(working parameter)`` -> this rank's 1-D master piece of it (``valid`` elements; a
        view into the parameter when it is its own master), a new dict at every read."""
        return {id(s.param): s.master for s in self.layout.slots}

    @property
    def master_to_working_param(self) -> dict[int, torch.Tensor]:
        """``id(master piece)`` -> the working parameter it belongs to (ColossalAI's mapping)."""
        return {id(s.master): s.param for s in self.layout.slots}

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """ColossalAI's getter of :attr:`working_to_master_param`."""
        return self.working_to_master_param

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        """ColossalAI's getter of :attr:`master_to_working_param`."""
        return self.master_to_working_param

    def get_param_padding_size(self, param: torch.Tensor) -> int:
        """Zeros that pad ``param``'s flat ``numel`` to ``world_size`` equal pieces (ColossalAI's member:
        ``pad(param.view(-1), (0, padding)).chunk(world_size)[rank]`` is this rank's piece; stepforge's master
        piece holds only its ``valid`` elements); ``KeyError`` for a parameter this optimizer does not manage."""
        return self.get_param_padding_map()[id(param)]

    def get_param_padding_map(self) -> dict[int, int]:
        """``id(working parameter)`` -> its padding (see :meth:`get_param_padding_size`)."""
        return {id(s.param): padding(s.numel, self.world_size) for s in self.layout.slots}

    def update_master_params(self, model: nn.Module | None = None) -> None:
        """Copy the working parameters into this rank's master pieces, e.g. after ``model.load_state_dict``:
        without it the next :meth:`step` (even at lr 0) writes the old masters back into the model. ``model``:
        only its parameters (ColossalAI's signature; ``None``: every one). No collective."""
        self.wait_for_param_gather()  # a gather landing after this copy would overwrite the weights again
        wanted = None if model is None else {id(p) for p in model.parameters()}
        with torch.no_grad():
            for slot in self.layout.slots:  # a master that is a view of its parameter already holds it
                if slot.valid and slot.separate_master and (wanted is None or id(slot.param) in wanted):
                    slot.master.copy_(slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid])

    # -- state dicts ---------------------------------------------------------------------------------------
    def _zero_extras(self) -> dict[str, Any]:
        # the scaler's counters as zero's checkpoints have always named them (the core scaler, like GradScaler,
        # prefixes an underscore and reads both): old DCP checkpoints, whose template keys must match, still load
        renamed = {"_growth_tracker": "growth_tracker", "_hysteresis_left": "hysteresis_left"}
        scaler = {renamed.get(key, key): value for key, value in self.scaler.state_dict().items()}
        return {"loss_scaler": scaler, "skipped_steps": self.skipped_steps}

    def scaler_state_dict(self) -> dict[str, Any] | None:
        """``None``: the loss scaler's state travels inside this optimizer's (``["zero"]["loss_scaler"]`` of both
        state dicts); ``scaler.state_dict()`` is the scaler's alone."""
        return None

    def load_scaler_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Load a loss-scaler state written apart (``DynamicLossScaler``'s or ``torch.amp.GradScaler``'s, or
        zero's own ``["zero"]["loss_scaler"]`` entry); ``None`` or ``{}`` change nothing."""
        if state:
            self.scaler.load_state_dict(state)

    def unwrap(self) -> torch.optim.Optimizer:
        """The inner optimizer, which steps this rank's master pieces (ColossalAI's ``OptimizerWrapper.unwrap``)."""
        return self.optim

    def state_dict(self) -> dict[str, Any]:
        """The full state in ``torch.optim`` layout keyed by global parameter index (collective: every rank
        must call it; every rank gets the full state). Extra key ``"zero"``: loss scaler, skip counter and the
        fp32 masters of low-precision parameters (:mod:`stepforge.zero.state.dicts`)."""
        self.wait_for_param_gather()
        return dicts.full_state_dict(self.layout, self.optim, self.param_groups, self._zero_extras())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict` at any world size, or a plain ``torch.optim`` one)."""
        self._load(state_dict, sharded=False)

    def sharded_state_dict(self, names: list[str] | None = None) -> dict[str, Any]:
        """This rank's pieces for ``torch.distributed.checkpoint`` in the layout every plugin shares: keyed by
        parameter name (``names``, one per parameter in param-group order; ``None``: the global index as a
        string), each tensor a :class:`stepforge.core.flat_shard.FlatShard` in its parameter's shape, no
        gathering (:mod:`stepforge.zero.state.dicts`). A never-stepped optimizer is laid out without stepping
        it, so the result is a template for ``dcp.load`` and nothing of the optimizer changes."""
        self._reducer.wait()
        self.wait_for_param_gather()
        if names is None:
            names = [str(slot.index) for slot in self.layout.slots]
        return dicts.named_state_dict(self.layout, self.optim, self.param_groups, names, self._zero_extras())

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`sharded_state_dict`'s form after ``torch.distributed.checkpoint.load`` filled it (saved by
        this optimizer at any world size, by another plugin, or in the index-keyed layout of earlier versions);
        a section of this optimizer's extras the checkpoint lacks (loss scaler, skip counter) is left as is."""
        self._load(state_dict, sharded=True)

    def _load(self, state_dict: Mapping[str, Any], *, sharded: bool) -> None:
        self._reducer.wait()
        self.wait_for_param_gather()
        zero = dicts.load_state_dict(self.layout, self.optim, self.param_groups, state_dict, sharded=sharded)
        if zero.get("loss_scaler"):  # a section the checkpoint lacks is left as it is
            self.scaler.load_state_dict(zero["loss_scaler"])
        self.skipped_steps = int(zero.get("skipped_steps", self.skipped_steps))

    def __repr__(self) -> str:
        return (
            f"LowLevelZeroOptimizer(stage={self.config.stage}, world_size={self.world_size}, "
            f"cpu_offload={self.config.cpu_offload}, inner={type(self.optim).__name__})"
        )
