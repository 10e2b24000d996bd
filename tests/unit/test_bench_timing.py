"""tfcs-bench's timing loop: the busy gap before each call is spent, and never counted in the call's time.

A fake clock (``time.perf_counter`` advancing 1 us per reading, plus what a call adds) makes every
figure exact, whatever the machine is doing."""

import pytest

from tf_commstrategy.bench import workers

TICK = 1e-6

pytestmark = pytest.mark.bench


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


class FakeSession:
    """An implementation whose every call takes ``cost`` seconds of the fake clock; it notes each call."""

    def __init__(self, name, clock, cost, log):
        self.name, self.clock, self.cost, self.log = name, clock, cost, log

    def calls(self, nbytes, n):
        def call():
            self.log.append((self.name, nbytes))
            self.clock.now += self.cost
        return call, None


def test_interleaved_rounds_take_turns_in_alternating_order(clock):
    import argparse
    log = []
    sessions = {"tfcs": FakeSession("tfcs", clock, 1e-3, log), "gloo": FakeSession("gloo", clock, 4e-3, log)}
    args = argparse.Namespace(sizes=[8, 1 << 20], budget=0.2, gap_s=0.0, rounds=4)
    got = workers.run_interleaved(sessions, args)
    for nbytes in args.sizes:
        iters = workers.iterations(nbytes, args.budget)
        k = workers.per_round_calls(iters, args.rounds)
        assert got["tfcs"][nbytes] == pytest.approx([1e-3 + TICK] * (4 * k))
        assert got["gloo"][nbytes] == pytest.approx([4e-3 + TICK] * (4 * k))
        # the calls of one size, as runs of one implementation: rounds 1 and 3 go tfcs then gloo, rounds 2
        # and 4 gloo then tfcs, so consecutive rounds meet in a run of the same one
        blocks = []
        for name, size in log:
            if size == nbytes and (not blocks or blocks[-1][0] != name):
                blocks.append([name, 0])
            if size == nbytes:
                blocks[-1][1] += 1
        assert [b[0] for b in blocks] == ["tfcs", "gloo", "tfcs", "gloo", "tfcs"]
        warm = max(3, iters // 10)  # a job's own warm-up in the first round, one untimed call in each later block
        assert [b[1] for b in blocks] == [warm + k, (warm + k) + (1 + k), 2 * (1 + k), 2 * (1 + k), 1 + k]


def test_per_round_calls_share_the_budget_and_keep_a_median():
    assert workers.per_round_calls(600, 6) == 100
    assert workers.per_round_calls(601, 6) == 101
    assert workers.per_round_calls(5, 6) == 3


def test_round_ratios_are_per_round_medians():
    from tf_commstrategy.bench.cli import round_ratios
    mine = [1.0, 2.0, 3.0, 10.0, 10.0, 30.0, 7.0]  # a last round in part: left out
    theirs = [2.0, 2.0, 9.0, 5.0, 4.0, 6.0]
    assert round_ratios(mine, theirs, 3) == pytest.approx([2.0 / 2.0, 10.0 / 5.0])


def test_an_interleaved_table_reports_the_median_of_the_round_ratios():
    from tf_commstrategy.bench import cli
    raw = {"tfcs": {"interleaved": {"rounds": 3}, "times": {"8": [1, 1, 2, 2, 9, 9]}},
           "gloo": {"times": {"8": [2, 2, 2, 2, 10, 10]}}}
    results = {impl: cli.summarize(r, "allreduce", 2) for impl, r in raw.items()}
    cli.add_round_ratios(results, raw)
    assert results["gloo"][8]["round_ratios"] == pytest.approx([0.5, 1.0, 0.9])
    assert results["gloo"][8]["ratio"] == pytest.approx(0.9)
    text = cli.table(results, [8], "allreduce", 2)
    # not the ratio of the medians over all calls (2 / 2 = 1.00): the median of the rounds' ratios
    assert text.splitlines()[-1] == "| 8 B | 2.00 s | 0.000 | 0.000 | 2.00 s | 0.90 | 0.50-1.00 |"


def test_rounds_must_be_positive():
    from tf_commstrategy.bench import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["--interleave", "--rounds", "0"])
    assert e.value.code == 2


def test_a_failed_interleaved_job_falls_back_to_one_job_each(monkeypatch):
    from tf_commstrategy.bench import cli
    jobs = []

    def run_job(impls, args, sizes):
        jobs.append((list(impls), args.rounds))
        if len(impls) > 1:
            return {i: {} for i in impls}  # the shared job failed
        return {impls[0]: {"times": {"8": [1e-3] * 5}}}
    monkeypatch.setattr(cli, "run_job", run_job)
    assert cli.main(["--sizes", "8", "--compare", "tf-ring", "--interleave", "--rounds", "4"]) == 0
    assert jobs == [(["tfcs", "tf-ring"], 4), (["tfcs"], 1), (["tf-ring"], 1)]


def test_interleave_without_a_peer_is_a_plain_run(monkeypatch):
    from tf_commstrategy.bench import cli
    jobs = []
    monkeypatch.setattr(cli, "run_job", lambda impls, args, sizes: jobs.append(list(impls)) or
                        {impls[0]: {"times": {"8": [1e-3] * 5}}})
    # tf-ring has no broadcast: it is left out, and tfcs runs alone
    assert cli.main(["--sizes", "8", "--op", "broadcast", "--compare", "tf-ring", "--interleave"]) == 0
    assert jobs == [["tfcs"]]


def test_the_plot_shows_the_tables_ratio_and_the_round_range(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tf_commstrategy.bench import cli
    raw = {"tfcs": {"interleaved": {"rounds": 3}, "times": {"8": [1, 1, 2, 2, 9, 9], "64": [1, 1, 1, 1, 1, 1]}},
           "gloo": {"times": {"8": [2, 2, 2, 2, 10, 10]}}}  # gloo has no 64-byte row: left out of the ratio
    results = {impl: cli.summarize(r, "allreduce", 2) for impl, r in raw.items()}
    cli.add_round_ratios(results, raw)
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    cli.plot(results, [8, 64], "allreduce", 2, str(tmp_path / "p.png"))
    ratio_axes = figures[0].axes[1]
    (line,) = [ln for ln in ratio_axes.get_lines() if ln.get_label() == "tfcs / gloo"]
    assert list(line.get_xdata()) == [8]
    assert list(line.get_ydata()) == pytest.approx([0.9])  # the median of the rounds, as in the table
    bars = [c for c in ratio_axes.collections if len(c.get_segments())]
    assert [list(map(tuple, seg)) for seg in bars[0].get_segments()] == [[(8, 0.5), (8, 1.0)]]
