# SPDX-License-Identifier: Apache-2.0
"""torch.optim state-dict compatibility, pickling and state creation of the fused optimizers.

State layout is ``torch.optim``'s (``step`` 0-dim float32, moments float32 shaped like the param), so a
``torch.optim.AdamW``/``SGD`` checkpoint loads into the fused classes and back. State tensors follow their
parameter: created on its device, moved when it moves, float32 whatever the parameter's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stepforge.core import GroupValidator, HyperParameterError

from ._huge_pages import float32_copy, float32_zeros_like
from ._step.buckets import BucketCache

__all__ = ["StateMixin"]


class StateMixin(torch.optim.Optimizer):
    """The state half of :class:`~._base.FusedOptimizerBase`: a ``torch.optim.Optimizer`` subclass, so its
    ``super()`` calls reach ``torch.optim.Optimizer`` (the MRO is ``FusedOptimizerBase, StateMixin, Optimizer``)."""

    _owner: str
    _uses_steps: bool
    _groups: GroupValidator
    _bucket_cache: BucketCache
    master_weights: bool

    _PICKLED_OPTIONS = ("master_weights", "skip_nonfinite", "assume_stable_grads", "set_grad_none")

    # Defined by FusedOptimizerBase (a subclass hook and a device helper); declared here for the type checker.
    if TYPE_CHECKING:

        def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]: ...

        @staticmethod
        def _device_path(device: torch.device) -> bool: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW``/``Adam``/``SGD`` (same state layout).

        Group options missing from ``state_dict`` (e.g. ``bias_correction`` in a torch checkpoint) keep this
        optimizer's current values, so a torch checkpoint never raises ``KeyError`` (apex #577); ``capturable``
        always keeps this optimizer's value. Steps saved on the CPU (torch's non-fused layout) move to a CUDA
        parameter's device at the next step (one copy), steps saved on a device are used in place.
        """
        self._check_loadable(state_dict)
        own = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        # torch.optim casts every floating state tensor to its param's dtype on load, which would round float32
        # moments and masters of fp16/bf16 params: keep the float32 values aside and put them back after.
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        own_params = [p for g in self.param_groups for p in g["params"]]
        wide: dict[int, dict[str, torch.Tensor]] = {}
        for pid, p in zip(saved_ids, own_params, strict=False):
            st = state_dict["state"].get(pid, {})
            keep = {
                k: v
                for k, v in st.items()
                if k != "step"
                and isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and v.dtype != p.dtype
            }
            if keep:
                wide[id(p)] = keep
        super().load_state_dict(state_dict)
        for p in own_params:
            for key, value in wide.get(id(p), {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        for old, group in zip(own, self.param_groups, strict=True):
            for key, value in old.items():
                group.setdefault(key, value)
            if "capturable" in old or "capturable" in group:
                # How this instance runs (device lr for CUDA graphs, CPU params allowed or not), not a property
                # of the checkpoint: keep the constructor's choice, whatever optimizer wrote the state.
                group["capturable"] = bool(old.get("capturable", False))
            self._check_loaded_group(group)
        self._groups.forget()
        for i, group in enumerate(self.param_groups):
            self._groups.validate(group, i)
        self._bucket_cache.invalidate()

    #: state keys a loaded state may hold besides ``step``, ``master_param`` and ``_state_keys(group)``.
    _extra_state_keys: tuple[str, ...] = ()

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Refuse, before anything changes, a state of another optimizer or of other parameters: every state
        key must be one this class uses and every state tensor must have its parameter's shape."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                f"{self._owner}.load_state_dict: expected a dict with 'state' and 'param_groups' "
                "(what optimizer.state_dict() returns)."
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{self._owner}.load_state_dict: the state has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}."
            )
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{self._owner}.load_state_dict: param group #{gi} has {len(saved['params'])} parameters in "
                    f"the state and {len(group['params'])} here."
                )
            allowed = {"step", "master_param", *self._state_keys(group), *self._extra_state_keys}
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"], strict=True)):
                entry = state_dict["state"].get(pid)
                if not entry:
                    continue
                for key, value in entry.items():
                    if key not in allowed:
                        raise ValueError(
                            f"{self._owner}.load_state_dict: state key {key!r} of parameter #{pi} (group {gi}) is "
                            f"not one {self._owner} uses ({', '.join(sorted(allowed))}); the state was saved by "
                            "another optimizer. Load it into that optimizer, or start this one afresh."
                        )
                    if key != "step" and isinstance(value, torch.Tensor) and value.shape != p.shape:
                        raise ValueError(
                            f"{self._owner}.load_state_dict: state[{key!r}] of parameter #{pi} (group {gi}) has "
                            f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; the state belongs to "
                            "other parameters."
                        )

    def _check_loaded_group(self, group: dict[str, Any]) -> None:
        if group.get("amsgrad", False):
            raise HyperParameterError(
                f"{self._owner}: the loaded state uses amsgrad=True, which is not supported."
            )
        if group.get("maximize", False):
            raise HyperParameterError(
                f"{self._owner}: the loaded state uses maximize=True, which is not supported."
            )

    def _torch_group_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        """Extra keys written into state_dict() groups so torch.optim loads them with the same semantics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for saved, group in zip(sd["param_groups"], self.param_groups, strict=True):
            for key, value in self._torch_group_keys(group).items():
                saved.setdefault(key, value)
        return sd

    def _init_state(
        self, p: torch.Tensor, group: dict[str, Any], moved: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Create (or normalise a loaded or moved) state for ``p``; returns (state, created_momentum_now).

        State follows its parameter: tensors move to the parameter's device and stay float32 (``moved``: the
        parameter got new storage since the last build, so a master copy is re-synced from it if they differ).
        """
        state = self.state[p]
        fresh = False
        if self._uses_steps and "step" not in state:
            # torch.optim layout: a 0-dim float32 tensor, on the param's device for CUDA params (as torch's
            # fused/capturable AdamW), so device steps need no host copy.
            state["step"] = torch.zeros(
                (), dtype=torch.float32, device=p.device if self._device_path(p.device) else None
            )
        for key in self._state_keys(group):
            buf = state.get(key)
            if buf is None:
                state[key] = float32_zeros_like(p)
                fresh = True
            elif buf.dtype != torch.float32 or buf.device != p.device or not buf.is_contiguous():
                # A torch checkpoint of fp16/bf16 params keeps low-precision moments: widen them (exact).
                state[key] = buf.to(device=p.device, dtype=torch.float32).contiguous()
            if state[key].shape != p.shape and moved:
                raise RuntimeError(
                    f"{self._owner}: a parameter was given new storage of shape {tuple(p.shape)} but its "
                    f"state['{key}'] has shape {tuple(state[key].shape)}; state cannot follow a change of size. "
                    "Start it afresh with `del optimizer.state[param]` (or rebuild the optimizer)."
                )
            if state[key].shape != p.shape:
                raise RuntimeError(
                    f"{self._owner}: state['{key}'] has shape {tuple(state[key].shape)} but its parameter has "
                    f"shape {tuple(p.shape)}; the loaded state does not belong to these parameters."
                )
        if self.master_weights and p.dtype != torch.float32:
            w = state.get("master_param")
            if w is None or w.shape != p.shape:
                state["master_param"] = float32_copy(p)
            else:
                if w.dtype != torch.float32 or w.device != p.device or not w.is_contiguous():
                    w = state["master_param"] = w.to(device=p.device, dtype=torch.float32).contiguous()
                if moved and not torch.equal(w.to(p.dtype), p.detach()):
                    # new values were put into the parameter (p.data = t, a load): they win over the master
                    w.copy_(p.detach())
        elif "master_param" in state:
            # the parameter became float32 (model.float()): it is its own master now, as in torch.optim
            del state["master_param"]
        self._adopt_state(p, state)
        return state, fresh

    def _adopt_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Hook called once ``p``'s state tensors exist: a subclass may move them (CPUAdam's NVMe offload)."""
