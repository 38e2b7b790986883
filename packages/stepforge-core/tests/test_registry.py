# SPDX-License-Identifier: Apache-2.0
"""Registry: discovery through real entry points, laziness, duplicates, precedence, install hints."""

from __future__ import annotations

import sys

import pytest
import torch

from stepforge.core import (
    INSTALL_HINTS,
    OPTIMIZERS,
    DuplicateNameError,
    Registry,
    UnknownNameError,
    normalize_name,
)


def optimizer_registry() -> Registry:
    return Registry("stepforge.optimizers", "optimizer", install_hints=INSTALL_HINTS["stepforge.optimizers"])


@pytest.mark.parametrize("spelling", ["AlphaSGD", "alphasgd", "alpha_sgd", "ALPHA-SGD", " alpha-Sgd "])
def test_entry_point_is_found_under_any_spelling(installed_fixtures, spelling):
    registry = optimizer_registry()
    cls = registry.get(spelling)
    assert cls.__module__ == "sf_fixture_alpha"
    assert issubclass(cls, torch.optim.SGD)


def test_entry_points_load_lazily(installed_fixtures):
    registry = optimizer_registry()
    assert "AlphaSGD" in registry.names()
    entry = registry.describe()[normalize_name("AlphaSGD")]
    assert (entry.source, entry.distribution, entry.target) == (
        "entry point",
        "sf-fixture-alpha",
        "sf_fixture_alpha:AlphaSGD",
    )
    assert "sf_fixture_alpha" not in sys.modules, "names()/describe() must not import plugins"
    registry.get("AlphaSGD")
    assert "sf_fixture_alpha" in sys.modules


def test_other_groups_have_their_own_registry(installed_fixtures):
    plugins = Registry("stepforge.plugins", "plugin")
    assert plugins.get("alpha_plugin").name == "alpha-plugin"
    assert "alpha-plugin" not in optimizer_registry()


def test_name_claimed_by_two_distributions_names_both(installed_fixtures):
    registry = optimizer_registry()
    with pytest.raises(DuplicateNameError) as info:
        registry.get("shared-name")
    message = str(info.value)
    assert "sf-fixture-alpha" in message and "sf-fixture-beta" in message
    # the conflict is confined to that name
    assert registry.get("AlphaSGD").__name__ == "AlphaSGD"


def test_broken_entry_point_names_its_distribution(installed_fixtures):
    with pytest.raises(ImportError, match=r"sf-fixture-alpha.*sf_fixture_alpha:DoesNotExist"):
        optimizer_registry().get("Broken")


def test_refresh_sees_a_distribution_installed_at_run_time(fixture_site):
    registry = optimizer_registry()
    assert "AlphaSGD" not in registry
    sys.path.insert(0, str(fixture_site))
    try:
        assert "AlphaSGD" not in registry, "the scan is cached"
        registry.refresh()
        assert "AlphaSGD" in registry
    finally:
        sys.path.remove(str(fixture_site))


def test_register_in_process_and_as_decorator():
    registry = Registry("stepforge.test-empty", "optimizer")

    @registry.register("MyOpt")
    class MyOpt(torch.optim.SGD):
        pass

    assert registry.get("my_opt") is MyOpt
    assert registry.describe()["myopt"].source == "register()"
    with pytest.raises(DuplicateNameError, match="already registered"):
        registry.register("my-opt", torch.optim.Adam)
    registry.register("my-opt", torch.optim.Adam, override=True)
    assert registry.get("MyOpt") is torch.optim.Adam
    registry.unregister("MYOPT")
    assert "MyOpt" not in registry


def test_register_over_an_entry_point_needs_override(installed_fixtures):
    registry = optimizer_registry()
    with pytest.raises(DuplicateNameError, match="sf-fixture-alpha"):
        registry.register("AlphaSGD", torch.optim.Adam)
    registry.register("AlphaSGD", torch.optim.Adam, override=True)
    assert registry.get("alphasgd") is torch.optim.Adam


def test_torch_optimizers_are_built_in():
    assert OPTIMIZERS.get("adamw") is torch.optim.AdamW
    assert OPTIMIZERS.get("SGD") is torch.optim.SGD
    assert OPTIMIZERS.describe()["adamw"].source == "built-in"
    assert "Optimizer" not in OPTIMIZERS.names()


def test_in_process_registration_beats_built_ins():
    registry = Registry("stepforge.test-empty", "optimizer", builtins=lambda: {"AdamW": torch.optim.AdamW})
    registry.register("AdamW", torch.optim.SGD, override=True)
    assert registry.get("adamw") is torch.optim.SGD


@pytest.mark.parametrize(
    ("name", "dist"),
    [(name, dist) for name, dist in INSTALL_HINTS["stepforge.optimizers"].items()],
)
def test_unknown_stepforge_name_says_what_to_install(name, dist):
    registry = Registry(
        "stepforge.test-empty", "optimizer", install_hints=INSTALL_HINTS["stepforge.optimizers"]
    )
    with pytest.raises(UnknownNameError, match=f"pip install {dist}"):
        registry.get(name.lower())


@pytest.mark.parametrize(
    ("name", "dist"),
    [
        ("low_level_zero", "stepforge-zero"),
        ("zero2", "stepforge-zero"),
        ("LowLevelZeroPlugin", "stepforge-zero"),
        ("gemini", "stepforge-strategy"),
        ("torch_fsdp", "stepforge-strategy"),
        ("TorchDDPPlugin", "stepforge-strategy"),
        ("single", "stepforge-strategy"),
    ],
)
def test_unknown_plugin_says_what_to_install(name, dist):
    registry = Registry("stepforge.test-empty", "plugin", install_hints=INSTALL_HINTS["stepforge.plugins"])
    with pytest.raises(UnknownNameError, match=f"pip install {dist}"):
        registry.get(name)


def test_unknown_name_lists_what_exists_and_what_can_be_installed():
    registry = Registry(
        "stepforge.test-empty",
        "optimizer",
        builtins=lambda: {"AdamW": torch.optim.AdamW},
        install_hints={"FusedAdam": "stepforge-fused"},
    )
    with pytest.raises(UnknownNameError) as info:
        registry.get("Adamm")
    message = str(info.value)
    assert "Available: AdamW" in message
    assert "pip install stepforge-fused" in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, LookupError)


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_bad_names_are_type_errors(bad):
    with pytest.raises(TypeError, match="non-empty str"):
        normalize_name(bad)
