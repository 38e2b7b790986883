# SPDX-License-Identifier: Apache-2.0
"""The kernel modules: loading them, choosing one per device, and calling them (contract: ``csrc/README.md``).

``_cpu`` is always built; ``_cuda`` only with ``STEPFORGE_CUDA=ON`` (or ``AUTO`` and nvcc found). Both expose the
same kernel functions, so callers take ``module_for(device)`` and never branch on the device. ``_cuda`` links the
CUDA runtime statically, so it imports on machines without a GPU; :func:`cuda_status` then says why it cannot run.

One :class:`KernelSpec` per update kernel (:data:`ADAM`, :data:`SGD`, :data:`LAMB`) gives the operator's schema,
the one call of the pybind kernel (:func:`call_kernel`) and the compiled step's operator call
(:func:`call_operator`): adding an Adam argument means the kernel and its binding, one :class:`Arg` in
:data:`ADAM`, and the class that puts the value into its param groups.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from stepforge.core import StepforgeError

__all__ = [
    "ADAM",
    "DTYPE_CODES",
    "LAMB",
    "SGD",
    "Arg",
    "BackendUnavailableError",
    "KernelSpec",
    "call_kernel",
    "call_operator",
    "cpu_features",
    "cpu_module",
    "cuda_available",
    "cuda_module",
    "cuda_status",
    "device_env",
    "device_kw",
    "device_path",
    "dtype_code",
    "get_num_threads",
    "has_cuda",
    "launch_ctx",
    "module_for",
    "set_cpu_isa",
    "set_num_threads",
]

#: dtype codes of the kernel contract (csrc/README.md); never reorder.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class BackendUnavailableError(StepforgeError, RuntimeError):
    """A kernel module needed for a tensor's device is not available; the message says how to get it."""


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"stepforge.fused.{name}"), ""
    except ImportError as exc:  # not built, or built for another Python / missing runtime libraries
        return None, f"{type(exc).__name__}: {exc}"


def cpu_module() -> ModuleType:
    """The ``_cpu`` kernel module; raises :class:`BackendUnavailableError` when it failed to import."""
    mod, why = _load("_cpu")
    if mod is None:
        raise BackendUnavailableError(
            "stepforge-fused: the CPU kernel module stepforge.fused._cpu could not be imported "
            f"({why}). Reinstall the package: pip install --force-reinstall packages/stepforge-fused"
        )
    return mod


def cuda_module() -> ModuleType:
    """The ``_cuda`` kernel module; raises :class:`BackendUnavailableError` when built without CUDA or when torch
    sees no CUDA device."""
    mod, why = _load("_cuda")
    if mod is None:
        raise BackendUnavailableError(
            "stepforge-fused was built without its CUDA module, so CUDA tensors cannot be stepped "
            f"({why}). Rebuild with nvcc on PATH: STEPFORGE_CUDA=ON pip install packages/stepforge-fused "
            "(architectures via STEPFORGE_CUDA_ARCHS, default '80;90')."
        )
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "stepforge-fused: CUDA tensors were passed but torch sees no CUDA device "
            "(torch.cuda.is_available() is False); move the parameters to a GPU machine or to the CPU."
        )
    return mod


def cuda_status() -> str:
    """One line for humans: built architectures and runtime, and the device or why there is none, e.g.
    ``"built for sm_90 (cubin), sm_90 (PTX); CUDA 13.0 (static runtime); 1 device(s): 0=NVIDIA H200 sm_90"``.

    Composed here from the module's small queries and torch's device names: the C++ status string this replaced
    crashed the process once a device was present (an H200, driver 580), while each of these queries ran fine.
    """
    mod, why = _load("_cuda")
    if mod is None:
        return (
            "stepforge-fused was built without CUDA; rebuild with STEPFORGE_CUDA=ON and nvcc on PATH "
            f"(STEPFORGE_CUDA=ON pip install --no-build-isolation packages/stepforge-fused) ({why})"
        )
    built = ", ".join(_describe_arch(a) for a in mod.built_archs())
    status = f"built for {built}; CUDA {mod.TOOLKIT_VERSION} (static runtime)"
    if not mod.available():
        try:
            mod.device_count()
        except RuntimeError as exc:
            status += f"; no CUDA driver/device: {exc}"
            if mod.driver_version() == 0:
                status += "; no NVIDIA driver is installed or loadable (libcuda.so)"
            return status
        return status + "; no CUDA device visible"
    if not torch.cuda.is_available():
        return status + f"; but torch {torch.__version__} cannot use CUDA (a CPU-only torch build?)"
    devices = []
    for d in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(d)
        devices.append(f"{d}={torch.cuda.get_device_name(d)} sm_{major}{minor}")
    return status + f"; {len(devices)} device(s): " + ", ".join(devices)


