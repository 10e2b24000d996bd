"""The job's data-path report at the end of setup is informational: a rank that dies right after its
rings came up must not turn into a setup failure after the whole rendezvous timeout on rank 0. The
survivors get the same typed peer-loss error as for a rank that dies later, within seconds."""

import time

import numpy as np
import pytest

from tests.helpers import run_workers


def _dies_before_reporting(rank, size):
    import logging
    import os
    import signal
    import tf_commstrategy as tfcs
    from tf_commstrategy.backends.host import setup_report
    warnings = []

    class Grab(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("tf_commstrategy").addHandler(Grab(level=logging.WARNING))
    if rank == 2:  # its rings are up; it dies (kill -9) instead of publishing its part of the report
        setup_report.publish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.time()
    try:
        tfcs.init()
        tfcs.allreduce(np.ones(1000, np.float32))
    except tfcs.TfcsError as e:
        return type(e).__name__, getattr(e, "peer_rank", None), time.time() - t0, warnings
    return "no error", None, time.time() - t0, warnings


@pytest.mark.timeout(200)
def test_a_rank_lost_before_it_reports_its_links_is_a_peer_loss_not_a_rendezvous_timeout():
    res = run_workers(_dies_before_reporting, 3, timeout=150, expect_failure=True,
                      env={"TFCS_RENDEZVOUS_TIMEOUT": "300", "TFCS_TIMEOUT": "300"})
    assert res[2][0] == "missing", res[2]
    for r in (0, 1):
        assert res[r][0] == "ok", (r, res[r])  # "missing": still waiting for rank 2's report at the limit
        name, peer, took, warnings = res[r][1]
        assert (name, peer) == ("PeerLostError", 2), (r, name, peer)
        assert took < 90, (r, took)  # report wait (15 s) + peer-loss detection, far from 300 s
    assert any("rank 2 did not report its data paths within 15 s" in w for w in res[0][1][3]), res[0][1][3]
