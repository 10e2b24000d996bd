"""CommStrategy with model.fit: identical on every worker, equal to one process on the global batch."""

import numpy as np
import pytest

from tests.helpers import run_workers
from tests.multiprocess import tf_workloads as W


def _distributed(rank, size, local_devices, flavour=2):
    W.setup_tf(local_devices)
    import tf_commstrategy as tfcs
    devices = [f"/cpu:{i}" for i in range(local_devices)]
    strategy = tfcs.CommStrategy(devices=devices)
    assert strategy.num_replicas_in_sync == size * local_devices
    # a different seed on every worker: CommStrategy must still start every worker from rank 0's values
    return {wl: W.train(strategy, *wl, seed=100 + rank, flavour=flavour) for wl in W.WORKLOADS}


def _single(rank, size, flavour=2):
    tf = W.setup_tf(1)
    strategy = tf.distribute.get_strategy()  # the default strategy: one process, one device
    return {wl: W.train(strategy, *wl, seed=100, flavour=flavour) for wl in W.WORKLOADS}


@pytest.fixture(scope="module")
def references():
    """The single-process results per Keras flavour, computed once per module when first asked for."""
    cache = {}

    def get(flavour):
        if flavour not in cache:
            cache[flavour] = run_workers(_single, 1, flavour, timeout=280)[0]
        return cache[flavour]
    return get


def _assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.timeout(600)
# 3 workers (about 50 s on the 2-core machine) run in the slow step; the default suite keeps 2 workers with
# one and two local devices each, in both Keras flavours (3: ``import keras``; 2: tf_keras)
@pytest.mark.parametrize("flavour", [3, 2])
@pytest.mark.parametrize("size,local_devices", [(2, 2), pytest.param(3, 2, marks=pytest.mark.slow), (2, 1)])
def test_fit_matches_single_process_and_is_identical_across_workers(references, size, local_devices, flavour):
    reference = references(flavour)
    results = run_workers(_distributed, size, local_devices, flavour, timeout=540)
    for wl in W.WORKLOADS:
        first = results[0][wl]
        for r in range(1, size):  # bitwise identical across workers
            for a, b in zip(first["weights"] + first["opt"], results[r][wl]["weights"] + results[r][wl]["opt"]):
                np.testing.assert_array_equal(a, b, err_msg=f"{wl} rank {r} differs from rank 0")
            np.testing.assert_array_equal(first["pred"], results[r][wl]["pred"])
            assert first["eval"] == results[r][wl]["eval"]
        ref = reference[wl]
        for i, (a, b) in enumerate(zip(first["weights"], ref["weights"])):
            _assert_close(a, b, f"{wl} weight {i} vs single process")
        for i, (a, b) in enumerate(zip(first["opt"], ref["opt"])):
            _assert_close(a, b, f"{wl} optimizer variable {i} vs single process")
        _assert_close(first["eval"], ref["eval"], f"{wl} evaluate vs single process", rtol=1e-5)
        assert first["pred"].shape == ref["pred"].shape
        _assert_close(first["pred"], ref["pred"], f"{wl} predict (full and ordered) vs single process",
                      rtol=1e-4, atol=1e-5)
        _assert_close(first["history"]["loss"], ref["history"]["loss"], f"{wl} loss history", rtol=1e-5)
