"""The job's one report of its data paths (rank 0 logs it): the INFO line and the shared-memory warning."""

import json
import logging
import time

import pytest

from tf_commstrategy.backends.host import setup_report as R


class _Ring:
    def __init__(self, ring_id, right, planned, transport, size=2):
        self.ring_id, self.right, self.planned, self.transport, self.size = ring_id, right, planned, transport, size


def _reports(*links_per_rank, problems=None):
    problems = problems or {}
    return [{"links": [list(x) for x in links], "problems": [list(p) for p in problems.get(r, [])]}
            for r, links in enumerate(links_per_rank)]


def test_my_facts_lists_the_outbound_link_of_every_ring_of_more_than_one_rank():
    rings = (_Ring(0, 1, "shm", "unix", 4), None, _Ring(1, 0, "shm", "shm", 1), _Ring(2, 2, "grpc", "grpc"))
    facts = json.loads(json.dumps(R.my_facts(rings, [("shared-memory links", "full")], "dropped")))
    assert facts == {"links": [[0, 1, "shm", "unix"], [2, 2, "grpc", "grpc"]],
                     "problems": [["shared-memory links", "full"]], "fusion": "dropped"}
    assert R.my_facts(rings, [])["fusion"] is None
    with pytest.raises(ValueError, match="fusion='gone'"):
        R.my_facts(rings, [], "gone")


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
    for rep in reports:
        rep["fusion"] = "dropped"
    text = R.warning(reports)
    assert "rank 2, shared all-reduce buffers: No space left on device" in text
    assert "the all-reduce uses the ring instead" in text and "Unix sockets" not in text
    assert "TFCS_SHM_FUSION_BYTES" in text


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


def test_warning_says_the_shared_buffers_went_too_when_every_rank_fell_back():
    """Every rank's links fell back for one cause: the buffers were not even tried (their cause is the
    links'), yet the user must learn that the all-reduce lost them too."""
    n = 4
    reports = _reports(*[[(0, (r + 1) % n, "shm", "unix")] for r in range(n)],
                       problems={r: [("shared-memory links", "cannot reserve 17 MiB in /dev/shm")] for r in range(n)})
    for rep in reports:
        rep["fusion"] = "dropped"
    text = R.warning(reports)
    assert "Unix sockets instead and the all-reduce uses the ring instead of the shared buffers" in text, text
    assert "TFCS_SHM_FUSION_BYTES" not in text  # a smaller buffer would not help: /dev/shm is the cause


def test_warning_merges_ranks_with_one_cause_and_stays_short_in_a_large_job():
    n = 16
    reports = _reports(*[[(0, (r + 1) % n, "shm", "unix")] for r in range(n)],
                       problems={r: [("shared-memory links", "cannot reserve 17 MiB in /dev/shm")] for r in range(n)})
    text = R.warning(reports)
    assert text.count("cannot reserve") == 1, text
    assert "ranks 0, 1, 2, 3, 4, 5, 6, 7, +8 more, shared-memory links: cannot reserve 17 MiB" in text
    assert "links 0->1, 1->2, 2->3, 3->4, 4->5, 5->6, 6->7, 7->8, +8 more use Unix sockets instead" in text
    assert len(text) < 600, len(text)


def test_warning_names_the_ring_of_each_link_that_fell_back():
    """With the hierarchy on, rank 0 has a link in the job's ring and one in its host ring, both to rank 1."""
    reports = _reports([(0, 1, "shm", "unix"), (1, 1, "shm", "unix"), (2, 2, "grpc", "grpc")],
                       [(0, 2, "grpc", "grpc"), (1, 0, "shm", "shm")],
                       [(0, 3, "shm", "shm"), (1, 3, "shm", "shm"), (2, 0, "grpc", "grpc")],
                       [(0, 0, "grpc", "grpc"), (1, 2, "shm", "shm")],
                       problems={1: [("shared-memory links", "cannot reserve 17 MiB in /dev/shm")]})
    text = R.warning(reports)
    assert "links 0->1 (ring), 0->1 (host rings) use Unix sockets instead" in text, text
    assert "rank 1, shared-memory links" in text


def test_buffers_turned_off_on_purpose_are_not_warned_about():
    reports = _reports([(0, 1, "shm", "shm")], [(0, 2, "shm", "shm")], [(0, 0, "shm", "shm")])
    for rep in reports:
        rep["fusion"] = "off"
    assert R.warning(reports) == ""


class _SlowStore:
    """A store in which some ranks never publish: a get for them waits its whole timeout, then fails."""

    def __init__(self, fail_set=False):
        self.kv, self.waited, self.fail_set = {}, [], fail_set

    def set(self, k, v):
        if self.fail_set:
            from tf_commstrategy.errors import RendezvousError
            raise RendezvousError("the coordinator is gone")
        self.kv[k] = v

    def get(self, k, timeout):
        if k not in self.kv:
            from tf_commstrategy.errors import RendezvousError
            self.waited.append(timeout)
            time.sleep(timeout)
            raise RendezvousError(f"key {k!r} did not appear within {timeout:.0f} s")
        return self.kv[k]