def _describe_arch(arch: str) -> str:
    """``"90-real"`` -> ``"sm_90 (cubin)"``, ``"90-virtual"`` -> ``"sm_90 (PTX)"``."""
    sm, _, kind = arch.partition("-")
    return f"sm_{sm} ({'PTX' if kind == 'virtual' else 'cubin'})"


def cuda_available() -> bool:
    """Whether the CUDA kernels can run: module built, a device visible to it and to torch."""
    mod = _load("_cuda")[0]
    return mod is not None and bool(mod.available()) and torch.cuda.is_available()


def has_cuda() -> bool:
    """True when the ``_cuda`` module was built into this install (a GPU is not required)."""
    return _load("_cuda")[0] is not None


def module_for(device: torch.device) -> ModuleType:
    """The kernel module for tensors on ``device`` (``cpu`` -> ``_cpu``, ``cuda`` -> ``_cuda``); raises
    :class:`BackendUnavailableError` for other devices."""
    if device.type == "cpu":
        return cpu_module()
    if device.type == "cuda":
        return cuda_module()
    raise BackendUnavailableError(
        f"stepforge-fused has kernels for CPU and CUDA tensors only, got a tensor on {device}; "
        "move the parameters or use a torch.optim optimizer."
    )


def dtype_code(dtype: torch.dtype, *, what: str, owner: str) -> int:
    """Kernel dtype code of ``dtype``; raises a TypeError naming ``what`` for unsupported dtypes."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"{owner}: {what} has dtype {dtype}; the fused kernels support float32, float16 and bfloat16. "
            "Cast the parameter (e.g. model.float()) or use a torch.optim optimizer."
        ) from None


_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads used by the CPU kernels; ``None`` (default) follows ``torch.get_num_threads()`` at each call."""
    global _threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"set_num_threads: n must be a positive int or None, got {n!r}")
    _threads = n


def get_num_threads() -> int:
    """Threads the next CPU kernel call will use."""
    return _threads if _threads is not None else torch.get_num_threads()


def cpu_features() -> dict[str, Any]:
    """What the CPU module chose: ``isa`` (active path), ``supported``, ``compiled``, ``forced_by_env``
    (``STEPFORGE_CPU_ISA``), ``openmp``, ``num_threads`` (what the kernels will use) and raw ``cpu_flags``."""
    info = dict(cpu_module().cpu_features())
    info["num_threads"] = get_num_threads()
    return info


def set_cpu_isa(name: str) -> None:
    """Switch the CPU kernel path at run time (``"scalar"``, ``"avx2"``, ``"avx512"`` or ``"auto"``)."""
    cpu_module().set_isa(name)


def device_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the sync-free device path (CUDA)."""
    return device.type == "cuda"


def device_env(device: torch.device) -> tuple[int, int]:
    """``(ctx, device index)`` of a CUDA launch: the caller's current stream on that device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.current_stream(index).cuda_stream), index


def device_kw(device: torch.device) -> dict[str, Any]:
    """Extra keyword for the CUDA module: the device index (the CPU module takes none)."""
    if device.type == "cuda":
        return {"device": device.index if device.index is not None else torch.cuda.current_device()}
    return {}


def launch_ctx(module: ModuleType, device: torch.device) -> int:
    """The ``ctx`` argument of a launch: CPU kernel threads, or the current CUDA stream handle."""
    if device.type == "cpu":
        return get_num_threads()
    return int(torch.cuda.current_stream(device).cuda_stream)


@dataclass(frozen=True)
class Arg:
    """One hyper-parameter of a kernel: its operator argument ``name`` and ``type`` (``"float"``/``"bool"``),
    and where the param group keeps it: ``key``, and ``index`` in a tuple value (``betas``, ``trust_clip``)."""

    name: str
    type: str
    key: str
    index: int | None = None


