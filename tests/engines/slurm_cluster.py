"""A real Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages (``make engines``
installs them), every file of theirs in one directory, every daemon in the foreground so that ``close()``
stops it.

``SlurmCluster(dir)``: one node, this machine as ``slurmd -C`` describes it. ``SlurmCluster(dir, hosts)``:
one node per network-namespace host (tests/netns/hosts.py), named by the host's hostname; slurmctld runs
on host 0, one slurmd in every namespace, and the clients run on host 0 (``client_argv``). Names resolve
through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``; ``ip netns
exec`` also mounts a fresh /sys, so each slurmd first mounts the cgroup v1 hierarchies it checks for.
munge gets a fresh key and its own socket (a path, reachable from every namespace), the daemons their
own ports, so nothing of the machine's own Slurm or munge setup (if any) is touched. Clients (``srun``,
``sbatch``, ``sinfo``) find the cluster through ``env()``'s ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
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
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_directory() -> str:
    """A new directory under /tmp with a short path: slurmstepd's Unix sockets live in the spool directory,
    and a socket path may not exceed 108 bytes. ``SlurmCluster.close`` removes it."""
    import tempfile
    return tempfile.mkdtemp(prefix="tfcs-slurm-", dir="/tmp")


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


# slurmd's cgroup plugin checks for these hierarchies even with proctrack/linuxproc and task/none
_CGROUP_MOUNTS = ("mount -t tmpfs none /sys/fs/cgroup && for c in freezer cpuset memory devices cpu,cpuacct pids; "
                  "do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c none /sys/fs/cgroup/$c; done && "
                  "mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd none /sys/fs/cgroup/systemd")


class SlurmCluster:
    def __init__(self, directory: str, hosts=None):
        self.dir = directory
        self.hosts = hosts
        self.procs: List[subprocess.Popen] = []
        self._etc: List[str] = []
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
        hardware = " ".join(node.split()[1:])
        if self.hosts is None:
            self.nodes = [(node.split()[0].split("=", 1)[1], "127.0.0.1")]
        else:
            self.nodes = list(zip(self.hosts.hostnames, self.hosts.addresses))
            self._write_hosts_files()
        for name, _ in self.nodes:
            os.makedirs(os.path.join(d, f"spool-{name}"), exist_ok=True)
        self.node_name = self.nodes[0][0]
        self.conf = os.path.join(d, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=tfcs", f"SlurmctldHost={self.nodes[0][0]}({self.nodes[0][1]})",
                "SlurmUser=root", "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge/munge.sock",
                f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
                f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
                f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
                "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
                "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
                "KillWait=5", "InactiveLimit=0",
                *(f"NodeName={name} NodeAddr={addr} {hardware} State=UNKNOWN" for name, addr in self.nodes),
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE", ""]))

    def _write_hosts_files(self) -> None:
        lines = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in self.nodes)
        for ns in self.hosts.names:
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            self._etc.append(etc)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(lines)

    def _daemon(self, argv, host: Optional[int] = None, log_name: Optional[str] = None) -> None:
        log = open(os.path.join(self.dir, (log_name or os.path.basename(argv[0])) + ".out"), "w")
        kw = dict(stdout=log, stderr=subprocess.STDOUT, env=self.env())
        if host is None:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        else:
            p = self.hosts.popen(host, argv, start_new_session=True, **kw)
        self.procs.append(p)

    def _start(self) -> None:
        m = os.path.join(self.dir, "munge")
        self._daemon([_which("munged"), "-F", "-f", f"--key-file={m}/munge.key", f"--socket={m}/munge.sock",
                      f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/seed"])
        end = time.monotonic() + 20
        while not os.path.exists(f"{m}/munge.sock"):
            if time.monotonic() > end:
                raise RuntimeError(f"munged did not start: {self.log('munged.out')}")
            time.sleep(0.05)
        if self.hosts is None:
            self._daemon([_which("slurmctld"), "-D", "-i", "-f", self.conf])
            self._daemon([_which("slurmd"), "-D", "-f", self.conf])
            return
        self._daemon([_which("slurmctld"), "-D", "-i", "-f", self.conf], host=0)
        for i, (name, _) in enumerate(self.nodes):
            self._daemon(["sh", "-c", f"{_CGROUP_MOUNTS} && exec {_which('slurmd')} -D -N {name} -f {self.conf}"],
                         host=i, log_name=f"slurmd-{name}")

    def client_argv(self, argv: List[str]) -> List[str]:
        """``argv`` (sbatch, srun, sinfo) as run on the cluster's first node."""
        return list(argv) if self.hosts is None else self.hosts.wrap(0, argv)

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def log(self, name: str) -> str:
        if name in getattr(self, "logs", {}):
            return self.logs[name]
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
            p = subprocess.run(self.client_argv(["sinfo", "-h", "-N", "-o", "%t"]), env=self.env(),
                               capture_output=True, text=True, timeout=30)
            state = (p.stdout + p.stderr).strip()
            if state.split() == ["idle"] * len(self.nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm node is not idle after {timeout} s (sinfo: {state!r}); slurmctld: "
                           f"{self.log('slurmctld.log')}\nslurmd: " + " ".join(self.log(f"slurmd-{n}.log") for n, _ in self.nodes))

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
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        if os.path.basename(self.dir).startswith("tfcs-slurm-"):  # short_directory's, its logs are kept in memory for the report
            self.logs = {n: self.log(n) for n in ("slurmctld.log",
                                                 *(f"slurmd-{name}.log" for name, _ in getattr(self, "nodes", [])))}
            shutil.rmtree(self.dir, ignore_errors=True)
