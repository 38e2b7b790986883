# SPDX-License-Identifier: Apache-2.0
"""The capacity search's decisions (``gpu_train/_search.py``), driven by a fake oracle: plain doubling then
bisection finds the exact deepest depth; the measured bytes' prediction reaches the same answer in fewer tries
and never beyond what doubling would try; a start that fails searches downwards; nothing fits ends the search;
failures below the deepest pass do not bound it."""

from __future__ import annotations

from collections.abc import Callable

from bench.gpu_train._search import TryResult, bracket, next_depth, predict_max_depth


def _params(depth: int) -> int:
    return 1000 + 200 * depth


def _bytes(depth: int) -> int:
    return 500 + 16 * _params(depth)


LIMIT = _bytes(21)  # depth 21 is the deepest that fits


def _search(
    fits: Callable[[int], bool], *, start: int, max_depth: int = 100, predict: bool = False
) -> list[int]:
    tries: list[TryResult] = []
    while True:
        predicted = (
            predict_max_depth(tries, _params, device_limit=LIMIT, host_limit=None, max_depth=max_depth)
            if predict
            else None
        )
        depth = next_depth(tries, start=start, max_depth=max_depth, predicted=predicted)
        if depth is None:
            return [t.depth for t in tries]
        ok = fits(depth)
        tries.append(TryResult(depth, ok, _params(depth), _bytes(depth) if ok else None))
        assert len(tries) < 30


def test_doubling_then_bisection_finds_the_deepest_depth() -> None:
    order = _search(lambda d: d <= 21, start=8)
    assert order == [8, 16, 32, 24, 20, 22, 21]


def test_the_measured_bytes_cut_the_tries_without_jumping_past_doubling() -> None:
    order = _search(lambda d: _bytes(d) <= LIMIT, start=8, predict=True)
    # 16: the prediction (21) is held to 2 x 8; 21: predicted; 22: one past the prediction confirms the bracket
    assert order == [8, 16, 21, 22]


def test_a_failing_start_searches_downwards_and_nothing_fitting_ends_it() -> None:
    assert _search(lambda d: d <= 3, start=8) == [8, 4, 2, 3]
    assert _search(lambda d: False, start=4) == [4, 2, 1]


def test_the_search_stops_at_max_depth_when_everything_fits() -> None:
    assert _search(lambda d: True, start=3, max_depth=10) == [3, 6, 10]


def test_a_single_try_predicts_conservatively_and_two_predict_exactly() -> None:
    one = [TryResult(8, True, _params(8), _bytes(8))]
    two = [*one, TryResult(16, True, _params(16), _bytes(16))]
    through_origin = predict_max_depth(one, _params, device_limit=LIMIT, host_limit=None, max_depth=100)
    assert through_origin is not None and through_origin <= 21
    assert predict_max_depth(two, _params, device_limit=LIMIT, host_limit=None, max_depth=100) == 21
    # the tighter of the two resources bounds it; an unmeasured resource does not
    host = [
        TryResult(8, True, _params(8), _bytes(8), 100 * _params(8)),
        TryResult(16, True, _params(16), _bytes(16), 100 * _params(16)),
    ]
    assert (
        predict_max_depth(host, _params, device_limit=LIMIT, host_limit=100 * _params(10), max_depth=100)
        == 10
    )
    assert predict_max_depth(two, _params, device_limit=None, host_limit=10**9, max_depth=100) is None


def test_failures_below_the_deepest_pass_do_not_bound_the_bracket() -> None:
    tries = [TryResult(4, False, 0), TryResult(8, True, 0), TryResult(12, False, 0), TryResult(16, False, 0)]
    b = bracket(tries)
    assert (b.lo, b.hi) == (8, 12)
    assert next_depth(tries, start=4, max_depth=100) == 10
