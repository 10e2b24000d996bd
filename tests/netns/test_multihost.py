"""Multi-host runs on one machine: every "host" is a network namespace with its own address and hostname.

* model.fit under CommStrategy on 3 hosts (one rank each): the ring goes over raw TCP between hosts,
  every worker ends with the same weights, equal to one process trained on the global batch;
* 2 hosts x 2 ranks: a mixed ring (Unix sockets inside a host, raw TCP between hosts), direct-API
  collectives equal to numpy;
* a host's link goes down in the middle of a loop of all-reduces: the survivors must raise a
  tf_commstrategy error within 15 s (measured; written to $TFCS_NETNS_REPORT as JSON when set).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.netns import workers as WK

pytestmark = pytest.mark.netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "netns", "workers.py")
COORD_PORT = 29500
DETECT_BOUND_S = 15.0


class Worker:
    """One worker process inside a namespace; its output goes to a log file and is kept in memory."""

    def __init__(self, hosts, host: int, rank: int, argv, env, log_path):
        self.rank, self.host = rank, host
        self.lines = []  # (time.time(), text)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = hosts.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((time.time(), text))
            self._log.write(text + "\n")
            self._log.flush()
        self.proc.stdout.close()

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None

    def output(self) -> str:
        self._t.join(5)
        return "\n".join(t for _, t in self.lines)

    def idle(self) -> bool:
        return any(text.startswith("idle ") for _, text in self.lines)

    def progress(self) -> int:
        for _, text in reversed(self.lines):
            if text.startswith("progress "):
                return int(text.split()[1])
        return 0


def _clean_env():
    drop = ("TFCS_", "TF_CONFIG", "SLURM_", "OMPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and "proxy" not in k.lower()}
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""})
    return env


def start_job(hosts, placement, kind, out, extra_env=None, explicit_hosts=True, args=(), rendezvous_timeout=60):
    """Rank r runs ``workers.py kind`` on host ``placement[r]``; the coordinator is on rank 0's host."""
    size = len(placement)
    token = secrets.token_hex(16)
    coordinator = f"{hosts.addresses[placement[0]]}:{COORD_PORT}"
    workers = []
    for rank, h in enumerate(placement):
        env = _clean_env()
        env.update({"TFCS_RANK": str(rank), "TFCS_WORLD_SIZE": str(size), "TFCS_COORDINATOR": coordinator,
                    "TFCS_TOKEN": token, "TFCS_TIMEOUT": "60"})
        if rendezvous_timeout is not None:
            env["TFCS_RENDEZVOUS_TIMEOUT"] = str(rendezvous_timeout)
        if explicit_hosts:
            env.update({"TFCS_BIND_HOST": hosts.addresses[h], "TFCS_ADVERTISE_HOST": hosts.addresses[h]})
        env.update(extra_env or {})
        argv = [sys.executable, WORKER, kind, "--out", str(out), *args]
        workers.append(Worker(hosts, h, rank, argv, env, os.path.join(out, f"{kind}-{rank}.log")))
    return workers


def wait_all(workers, timeout):
    end = time.monotonic() + timeout
    codes = [w.wait(max(1.0, end - time.monotonic())) for w in workers]
    bad = [(w.rank, c) for w, c in zip(workers, codes) if c != 0]
    if bad:
        logs = "\n".join(f"--- rank {w.rank} (host {w.host}) exit {c}:\n{w.output()[-4000:]}"
                         for w, c in zip(workers, codes) if c != 0)
        pytest.fail(f"workers failed or timed out (None = killed at the {timeout} s limit): {bad}\n{logs}")


