"""tfcs-bench's timing loop: the busy gap before each call is spent, and never counted in the call's time."""

import time

import pytest

from tf_commstrategy.bench import workers


def test_back_to_back_calls_are_all_timed():
    calls = []
    times = workers.timed(lambda: calls.append(time.perf_counter()), iters=20, warmup=3)
    assert len(times) == 20 and len(calls) == 23
    assert all(t >= 0 for t in times) and sorted(times)[10] < 0.01


@pytest.mark.parametrize("gap_ms", [2.0, 5.0])
def test_gap_is_spent_before_each_call_but_not_timed(gap_ms):
    starts = []
    t0 = time.perf_counter()
    times = workers.timed(lambda: starts.append(time.perf_counter()), iters=10, warmup=0, gap_s=gap_ms / 1e3)
    wall = time.perf_counter() - t0
    assert len(times) == 10
    # each timed call only appends: far below the gap (the median: a preemption may hit one call)
    assert sorted(times)[len(times) // 2] < gap_ms / 1e3 / 2, times
    # the gap really passed before every call (starts at least gap apart), and in all
    assert wall >= 10 * gap_ms / 1e3
    assert min(b - a for a, b in zip(starts, starts[1:])) >= gap_ms / 1e3


def test_busy_works_instead_of_sleeping(monkeypatch):
    hashed = []
    real = workers.hashlib.sha256
    monkeypatch.setattr(workers.hashlib, "sha256", lambda b: (hashed.append(len(b)), real(b))[1])
    monkeypatch.setattr(workers.time, "sleep", lambda s: pytest.fail("busy() slept"))
    t0 = time.perf_counter()
    workers.busy(0.02)
    assert time.perf_counter() - t0 >= 0.02
    # native work on a small buffer the whole time (each hash takes microseconds)
    assert len(hashed) > 10 and set(hashed) == {16 << 10}


def test_iterations_count_the_gap():
    assert workers.iterations(8, 1.0) > workers.iterations(8, 1.0, gap_s=0.01) >= 5
    assert workers.iterations(8, 1.0, gap_s=0.01) == pytest.approx(1.0 / (2e-4 + 8 / 5e8 + 0.01), abs=1)
