"""The job's one report of its data paths (rank 0 logs it): the INFO line and the shared-memory warning."""

import json
import logging

from tf_commstrategy.backends.grpc import setup_report as R


class _Ring:
    def __init__(self, ring_id, right, planned, transport, size=2):
        self.ring_id, self.right, self.planned, self.transport, self.size = ring_id, right, planned, transport, size


def _reports(*links_per_rank, problems=None):
    problems = problems or {}
    return [{"links": [list(x) for x in links], "problems": [list(p) for p in problems.get(r, [])]}
            for r, links in enumerate(links_per_rank)]


def test_my_facts_lists_the_outbound_link_of_every_ring_of_more_than_one_rank():
    rings = (_Ring(0, 1, "shm", "unix", 4), None, _Ring(1, 0, "shm", "shm", 1), _Ring(2, 2, "grpc", "grpc"))
    facts = json.loads(json.dumps(R.my_facts(rings, [("shared-memory links", "full")])))
    assert facts == {"links": [[0, 1, "shm", "unix"], [2, 2, "grpc", "grpc"]],
                     "problems": [["shared-memory links", "full"]]}


def test_summary_names_every_link_of_every_ring_grouped_by_data_path():
    reports = _reports([(0, 1, "unix", "unix"), (1, 1, "shm", "shm"), (2, 2, "grpc", "grpc")],
                       [(0, 2, "grpc", "grpc"), (1, 0, "shm", "shm")],
                       [(0, 3, "unix", "unix"), (1, 3, "shm", "shm"), (2, 0, "grpc", "grpc")],
                       [(0, 0, "grpc", "grpc"), (1, 2, "shm", "shm")])
    assert R.summary(reports, 2) == (
        "tf_commstrategy: data paths of the job (4 ranks on 2 hosts): "
        "ring: grpc x2 (1->2, 3->0), unix x2 (0->1, 2->3); "
        "host rings: shm x4 (0->1, 1->0, 2->3, 3->2); leader ring: grpc x2 (0->2, 2->0)")


def test_summary_of_a_large_job_counts_the_links_it_does_not_name():
    n = 20
    reports = _reports(*[[(0, (r + 1) % n, "shm", "shm")] for r in range(n)])
    line = R.summary(reports, 1)
    assert line.endswith("(20 ranks on 1 host): ring: shm x20 (0->1, 1->2, 2->3, 3->4, 4->5, 5->6, 6->7, "
                         "7->8, +12 more)"), line


def test_no_warning_when_every_planned_shared_memory_link_got_it():
    reports = _reports([(0, 1, "shm", "shm")], [(0, 0, "shm", "shm")])
    assert R.warning(reports) == ""


def test_warning_names_the_rank_its_cause_the_links_that_fell_back_and_the_fix():
    reports = _reports([(0, 1, "shm", "unix")], [(0, 2, "shm", "unix")], [(0, 0, "shm", "shm")],
                       problems={1: [("shared-memory links", "cannot reserve 17 MiB in /dev/shm")]})
    text = R.warning(reports)
    assert text.startswith("tf_commstrategy: shared memory unavailable (rank 1, shared-memory links: cannot "
                           "reserve 17 MiB in /dev/shm): links 0->1, 1->2 use Unix sockets instead; to fix it, ")
    assert "--shm-size" in text and "TFCS_TRANSPORT=unix" in text


def test_warning_for_the_shared_buffers_alone_keeps_the_links():
    reports = _reports([(0, 1, "shm", "shm")], [(0, 2, "shm", "shm")], [(0, 0, "shm", "shm")],
                       problems={2: [("shared all-reduce buffers", "No space left on device")]})
    text = R.warning(reports)
    assert "rank 2, shared all-reduce buffers: No space left on device" in text
    assert "the all-reduce uses the ring instead" in text and "Unix sockets" not in text


def test_publish_logs_once_on_rank_0_only(caplog):
    class Store:
        def __init__(self):
            self.kv = {}

        def set(self, k, v):
            self.kv[k] = v

        def get(self, k, timeout):
            return self.kv[k]

    store = Store()
    facts = [{"links": [[0, (r + 1) % 3, "shm", "unix" if r < 2 else "shm"]],
              "problems": [["shared-memory links", "full"]] if r == 1 else []} for r in range(3)]
    with caplog.at_level(logging.INFO, logger="tf_commstrategy"):
        for r in (2, 1):
            R.publish(store, r, 3, 1.0, facts[r], 1)
        assert caplog.records == []  # ranks other than 0 say nothing
        R.publish(store, 0, 3, 1.0, facts[0], 1)
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert caplog.records[0].getMessage().endswith("ring: unix x2 (0->1, 1->2), shm x1 (2->0)")
    assert "rank 1, shared-memory links: full" in caplog.records[1].getMessage()
