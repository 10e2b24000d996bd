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


def test_prepare_runs_before_every_call_and_is_not_timed(clock):
    order = []

    def prepare():  # restoring an in-place call's input: 2 ms of the fake clock, never in the figure
        order.append("prepare")
        clock.now += 2e-3

    def call():
        order.append("call")
        clock.now += 1e-3
    times = workers.timed(call, iters=4, warmup=2, prepare=prepare)
    assert order == ["prepare", "call"] * 6
    assert times == pytest.approx([1e-3 + TICK] * 4)


def test_the_table_takes_each_calls_slowest_rank(tmp_path):
    import json
    from tf_commstrategy.bench.cli import slowest_rank
    rank0 = {"8": [1.0, 5.0, 2.0], "64": [3.0]}
    (tmp_path / "r1").write_text(json.dumps({"8": [4.0, 1.0, 2.5], "64": [1.0]}))
    (tmp_path / "r2").write_text(json.dumps({"8": [0.5, 6.0, 1.0]}))
    got = slowest_rank(rank0, [str(tmp_path / "r1"), str(tmp_path / "r2"), str(tmp_path / "missing")])
    assert got == {"8": [4.0, 6.0, 2.5], "64": [3.0]}


@pytest.mark.parametrize("iters,untimed", [(5, 3), (100, 10), (2000, 200)])
def test_the_default_warm_up_is_a_tenth_of_the_timed_calls_and_at_least_three(clock, iters, untimed):
    calls = []
    times = workers.timed(lambda: calls.append(1), iters=iters)
    assert len(times) == iters and len(calls) == iters + untimed


@pytest.mark.parametrize("code", [130, 143])
def test_ctrl_c_ends_the_benchmark_instead_of_running_the_peers(monkeypatch, code):
    from tf_commstrategy.bench import cli
    calls = []
    monkeypatch.setattr(cli.launcher, "run", lambda argv: calls.append(argv) or code)
    assert cli.main(["-np", "2", "--sizes", "8", "--compare", "tf-ring"]) == code
    assert len(calls) == 1  # tf-ring was not started after tfcs was interrupted
