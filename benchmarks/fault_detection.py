"""How long the survivors of a fault take to raise their error, on hosts joined by a shaped link.

    sudo python benchmarks/fault_detection.py [--trials 10] [--rate 1gbit] [--json out.json]

Three network-namespace hosts on one bridge (tests/netns/hosts.py), every link shaped with ``tc tbf`` to
``--rate`` both ways (this kernel has no netem: no delay), one rank per host. Each trial starts a fresh job
that trains with tf_keras ``model.fit`` under ``CommStrategy`` (tests/netns/workers.py ``fitloop``: an
endless dataset, 10 ms between steps), waits for 30 steps on every rank, then does one fault to the last
host:

* ``link-cut``: its bridge port goes down: nothing more arrives or leaves, no FIN, no RST;
* ``host-kill``: SIGKILL to every process in its namespace (workers included); its kernel closes their
  connections, as a crashed process's would, while a machine losing power would look like a cut link.

Faults alternate, trial by trial. For every survivor: the time from the fault to its error (the
worker notes the time when the error reaches its code), the error's class, and whether the message names
the lost host (its address or hostname). Needs root (``ip netns``, ``tc``); the figures go to
docs/benchmarks.md, `make bench-faults` writes bench-results/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.netns import hosts as H  # noqa: E402
from tests.netns.faults import FAULTS, trial  # noqa: E402

BOUND_S = 15.0


def summarize(reports):
    rows = []
    for fault in FAULTS:
        got = [r for rep in reports if rep["fault"] == fault for r in rep["ranks"].values()]
        if not got:
            continue
        times = sorted(r["detection_s"] for r in got if r["detection_s"] is not None)
        rows.append({
            "fault": fault, "trials": sum(rep["fault"] == fault for rep in reports), "survivors": len(got),
            "detected": sum(r["detected"] for r in got), "peer_lost": sum(r["error_class"] == "PeerLostError" for r in got),
            "names_host": sum(r["names_host"] for r in got), "within_bound": sum(t <= BOUND_S for t in times),
            "median_s": statistics.median(times) if times else None, "min_s": times[0] if times else None,
            "max_s": times[-1] if times else None})
    return rows


def table(rows, rate):
    lines = [f"| fault ({rate} link) | trials | survivors | error on every survivor | PeerLostError | names the host "
             f"| within {BOUND_S:g} s | median | min - max |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['trials']} | {r['survivors']} | {r['detected']}/{r['survivors']} | "
                     f"{r['peer_lost']}/{r['survivors']} | {r['names_host']}/{r['survivors']} | "
                     f"{r['within_bound']}/{r['survivors']} | {r['median_s']:.2f} s | "
                     f"{r['min_s']:.2f} - {r['max_s']:.2f} s |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10, help="trials per fault")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of every link")
    p.add_argument("--json", help="write every trial and the summary here")
    a = p.parse_args(argv)
    reason = H.unavailable_reason()
    if reason:
        sys.exit(f"fault_detection: {reason}")
    reports = []
    with H.NetnsHosts(3) as hosts, tempfile.TemporaryDirectory() as tmp:
        hosts.shape(a.rate)
        for i in range(a.trials):
            for fault in (FAULTS if i % 2 == 0 else FAULTS[::-1]):
                rep = trial(hosts, fault, os.path.join(tmp, f"{fault}-{i}"))
                reports.append(rep)
                print(json.dumps({"trial": i, "fault": fault, "ranks": {
                    k: {x: v[x] for x in ("detection_s", "error_class", "names_host")}
                    for k, v in rep["ranks"].items()}}), flush=True)
    rows = summarize(reports)
    print(table(rows, a.rate))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rate": a.rate, "bound_s": BOUND_S, "summary": rows, "trials": reports}, f, indent=1)


if __name__ == "__main__":
    main()
