"""tfcs-bench's timing loop: the busy gap before each call is spent, and never counted in the call's time.

A fake clock (``time.perf_counter`` advancing 1 us per reading, plus what a call adds) makes every
figure exact, whatever the machine is doing."""

import pytest

from tf_commstrategy.bench import workers

TICK = 1e-6


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += TICK
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(workers.time, "perf_counter", c)
    monkeypatch.setattr(workers.time, "sleep", lambda s: pytest.fail("busy() slept"))
    return c


def test_back_to_back_calls_are_all_timed(clock):
    calls = []

    def call():  # a call that takes 3 ms of the fake clock
        calls.append(clock.now)
        clock.now += 3e-3
    times = workers.timed(call, iters=20, warmup=3)
    assert len(times) == 20 and len(calls) == 23
    assert times == pytest.approx([3e-3 + TICK] * 20)


@pytest.mark.parametrize("gap_ms", [2.0, 5.0])
def test_gap_is_spent_before_each_call_but_not_timed(clock, gap_ms):
    starts = []

    def call():
        starts.append(clock.now)
        clock.now += 1e-3
    times = workers.timed(call, iters=10, warmup=0, gap_s=gap_ms / 1e3)
    # only the call's 1 ms (and the reading that ends it) is timed, never the gap
    assert times == pytest.approx([1e-3 + TICK] * 10)
    # the gap really passed before every call: consecutive calls start the call plus the gap apart
    assert all(b - a >= 1e-3 + gap_ms / 1e3 for a, b in zip(starts, starts[1:]))
    assert starts[0] >= gap_ms / 1e3


def test_busy_works_instead_of_sleeping(clock, monkeypatch):
    hashed = []
    real = workers.hashlib.sha256
    monkeypatch.setattr(workers.hashlib, "sha256", lambda b: (hashed.append(len(b)), real(b))[1])
    workers.busy(200 * TICK)
    assert clock.now >= 200 * TICK
    # native work on a small buffer at every turn of the loop, never a sleep (the fixture fails one)
    assert len(hashed) >= 190 and set(hashed) == {16 << 10}


def test_iterations_count_the_gap():
    assert workers.iterations(8, 1.0) > workers.iterations(8, 1.0, gap_s=0.01) >= 5
    assert workers.iterations(8, 1.0, gap_s=0.01) == pytest.approx(1.0 / (2e-4 + 8 / 5e8 + 0.01), abs=1)