def job_links(workers, ranks, hosts):
    """The job's one report of its data paths (rank 0 logs it; no other rank may), of a job of ``ranks``
    ranks on ``hosts`` hosts, every rank reporting: ring name -> {(src, dst): kind}."""
    found = {w.rank: re.findall(r"data paths of the job \((\d+) ranks on (\d+) hosts?\): (.*)", w.output())
             for w in workers}
    assert [r for r, lines in found.items() if lines] == [0], {r: len(v) for r, v in found.items()}
    assert len(found[0]) == 1, found[0]
    got_ranks, got_hosts, body = found[0][0]
    assert (int(got_ranks), int(got_hosts)) == (ranks, hosts), found[0][0]
    rings = {}
    for part in body.split("; "):
        name, kinds = part.split(": ", 1)
        links = rings.setdefault(name, {})
        for kind, pairs in re.findall(r"(\w+) x\d+ \(([^)]*)\)", kinds):
            for pair in pairs.split(", "):
                src, dst = pair.split("->")
                links[(int(src), int(dst))] = kind
    return rings


# -- 1: model.fit, 3 hosts ----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_fit_three_hosts_matches_single_process(make_hosts, tmp_path):
    hosts = make_hosts(3)
    out = str(tmp_path)
    workers = start_job(hosts, [0, 1, 2], "fit", out)
    # the reference: one process in this test's own subprocess, no tf_commstrategy, same seed and data
    ref = subprocess.run([sys.executable, WORKER, "reference", "--out", out], env=_clean_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    wait_all(workers, timeout=180)

    assert not json.load(open(os.path.join(out, "reference.json")))["tfcs_imported"]
    reference = np.load(os.path.join(out, "reference.npz"))
    ref_w = [reference[f"arr_{i}"] for i in range(len(reference.files))]
    results = []
    for w in workers:
        info = json.load(open(os.path.join(out, f"fit-{w.rank}.json")))
        assert info["hostname"] == hosts.hostnames[w.host]
        assert (info["local_rank"], info["local_size"]) == (0, 1), info
        assert info["advertise_host"] == hosts.addresses[w.host]
        # every ring link joins two hosts: raw TCP (no TLS), in the log line and in the backend
        assert info["transport"] == "tcp", info
        npz = np.load(os.path.join(out, f"fit-{w.rank}.npz"))
        results.append([npz[f"arr_{i}"] for i in range(len(npz.files))])
    assert job_links(workers, 3, 3) == {"ring": {(0, 1): "tcp", (1, 2): "tcp", (2, 0): "tcp"}}
    for r in (1, 2):  # identical on every worker
        for i, (a, b) in enumerate(zip(results[0], results[r])):
            np.testing.assert_array_equal(a, b, err_msg=f"weight {i}: rank {r} differs from rank 0")
    assert len(results[0]) == len(ref_w)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results[0], ref_w))
    print(f"fit on 3 hosts: weights identical on all ranks; max |distributed - single process| = {worst:.3g}")
    for i, (a, b) in enumerate(zip(results[0], ref_w)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"weight {i} vs single process")


# -- 1b: 2 hosts x 2 ranks, direct API: hierarchical all-reduce (host ring, leader ring) and the flat ring ----
@pytest.mark.timeout(180)
@pytest.mark.parametrize("placement,hierarchical,transport", [([0, 0, 1, 1], "1", "auto"), ([0, 0, 1, 1], "0", "auto"),
                                                              ([0, 1, 1, 0, 1], "1", "auto"),
                                                              ([0, 1, 1, 0, 1], "1", "tcp")])
