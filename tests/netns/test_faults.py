"""Faults during model.fit on a shaped link (tc tbf, 1 Gbit/s both ways; no delay, this kernel has no netem):
a host's link is cut, or the host is killed; every survivor raises PeerLostError naming the lost host
within 15 s. benchmarks/fault_detection.py repeats these trials for the figures."""

from __future__ import annotations

import pytest

from tests.netns.faults import FAULTS, trial

pytestmark = pytest.mark.netns

DETECT_BOUND_S = 15.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_during_fit_on_a_shaped_link_names_the_host_on_every_survivor(make_hosts, tmp_path, fault):
    hosts = make_hosts(3)
    hosts.shape("1gbit")
    report = trial(hosts, fault, str(tmp_path))
    assert len(report["ranks"]) == 2
    for rank, r in report["ranks"].items():
        assert r["detected"], f"rank {rank} raised no tf_commstrategy error (rc={r['returncode']}):\n{r['output']}"
        assert r["error_class"] == "PeerLostError", (rank, r["error_class"], r["message"])
        assert r["names_host"], f"rank {rank}: the message does not name the lost host: {r['message']}"
        assert r["detection_s"] <= DETECT_BOUND_S, (rank, r["detection_s"], r["message"])
