# SPDX-License-Identifier: Apache-2.0
"""Build a model without memory and materialise only what each rank keeps: ColossalAI's ``LazyInitContext``.

Under the context every tensor is created on the meta device and every operation that creates or writes one is
recorded. Materialising replays the record on ``default_device`` from the random state the context was entered
with, so every tensor gets an eager build's values under the same seed. The replay holds a tensor only while a
later operation reads it and hands each parameter or buffer to its destination after its last operation:
memory is the destination plus about the largest tensor. A model built under ``torch.device("meta")`` has no
record: its modules' ``reset_parameters()`` are recorded at ``boost`` (torch's convention). Unlike
ColossalAI's ``LazyTensor`` the tensors report the ``meta`` device and a value read during construction
raises."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stepforge.core.torch_compat import DispatchMode, apply_in_place, storage_id, tree_flatten, tree_unflatten

__all__ = ["LazyInitContext", "has_meta_tensors", "materialize_model", "lazy_state_names"]

#: in-place operations that write every element of their first argument without reading it
_OVERWRITES = {
    "aten::uniform_",
    "aten::normal_",
    "aten::fill_",
    "aten::zero_",
    "aten::random_",
    "aten::exponential_",
    "aten::geometric_",
    "aten::cauchy_",
    "aten::log_normal_",
    "aten::bernoulli_",
    "aten::copy_",
}


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


@dataclass(frozen=True)
class _Ref:
    """A recorded meta tensor: its storage and the view of it."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(storage_id(t), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


@dataclass
class _Op:
    func: Any
    spec: Any  # the pytree spec of (args, kwargs)
    leaves: list[Any]  # _Ref for meta tensors, the value itself otherwise
    created: list[tuple[int, int, int]]  # (output leaf index, storage key, storage numel) of new storages


@dataclass
class _Record:
    """What one :class:`LazyInitContext` (or one model's ``reset_parameters``) did to meta tensors."""

    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    device: torch.device
    ops: list[_Op] = field(default_factory=list)
    #: storage key -> a meta tensor of it (no memory), kept for good so that no other storage takes its key
    storages: dict[int, torch.Tensor] = field(default_factory=dict)
    #: set once replayed: the operations (and the real tensors they hold) are dropped
    materialized: bool = False


#: every record, by the storage keys it created or wrote (a materialised one keeps only its meta storages)
_RECORDS: dict[int, _Record] = {}


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


_META = torch.device("meta")


