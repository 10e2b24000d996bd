"""tfcs-bench's timing loop: the busy gap before each call is spent, and never counted in the call's time."""

import time

import pytest

from tf_commstrategy.bench import workers


def test_back_to_back_calls_are_all_timed():
    calls = []
    times = workers.timed(lambda: calls.append(time.perf_counter()), iters=20, warmup=3)
    assert len(times) == 20 and len(calls) == 23
    assert all(0 <= t < 0.05 for t in times)


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


def test_busy_keeps_the_cpu_busy():
    c0, w0 = time.process_time(), time.perf_counter()
    workers.busy(0.05)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert wall >= 0.05
    assert cpu >= 0.5 * wall  # spinning, not sleeping (a loaded 2-core machine may steal some)


def test_iterations_count_the_gap():
    assert workers.iterations(8, 1.0) > workers.iterations(8, 1.0, gap_s=0.01) >= 5
    assert workers.iterations(8, 1.0, gap_s=0.01) == pytest.approx(1.0 / (2e-4 + 8 / 5e8 + 0.01), abs=1)