def test_collectives_two_hosts_two_ranks_each_mixed_ring(make_hosts, tmp_path, placement, hierarchical, transport):
    hosts = make_hosts(2)
    out = str(tmp_path)
    # bind / advertise hosts left to their defaults: all interfaces / the address routing to the coordinator
    workers = start_job(hosts, placement, "collectives", out, explicit_hosts=False,
                        extra_env={"TFCS_HIERARCHICAL": hierarchical, "TFCS_TRANSPORT": transport})
    wait_all(workers, timeout=150)
    size = len(placement)
    # rank -> its link to rank + 1: unix inside a host, raw TCP between hosts; raw TCP everywhere when asked
    expected_links = {r: "tcp" if transport == "tcp" else "unix" if placement[r] == placement[(r + 1) % size]
                      else "tcp" for r in range(size)}
    groups = [[r for r in range(size) if placement[r] == h] for h in sorted(set(placement))]
    leaders = [g[0] for g in sorted(groups)]
    for w in workers:
        info = json.load(open(os.path.join(out, f"coll-{w.rank}.json")))
        assert info["hostname"] == hosts.hostnames[w.host]
        assert info["hierarchical"] == (hierarchical == "1"), info
        mine = next(g for g in groups if w.rank in g)
        assert (info["local_rank"], info["local_size"]) == (mine.index(w.rank), len(mine)), info
        assert info["advertise_host"] == hosts.addresses[w.host], info
        assert info["transport"] == expected_links[w.rank], info
        got = np.load(os.path.join(out, f"coll-{w.rank}.npz"))
        for key, want in WK.expected_collectives(w.rank, size).items():
            assert got[key].dtype == want.dtype, (key, got[key].dtype, want.dtype)
            assert got[key].shape == want.shape, (key, got[key].shape, want.shape)
            if want.dtype.kind == "f":
                tol = 1e-2 if want.dtype == np.float16 else 1e-5
                np.testing.assert_allclose(got[key], want, rtol=tol, atol=tol, err_msg=f"rank {w.rank} {key}")
            else:
                np.testing.assert_array_equal(got[key], want, err_msg=f"rank {w.rank} {key}")
    # the job's one report names every link of every ring, as each rank's backend has it
    want = {"ring": {(r, (r + 1) % size): expected_links[r] for r in range(size)}}
    if hierarchical == "1":  # a host ring within each host, a leader ring among the hosts' first ranks
        local = "tcp" if transport == "tcp" else "unix"
        want["host rings"] = {(g[i], g[(i + 1) % len(g)]): local for g in groups if len(g) > 1 for i in range(len(g))}
        remote = "tcp"
        want["leader ring"] = {(leaders[i], leaders[(i + 1) % len(leaders)]): remote for i in range(len(leaders))}
    assert job_links(workers, size, len(groups)) == want


# -- 2: a host's link goes down --------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("phase", ["busy", "waiting"])
def test_link_down_is_detected_by_survivors_within_15s(make_hosts, tmp_path, phase):
    """busy: all-reduces 10 ms apart, the link goes down after >= 50 of them.

    waiting: after 50 all-reduces rank 2 pauses 20 s before the next one (a long compute step) while
    ranks 0 and 1 enter it and wait for rank 2; the link goes down 1 s into that wait, when nothing is
    in flight any more: a silent partition, no EOF, no RST, no unacknowledged data."""
    hosts = make_hosts(3)
    out = str(tmp_path)
    args = ["--max-seconds", "150"]
    if phase == "waiting":
        args += ["--idle-after", "50", "--idle-sleep", "20", "--idle-ranks", "2"]
    # default timeouts except the collective deadline (TFCS_TIMEOUT=60): detection must not come from it
    workers = start_job(hosts, [0, 1, 2], "loop", out, args=args, rendezvous_timeout=None)
    end = time.monotonic() + 120
    ready = (lambda: workers[2].idle()) if phase == "waiting" else \
        (lambda: min(w.progress() for w in workers) >= 50)
    while not ready():
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead or time.monotonic() > end:
            for w in workers:
                w.proc.kill()
            pytest.fail("workers did not reach 50 collectives: " +
                        "; ".join(f"rank {w.rank} rc={w.proc.poll()} progress={w.progress()}:\n"
                                  f"{w.output()[-2000:]}" for w in workers))
        time.sleep(0.05)
    if phase == "waiting":
        time.sleep(1.0)
    progress_at_cut = [w.progress() for w in workers]
    t_down = time.time()
    hosts.link_down(2)
    survivors = workers[:2]
    for w in survivors:  # generous wait, so that a slow detection is measured rather than cut off
        w.wait(timeout=75)
    workers[2].proc.kill()
    workers[2].wait(5)

    report = {"phase": phase, "link_down_at": t_down, "bound_s": DETECT_BOUND_S, "progress_at_cut": progress_at_cut,
              "cut_host": 2, "ranks": {}}
    failures = []
    for w in survivors:
        path = os.path.join(out, f"loop-{w.rank}.json")
        if not os.path.exists(path):
            failures.append(f"rank {w.rank}: no error report (rc={w.proc.returncode}):\n{w.output()[-3000:]}")
            report["ranks"][w.rank] = {"detected": False, "returncode": w.proc.returncode}
            continue
        r = json.load(open(path))
        detect = None if r["t_error"] is None else r["t_error"] - t_down
        report["ranks"][w.rank] = {"detected": r["error_class"] is not None, "detection_s": detect,
                                   "error_class": r["error_class"], "message": r["message"],
                                   "collectives": r["collectives"], "transport": r["transport"]}
        if r["error_class"] is None:
            failures.append(f"rank {w.rank}: no tf_commstrategy error, loop ended after {r['collectives']}")
            continue
        if "TfcsError" not in r["error_mro"]:
            failures.append(f"rank {w.rank}: {r['error_class']} is not a TfcsError")
        if detect > DETECT_BOUND_S:
            failures.append(f"rank {w.rank}: detected after {detect:.1f} s > {DETECT_BOUND_S} s "
                            f"({r['error_class']}: {r['message'][:300]})")
    path = os.environ.get("TFCS_NETNS_REPORT")
    if path:  # one file, one entry per phase
        try:
            with open(path) as f:
                everything = json.load(f)
        except (OSError, ValueError):
            everything = {}
        everything[phase] = report
        with open(path, "w") as f:
            json.dump(everything, f, indent=1)
    print(json.dumps(report, indent=1))
    assert not failures, "\n".join(failures)


