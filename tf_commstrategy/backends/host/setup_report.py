"""One report per job of the data paths its rings use, logged by rank 0.

Each rank knows only its own outbound links (and, for shared memory, whether they fell back to Unix
sockets). At the end of the backend's setup every rank publishes those facts in the coordinator
store; rank 0 reads them all and logs one INFO line naming every link of every ring, and, when any
rank could not use shared memory, one WARNING that names the ranks, their reasons and the fix. The
other ranks log their own links at DEBUG only, so a job of any size prints the choice once.

The report is informational: it never fails a job. Rank 0 waits at most ``REPORT_WAIT_S`` in all for
the other ranks' parts (they publish at the same point of setup, right after their rings connect); a
rank that has not published by then is named as missing and the report lists the others. A rank that
died is named again, with its cause, by the peer-loss error of the job's next collective.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import TfcsError

log = logging.getLogger("tf_commstrategy")

#: The rings of a job by ring id (``links.RingLinks.ring_id``).
RING_NAMES = {0: "ring", 1: "host rings", 2: "leader ring"}
#: Links (or ranks) of one kind listed by name; more are counted ("+12 more").
LIST_AT_MOST = 8
#: Seconds rank 0 waits, in all, for the other ranks' parts of the report (capped by the rendezvous timeout).
REPORT_WAIT_S = 15.0
#: What the warning tells a user whose ranks could not use shared memory.
SHM_FIX = ("give /dev/shm more room (docker run --shm-size=1g; on Kubernetes an emptyDir volume with "
           "medium: Memory mounted at /dev/shm)")
#: What became of the shared all-reduce buffers on a rank (``fusion`` in its facts; None: not planned).
FUSION_STATES = ("used", "dropped", "off")


def my_facts(rings, problems: Sequence[Tuple[str, str]], fusion: Optional[str] = None) -> dict:
    """This rank's part of the report.

    Args:
      rings: the rank's rings (None for one it is not in); each gives its outbound link (ring id, right
        neighbour, planned and actual kind).
      problems: (what, reason) pairs found on this rank.
      fusion: what became of the shared all-reduce buffers (one of ``FUSION_STATES``), or None when the
        job did not plan them.
    """
    if fusion is not None and fusion not in FUSION_STATES:
        raise ValueError(f"fusion={fusion!r}: expected one of {FUSION_STATES} or None")
    out = [[r.ring_id, r.right, r.planned, r.transport] for r in rings if r is not None and r.size > 1]
    return {"links": out, "problems": [list(p) for p in problems], "fusion": fusion}


def _listed(names: List[str]) -> str:
    shown = ", ".join(names[:LIST_AT_MOST])
    return shown + (f", +{len(names) - LIST_AT_MOST} more" if len(names) > LIST_AT_MOST else "")


def _ranks_text(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {_listed([str(r) for r in sorted(ranks)])}"


def _kinds_text(links: List[Tuple[int, int, str]]) -> str:
    by_kind: Dict[str, List[str]] = {}
    for src, dst, kind in sorted(links):
        by_kind.setdefault(kind, []).append(f"{src}->{dst}")
    parts = []
    for kind in sorted(by_kind, key=lambda k: (-len(by_kind[k]), k)):
        parts.append(f"{kind} x{len(by_kind[kind])} ({_listed(by_kind[kind])})")
    return ", ".join(parts)


#: The part of a cause that differs from rank to rank for one cause (merged causes leave it out).
_FREE = re.compile(r"; \d+ MiB free\)")


def cause_key(why: str) -> str:
    """What stays of a cause when it is merged with the same cause found elsewhere (no free space)."""
    return _FREE.sub(")", why)


def _causes_text(causes: Dict[Tuple[str, str], List[int]]) -> str:
    """One clause per cause, the ranks that found it named together; free space, which differs from rank
    to rank, is left out of a cause that several ranks found; at most ``LIST_AT_MOST`` clauses."""
    merged: Dict[Tuple[str, str], Tuple[List[int], List[str]]] = {}
    for (what, why), ranks in causes.items():
        ranks_texts = merged.setdefault((what, cause_key(why)), ([], []))
        ranks_texts[0].extend(ranks)
        ranks_texts[1].append(why)
    said = [f"{_ranks_text(ranks)}, {what}: {texts[0] if len(set(texts)) == 1 else key}"
            for (what, key), (ranks, texts) in merged.items()]
    more = f"; +{len(said) - LIST_AT_MOST} more causes" if len(said) > LIST_AT_MOST else ""
    return "; ".join(said[:LIST_AT_MOST]) + more


def _present(reports: Sequence[Optional[dict]]):
    return [(rank, rep) for rank, rep in enumerate(reports) if rep is not None]


def summary(reports: Sequence[Optional[dict]], hosts: int) -> str:
    """The INFO line: every link of every ring, grouped by data path (None: a rank that did not report)."""
    rings: Dict[int, List[Tuple[int, int, str]]] = {}
    for rank, rep in _present(reports):
        for ring_id, right, _planned, actual in rep["links"]:
            rings.setdefault(ring_id, []).append((rank, right, actual))
    parts = [f"{RING_NAMES.get(i, f'ring {i}')}: {_kinds_text(rings[i])}" for i in sorted(rings)]
    missing = [rank for rank, rep in enumerate(reports) if rep is None]
    gap = f"; {_ranks_text(missing)} did not report" if missing else ""
    return (f"tf_commstrategy: data paths of the job ({len(reports)} ranks on {hosts} host"
            f"{'' if hosts == 1 else 's'}{gap}): " + "; ".join(parts))


def warning(reports: Sequence[Optional[dict]]) -> str:
    """The WARNING line when some rank could not use shared memory, else ""."""
    present = _present(reports)
    causes: Dict[Tuple[str, str], List[int]] = {}  # one cause, every rank that found it
    for rank, rep in present:
        for what, why in rep["problems"]:
            causes.setdefault((what, why), []).append(rank)
    fell: Dict[int, List[str]] = {}  # ring id -> links planned on shared memory that use sockets
    for rank, rep in present:
        for ring_id, right, planned, actual in rep["links"]:
            if planned == "shm" and actual != "shm":
                fell.setdefault(ring_id, []).append(f"{rank}->{right}")
    dropped = (any(rep.get("fusion") == "dropped" for _rank, rep in present)
               or any(what == "shared all-reduce buffers" for what, _why in causes))
    if not causes and not fell and not dropped:
        return ""
    found = dict(causes)  # the causes the ranks found themselves
    fixes = [SHM_FIX] if found or fell else ["see the log of the rank that did not report"]
    off = [rank for rank, rep in present if rep.get("fusion") == "off"]
    if dropped and off:  # TFCS_SHM_FUSION_BYTES=0 on some ranks only: every rank drops the buffers
        causes[("shared all-reduce buffers",
                "turned off (TFCS_SHM_FUSION_BYTES=0) there but not on the other ranks")] = off
        fixes = ["set the same TFCS_SHM_FUSION_BYTES on every rank"] + (fixes if found or fell else [])
    unknown = ("a rank could not map a neighbour's segments" if fell else
               "the cause was found on a rank that did not report")
    text = "shared memory unavailable (" + (_causes_text(causes) or unknown) + ")"
    consequences = []
    if fell:
        count = sum(len(v) for v in fell.values())
        if len(fell) == 1 and 0 in fell:
            names = _listed(fell[0])
        else:
            names = ", ".join(f"{_listed(fell[i])} ({RING_NAMES.get(i, f'ring {i}')})" for i in sorted(fell))
        consequences.append(f"link{'s' if count > 1 else ''} {names} use{'' if count > 1 else 's'} "
                            "Unix sockets instead")
        fixes.append("set TFCS_TRANSPORT=unix to choose them without this warning")
    if dropped:
        consequences.append("the all-reduce uses the ring instead of the shared buffers")
        if any(what == "shared all-reduce buffers" for what, _why in found):
            fixes.append("set a smaller TFCS_SHM_FUSION_BYTES (0 turns the buffers off)")
    return (f"tf_commstrategy: {text}: "
            f"{' and '.join(consequences) or 'slower data paths are used'}; to fix it, {', or '.join(fixes)}")


def _valid(rep) -> bool:
    def link(x):
        return (isinstance(x, list) and len(x) == 4 and all(isinstance(v, int) for v in x[:2])
                and all(isinstance(v, str) for v in x[2:]))

    def problem(p):
        return isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
    return (isinstance(rep, dict) and isinstance(rep.get("links"), list) and isinstance(rep.get("problems"), list)
            and all(map(link, rep["links"])) and all(map(problem, rep["problems"]))
            and rep.get("fusion") in FUSION_STATES + (None,))


def publish(store, rank: int, size: int, timeout: float, facts: dict, hosts: int) -> None:
    """Every rank publishes its facts; rank 0 reads every rank's and logs the job's report.

    Never raises for a store that fails or a rank that does not report: rank 0 waits at most
    ``min(timeout, REPORT_WAIT_S)`` seconds in all and names the ranks whose parts it lacks.
    """
    try:
        store.set(f"links/report/{rank}", json.dumps(facts))
    except (TfcsError, OSError, ValueError) as e:
        log.debug("tf_commstrategy rank %d: could not publish its part of the data-path report: %s", rank, e)
    if rank != 0:
        return
    wait_s = min(timeout, REPORT_WAIT_S)
    end = time.monotonic() + wait_s
    reports: List[Optional[dict]] = [facts]
    for q in range(1, size):
        try:
            rep = json.loads(store.get(f"links/report/{q}", max(0.0, end - time.monotonic())))
        except (TfcsError, OSError, ValueError):
            rep = None
        reports.append(rep if _valid(rep) else None)
    missing = [q for q, rep in enumerate(reports) if rep is None]
    if missing:
        log.warning("tf_commstrategy: %s did not report %s data paths within %g s of rank 0's rings "
                    "connecting; the report lists the others (a rank that died is named by the next "
                    "collective's peer-loss error)", _ranks_text(missing), "its" if len(missing) == 1 else "their",
                    wait_s)
    log.info("%s", summary(reports, hosts))
    text = warning(reports)
    if text:
        log.warning("%s", text)