def _places(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` takes a device and makes a new tensor from no tensor or from a meta one (a factory,
    ``tensor.to(device)`` of a lazy tensor); a real tensor's move stays real (a loaded weight)."""
    if not any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
        return False
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    return not tensors or any(_is_meta(t) for t in tensors)


class _Recorder(DispatchMode):
    """Record every operation that creates or writes a meta tensor."""

    def __init__(self, record: _Record, *, create_on_meta: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        self.create_on_meta = create_on_meta

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.create_on_meta and _places(func, args, kwargs):
            # a factory (or a move of a meta tensor) creates on the meta device; the replay creates where it was
            # asked to (the CPU and "not given" mean the context's default device)
            asked = kwargs.get("device")
            kwargs["device"] = _META
            out = func(*args, **kwargs)
            if asked is not None and torch.device(asked).type not in ("cpu", "meta"):
                kwargs["device"] = torch.device(asked)
        else:
            out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        outs = tree_flatten(out)[0]
        if not any(_is_meta(x) for x in [*leaves, *outs]):
            return out
        known = self.record.storages
        inputs = {storage_id(x) for x in leaves if _is_meta(x)}
        created = [
            (i, storage_id(o), _storage_numel(o))
            for i, o in enumerate(outs)
            if _is_meta(o) and storage_id(o) not in known and storage_id(o) not in inputs
        ]
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if not created and not writes:
            return out  # a view or a metadata query: the storage references carry it
        for t in [*outs, *leaves]:
            if _is_meta(t):
                known.setdefault(storage_id(t), t.detach())
        refs = [_Ref.of(x) if _is_meta(x) else x for x in leaves]
        self.record.ops.append(_Op(func, spec, refs, created))
        return out


def _rng_state(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class LazyInitContext:
    """ColossalAI's ``LazyInitContext``: build a model inside it without allocating its tensors;
    ``Booster.boost`` materialises it where its plugin keeps it, :meth:`materialize` whole on
    ``default_device`` (default: the CPU)."""

    def __init__(
        self, tensor_cls: Any = None, default_device: str | torch.device | int | None = None
    ) -> None:
        if tensor_cls is not None:
            raise TypeError(
                "LazyInitContext: tensor_cls is ColossalAI's test hook and is not supported; leave it unset."
            )
        self.default_device = torch.device("cpu" if default_device is None else default_device)
        self._record: _Record | None = None
        self._recorder: _Recorder | None = None

    def __enter__(self) -> LazyInitContext:
        if self._record is not None:
            raise RuntimeError("LazyInitContext: the context is already entered; use a new one.")
        rng, cuda = _rng_state(self.default_device)
        self._record = _Record(rng, cuda, self.default_device)
        self._recorder = _Recorder(self._record, create_on_meta=True)
        self._recorder.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._recorder is not None and self._record is not None
        self._recorder.__exit__(*exc)  # type: ignore[no-untyped-call]
        for key in self._record.storages:
            _RECORDS[key] = self._record

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """Materialise every meta tensor of ``module`` in place, on the context's ``default_device`` (ColossalAI's
        method); returns ``module``. ``verbose``: print the bytes materialised."""
        record = lazy_state_names(module)
        device = record[0].device
        materialize_model(module, device, record=record)
        if verbose:
            total = sum(t.numel() * t.element_size() for t in module.state_dict().values())
            print(f"LazyInitContext.materialize: {total / 2**20:.1f} MiB materialised on {device}")
        return module

    @staticmethod
    def distribute(
        module: nn.Module, device_mesh: Any, sharding_spec_dict: Any, verbose: bool = False
    ) -> nn.Module:
        """ColossalAI's tensor-parallel distribution, not offered: raises ``ValueError`` naming the way that works
        (``torch_fsdp``/``gemini`` materialise each rank's shard)."""
        raise ValueError(
            "LazyInitContext.distribute: tensor-parallel sharding specs are not supported; pass the lazy model to "
            "Booster.boost with plugin='torch_fsdp' or 'gemini', which materialise only this rank's shards."
        )


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether a parameter or buffer of ``model`` (a DTensor's local shard) is on the meta device (it is lazy)."""
    from torch.distributed.tensor import DTensor

    return any(
        _is_meta(t.to_local() if isinstance(t, DTensor) else t)
        for t in [*model.parameters(), *model.buffers()]
    )


#: a state name -> the recorded view of its meta tensor; taken before a plugin replaces the tensors
LazyNames = dict[int, list[tuple[str, _Ref]]]


def lazy_state_names(model: nn.Module) -> tuple[_Record, LazyNames]:
    """The record that builds ``model``'s meta tensors and, per recorded storage, the state names viewing it;
    call it before the tensors are replaced (``fully_shard``, ``to_empty``)."""
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    metas = [(n, t) for n, t in named if _is_meta(t)]
    records = {
        id(_RECORDS[storage_id(t)]): _RECORDS[storage_id(t)] for _, t in metas if storage_id(t) in _RECORDS
    }
    if len(records) > 1:
        raise ValueError(
            "materialize: the model's meta tensors come from several LazyInitContext blocks; build the model in one."
        )
    if records:
        record = next(iter(records.values()))
    else:  # built under torch.device("meta"): record its modules' reset_parameters() now (torch's convention)
        rng, cuda = _rng_state(torch.device("cpu"))
        record = _Record(rng, cuda, torch.device("cpu"))
        with _Recorder(record, create_on_meta=False), torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    if record.materialized:
        raise ValueError(
            "materialize: this model's LazyInitContext was already materialised for another model; build each "
            "model in a LazyInitContext of its own."
        )
    names: LazyNames = {}
    for name, t in metas:
        names.setdefault(storage_id(t), []).append((name, _Ref.of(t)))
    return record, names


def _covers(ref: _Ref, numel: int) -> bool:
    """Whether the view ``ref`` is its whole storage of ``numel`` elements, contiguous."""
    expected = 1
    for size, stride in zip(reversed(ref.size), reversed(ref.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return ref.offset == 0 and expected == numel


def _lifetimes(record: _Record) -> tuple[dict[int, set[int]], dict[int, list[tuple[int, bool]]]]:
    """``(fresh, release)`` from the record: per operation index, the storages that get new memory at it (created,
    or overwritten whole: the previous value is never read again), and those whose value is last read at it, with
    whether that value is the storage's last one (the value its parameter or buffer keeps)."""
    fresh: dict[int, set[int]] = {}
    release: dict[int, list[tuple[int, bool]]] = {}
    last_use: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        new = {key for _, key, _ in op.created}
        target = op.leaves[0] if op.leaves and isinstance(op.leaves[0], _Ref) else None
        if (
            target is not None
            and op.func._schema.name in _OVERWRITES
            and _covers(target, _storage_numel(record.storages[target.key]))
        ):
            new.add(target.key)
        for key in new:
            if key in last_use:
                release.setdefault(last_use.pop(key), []).append((key, False))
        fresh[i] = new
        for leaf in op.leaves:
            if isinstance(leaf, _Ref):
                if leaf.key not in last_use and leaf.key not in new:
                    raise ValueError(
                        f"materialize: {op.func} reads a meta tensor nothing recorded initialises (made before the "
                        "record began); build the model under stepforge.strategy.LazyInitContext."
                    )
                last_use[leaf.key] = i
        for key in new:
            last_use[key] = i
    for key, at in last_use.items():
        release.setdefault(at, []).append((key, True))
    return fresh, release


def _replay(record: _Record, emit: Callable[[int, torch.Tensor], None]) -> None:
    """Run the record on its device from its random state; ``emit(key, flat)`` hands over each storage's last
    value after its last operation, and the replay drops it. The caller's random state is restored afterwards."""
    fresh, release = _lifetimes(record)
    device = record.device
    live: dict[int, torch.Tensor] = {}  # storage key -> its memory, flat
    saved_cpu = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state_all() if record.cuda_rng is not None else None
    torch.set_rng_state(record.rng)
    if record.cuda_rng is not None:
        torch.cuda.set_rng_state_all(record.cuda_rng)
    try:
        with torch.no_grad():
            for i, op in enumerate(record.ops):
                made = {key for _, key, _ in op.created}
                # overwritten whole: new memory (the op still runs: random stream)
                for key in fresh[i] - made:
                    meta = record.storages[key]
                    live[key] = torch.empty(_storage_numel(meta), dtype=meta.dtype, device=device)
                args, kwargs = tree_unflatten([_real(leaf, live, device) for leaf in op.leaves], op.spec)
                outs = tree_flatten(op.func(*args, **kwargs))[0]
                for index, key, numel in op.created:
                    live[key] = outs[index].as_strided((numel,), (1,), 0)
                for key, last in release.get(i, ()):
                    flat = live.pop(key)
                    if last:
                        emit(key, flat)
    finally:
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)


def _real(leaf: Any, live: dict[int, torch.Tensor], device: torch.device) -> Any:
    if isinstance(leaf, _Ref):
        base = live[leaf.key]
        if base.dtype != leaf.dtype:  # a view of the storage as another dtype (``tensor.view(torch.int32)``)
            base = base.view(leaf.dtype)
        return base.as_strided(leaf.size, leaf.stride, leaf.offset)
    if isinstance(leaf, torch.device) and leaf.type == "meta":
        return device
    return leaf


def materialize_model(
    model: nn.Module,
    device: torch.device,
    *,
    record: tuple[_Record, LazyNames] | None = None,
    on_host: Collection[str] = (),
) -> None:
    """Materialise ``model``'s meta tensors in place on ``device`` with an eager build's values, or each
    DTensor's shard (every rank replays the same record: no communication). ``record``:
    :func:`lazy_state_names` taken before the tensors were replaced (default: now); a tensor the record does
    not build raises, naming it. ``on_host``: names of parameters materialised on the CPU instead (FSDP2's
    CPU-offloaded shards), so that they never occupy ``device``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    rec, names = record if record is not None else lazy_state_names(model)
    known = set(rec.storages)
    missing = [n for key, views in names.items() if key not in known for n, _ in views]
    if missing:
        raise ValueError(
            f"materialize: {', '.join(missing[:5])} ({len(missing)} in all) of this meta-device model are not "
            "initialised by any module's "
            "reset_parameters(); build the model under stepforge.strategy.LazyInitContext (which records its "
            "whole construction) instead of torch.device('meta')."
        )
    # memory on device for the meta tensors, each parameter object kept (swapped in place: tied weights stay one
    # parameter and FSDP2 keeps its sharded parameters registered); the other tensors moved there
    host = {id(p) for name, p in model.named_parameters() if name in on_host}
    cpu = torch.device("cpu")

    def place(t: torch.Tensor) -> torch.Tensor:
        where = cpu if id(t) in host else device
        return torch.empty_like(t, device=where) if t.is_meta else t.to(where)

    apply_in_place(model, place)
    state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }

    def emit(key: int, flat: torch.Tensor) -> None:
        for name, ref in names.get(key, ()):
            value = _real(ref, {key: flat}, device)
            dest = state[name]
            with torch.no_grad():
                if isinstance(dest, DTensor):
                    local = distribute_tensor(value, dest.device_mesh, dest.placements, src_data_rank=None)
                    dest.to_local().copy_(local.to_local())
                else:
                    dest.copy_(value)

    _replay(rec, emit)
    rec.ops, rec.materialized = [], True