# -- hosts that share a hostname but not a network ----------------------------------------------------------
@pytest.mark.timeout(120)
def test_same_hostname_different_network_namespaces_are_different_hosts(make_hosts, tmp_path):
    hosts = make_hosts(2, own_hostnames=False)
    out = str(tmp_path)
    workers = start_job(hosts, [0, 1], "collectives", out)
    wait_all(workers, timeout=90)
    for w in workers:
        info = json.load(open(os.path.join(out, f"coll-{w.rank}.json")))
        assert info["transport"] == "tcp", info
        got = np.load(os.path.join(out, f"coll-{w.rank}.npz"))
        for key, want in WK.expected_collectives(w.rank, 2).items():
            np.testing.assert_allclose(got[key], want, rtol=1e-2, atol=1e-2, err_msg=f"rank {w.rank} {key}")


# -- a raw TCP link that cannot be opened falls back to gRPC ----------------------------------------------------
@pytest.mark.timeout(120)
def test_a_raw_tcp_link_that_cannot_connect_takes_grpc_and_says_so(make_hosts, tmp_path):
    """Rank 1's raw TCP connects are refused (workers.py --refuse-raw-tcp: what a firewall's REJECT gives,
    in that process only): its link to rank 0 takes gRPC with one WARNING naming the pair, rank 0's link to
    rank 1 stays raw TCP, and the collectives equal numpy."""
    hosts = make_hosts(2)
    out = str(tmp_path)
    workers = start_job(hosts, [0, 1], "collectives", out, args=("--refuse-raw-tcp", "1"))
    wait_all(workers, timeout=90)
    for w in workers:
        info = json.load(open(os.path.join(out, f"coll-{w.rank}.json")))
        assert info["transport"] == ("grpc" if w.rank == 1 else "tcp"), info
        got = np.load(os.path.join(out, f"coll-{w.rank}.npz"))
        for key, want in WK.expected_collectives(w.rank, 2).items():
            np.testing.assert_allclose(got[key], want, rtol=1e-2, atol=1e-2, err_msg=f"rank {w.rank} {key}")
    warned = [line for line in workers[1].output().splitlines() if "no raw TCP data connection to rank 0" in line]
    assert len(warned) == 1 and "WARNING" in warned[0] and "uses gRPC instead" in warned[0], warned
    assert "no raw TCP data connection" not in workers[0].output()
    assert job_links(workers, 2, 2) == {"ring": {(0, 1): "tcp", (1, 0): "grpc"}}
