"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages
(``make engines`` installs them), every file of theirs in one directory, every daemon in the foreground
so that ``close()`` stops it.

The node is this machine as ``slurmd -C`` describes it; munge gets a fresh key and its own socket, and
the daemons their own ports, so nothing of the machine's own Slurm or munge setup (if any) is touched.
Clients (``srun``, ``sbatch``, ``sinfo``) find the cluster through ``env()``'s ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Dict, List, Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")


def unavailable_reason() -> Optional[str]:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; `make engines` installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, directory: str):
        self.dir = directory
        self.procs: List[subprocess.Popen] = []
        try:
            self._write_files()
            self._start()
            self.wait_idle()
        except BaseException:
            self.close()
            raise

    def _write_files(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        node = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
        node = node.splitlines()[0].split(" UpTime")[0]
        self.node_name = node.split()[0].split("=", 1)[1]
        self.conf = os.path.join(d, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=tfcs", f"SlurmctldHost={self.node_name}(127.0.0.1)",
                "SlurmUser=root", "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge/munge.sock",
                f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log",
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
                "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
                "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
                "KillWait=5", "InactiveLimit=0",
                f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE", ""]))

    def _daemon(self, argv) -> None:
        log = open(os.path.join(self.dir, os.path.basename(argv[0]) + ".out"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env(), start_new_session=True))

    def _start(self) -> None:
        m = os.path.join(self.dir, "munge")
        self._daemon([_which("munged"), "-F", "-f", f"--key-file={m}/munge.key", f"--socket={m}/munge.sock",
                      f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/seed"])
        end = time.monotonic() + 20
        while not os.path.exists(f"{m}/munge.sock"):
            if time.monotonic() > end:
                raise RuntimeError(f"munged did not start: {self.log('munged.out')}")
            time.sleep(0.05)
        self._daemon([_which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._daemon([_which("slurmd"), "-D", "-f", self.conf])

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read()[-3000:]
        except OSError:
            return "(no log)"

    def wait_idle(self, timeout: float = 60.0) -> None:
        """The node is up and idle (slurmd registered with slurmctld)."""
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            p = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env(), capture_output=True, text=True,
                               timeout=30)
            state = (p.stdout + p.stderr).strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm node is not idle after {timeout} s (sinfo: {state!r}); slurmctld: "
                           f"{self.log('slurmctld.log')}\nslurmd: {self.log('slurmd.log')}")

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
