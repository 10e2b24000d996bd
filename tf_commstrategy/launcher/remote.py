"""Workers on other hosts: started over ssh, controlled through the ssh connection's standard input.

``tfcs-run`` runs ``ssh [options] HOST python -S -E -c <shims.REMOTE>`` and writes the worker's spec
(command, environment, working directory) as the first line of that program's standard input; signals
for the worker follow as lines. Closing the connection, or losing it, stops the worker on its host, so
a job that ends leaves no process behind on any host it reached.

The environment is forwarded as horovodrun does: every variable of ``tfcs-run``'s own environment but
those that describe this shell or this machine (``EXCLUDED``), then the ``-x`` variables, then the job's
``TFCS_*`` variables. The remote host is expected to have the same Python at the same path (a shared
file system or an identical image), as horovodrun and mpirun expect.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Dict, List, Optional

from . import shims

# Variables that describe this shell or this machine, never forwarded (Horovod skips BASH_FUNC_* and OLDPWD).
EXCLUDED = ("BASH_FUNC_*", "OLDPWD", "PWD", "SHLVL", "_", "HOSTNAME", "SSH_*", "TERM", "TMUX*", "PS1")
# ssh ends a connection whose host has not answered for INTERVAL x COUNT seconds: a host that died or was
# cut off is reported within that time.
SSH_ALIVE_INTERVAL_S = 5
SSH_ALIVE_COUNT = 3


def forwarded_env(base: Dict[str, str]) -> Dict[str, str]:
    """``base`` without the variables of ``EXCLUDED``."""
    return {k: v for k, v in base.items() if not any(fnmatch.fnmatchcase(k, pat) for pat in EXCLUDED)}


def ssh_argv(host: str, ssh_command: str = "ssh", port: Optional[int] = None,
             identity_file: Optional[str] = None, python: Optional[str] = None) -> List[str]:
    """The local command that runs the remote shim on ``host``.

    ``ssh_command`` is the ssh program and its own options (``"ssh -F cluster.conf"``); ``BatchMode``
    (no password prompt: a job must not wait on a terminal) and the keep-alive are always added.
    """
    argv = shlex.split(ssh_command) + ["-T", "-o", "BatchMode=yes",
                                        "-o", f"ServerAliveInterval={SSH_ALIVE_INTERVAL_S}",
                                        "-o", f"ServerAliveCountMax={SSH_ALIVE_COUNT}"]
    if port:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    remote = shlex.join([python or sys.executable, "-S", "-E", "-c", shims.REMOTE])
    return argv + [host, remote]


class RemoteWorker:
    """One worker on another host: its local ssh process and the line on which signals reach it."""

    def __init__(self, proc: subprocess.Popen, host: str):
        self.proc = proc
        self.host = host

    @classmethod
    def start(cls, host: str, command: List[str], env: Dict[str, str], grace: float,
              ssh: List[str]) -> "RemoteWorker":
        """Start ``command`` on ``host`` with ``env`` in this directory (``ssh``: from ``ssh_argv``).

        Raises:
          OSError: the ssh program cannot be started.
        """
        proc = subprocess.Popen(ssh, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        spec = {"argv": list(command), "env": env, "cwd": os.getcwd(), "grace": grace,
                "death_shim": shims.DEATH_SIGNAL}
        worker = cls(proc, host)
        worker._write(json.dumps(spec) + "\n")
        return worker

    def _write(self, text: str) -> None:
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the connection is gone: the worker stops by itself
            pass

    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to the worker's process group on its host. SIGKILL also closes the connection's
        input: the remote side kills whatever is left and exits, and ``close`` ends the local ssh."""
        if self.proc.poll() is not None:
            return
        self._write(f"{int(sig)}\n")
        if sig == signal.SIGKILL:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the remote side to finish, then kill the local ssh process
        (a host that cannot be reached any more would otherwise hold it until the keep-alive gives up)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
