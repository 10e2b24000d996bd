"""A real OpenSSH server on every network-namespace host, with keys made for the test.

``SshHosts(hosts, directory)`` makes a host key and a client key in ``directory``, starts ``sshd`` (from
Debian's openssh-server, installed by ``make engines``) inside every namespace, listening on the host's
address, and writes ``ssh_config``: the client options a launcher passes with ``--ssh-command "ssh -F
<ssh_config>"``. Nothing outside ``directory`` is touched but ``/run/sshd``, which sshd requires.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional

SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> Optional[str]:
    """Why an sshd cannot be started here, or None."""
    if not os.path.exists(SSHD):
        return "openssh-server is not installed (`make engines` installs it with apt-get)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "openssh-client is not installed (`make engines` installs it with apt-get)"
    return None


class SshHosts:
    def __init__(self, hosts, directory: str):
        self.hosts = hosts
        self.dir = directory
        os.makedirs("/run/sshd", exist_ok=True)
        for name in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfcs-test", "-f",
                            os.path.join(directory, name)], check=True, timeout=30)
        shutil.copy(os.path.join(directory, "id.pub"), os.path.join(directory, "authorized_keys"))
        self.config = os.path.join(directory, "ssh_config")
        with open(self.config, "w") as f:
            f.write(f"Host *\n  User root\n  IdentityFile {directory}/id\n  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                    "  ConnectTimeout 10\n")
        self.servers = [self._start(i) for i in range(hosts.n)]
        self.wait_ready()

    def _start(self, i: int) -> subprocess.Popen:
        cfg = os.path.join(self.dir, f"sshd_config_{i}")
        with open(cfg, "w") as f:
            f.write(f"Port 22\nListenAddress {self.hosts.addresses[i]}\nHostKey {self.dir}/host_key\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    f"PidFile {self.dir}/sshd_{i}.pid\nLogLevel ERROR\n")
        log = open(os.path.join(self.dir, f"sshd_{i}.log"), "w")
        return self.hosts.popen(i, [SSHD, "-D", "-e", "-f", cfg], stdout=log, stderr=subprocess.STDOUT)

    @property
    def ssh_command(self) -> str:
        """What ``tfcs-run --ssh-command`` takes to reach these hosts."""
        return f"ssh -F {self.config}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Every host answers an ssh login from host 0 (sshd needs a moment to listen)."""
        end = time.monotonic() + timeout
        for i in range(self.hosts.n):
            while True:
                p = self.hosts.run(0, ["ssh", "-F", self.config, "-o", "BatchMode=yes", self.hosts.addresses[i],
                                       "hostname"], capture_output=True, text=True, timeout=30)
                if p.returncode == 0 and p.stdout.strip() == self.hosts.hostnames[i]:
                    break
                if time.monotonic() > end:
                    log = open(os.path.join(self.dir, f"sshd_{i}.log")).read()
                    raise RuntimeError(f"ssh to host {i} ({self.hosts.addresses[i]}) fails: rc={p.returncode} "
                                       f"{p.stdout.strip()!r} {p.stderr.strip()!r}; sshd log: {log[-2000:]}")
                time.sleep(0.2)

    def processes(self, i: int, needle: str):
        """(pid, command line) of the processes in host ``i`` whose command line contains ``needle``."""
        p = subprocess.run(["ip", "netns", "pids", self.hosts.names[i]], capture_output=True, text=True)
        found = []
        for tok in p.stdout.split():
            try:
                with open(f"/proc/{tok}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd and int(tok) != os.getpid():
                found.append((int(tok), cmd))
        return found
