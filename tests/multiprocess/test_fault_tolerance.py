"""Workers that die, freeze or fail in the middle of ``model.fit``, run through ``tfcs-run`` as a user would.

The survivors must raise a typed error naming the lost rank quickly (not at the deadline), ``tfcs-run``
must exit non-zero naming it, and ``--max-restarts`` with ``BackupAndRestore`` must finish the training
with the same weights as an uninterrupted run. Assertions are made here, in the parent.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "multiprocess", "fault_job.py")
RUN = [sys.executable, "-m", "tf_commstrategy.run"]


def _job(tmp, *job_args, run_args=(), env=None, timeout=180):
    e = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    e.update(env or {})
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    r = subprocess.run(RUN + ["-np", "3", *run_args, sys.executable, JOB, "--out", str(out), *job_args],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    reports = {}
    for rank in range(3):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    return r, reports, out


def _check_kill(r, reports, victim=2):
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    assert f"rank {victim} (pid" in r.stderr and "SIGKILL" in r.stderr and "first failure" in r.stderr
    survivors = sorted(set(range(3)) - {victim})
    assert sorted(reports) == survivors, r.stderr[-3000:]
    for rank in survivors:
        rep = reports[rank]
        assert rep["cls"] == "PeerLostError", rep
        assert rep["peer"] == victim and f"rank {victim}" in rep["msg"] and "host " in rep["msg"], rep
        assert rep["chained_from_tf"] and rep["tfcs_error"], rep  # model.fit raised ours, from TF's error
        assert rep["detect_s"] is not None and rep["detect_s"] < 15, rep
    return [reports[r]["detect_s"] for r in survivors]


@pytest.mark.timeout(200)
# shared memory (the default here) and raw TCP sockets with tf_keras; shared memory with Keras 3
@pytest.mark.parametrize("transport,keras", [("auto", "2"), ("tcp", "2"), ("auto", "3")])
def test_kill9_during_fit_survivors_raise_peer_lost_naming_it(tmp_path, transport, keras):
    r, reports, _ = _job(tmp_path, "--fault", "kill", "--victim", "2", "--at", "5", "--keras", keras,
                         run_args=("--transport", transport))
    _check_kill(r, reports)


@pytest.mark.slow
@pytest.mark.timeout(1100)
def test_kill9_twenty_times_no_hang(tmp_path):
    times, victims = [], []
    for i in range(20):
        victim = i % 3
        d = tmp_path / f"rep{i}"
        d.mkdir()
        r, reports, _ = _job(d, "--fault", "kill", "--victim", str(victim), "--at", str(3 + i % 5), timeout=120)
        times += _check_kill(r, reports, victim)
        victims.append(victim)
    report = os.environ.get("TFCS_RELIABILITY_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"trials": 20, "victims": victims, "detect_s": times}, f)
    assert len(times) == 40 and max(times) < 15


@pytest.mark.timeout(200)
def test_frozen_worker_past_the_deadline_gives_timeout_naming_it(tmp_path):
    # deadline 4 s, heartbeat limit 10 s: the deadline comes first
    r, reports, _ = _job(tmp_path, "--fault", "stop", "--victim", "2", "--at", "5", run_args=("--timeout", "4"))
    assert r.returncode != 0
    assert "rank 2 (pid" in r.stderr and "is stopped" in r.stderr, r.stderr[-3000:]
    assert sorted(reports) == [0, 1], r.stderr[-3000:]
    for rank in (0, 1):
        rep = reports[rank]
        assert rep["cls"] == "CollectiveTimeoutError", rep
        assert rep["waiting_for"] == [2] and "rank 2 (host" in rep["msg"] and "not arrived" in rep["msg"], rep
        assert 3.5 < rep["detect_s"] < 15, rep


@pytest.mark.timeout(200)
def test_frozen_worker_is_declared_lost_by_heartbeats_within_15s(tmp_path):
    r, reports, _ = _job(tmp_path, "--fault", "stop", "--victim", "1", "--at", "5")  # default deadline 300 s
    assert r.returncode != 0
    assert sorted(reports) == [0, 2], r.stderr[-3000:]
    for rank in (0, 2):
        rep = reports[rank]
        assert rep["cls"] == "PeerLostError" and rep["peer"] == 1, rep
        assert "heartbeats" in rep["msg"], rep
        assert rep["detect_s"] < 15, rep


@pytest.mark.slow  # two 3-worker jobs, about a minute on 2 cores; the default suite keeps the restart loop
@pytest.mark.timeout(300)  # (test_max_restarts_gives_up_after_k_attempts) and BackupAndRestore's resume (test_keras_paths)
@pytest.mark.parametrize("keras", ["2", "3"])
def test_max_restarts_with_backup_and_restore_loses_nothing(tmp_path, keras):
    common = ("--steps", "12", "--epochs", "3", "--keras", keras)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    r, _, ref_out = _job(ref_dir, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    backup = tmp_path / "backup"
    r, _, out = _job(run_dir, *common, "--backup", str(backup), "--kill-epoch", "1", run_args=("--max-restarts", "1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restarting all 3 workers (restart 1 of 1)" in r.stderr
    assert "rank 2 (pid" in r.stderr and "SIGKILL" in r.stderr
    ref = np.load(ref_out / "weights0_r0.npz")
    for rank in range(3):
        assert (out / f"done{rank}").read_text() == "1"  # finished on the restarted attempt
        got = np.load(out / f"weights{rank}_r1.npz")
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_max_restarts_gives_up_after_k_attempts(tmp_path):
    s = tmp_path / "fail.py"
    s.write_text("import os, sys\nprint('attempt', os.environ['TFCS_RESTART_COUNT'], flush=True)\n"
                 "sys.exit(5 if os.environ['TFCS_RANK'] == '1' else 0)\n")
    r = subprocess.run(RUN + ["-np", "2", "--max-restarts", "2", "--grace", "2", sys.executable, str(s)],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 5
    assert sorted(line.split("] ", 1)[1] for line in r.stdout.splitlines() if "attempt" in line) == \
        ["attempt 0", "attempt 0", "attempt 1", "attempt 1", "attempt 2", "attempt 2"]
    assert r.stderr.count("restarting all 2 workers") == 2
