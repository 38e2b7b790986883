# SPDX-License-Identifier: Apache-2.0
"""Registries filled from entry points: one per plugin kind, scanned once, loaded lazily by name.

Names are matched ignoring case, ``-`` and ``_`` (``FusedAdam`` == ``fused_adam`` == ``fused-adam``).
Precedence: in-process :meth:`Registry.register` > entry points of installed distributions > built-ins
(``torch.optim`` classes for the optimizer registry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from .errors import DuplicateNameError, UnknownNameError

__all__ = [
    "Registry",
    "RegistryEntry",
    "normalize_name",
    "OPTIMIZERS",
    "PLUGINS",
    "OPTIM_WRAPPERS",
    "INSTALL_HINTS",
]

T = TypeVar("T")


def normalize_name(name: str) -> str:
    """The lookup key of ``name``: lower case without ``-`` and ``_``."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"a registry name must be a non-empty str, got {name!r}")
    return name.strip().lower().replace("-", "").replace("_", "")


@dataclass(frozen=True)
class RegistryEntry:
    """Where a name comes from, known without importing it."""

    name: str  # as declared
    source: str  # "entry point", "register()" or "built-in"
    distribution: str | None  # the distribution that declared it (entry points only)
    target: str  # "module:attr", or the object's qualified name


# Known stepforge names and the distribution that provides each (the install hint for unknown names).
INSTALL_HINTS: dict[str, dict[str, str]] = {
    "stepforge.optimizers": {
        "Lamb": "stepforge-optim",
        "Lars": "stepforge-optim",
        "FusedAdam": "stepforge-fused",
        "FusedLAMB": "stepforge-fused",
        "FusedSGD": "stepforge-fused",
        "CPUAdam": "stepforge-fused",
        "HybridAdam": "stepforge-fused",
        "ZeroRedundancyOptimizer": "stepforge-zero",
    },
    "stepforge.plugins": {
        "single": "stepforge-strategy",
        "torch_ddp": "stepforge-strategy",
        "ddp": "stepforge-strategy",
        "TorchDDPPlugin": "stepforge-strategy",
        "torch_fsdp": "stepforge-strategy",
        "fsdp": "stepforge-strategy",
        "TorchFSDPPlugin": "stepforge-strategy",
        "gemini": "stepforge-strategy",
        "GeminiPlugin": "stepforge-strategy",
        "low_level_zero": "stepforge-zero",
        "lowlevel-zero": "stepforge-zero",
        "LowLevelZeroPlugin": "stepforge-zero",
        "zero1": "stepforge-zero",
        "zero2": "stepforge-zero",
    },
    "stepforge.optim_wrappers": {
        "OptimWrapper": "stepforge-accum",
        "AmpOptimWrapper": "stepforge-strategy",
        "ColossalAIOptimWrapper": "stepforge-strategy",
    },
}


