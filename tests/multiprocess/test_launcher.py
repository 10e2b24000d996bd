"""tfcs-run as a user runs it: a fresh process, real workers, exit codes, prefixes, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import ROOT

RUN = [sys.executable, "-m", "tf_commstrategy.run"]


def _script(tmp_path, body):
    p = tmp_path / "w.py"
    p.write_text(textwrap.dedent(body))
    return str(p)


def _run(args, timeout=120, **kw):
    return subprocess.run(RUN + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def _started(script, n=2):
    """tfcs-run with ``n`` workers running ``script``, returned once every worker printed "ready"."""
    p = subprocess.Popen(RUN + ["-np", str(n), sys.executable, script], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for _ in range(n):
        assert "ready" in p.stdout.readline()
    return p


def test_demo_runs_and_prefixes_every_line_with_its_rank():
    r = _run(["-np", "2", sys.executable, "examples/collective_demo.py"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert sorted(l[:4] for l in lines) == ["[0] ", "[1] "]
    assert all("sum=[3.0, 3.0, 3.0, 3.0]" in l for l in lines)


def test_environment_given_to_workers(tmp_path):
    s = _script(tmp_path, """
        import os
        print(os.environ["TFCS_RANK"], os.environ["TFCS_WORLD_SIZE"], os.environ["TFCS_LOCAL_RANK"],
              os.environ["TFCS_COORDINATOR"].startswith("127.0.0.1:"), os.environ.get("TFCS_BACKEND"),
              os.environ.get("TFCS_TIMEOUT"), len(os.environ.get("TFCS_TOKEN", "")) >= 32,
              os.environ.get("TFCS_TRANSPORT"))
    """)
    r = _run(["-np", "3", "--backend", "grpc", "--timeout", "42", "--transport", "tcp", "--no-prefix",
              sys.executable, s])
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:3]) == [f"{i} 3 {i} True grpc 42.0 True tcp" for i in range(3)]


def test_failing_worker_stops_the_others_and_sets_the_exit_code(tmp_path):
    pidfile = tmp_path / "pids"
    s = _script(tmp_path, f"""
        import os, sys, time
        with open({str(pidfile)!r}, "a") as f:
            f.write(str(os.getpid()) + "\\n")
        if os.environ["TFCS_RANK"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    r = _run(["-np", "3", sys.executable, s])
    assert r.returncode == 3
    assert time.monotonic() - t0 < 60
    assert "rank 1" in r.stderr and "exited with code 3" in r.stderr
    for pid in map(int, pidfile.read_text().split()):  # no orphans left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_killed_worker_is_reported_with_its_signal(tmp_path):
    s = _script(tmp_path, """
        import os, signal, time
        if os.environ["TFCS_RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    r = _run(["-np", "2", sys.executable, s])
    assert r.returncode == 128 + 9
    assert "rank 0" in r.stderr and "SIGKILL" in r.stderr


def test_sigterm_is_forwarded_to_every_worker(tmp_path):
    marker = tmp_path / "got"
    s = _script(tmp_path, f"""
        import os, signal, sys, time
        def h(sig, frm):
            open({str(marker)!r} + os.environ["TFCS_RANK"], "w").write("x")
            sys.exit(0)
        signal.signal(signal.SIGTERM, h)
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = _started(s)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    assert os.path.exists(str(marker) + "0") and os.path.exists(str(marker) + "1")


def test_what_a_worker_started_is_stopped_when_the_job_ends(tmp_path):
    pidfile = tmp_path / "child"
    s = _script(tmp_path, f"""
        import os, subprocess, sys
        if os.environ["TFCS_RANK"] == "1":  # starts a process and exits without waiting for it
            child = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            open({str(pidfile)!r}, "w").write(str(child.pid))
    """)
    r = _run(["-np", "2", sys.executable, s], timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the worker's child {pid} outlived the job")


def test_output_to_a_closed_pipe_does_not_block_the_workers(tmp_path):
    s = _script(tmp_path, """
        for i in range(100_000):  # far more than a pipe holds
            print("line", i)
    """)
    cmd = " ".join(RUN + ["-np", "2", sys.executable, s]) + " | head -n 1"
    p = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # tfcs-run; its workers are in their own groups
        subprocess.run(["pkill", "-9", "-f", s])
        pytest.fail("tfcs-run | head did not finish: the workers blocked on a full pipe")
    assert out.strip() in ("[0] line 0", "[1] line 0"), out[:200]


def test_workers_that_ignore_a_forwarded_signal_are_stopped_after_the_grace_period(tmp_path):
    s = _script(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that never reacts
        print("ready", flush=True)
        time.sleep(120)
    """)
    p = _started(s)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)  # bounded: the workers ignore SIGTERM, tfcs-run stops them after its grace
    except subprocess.TimeoutExpired:
        p.kill()
        subprocess.run(["pkill", "-9", "-f", s])
        pytest.fail("tfcs-run waited for workers that ignore SIGTERM")
    assert p.returncode == 128 + signal.SIGTERM
    assert "still running" in p.stderr.read()


def test_host_argument_beats_an_inherited_bind_host(tmp_path):
    s = _script(tmp_path, """
        import os
        print(os.environ.get("TFCS_BIND_HOST"))
    """)
    env = dict(os.environ, TFCS_BIND_HOST="10.9.9.9")
    r = _run(["-np", "1", "--host", "127.0.0.1", "--no-prefix", sys.executable, s], env=env)
    assert r.returncode == 0 and r.stdout.split() == ["127.0.0.1"], (r.stdout, r.stderr)
    r = _run(["-np", "1", "--no-prefix", sys.executable, s], env=env)  # no --host: the variable stands
    assert r.returncode == 0 and r.stdout.split() == ["10.9.9.9"], (r.stdout, r.stderr)


def _has_ipv6_loopback():
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_an_ipv6_coordinator_and_data_path(transport):
    r = _run(["-np", "2", "--host", "::1", "--transport", transport, sys.executable, "examples/collective_demo.py"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(l[:4] for l in r.stdout.strip().splitlines()) == ["[0] ", "[1] "]
    assert all("sum=[3.0, 3.0, 3.0, 3.0]" in l for l in r.stdout.strip().splitlines())


def test_usage_errors():
    r = _run(["-np", "2"])
    assert r.returncode == 2 and "no command" in r.stderr


def test_the_first_worker_to_fail_is_named_not_the_lowest_rank(tmp_path):
    # rank 1 fails; rank 0 notices at once and exits 1 itself 35 ms later (as a worker raising
    # PeerLostError does): the job's code and message are rank 1's. Rank 0 waits on a pidfd, so it
    # takes no CPU from tfcs-run's waiter threads meanwhile (the machine has 2 cores)
    pidfile = tmp_path / "pid1"
    s = _script(tmp_path, f"""
        import os, sys, time
        path = {str(pidfile)!r}
        if os.environ["TFCS_RANK"] == "1":
            time.sleep(0.3)
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            os._exit(7)
        while not os.path.exists(path):
            time.sleep(0.0005)
        pid = int(open(path).read())
        try:
            import select
            fd = os.pidfd_open(pid)  # readable once the process has exited
            select.select([fd], [], [], 30)
        except (AttributeError, OSError):  # no pidfd here (or it is gone already): poll /proc
            pass
        def dead():
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except OSError:
                return True
        while not dead():
            time.sleep(0.0005)
        time.sleep(0.035)  # a real survivor takes longer to notice, report and exit
        os._exit(1)
    """)
    for _ in range(10):  # tfcs-run used to poll every 50 ms and blame the lowest rank seen in one poll (caught
        # with 1 - 0.7 ** 10 = 97 % here)
        r = _run(["-np", "2", sys.executable, s], timeout=60)
        assert r.returncode == 7, r.stderr
        assert "job failed: rank 1 exited with code 7 (first failure)" in r.stderr, r.stderr
        pidfile.unlink()


def test_workers_are_stopped_when_tfcs_run_is_killed(tmp_path):
    pidfile = tmp_path / "pids"
    s = _script(tmp_path, f"""
        import os, time
        with open({str(pidfile)!r}, "a") as f:
            f.write(str(os.getpid()) + "\\n")
        print("ready", flush=True)
        time.sleep(120)
    """)
    p = _started(s)
    p.kill()
    p.wait(timeout=10)
    pids = list(map(int, pidfile.read_text().split()))
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived a SIGKILLed tfcs-run"


def test_a_command_that_does_not_exist_is_reported_at_once():
    r = _run(["-np", "2", "no-such-program-tfcs"], timeout=60)
    assert r.returncode == 127 and "cannot start 'no-such-program-tfcs'" in r.stderr, r.stderr


def test_a_child_holding_the_output_pipe_does_not_delay_the_exit(tmp_path):
    # a worker starts a server in a session of its own (out of reach of the job's cleanup) that keeps
    # the worker's stdout: tfcs-run waits for the output once, not once per pipe
    pidfile = tmp_path / "child"
    s = _script(tmp_path, f"""
        import os, subprocess, time
        c = subprocess.Popen(["sleep", "30"], start_new_session=True)
        with open({str(pidfile)!r}, "a") as f:
            f.write(f"{{c.pid}} {{time.time()}}\\n")  # the worker is done from here on
    """)
    try:
        r = _run(["-np", "2", sys.executable, s], timeout=60)
        ended = time.time()
    finally:
        lines = [l.split() for l in pidfile.read_text().splitlines()]
        for pid, _ in lines:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert r.returncode == 0, r.stderr
    took = ended - max(float(t) for _, t in lines)  # from the last worker's end (not counting start-up)
    assert len(lines) == 2 and took < 9, f"tfcs-run exited {took:.1f} s after its workers ended"


def test_segments_of_a_worker_behind_a_shell_are_removed(tmp_path):
    # the worker is a shell running python: the segment carries python's pid, not the worker's
    from tf_commstrategy.core.shared_memory import SHM_DIR
    s = _script(tmp_path, """
        import os, signal
        from tf_commstrategy.core.shared_memory import Segment
        seg = Segment.create(4096, "launchertest")
        print(os.path.basename(seg.path), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # dies before anyone unlinks it
    """)
    r = _run(["-np", "1", "--no-prefix", "sh", "-c", f"cd {ROOT} && {sys.executable} {s}"], timeout=60)
    names = r.stdout.split()
    assert len(names) == 1 and names[0].startswith("tfcs-shm-"), (r.stdout, r.stderr)
    assert not os.path.exists(os.path.join(SHM_DIR, names[0])), "segment left behind"


def test_coordinator_port_is_outside_the_ephemeral_range():
    from tf_commstrategy.launcher.run import _ephemeral_range, _free_port
    lo, hi = _ephemeral_range()
    for _ in range(20):
        port = _free_port()
        assert not lo <= port <= hi, (port, lo, hi)


def test_horovodrun_flags_on_one_machine(tmp_path):
    # horovodrun's -H localhost:N, --verbose, --start-timeout and its tuning flags; -x as mpirun's
    s = _script(tmp_path, """
        import os
        import numpy as np
        import tf_commstrategy as tfcs
        tfcs.init()
        total = tfcs.allreduce(np.array([tfcs.rank() + 1.0]), op="sum")
        print("result", tfcs.rank(), tfcs.local_rank(), total[0], os.environ["TFCS_RENDEZVOUS_TIMEOUT"],
              os.environ["MY_SETTING"], os.environ["TFCS_LOG_LEVEL"])
    """)
    r = _run(["-np", "2", "-H", "localhost:2", "--verbose", "--start-timeout", "77", "--fusion-threshold-mb", "64",
              "--cycle-time-ms", "5", "-x", "MY_SETTING=on", sys.executable, s])
    assert r.returncode == 0, r.stderr
    got = sorted(line.split("] ", 1)[1] for line in r.stdout.splitlines() if "result" in line)
    assert got == [f"result {i} {i} 3.0 77.0 on INFO" for i in range(2)]
    assert ("tfcs-run: 2 workers: rank 0 on localhost (local rank 0 of 2); rank 1 on localhost (local rank 1 "
            "of 2)") in r.stderr
    assert "--fusion-threshold-mb is accepted and not needed" in r.stderr
    assert "--cycle-time-ms is accepted and not needed" in r.stderr
    # --verbose: the workers' tf_commstrategy logger speaks at INFO, on stderr
    assert sum("joined via TFCS_*" in line for line in r.stderr.splitlines()) == 2
