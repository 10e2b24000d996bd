"""Many back-to-back collectives in one process group: no cross-talk, no deadlock, memory flat."""

import numpy as np

from tests.helpers import run_workers


def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _stress(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init()
    wrong = 0
    for i in range(10_000):  # each call's value depends on i: a message from another call shows up
        v = tfcs.allreduce(np.array([i * (rank + 1)], dtype=np.int64))
        wrong += int(v[0] != i * size * (size + 1) // 2)
    rng = np.random.default_rng(7)
    rss = []
    mixed_wrong = 0
    for j in range(50):
        n = int(rng.choice([1, 1000, 3 << 18, 1 << 20, (1 << 21) + 5]))
        kind = j % 3
        x = np.full(n, float(rank + j), dtype=np.float32)
        if kind == 0:
            got = tfcs.allreduce(x)
            mixed_wrong += int(not np.all(got == sum(r + j for r in range(size))))
        elif kind == 1:
            got = tfcs.broadcast(x, root_rank=j % size)
            mixed_wrong += int(not np.all(got == (j % size) + j))
        else:
            got = tfcs.allgather(x[: n // (rank + 1)])
            mixed_wrong += int(got.size != sum(n // (r + 1) for r in range(size)))
        if j in (10, 49):
            rss.append(_rss_mib())
    b = default_group().backend("grpc")
    return wrong, mixed_wrong, rss, b.stats()


def test_ten_thousand_small_and_fifty_large_collectives():
    for wrong, mixed_wrong, (rss10, rss49), stats in run_workers(_stress, 2, timeout=280):
        assert wrong == 0 and mixed_wrong == 0
        assert stats.pending_messages == 0  # nothing left behind in the mailbox
        assert stats.collectives >= 10_050
        assert rss49 - rss10 < 64, f"RSS grew from {rss10:.0f} to {rss49:.0f} MiB"


def _means(rank, size, transport):
    import tf_commstrategy as tfcs
    tfcs.init(transport=transport, chunk_bytes=64 << 10)  # many chunks in flight per call
    bad = []
    n = 1 << 20  # 8 MiB of float64: several chunks, so sends are still leaving while the ring goes on
    for i in range(60):
        x = np.random.default_rng(100 * i + rank).standard_normal(n)
        want = sum(np.random.default_rng(100 * i + r).standard_normal(n) for r in range(size)) / size
        got = tfcs.allreduce(x, op="mean")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            bad.append((i, int(np.sum(~np.isclose(got, want)))))
    return bad


def test_mean_of_large_buffers_is_right_every_time_on_every_transport():
    # regression: the mean used to be divided in place while the last chunks were still being sent
    for transport in ("unix", "tcp", "grpc"):
        res = run_workers(_means, 2, transport, timeout=240)
        assert res == [[], []], (transport, res)
