# SPDX-License-Identifier: Apache-2.0
"""What importing stepforge.mmengine (and .override) puts into mmengine's registries."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from mmengine.optim import build_optim_wrapper
from mmengine.registry import OPTIM_WRAPPERS, OPTIMIZERS, PARAM_SCHEDULERS, STRATEGIES

import stepforge.mmengine as sm
from stepforge.fused import CPUAdam, FusedAdam, HybridAdam
from stepforge.optim import Lamb, Lars
from stepforge.strategy import AmpOptimWrapper, ColossalAIOptimWrapper
from stepforge.strategy.schedulers import SCHEDULERS
from stepforge.zero import ZeroRedundancyOptimizer


def test_optimizers_and_wrappers_are_registered_with_the_stepforge_prefix():
    expected = {
        "StepforgeCPUAdam": CPUAdam,
        "StepforgeHybridAdam": HybridAdam,
        "StepforgeFusedAdam": FusedAdam,
        "StepforgeLamb": Lamb,
        "StepforgeLars": Lars,
        "StepforgeZeroRedundancyOptimizer": ZeroRedundancyOptimizer,
    }
    for name, cls in expected.items():
        assert OPTIMIZERS.get(name) is cls, name
    assert OPTIM_WRAPPERS.get("StepforgeColossalAIOptimWrapper") is ColossalAIOptimWrapper
    assert OPTIM_WRAPPERS.get("StepforgeAmpOptimWrapper") is AmpOptimWrapper
    assert STRATEGIES.get("StepforgeStrategy") is sm.StepforgeStrategy
    # mmengine's own entries are untouched by the plain import
    assert OPTIMIZERS.get("ZeroRedundancyOptimizer") is not ZeroRedundancyOptimizer
    assert OPTIM_WRAPPERS.get("AmpOptimWrapper") is not AmpOptimWrapper


def test_every_stepforge_scheduler_name_resolves_in_mmengine():
    # mmengine 0.10 has all of them (same semantics), so none is replaced
    for name in SCHEDULERS:
        assert PARAM_SCHEDULERS.get(name) is not None, name
    assert "param_scheduler" not in sm.registered_names()


def test_build_optim_wrapper_with_a_prefixed_name_builds_our_optimizer():
    model = torch.nn.Linear(4, 2)
    wrapper = build_optim_wrapper(
        model, dict(type="OptimWrapper", optimizer=dict(type="StepforgeCPUAdam", lr=0.1, weight_decay=0.0))
    )
    assert type(wrapper.optimizer) is CPUAdam
    reference = torch.optim.Adam(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    reference.param_groups[0]["params"][0].data.copy_(model.weight.data)
    reference.param_groups[0]["params"][1].data.copy_(model.bias.data)
    x = torch.randn(8, 4)
    wrapper.update_params(model(x).square().mean())
    ref_w, ref_b = reference.param_groups[0]["params"]
    torch.nn.functional.linear(x, ref_w, ref_b).square().mean().backward()
    reference.step()
    torch.testing.assert_close(model.weight.data, ref_w.data)
    torch.testing.assert_close(model.bias.data, ref_b.data)


def test_override_takes_the_colossalai_names_in_a_fresh_process():
    # a subprocess: the override must not leak into this process's registries (other tests rely on them)
    code = (
        "from mmengine.registry import OPTIMIZERS, OPTIM_WRAPPERS, STRATEGIES\n"
        "import stepforge.mmengine\n"
        "assert 'CPUAdam' not in OPTIMIZERS.module_dict or OPTIMIZERS.get('CPUAdam').__module__.startswith('colossalai')\n"
        "import stepforge.mmengine.override\n"
        "from stepforge.fused import CPUAdam, HybridAdam\n"
        "from stepforge.optim import Lamb\n"
        "from stepforge.strategy import ColossalAIOptimWrapper\n"
        "assert OPTIMIZERS.get('CPUAdam') is CPUAdam and OPTIMIZERS.get('HybridAdam') is HybridAdam\n"
        "assert OPTIMIZERS.get('Lamb') is Lamb\n"
        "assert OPTIM_WRAPPERS.get('ColossalAIOptimWrapper') is ColossalAIOptimWrapper\n"
        "assert STRATEGIES.get('ColossalAIStrategy') is stepforge.mmengine.StepforgeColossalAIStrategy\n"
        "assert OPTIMIZERS.get('ZeroRedundancyOptimizer').__module__.startswith('mmengine')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


_OVERRIDE_FIRST = "import stepforge.mmengine.override\nfrom mmengine.runner import FlexibleRunner, Runner\n"
_RUNNER_FIRST = "from mmengine.runner import FlexibleRunner, Runner\nimport stepforge.mmengine.override\n"
# a config's custom_imports, processed as Config.fromfile(import_custom_modules=True) does, before the runner
_CUSTOM_IMPORTS = (
    "from mmengine.config import Config\n"
    "from mmengine.utils import import_modules_from_strings\n"
    "cfg = Config(dict(custom_imports=dict(imports=['stepforge.mmengine.override'], allow_failed_imports=False)))\n"
    "import_modules_from_strings(**cfg.custom_imports)\n"
    "from mmengine.runner import FlexibleRunner, Runner\n"
)


@pytest.mark.parametrize(
    "imports",
    [_OVERRIDE_FIRST, _RUNNER_FIRST, _CUSTOM_IMPORTS],
    ids=["override-first", "runner-first", "custom-imports-first"],
)
def test_override_works_before_or_after_mmengines_runner_is_imported(imports):
    # mmengine's own _strategy/colossalai.py registers ColossalAIOptimWrapper (without force) when the runner is
    # first imported; the override must neither collide with it nor be undone by it, in either order
    code = imports + (
        "from mmengine.registry import OPTIM_WRAPPERS, STRATEGIES\n"
        "import stepforge.mmengine\n"
        "from stepforge.strategy import ColossalAIOptimWrapper\n"
        "assert OPTIM_WRAPPERS.get('ColossalAIOptimWrapper') is ColossalAIOptimWrapper\n"
        "assert STRATEGIES.get('ColossalAIStrategy') is stepforge.mmengine.StepforgeColossalAIStrategy\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_zero_redundancy_optimizer_without_optimizer_type_is_a_type_error_through_mmengine():
    # mmengine's test_zero_redundancy_optimizer: a config without optimizer_type must raise TypeError (mmengine's
    # builder re-raises the same exception type with the class named in front)
    cfg = dict(
        optimizer=dict(type="StepforgeZeroRedundancyOptimizer", lr=0.01, weight_decay=0.9, momentum=1e-4)
    )
    with pytest.raises(TypeError, match="optimizer_type"):
        build_optim_wrapper(torch.nn.Linear(2, 2), cfg)


def test_register_all_is_idempotent():
    before = sm.registered_names()
    assert sm.register_all() == before


@pytest.mark.parametrize("kind", ["StepforgeLamb", "StepforgeLars"])
def test_pure_python_optimizers_build_from_mmengine_configs(kind):
    model = torch.nn.Linear(3, 3)
    wrapper = build_optim_wrapper(model, dict(optimizer=dict(type=kind, lr=0.01)))
    before = model.weight.detach().clone()
    wrapper.update_params(model(torch.ones(2, 3)).sum())
    assert not torch.equal(model.weight, before)