def test_rank_0_waits_once_in_all_for_missing_reports_names_them_and_does_not_raise(monkeypatch, caplog):
    """A rank that died right after its rings came up must not turn into a setup failure after the
    whole rendezvous timeout (the next collective's peer-loss error names it within seconds)."""
    monkeypatch.setattr(R, "REPORT_WAIT_S", 0.3)
    store = _SlowStore()
    facts = {"links": [[0, 1, "shm", "shm"]], "problems": [], "fusion": None}
    store.set("links/report/2", json.dumps({"links": [[0, 3, "shm", "shm"]], "problems": []}))
    store.set("links/report/4", "not json")
    store.set("links/report/5", json.dumps({"links": "?"}))
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="tf_commstrategy"):
        R.publish(store, 0, 6, 300.0, facts, 1)  # ranks 1 and 3 never report; 4 and 5 sent garbage
    took = time.monotonic() - t0
    assert took < 1.0, took  # one deadline for all of them, not one per rank
    assert sum(store.waited) <= 0.3 + 1e-6, store.waited
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert msgs[0][0] == "WARNING" and "ranks 1, 3, 4, 5 did not report their data paths within 0.3 s" in msgs[0][1]
    assert msgs[1][0] == "INFO" and "(6 ranks on 1 host; ranks 1, 3, 4, 5 did not report): ring: shm x2 " \
                                    "(0->1, 2->3)" in msgs[1][1], msgs[1][1]


def test_a_rank_that_cannot_publish_its_part_carries_on(caplog):
    with caplog.at_level(logging.DEBUG, logger="tf_commstrategy"):
        R.publish(_SlowStore(fail_set=True), 3, 4, 300.0, {"links": [], "problems": []}, 1)
    assert "rank 3: could not publish" in caplog.text


def test_one_cause_found_with_different_free_space_is_merged_and_many_causes_are_capped():
    n = 4
    why = "cannot reserve 17 MiB in /dev/shm ([Errno 28] No space left on device; {} MiB free)"
    reports = _reports(*[[(0, (r + 1) % n, "shm", "unix")] for r in range(n)],
                       problems={r: [("shared-memory links", why.format(3 + r))] for r in range(n)})
    text = R.warning(reports)
    assert ("ranks 0, 1, 2, 3, shared-memory links: cannot reserve 17 MiB in /dev/shm ([Errno 28] No space "
            "left on device)") in text, text
    for rep in reports:
        rep["problems"] = [["shared-memory links", why.format(9)]]
    assert "9 MiB free" in R.warning(reports)  # one text on every rank: shown whole
    n = 30
    reports = _reports(*[[(0, (r + 1) % n, "shm", "unix")] for r in range(n)],
                       problems={r: [("shared-memory links", f"cannot map rank {(r + 1) % n}'s segments")]
                                 for r in range(n)})
    text = R.warning(reports)
    assert text.count("cannot map") == R.LIST_AT_MOST and "; +22 more causes)" in text, text
    assert len(text) < 1000, len(text)


def test_buffers_off_on_some_ranks_only_are_named_with_their_fix():
    """TFCS_SHM_FUSION_BYTES=0 on rank 1 only: every rank drops the buffers, no rank finds a cause."""
    reports = _reports([(0, 1, "shm", "shm")], [(0, 2, "shm", "shm")], [(0, 0, "shm", "shm")])
    for r, rep in enumerate(reports):
        rep["fusion"] = "off" if r == 1 else "dropped"
    text = R.warning(reports)
    assert "rank 1, shared all-reduce buffers: turned off (TFCS_SHM_FUSION_BYTES=0) there but not on the other" \
           in text, text
    assert text.endswith("the all-reduce uses the ring instead of the shared buffers; to fix it, set the same "
                         "TFCS_SHM_FUSION_BYTES on every rank"), text
    assert "--shm-size" not in text and "neighbour's segments" not in text


def test_buffers_dropped_for_a_cause_on_a_rank_that_did_not_report():
    reports = _reports([(0, 1, "shm", "shm")], [(0, 2, "shm", "shm")], [(0, 0, "shm", "shm")])
    for rep in reports:
        rep["fusion"] = "dropped"
    reports[2] = None
    text = R.warning(reports)
    assert "(the cause was found on a rank that did not report)" in text, text
    assert text.endswith("to fix it, see the log of the rank that did not report"), text


def test_a_report_of_the_wrong_shape_counts_as_missing():
    good = {"links": [[0, 1, "shm", "shm"]], "problems": [], "fusion": None}
    assert R._valid(good)
    for bad in ({"links": [["0", 1, "shm", "shm"]], "problems": []}, {"links": [], "problems": [[1, 2]]},
                {"links": [], "problems": [], "fusion": "maybe"}, [good], None):
        assert not R._valid(bad), bad
