"""Fault trials on namespace hosts: a job trains (``workers.py fitloop``, one rank per host), then one host's
link is cut or the host is killed, and each survivor's error is timed from that moment.

Used by tests/netns/test_faults.py (one trial per fault) and benchmarks/fault_detection.py (many, for the
figures of docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict

from tests.netns.test_multihost import start_job

FAULTS = ("link-cut", "host-kill")


def _wait_progress(workers, steps: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while min(w.progress() for w in workers) < steps:
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead or time.monotonic() > end:
            for w in workers:
                w.proc.kill()
            raise RuntimeError(f"workers did not reach {steps} steps: " + "; ".join(
                f"rank {w.rank} rc={w.proc.poll()} progress={w.progress()}:\n{w.output()[-2000:]}" for w in workers))
        time.sleep(0.05)


def trial(hosts, fault: str, out: str, victim: int = None, warmup_steps: int = 30, wait_s: float = 60.0) -> Dict:
    """One job on every host, one fault on host ``victim`` (default: the last) after ``warmup_steps`` steps.

    Returns:
      {"fault", "victim", "ranks": {rank: {"detected", "detection_s", "error_class", "names_host",
      "message", "returncode"}}} for every surviving rank.
    """
    victim = hosts.n - 1 if victim is None else victim
    os.makedirs(out, exist_ok=True)
    workers = start_job(hosts, list(range(hosts.n)), "fitloop", out, args=["--max-seconds", "150"],
                        rendezvous_timeout=None)
    try:
        _wait_progress(workers, warmup_steps, 150)
        t_fault = time.time()
        if fault == "link-cut":
            hosts.link_down(victim)
        elif fault == "host-kill":
            hosts.kill_host(victim)
        else:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        survivors = [w for w in workers if w.host != victim]
        for w in survivors:  # generous, so that a slow detection is measured rather than cut off
            w.wait(timeout=max(1.0, t_fault + wait_s - time.time()))
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.wait(5)
        hosts.kill_host(victim)
        hosts.link_up(victim)
    lost = (hosts.addresses[victim], hosts.hostnames[victim])
    report = {"fault": fault, "victim": victim, "ranks": {}}
    for w in survivors:
        path = os.path.join(out, f"fitloop-{w.rank}.json")
        r = json.load(open(path)) if os.path.exists(path) else {}
        msg = r.get("message") or ""
        report["ranks"][w.rank] = {
            "detected": r.get("error_class") is not None, "returncode": w.proc.returncode,
            "detection_s": None if r.get("t_error") is None else r["t_error"] - t_fault,
            "error_class": r.get("error_class"), "names_host": any(x in msg for x in lost), "message": msg,
            "output": "" if r.get("error_class") else w.output()[-3000:]}
    return report