class Registry(Generic[T]):
    """Name -> object map for one entry-point ``group`` (``"stepforge.optimizers"``) of ``kind`` objects (for
    messages); ``builtins`` is called once, lazily, for fallback objects (``torch.optim`` classes);
    ``install_hints`` maps known names to the distribution that provides them."""

    def __init__(
        self,
        group: str,
        kind: str,
        *,
        builtins: Callable[[], Mapping[str, T]] | None = None,
        install_hints: Mapping[str, str] | None = None,
    ) -> None:
        self.group = group
        self.kind = kind
        self._builtins_factory = builtins
        self._hints = {normalize_name(k): (k, v) for k, v in (install_hints or {}).items()}
        self._registered: dict[str, tuple[str, T]] = {}
        self._loaded: dict[str, T] = {}
        self._scan: dict[str, list[EntryPoint]] | None = None
        self._builtins: dict[str, tuple[str, T]] | None = None
        self._lock = threading.RLock()

    # -- discovery -------------------------------------------------------------------------------------
    def _entry_points(self) -> dict[str, list[EntryPoint]]:
        with self._lock:
            if self._scan is None:
                scan: dict[str, list[EntryPoint]] = {}
                seen: set[tuple[str | None, str, str]] = set()
                for ep in entry_points(group=self.group):
                    dist = ep.dist.name if ep.dist is not None else None
                    # one distribution found twice on sys.path (editable + site) is not a conflict
                    key = (dist, normalize_name(ep.name), ep.value)
                    if key in seen:
                        continue
                    seen.add(key)
                    scan.setdefault(normalize_name(ep.name), []).append(ep)
                self._scan = scan
            return self._scan

    def _builtin_map(self) -> dict[str, tuple[str, T]]:
        with self._lock:
            if self._builtins is None:
                objects = self._builtins_factory() if self._builtins_factory else {}
                self._builtins = {normalize_name(k): (k, v) for k, v in objects.items()}
            return self._builtins

    def refresh(self) -> None:
        """Forget the entry-point scan and loaded objects (after installing a distribution at run time)."""
        with self._lock:
            self._scan = None
            self._loaded.clear()

    # -- registration ----------------------------------------------------------------------------------
    def register(self, name: str, obj: T | None = None, *, override: bool = False) -> Any:
        """Register ``obj`` under ``name`` in this process; usable as a decorator when ``obj`` is omitted.

        Raises:
            DuplicateNameError: ``name`` is already registered in-process or declared by an installed
                distribution, and ``override`` is False.
        """
        if obj is None:

            def decorator(target: T) -> T:
                self.register(name, target, override=override)
                return target

            return decorator
        key = normalize_name(name)
        with self._lock:
            if not override:
                if key in self._registered:
                    raise DuplicateNameError(
                        f"{self.kind} name {name!r} is already registered in this process "
                        f"(as {self._registered[key][0]!r}); pass override=True to replace it."
                    )
                claims = self._entry_points().get(key, [])
                if claims:
                    raise DuplicateNameError(
                        f"{self.kind} name {name!r} is already provided by distribution "
                        f"{_dist_name(claims[0])!r} ({claims[0].value}); pass override=True to replace it."
                    )
            self._registered[key] = (name, obj)
            self._loaded.pop(key, None)
        return obj

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (entry points cannot be removed)."""
        with self._lock:
            key = normalize_name(name)
            self._registered.pop(key, None)
            self._loaded.pop(key, None)

    # -- lookup ----------------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object registered as ``name``, importing its module on first use.

        Raises:
            UnknownNameError: no such name; the message lists available names and the distribution to
                install for known stepforge names.
            DuplicateNameError: two installed distributions declare the name.
        """
        key = normalize_name(name)
        with self._lock:
            if key in self._registered:
                return self._registered[key][1]
            if key in self._loaded:
                return self._loaded[key]
            claims = self._entry_points().get(key)
            if claims:
                if len(claims) > 1:
                    owners = " and ".join(f"{_dist_name(ep)!r} ({ep.value})" for ep in claims)
                    raise DuplicateNameError(
                        f"{self.kind} name {name!r} is declared in entry-point group {self.group!r} by "
                        f"{owners}; uninstall one of them."
                    )
                ep = claims[0]
                try:
                    obj: T = ep.load()

                except Exception as exc:
                    raise ImportError(
                        f"could not load {self.kind} {name!r} from distribution {_dist_name(ep)!r} "
                        f"({ep.value}): {exc}"
                    ) from exc
                self._loaded[key] = obj
                return obj
            builtins = self._builtin_map()
            if key in builtins:
                return builtins[key][1]
        raise UnknownNameError(self._unknown_message(name, key))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = normalize_name(name)
        return key in self._registered or key in self._entry_points() or key in self._builtin_map()

    def names(self) -> list[str]:
        """Every available name, as declared, sorted; nothing is imported."""
        return sorted(entry.name for entry in self.describe().values())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def describe(self) -> dict[str, RegistryEntry]:
        """Normalised name -> where it comes from, with the highest-precedence source for each name."""
        out: dict[str, RegistryEntry] = {}
        for key, (declared, obj) in self._builtin_map().items():
            out[key] = RegistryEntry(declared, "built-in", None, _qualname(obj))
        for key, claims in self._entry_points().items():
            ep = claims[0]
            out[key] = RegistryEntry(ep.name, "entry point", _dist_name(ep), ep.value)
        for key, (declared, obj) in self._registered.items():
            out[key] = RegistryEntry(declared, "register()", None, _qualname(obj))
        return out

    def _unknown_message(self, name: str, key: str) -> str:
        message = f"unknown {self.kind} {name!r}."
        if key in self._hints:
            declared, dist = self._hints[key]
            message += f" {declared} is provided by {dist}: pip install {dist}"
        else:
            message += " Available: " + ", ".join(self.names())
            missing = sorted({dist for k, (_, dist) in self._hints.items() if k not in self})
            if missing:
                message += ". More come with: " + ", ".join(f"pip install {d}" for d in missing)
        return message


def _dist_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "<unknown distribution>"


def _qualname(obj: object) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{name}"


def _torch_optimizers() -> dict[str, Any]:
    import torch.optim

    classes = {attr: getattr(torch.optim, attr) for attr in dir(torch.optim)}
    base = torch.optim.Optimizer
    return {k: v for k, v in classes.items() if isinstance(v, type) and issubclass(v, base) and v is not base}


OPTIMIZERS: Registry[Any] = Registry(
    "stepforge.optimizers",
    "optimizer",
    builtins=_torch_optimizers,
    install_hints=INSTALL_HINTS["stepforge.optimizers"],
)
PLUGINS: Registry[Any] = Registry(
    "stepforge.plugins", "plugin", install_hints=INSTALL_HINTS["stepforge.plugins"]
)
OPTIM_WRAPPERS: Registry[Any] = Registry(
    "stepforge.optim_wrappers", "optimizer wrapper", install_hints=INSTALL_HINTS["stepforge.optim_wrappers"]
)
