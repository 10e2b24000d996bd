"""The program tfcs-run runs on a remote host (shims.REMOTE), driven here through a pipe as ssh drives it:
the worker's exit code comes back, signal lines reach the worker's process group, and the end of standard
input (tfcs-run or its connection gone) stops the worker and what it started."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tf_commstrategy.launcher import shims

# a worker that starts a grandchild in its own process group, reports both pids, and waits
WORKER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
signal.signal(signal.SIGINT, lambda *a: sys.exit(42))
print(os.getpid(), child.pid, os.environ.get("SHIM_TEST"), os.getcwd(), flush=True)
time.sleep(120)
"""


def _start(tmp_path, argv, grace=2.0):
    p = subprocess.Popen([sys.executable, "-S", "-E", "-c", shims.REMOTE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    env = dict(os.environ, SHIM_TEST="yes")
    spec = {"argv": argv, "env": env, "cwd": str(tmp_path), "grace": grace, "death_shim": shims.DEATH_SIGNAL}
    p.stdin.write((json.dumps(spec) + "\n").encode())
    p.stdin.flush()
    return p


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_exit_code_environment_and_directory(tmp_path):
    p = _start(tmp_path, [sys.executable, "-c", "import os, sys; print(os.environ['SHIM_TEST'], os.getcwd()); "
                                                "sys.exit(7)"])
    out, err = p.stdout.read(), p.stderr.read()  # standard input stays open, as ssh keeps it
    assert p.wait(timeout=30) == 7, err
    assert out.decode().split() == ["yes", str(tmp_path)]
    p = _start(tmp_path, ["/no/such/program"])
    err = p.stderr.read()
    assert p.wait(timeout=30) == 127 and b"cannot start" in err, err


@pytest.mark.timeout(60)
def test_signal_line_reaches_the_worker(tmp_path):
    p = _start(tmp_path, [sys.executable, "-c", WORKER])
    worker, grandchild, _, _ = p.stdout.readline().decode().split()
    p.stdin.write(f"{int(signal.SIGINT)}\n".encode())
    p.stdin.flush()
    assert p.wait(timeout=30) == 42  # the worker's own SIGINT handler ran
    assert _gone([int(worker), int(grandchild)]), "what the worker started must be stopped with it"


@pytest.mark.timeout(60)
def test_end_of_input_stops_the_worker_and_its_group(tmp_path):
    p = _start(tmp_path, [sys.executable, "-c", WORKER + "\n"], grace=1.0)
    worker, grandchild, _, _ = p.stdout.readline().decode().split()
    p.stdin.close()  # the ssh connection is gone
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert _gone([int(worker), int(grandchild)])


@pytest.mark.timeout(60)
def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(120)"
    p = _start(tmp_path, [sys.executable, "-c", stubborn], grace=1.0)
    assert p.stdout.readline().strip() == b"up"
    t0 = time.monotonic()
    p.stdin.close()
    assert p.wait(timeout=30) == 128 + signal.SIGKILL
    assert 0.8 < time.monotonic() - t0 < 10