@dataclass(frozen=True)
class KernelSpec:
    """What one update kernel takes besides the shared arguments (:func:`call_kernel`): the pybind ``kernel``
    name, the operator ``op``, ``(state key, operator list name)`` per state list and ``hyper``, in kernel order;
    ``first_run``: its per-tensor argument is SGD's first-run flags (else the step counts); ``optional_states``:
    the state lists may be empty (SGD without momentum)."""

    kernel: str
    op: str
    states: tuple[tuple[str, str], ...]
    hyper: tuple[Arg, ...]
    first_run: bool = False
    optional_states: bool = False
    #: the state keys of ``states`` (the bucket's pointer arrays by role)
    state_keys: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _readers: tuple[tuple[str, int | None, type], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (key, index, conversion) per hyper-parameter: values() runs at every launch, so plain lookups only
        readers = tuple((a.key, a.index, float if a.type == "float" else bool) for a in self.hyper)
        object.__setattr__(self, "_readers", readers)
        object.__setattr__(self, "state_keys", tuple(key for key, _name in self.states))

    def values(self, group: dict[str, Any]) -> list[float | bool]:
        """The hyper-parameters of ``group``, in kernel order."""
        return [conv(group[key] if i is None else group[key][i]) for key, i, conv in self._readers]

    def schema(self) -> str:
        """The operator schema: ``Tensor(x!)`` marks what it writes (never the gradients)."""
        marks = iter("abcde")  # found_inf is always (f!): the schemas registered before this spec existed
        args = [f"Tensor({next(marks)}!)[] params", "Tensor[] grads"]
        args += [f"Tensor({next(marks)}!)[] {name}" for _key, name in self.states]
        args.append(f"Tensor({next(marks)}!)[] masters")
        args.append(
            f"Tensor({next(marks)}!)? first_run" if self.first_run else f"Tensor({next(marks)}!) steps"
        )
        args += ["float lr", "Tensor? lr_tensor", *(f"{a.type} {a.name}" for a in self.hyper)]
        args += [
            "float grad_divisor",
            "Tensor? grad_divisor_tensor",
            "Tensor(f!)? found_inf",
            "bool check_finite",
        ]
        return f"{self.op}({', '.join(args)}, bool stochastic_rounding, int seed) -> ()"


_BETAS = (Arg("beta1", "float", "betas", 0), Arg("beta2", "float", "betas", 1), Arg("eps", "float", "eps"))
_ADAM_STATES = (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs"))

#: Adam/AdamW (FusedAdam, CPUAdam, HybridAdam; adam_math.h)
ADAM = KernelSpec(
    "adam",
    "adam_",
    _ADAM_STATES,
    (
        *_BETAS,
        Arg("weight_decay", "float", "weight_decay"),
        Arg("adamw_mode", "bool", "adamw_mode"),
        Arg("bias_correction", "bool", "bias_correction"),
    ),
)

#: SGD with momentum/nesterov/dampening (FusedSGD; sgd_math.h)
SGD = KernelSpec(
    "sgd",
    "sgd_",
    (("momentum_buffer", "momentum_buffers"),),
    (
        Arg("momentum", "float", "momentum"),
        Arg("dampening", "float", "dampening"),
        Arg("weight_decay", "float", "weight_decay"),
        Arg("nesterov", "bool", "nesterov"),
        Arg("wd_after_momentum", "bool", "wd_after_momentum"),
    ),
    first_run=True,
    optional_states=True,
)

#: LAMB (FusedLAMB; lamb_math.h): apex's names (``adam_w_mode``); the last two are the trust-ratio clamp
LAMB = KernelSpec(
    "lamb",
    "lamb_",
    _ADAM_STATES,
    (
        *_BETAS,
        Arg("weight_decay", "float", "weight_decay"),
        Arg("adam_w_mode", "bool", "adam_w_mode"),
        Arg("bias_correction", "bool", "bias_correction"),
        Arg("grad_averaging", "bool", "grad_averaging"),
        Arg("use_nvlamb", "bool", "use_nvlamb"),
        Arg("trust_clip_min", "float", "trust_clip", 0),
        Arg("trust_clip_max", "float", "trust_clip", 1),
    ),
)


def call_kernel(
    module: ModuleType,
    spec: KernelSpec,
    ptrs: list[Any],
    sizes: Any,
    per_tensor: Any,
    dtypes: tuple[int, int],
    lr: float,
    hyper: list[Any],
    divisor: float,
    found_inf_ptr: int,
    check_finite: bool,
    ctx: int,
    **kw: Any,
) -> Any:
    """The one call of an update kernel, in the binding's order (``csrc/README.md``): pointer arrays (params,
    grads, ``spec``'s states, masters; ``None`` for an empty list), sizes, per-tensor steps or SGD's first-run
    flags, dtype codes, lr, ``hyper``, divisor, ``found_inf`` address, finite check, ``ctx`` (CPU threads / CUDA
    stream) and the binding's keywords ``kw``. The eager step and the operators both call it. Returns whether the
    kernel's finite check skipped the update (None: decided on the device)."""
    fn = getattr(module, spec.kernel)
    return fn(*ptrs, sizes, per_tensor, *dtypes, lr, *hyper, divisor, found_inf_ptr, check_finite, ctx, **kw)


def call_operator(
    spec: KernelSpec,
    group: dict[str, Any],
    lists: list[list[torch.Tensor]],
    per_tensor: torch.Tensor | None,
    grad_divisor: float,
    grad_divisor_tensor: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    check_finite: bool,
) -> None:
    """The compiled step's call of ``spec``'s operator: ``lists`` = ``[params, grads, *states, masters]``,
    ``per_tensor`` the step counts (or SGD's first-run flags)."""
    # a tensor lr is read by the graph (no recompile when it changes), a float one is a constant
    lr = group["lr"]
    lr, lr_tensor = (0.0, lr) if isinstance(lr, torch.Tensor) else (float(lr), None)
    getattr(torch.ops.stepforge_fused, spec.op)(
        *lists, per_tensor, lr, lr_tensor, *spec.values(group), grad_divisor, grad_divisor_tensor, found_inf,
        check_finite, False, 0,
    )  # fmt: skip
