# SPDX-License-Identifier: Apache-2.0
"""The option checks (``_env.check_dict``, Strategy's own) and prepare steps (``_prepare``) of Strategy, each on its own: the errors
name the option and the fix, LR scaling multiplies by world x micro-batch x accumulation / base, and the
accumulation window starts only when it accumulates."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from _strategy_cases import make_model, make_strategy

from stepforge.strategy._env import check_dict
from stepforge.strategy.strategy import (
    accumulation_for_global_batch,
    keep_global_batch,
    scale_lr,
    start_accumulation,
)


def test_check_dict_copies_and_names_the_option():
    source = {"a": 1}
    checked = check_dict("env_kwargs", source, frozenset({"a", "b"}))
    assert checked == {"a": 1} and checked is not source
    assert check_dict("env_kwargs", None) == {}
    with pytest.raises(TypeError, match="log_kwargs must be a dict, got list"):
        check_dict("log_kwargs", [1])
    with pytest.raises(ValueError, match=r"compile: unknown key\(s\) \['c'\]; allowed: \['a', 'b'\]"):
        check_dict("compile", {"a": 1, "c": 2}, frozenset({"a", "b"}))


def test_check_auto_scale_lr_needs_a_base_only_when_enabled(tmp_path):
    for given, kept in ((None, {}), (dict(enable=False), {"enable": False}), (dict(base_batch_size=4), None)):
        s = make_strategy(str(tmp_path), auto_scale_lr=given)
        assert s.auto_scale_lr == (given if kept is None else kept)
        s.close()
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match="base_batch_size, a positive int"):
            make_strategy(str(tmp_path), auto_scale_lr=dict(base_batch_size=bad))


def test_strategy_rejects_a_model_wrapper_that_is_not_callable(tmp_path):
    with pytest.raises(TypeError, match="model_wrapper must be None or a callable"):
        make_strategy(str(tmp_path), model_wrapper=3)


@pytest.mark.parametrize(
    "cfg, error, match",
    [
        ([("optimizer", "SGD")], TypeError, "optim_wrapper must be a dict"),
        (
            dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg={}),
            ValueError,
            "'paramwise_cfg' is not sup",
        ),
        (dict(optimizer=dict(type="SGD", lr=0.1), constructor="X"), ValueError, "'constructor' is not sup"),
        (dict(accumulative_counts=1), ValueError, "optim_wrapper needs 'optimizer'"),
    ],
    ids=["not-a-dict", "paramwise_cfg", "constructor", "no-optimizer"],
)
def test_prepare_rejects_bad_optim_wrapper_configs(tmp_path, cfg, error, match):
    s = make_strategy(str(tmp_path))
    with pytest.raises(error, match=match):
        s.prepare(make_model(0), optim_wrapper=cfg)
    s.close()


def _wrapper(lr: float, counts: int, base_lr: float | None) -> Any:
    settings = None if base_lr is None else {"lr": base_lr}
    return SimpleNamespace(
        param_groups=[{"lr": lr}], accumulative_counts=counts, base_param_settings=settings
    )


def test_scale_lr_multiplies_groups_and_base_settings():
    logger = logging.getLogger("test_scale_lr")
    wrapper = _wrapper(0.5, counts=4, base_lr=0.25)
    scale_lr(wrapper, dict(base_batch_size=8), world_size=2, micro_batch=3, logger=logger)
    assert wrapper.param_groups[0]["lr"] == pytest.approx(0.5 * 2 * 3 * 4 / 8)
    assert wrapper.base_param_settings["lr"] == pytest.approx(0.25 * 2 * 3 * 4 / 8)
    untouched = _wrapper(0.5, counts=4, base_lr=None)
    scale_lr(untouched, dict(base_batch_size=8, enable=False), world_size=2, micro_batch=None, logger=logger)
    scale_lr(untouched, {}, world_size=2, micro_batch=None, logger=logger)
    assert untouched.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        scale_lr(untouched, dict(base_batch_size=8), world_size=2, micro_batch=0, logger=logger)


def test_start_accumulation_only_when_accumulating():
    calls: list[tuple[Any, ...]] = []
    model = make_model(0)

    def wrapper(counts: int) -> Any:
        return SimpleNamespace(accumulative_counts=counts, initialize_count_status=lambda *a: calls.append(a))

    start_accumulation(wrapper(1), model, None)
    assert calls == []
    with pytest.raises(ValueError, match=r"accumulative_counts=2 needs dispatch_kwargs\['max_iters'\]"):
        start_accumulation(wrapper(2), model, 0)
    start_accumulation(wrapper(2), model, 5)
    assert calls == [(model, 0, 5)]


def test_global_batch_derives_the_accumulation_or_names_what_divides():
    # DeepSpeed's rule: train_batch_size = micro-batch x accumulation x world size
    assert [accumulation_for_global_batch(12, w, 1) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    assert accumulation_for_global_batch(12, 4, 3) == 1
    with pytest.raises(ValueError) as info:
        accumulation_for_global_batch(12, 3, 3)
    message = str(info.value)
    assert "global_batch_size=12 is not a multiple of world size 3 x micro-batch 3" in message
    assert "micro-batch sizes [1, 2, 4] work; with micro-batch 3, world sizes [1, 2, 4]" in message
    with pytest.raises(
        ValueError, match=r"micro-batch sizes \[\] work; with micro-batch 1, world sizes \[1, 2, 3, 4"
    ):
        accumulation_for_global_batch(12, 5, 1)
    with pytest.raises(ValueError, match=r"needs dispatch_kwargs\['train_micro_batch_size_per_gpu'\]"):
        accumulation_for_global_batch(12, 2, None)
    cfg = dict(optimizer=dict(type="SGD", lr=0.1))
    assert (
        keep_global_batch(cfg, 12, 3, 1) == {**cfg, "accumulative_counts": 4}
        and "accumulative_counts" not in cfg
    )
    assert keep_global_batch({**cfg, "accumulative_counts": 4}, 12, 3, 1)["accumulative_counts"] == 4
    with pytest.raises(ValueError, match="accumulative_counts=3 contradicts global_batch_size=12"):
        keep_global_batch({**cfg, "accumulative_counts": 3}, 12, 3, 1)


def test_strategy_global_batch_size_is_checked_where_it_enters_and_used_by_prepare(tmp_path):
    for bad in (0, -4, True, 2.5, "12"):
        with pytest.raises(ValueError, match="global_batch_size must be None or a positive int"):
            make_strategy(str(tmp_path), global_batch_size=bad)
    s = make_strategy(str(tmp_path), global_batch_size=6)
    _, wrapper = s.prepare(
        make_model(0),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        dispatch_kwargs=dict(train_micro_batch_size_per_gpu=2, max_iters=6),
    )
    assert wrapper.accumulative_counts == 3  # 6 = 1 rank x micro-batch 2 x 3
    s.close()
    s = make_strategy(str(tmp_path), global_batch_size=6)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        s.prepare(make_model(0), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)))
    s.close()
