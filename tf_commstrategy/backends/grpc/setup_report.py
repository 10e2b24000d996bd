"""One report per job of the data paths its rings use, logged by rank 0.

Each rank knows only its own outbound links (and, for shared memory, whether they fell back to Unix
sockets). At the end of the backend's setup every rank publishes those facts in the coordinator
store; rank 0 reads them all and logs one INFO line naming every link of every ring, and, when any
rank could not use shared memory, one WARNING that names the ranks, their reasons and the fix. The
other ranks log their own links at DEBUG only, so a job of any size prints the choice once.
"""

from __future__ import annotations

import json
import logging
from typing import Dict, List, Sequence, Tuple

log = logging.getLogger("tf_commstrategy")

#: The rings of a job by ring id (``links.RingLinks.ring_id``).
RING_NAMES = {0: "ring", 1: "host rings", 2: "leader ring"}
#: Links of one kind listed by name in the INFO line; more are counted ("+12 more").
LIST_AT_MOST = 8
#: What the warning tells a user whose ranks could not use shared memory.
SHM_FIX = ("give /dev/shm more room (docker run --shm-size=1g; on Kubernetes an emptyDir volume with "
           "medium: Memory mounted at /dev/shm)")


def my_facts(rings, problems: Sequence[Tuple[str, str]]) -> dict:
    """This rank's part of the report: each ring's outbound link (ring id, right neighbour, planned and
    actual kind) and the problems found on this rank ((what, reason) pairs)."""
    out = [[r.ring_id, r.right, r.planned, r.transport] for r in rings if r is not None and r.size > 1]
    return {"links": out, "problems": [list(p) for p in problems]}


def _kinds_text(links: List[Tuple[int, int, str]]) -> str:
    by_kind: Dict[str, List[str]] = {}
    for src, dst, kind in sorted(links):
        by_kind.setdefault(kind, []).append(f"{src}->{dst}")
    parts = []
    for kind in sorted(by_kind, key=lambda k: (-len(by_kind[k]), k)):
        names = by_kind[kind]
        shown = ", ".join(names[:LIST_AT_MOST])
        more = f", +{len(names) - LIST_AT_MOST} more" if len(names) > LIST_AT_MOST else ""
        parts.append(f"{kind} x{len(names)} ({shown}{more})")
    return ", ".join(parts)


def summary(reports: Sequence[dict], hosts: int) -> str:
    """The INFO line: every link of every ring, grouped by data path."""
    rings: Dict[int, List[Tuple[int, int, str]]] = {}
    for rank, rep in enumerate(reports):
        for ring_id, right, _planned, actual in rep["links"]:
            rings.setdefault(ring_id, []).append((rank, right, actual))
    parts = [f"{RING_NAMES.get(i, f'ring {i}')}: {_kinds_text(rings[i])}" for i in sorted(rings)]
    return (f"tf_commstrategy: data paths of the job ({len(reports)} ranks on {hosts} host"
            f"{'' if hosts == 1 else 's'}): " + "; ".join(parts))


def warning(reports: Sequence[dict]) -> str:
    """The WARNING line when some rank could not use shared memory, else ""."""
    problems = [f"rank {rank}, {what}: {why}" for rank, rep in enumerate(reports) for what, why in rep["problems"]]
    fell = [f"{rank}->{right}" for rank, rep in enumerate(reports)
            for _ring, right, planned, actual in rep["links"] if planned == "shm" and actual != "shm"]
    if not problems and not fell:
        return ""
    text = "tf_commstrategy: shared memory unavailable (" + ("; ".join(problems) or "a rank could not map a "
                                                             "neighbour's segments") + ")"
    consequences, fixes = [], [SHM_FIX]
    if fell:
        consequences.append(f"link{'s' if len(fell) > 1 else ''} {', '.join(fell)} use{'' if len(fell) > 1 else 's'} "
                            "Unix sockets instead")
        fixes.append("set TFCS_TRANSPORT=unix to choose them without this warning")
    if any(what == "shared all-reduce buffers" for rep in reports for what, _ in rep["problems"]):
        consequences.append("the all-reduce uses the ring instead of the shared buffers")
        fixes.append("set a smaller TFCS_SHM_FUSION_BYTES (0 turns the buffers off)")
    return (f"{text}: {' and '.join(consequences) or 'slower data paths are used'}; to fix it, "
            f"{', or '.join(fixes)}")


def publish(store, rank: int, size: int, timeout: float, facts: dict, hosts: int) -> None:
    """Every rank publishes its facts; rank 0 reads every rank's and logs the job's report."""
    store.set(f"links/report/{rank}", json.dumps(facts))
    if rank != 0:
        return
    reports = [facts] + [json.loads(store.get(f"links/report/{q}", timeout)) for q in range(1, size)]
    log.info("%s", summary(reports, hosts))
    text = warning(reports)
    if text:
        log.warning("%s", text)
