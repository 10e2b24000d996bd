"""``tfcs-run -H`` / ``--hostfile`` across network-namespace hosts, each with a real sshd: the launcher runs
on host 0, starts host 0's workers itself and the others over ssh.

* ``-H a:2,b:2`` runs examples/keras_mnist.py to the end (one progress bar, rank 0's summary once);
* ``--hostfile`` (horovodrun's ``host slots=N``) with 2 + 1 slots: ranks, local ranks and hosts as
  placed, the job's token and ``-x`` variables on every host, the launcher's directory, no shell-specific
  variable; collectives equal to numpy;
* Ctrl-C (SIGINT to tfcs-run) ends the job with 130 and leaves no worker on any host;
* a host killed during the job (every process in its namespace, sshd included), or cut off by its link,
  is named by tfcs-run, the job ends with an error, and no worker is left on any host.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.netns import sshd as S
from tests.netns import workers as WK
from tests.netns.test_multihost import ROOT, WORKER, _clean_env

pytestmark = [pytest.mark.netns, pytest.mark.engines]


@pytest.fixture
def ssh_hosts(make_hosts, tmp_path):
    reason = S.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)

    def make(n):
        hosts = make_hosts(n)
        d = tmp_path / "ssh"
        d.mkdir()
        return hosts, S.SshHosts(hosts, str(d))
    return make


class Launcher:
    """``tfcs-run`` inside host 0; its output is collected line by line."""

    def __init__(self, hosts, ssh, args, env=None):
        e = _clean_env()
        e.update(env or {})
        argv = [sys.executable, "-m", "tf_commstrategy.run", "--ssh-command", ssh.ssh_command, *args]
        self.lines = []
        self.proc = hosts.popen(0, argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self._t.join(10)
        return code

    def output(self):
        return "\n".join(self.lines)

    def wait_for(self, predicate, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate(self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"{what} not seen within {timeout} s (launcher rc={self.proc.poll()}):\n"
                    + self.output()[-6000:])


def _no_workers_left(ssh, hosts_to_check, needle, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        left = {i: ssh.processes(i, needle) for i in hosts_to_check}
        if not any(left.values()) or time.monotonic() > end:
            return left
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_hosts_flag_trains_keras_mnist_to_the_end(ssh_hosts):
    hosts, ssh = ssh_hosts(2)
    a, b = hosts.addresses
    job = Launcher(hosts, ssh, ["-np", "4", "-H", f"{a}:2,{b}:2", "--timeout", "60", sys.executable,
                                "examples/keras_mnist.py", "--epochs", "1", "--train-samples", "2000"])
    code = job.wait(200)
    out = job.output()
    assert code == 0, out[-6000:]
    finals = [line for line in job.lines if "final: test accuracy" in line]
    assert len(finals) == 1 and finals[0].startswith("[0] "), finals
    assert "4 workers, 4 replicas" in out
    assert sum("val_accuracy" in line for line in job.lines) == 1, "one progress bar (rank 0's) expected"
    for r in range(4):
        assert any(line.startswith(f"[{r}] ") for line in job.lines), f"no output of rank {r}"


@pytest.mark.timeout(180)
def test_hostfile_places_ranks_passes_environment_and_reduces(ssh_hosts, tmp_path):
    hosts, ssh = ssh_hosts(2)
    a, b = hosts.addresses
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# horovodrun's format\n{a} slots=2\n{b} slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    job = Launcher(hosts, ssh, ["-np", "3", "--hostfile", str(hostfile), "-x", "TFCS_TEST_SET=on",
                                "-x", "TFCS_TEST_COPIED", sys.executable, WORKER, "collectives", "--out", str(out)],
                   env={"TFCS_TEST_COPIED": "from launcher", "TFCS_TEST_INHERITED": "yes", "OLDPWD": "/nowhere"})
    code = job.wait(150)
    assert code == 0, job.output()[-6000:]
    infos = [json.loads((out / f"coll-{r}.json").read_text()) for r in range(3)]
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert [i["hostname"] for i in infos] == ["tfcs-host-0", "tfcs-host-0", "tfcs-host-1"]
    assert [i["local_rank"] for i in infos] == [0, 1, 0]
    assert [i["local_size"] for i in infos] == [2, 2, 1]
    assert [i["environ"]["local_rank_var"] for i in infos] == ["0", "1", "0"]
    tokens = {i["environ"]["token_sha"] for i in infos}
    assert len(tokens) == 1 and None not in tokens, "every rank must get the one job token"
    for i in infos:
        env = i["environ"]
        assert env["test_vars"] == {"TFCS_TEST_SET": "on", "TFCS_TEST_COPIED": "from launcher",
                                    "TFCS_TEST_INHERITED": "yes"}, (i["rank"], env)
        assert env["cwd"] == ROOT
    assert infos[2]["environ"]["oldpwd"] is None, "a shell-specific variable was forwarded to the remote host"
    for r in range(3):
        got = np.load(out / f"coll-{r}.npz")
        for key, want in WK.expected_collectives(r, 3).items():
            np.testing.assert_allclose(got[key], want, rtol=2e-3 if want.dtype == np.float16 else 1e-5,
                                       err_msg=f"rank {r} {key}")


def _loop_job(hosts, ssh, tmp_path, extra=()):
    a, b = hosts.addresses
    out = tmp_path / "out"
    out.mkdir()
    job = Launcher(hosts, ssh, ["-np", "4", "-H", f"{a}:2,{b}:2", "--timeout", "30", "--grace", "20", *extra,
                                sys.executable, WORKER, "loop", "--out", str(out), "--max-seconds", "120"])
    job.wait_for(lambda lines: sum(line.split("] ", 1)[-1].startswith("progress 10") for line in lines) >= 4,
                 90, "10 all-reduces on every rank")
    return job


@pytest.mark.timeout(180)
def test_ctrl_c_ends_the_job_and_leaves_no_worker_on_any_host(ssh_hosts, tmp_path):
    hosts, ssh = ssh_hosts(2)
    job = _loop_job(hosts, ssh, tmp_path)
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    code = job.wait(60)
    took = time.monotonic() - t0
    assert code == 128 + signal.SIGINT, (code, job.output()[-4000:])
    assert took < 30, f"the job took {took:.1f} s to end after Ctrl-C"
    left = _no_workers_left(ssh, range(2), WORKER, timeout=10)
    assert not any(left.values()), f"workers left behind after Ctrl-C: {left}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["host-kill", "link-cut"])
def test_a_lost_host_is_named_and_the_job_ends_everywhere(ssh_hosts, tmp_path, fault):
    """host-kill: every process of host 1 (its workers, the remote shims, sshd) gets SIGKILL;
    link-cut: host 1's link goes down, its processes live on and must end by themselves."""
    hosts, ssh = ssh_hosts(2)
    hosts.shape("1gbit")  # a link with a real rate (tc tbf; no netem here, so no delay)
    job = _loop_job(hosts, ssh, tmp_path)
    t0 = time.monotonic()
    if fault == "host-kill":
        hosts.kill_host(1)
    else:
        hosts.link_down(1)
    code = job.wait(90)
    took = time.monotonic() - t0
    out = job.output()
    assert code not in (0, None), out[-6000:]
    # ssh's keep-alive gives up on a silent host after 15 s; the survivors' grace is 20 s
    assert took < 45, f"the job took {took:.1f} s to end after host 1 was lost"
    b = hosts.addresses[1]
    assert f"rank 2 on {b}" in out and "lost its ssh connection" in out, out[-4000:]
    assert sum("error PeerLostError" in line for line in job.lines) == 2, "both survivors must report the loss"
    left = _no_workers_left(ssh, [0], WORKER, timeout=10)
    assert not left[0], f"workers left on the surviving host: {left}"
    if fault == "link-cut":  # the cut-off workers notice they are alone and end, with what they started
        left = _no_workers_left(ssh, [1], WORKER, timeout=60)
        assert not left[1], f"workers left on the cut-off host: {left}"
