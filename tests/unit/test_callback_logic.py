import numpy as np
import pytest

from tf_commstrategy.callbacks import logic


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_warmup_closed_form(size):
    lr0, warm = 0.8, 5
    for epoch in [0, 0.5, 1, 2.25, 4.99]:
        want = lr0 / size * (epoch * (size - 1) / warm + 1)
        assert lr0 * logic.warmup_multiplier(epoch, size, warm) == pytest.approx(want)
    assert logic.warmup_multiplier(0, size, warm) == pytest.approx(1 / size)
    assert logic.warmup_multiplier(5, size, warm) == 1.0 and logic.warmup_multiplier(9, size, warm) == 1.0


def test_scalar_keys_sorted_and_non_scalars_skipped():
    logs = {"val_loss": 1.0, "acc": np.float32(0.5), "loss": 2, "hist": np.ones(3), "name": "x"}
    assert logic.scalar_keys(logs) == ["acc", "loss", "val_loss"]


def _fake_allreduce(values_per_rank):
    """An allreduce over simulated ranks; records the calls so we can check they are rank-invariant."""
    calls = []

    def make(rank):
        def allreduce(a, op):
            calls.append((rank, op, a.shape))
            stack = np.stack([values_per_rank[r] if a.shape == values_per_rank[rank].shape else np.ones(1)
                              for r in range(len(values_per_rank))])
            return {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0)}[op]
        return allreduce
    return make, calls


def test_average_logs_equals_global_mean_and_keeps_identical_values():
    logs = [{"loss": 1.0, "acc": 0.25, "val_loss": 3.0}, {"loss": 2.0, "acc": 0.75, "val_loss": 3.0}]
    vecs = [np.array([l[k] for k in sorted(l)], np.float64) for l in logs]
    make, _ = _fake_allreduce(vecs)
    out = [logic.average_logs(dict(l), make(r)) for r, l in enumerate(logs)]
    for o in out:
        assert o == {"acc": 0.5, "loss": 1.5, "val_loss": 3.0}
    # global values identical on every rank stay bit-for-bit (no (x+x+x)/3 rounding)
    x = 0.1 + 0.2
    logs3 = [{"loss": x}] * 3
    make, _ = _fake_allreduce([np.array([x])] * 3)
    assert logic.average_logs(dict(logs3[0]), make(0))["loss"] == x


def test_rank0_verbosity():
    assert logic.rank0_verbosity("auto", 0) == 1 and logic.rank0_verbosity("auto", 3) == 0
    assert logic.rank0_verbosity(2, 3) == 2
