"""flintgen.procutil.run_spawned: the one spawned worker pool of `flintgen build --jobs`, the benchmarks'
prebuilds and the GPU tests' precompiles."""

import operator

import pytest

from flintgen.procutil import run_spawned


def test_results_in_job_order_and_progress():
    calls = []
    got = run_spawned(operator.mul, [(i, i + 1) for i in range(7)], workers=2, on_done=lambda: calls.append(1))
    assert got == [i * (i + 1) for i in range(7)]
    assert len(calls) == 7


def test_a_failure_is_raised_after_the_others_ran():
    with pytest.raises(ZeroDivisionError):
        run_spawned(operator.truediv, [(1, 2), (3, 0), (4, 2)], workers=2)


def test_failures_returned_in_place():
    got = run_spawned(operator.truediv, [(1, 2), (3, 0), (4, 2)], workers=2, return_exceptions=True)
    assert got[0] == 0.5 and got[2] == 2.0
    assert isinstance(got[1], ZeroDivisionError)


def test_no_jobs():
    assert run_spawned(operator.mul, []) == []
