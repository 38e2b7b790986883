# SPDX-License-Identifier: Apache-2.0
"""The repository's import rules (design §1): no circle inside a package, no private module of another package,
torch privates only in the stepforge.core.torch_compat package. First the checker on small made-up trees (it
must find what it claims to), then the real source tree."""

from __future__ import annotations

import os
import pathlib
import textwrap

import pytest

from stepforge.testing import import_rules

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    """Write ``{"alpha/a.py": source}`` as packages/stepforge-alpha/src/stepforge/alpha/a.py."""
    for name, source in files.items():
        package, _, rest = name.partition("/")
        path = tmp_path / "packages" / f"stepforge-{package}" / "src" / "stepforge" / package / rest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return tmp_path


def test_cycle_through_a_function_level_import_is_found_with_its_edges(tmp_path):
    root = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "from .a import A\n",
            "alpha/a.py": "from .b import helper\nclass A: ...\n",
            "alpha/b.py": "def helper():\n    from .a import A\n    return A\n",
            "alpha/c.py": "from .b import helper\n",
        },
    )
    found = import_rules.violations(root)["cycles"]
    assert len(found) == 1
    assert (
        "stepforge.alpha.a -> stepforge.alpha.b (packages/stepforge-alpha/src/stepforge/alpha/a.py:1"
        in found[0]
    )
    assert "stepforge.alpha.b -> stepforge.alpha.a" in found[0] and "function-level" in found[0]
    assert "alpha.c" not in found[0]  # c only depends on the circle


def test_cycle_through_a_subpackage_init_and_absolute_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "alpha/top.py": "from stepforge.alpha.sub.leaf import x\n",
            "alpha/sub/__init__.py": "from ..top import y\n",
            "alpha/sub/leaf.py": "x = 1\n",
        },
    )
    (cycle,) = import_rules.violations(root)["cycles"]
    # importing sub.leaf runs sub/__init__, which imports top: a real circle
    assert "stepforge.alpha.top -> stepforge.alpha.sub " in cycle
    assert "stepforge.alpha.sub -> stepforge.alpha.top" in cycle


def test_no_cycle_without_a_back_edge_nor_across_packages(tmp_path):
    root = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "from .a import A\nfrom . import b\n",
            "alpha/a.py": "import stepforge.beta.api\nclass A: ...\n",
            "alpha/b.py": "from .a import A\n",
            "beta/__init__.py": "",
            "beta/api.py": "from stepforge.alpha import A\n",
        },
    )
    assert import_rules.violations(root)["cycles"] == []


def test_private_module_of_another_package_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "alpha/_impl.py": "X = 1\n",
            "alpha/api.py": "from ._impl import X\nfrom stepforge.alpha._impl import X as Y\n",
            "beta/__init__.py": "",
            "beta/one.py": "from stepforge.alpha._impl import X\n",
            "beta/two.py": "def f():\n    from stepforge.alpha import _impl\n",
            "beta/three.py": "import stepforge.alpha.api\nfrom stepforge.alpha import api\n",
        },
    )
    found = import_rules.violations(root)["private_imports"]
    assert len(found) == 2
    assert "stepforge.beta.one -> stepforge.alpha._impl (" in found[0]
    assert "stepforge.beta.two -> stepforge.alpha._impl (" in found[1] and "function-level" in found[1]


def test_torch_privates_are_found_outside_the_compat_module(tmp_path):
    use = """\
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.optim.lr_scheduler import _LRScheduler

        def f(t, m):
            torch._foreach_add_([t], 1.0)
            dist.distributed_c10d._get_default_store()
            isinstance(m, nn.modules.batchnorm._NormBase)
            FSDPModule._get_fsdp_state
            hasattr(t, "_local_tensor")
            return t._local_tensor, t.public, t._mine
        """
    root = _tree(
        tmp_path,
        {"core/__init__.py": "", "core/torch_compat.py": use, "alpha/__init__.py": "", "alpha/a.py": use},
    )
    found = import_rules.violations(root)["torch_privates"]
    assert all(line.startswith("stepforge.alpha.a (packages/stepforge-alpha/") for line in found), found
    text = "\n".join(found)
    for expected in (
        ":5): from torch.distributed.checkpoint._nested_dict import flatten_state_dict",
        ":6): from torch.optim.lr_scheduler import _LRScheduler",
        ":10): dist.distributed_c10d._get_default_store",
        ":11): nn.modules.batchnorm._NormBase",
        ":12): FSDPModule._get_fsdp_state",
        ":13): hasattr(..., '_local_tensor')",
        ":14): attribute ._local_tensor",
    ):
        assert expected in text, (expected, found)
    # the documented foreach API, public attributes and a private name torch does not own are fine
    assert "_foreach_" not in text and "._mine" not in text and "public" not in text
    assert len(found) == 7


def test_torch_privates_are_allowed_in_the_compat_package_modules_only(tmp_path):
    use = "import torch\n\ndef f(t):\n    return t._base\n"
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/torch_compat/__init__.py": use,
            "core/torch_compat/tensors.py": use,
            "core/torch_compat_extra.py": use,  # a sibling named like the package is not part of it
            "core/sync.py": use,
        },
    )
    found = import_rules.violations(root)["torch_privates"]
    assert sorted(line.split(" ")[0] for line in found) == [
        "stepforge.core.sync",
        "stepforge.core.torch_compat_extra",
    ], found


def test_checker_rejects_a_root_without_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match="repository root"):
        import_rules.violations(tmp_path)


def test_repository_follows_the_import_rules():
    found = import_rules.violations(ROOT)
    report = "\n".join(f"[{rule}] {line}" for rule, lines in found.items() for line in lines)
    assert not report, "import rules broken (design §1):\n" + report
