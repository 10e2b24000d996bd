"""Test "hosts" on one machine: network namespaces joined by veth pairs to a bridge in its own namespace.

Layout for ``NetnsHosts(3)`` (nothing is added to the root namespace)::

    tfcs-<pid>-<k>-br   bridge namespace: br0, with ports vh0 vh1 vh2
    tfcs-<pid>-<k>-0    eth0 10.77.<x>.1/24 (+ lo)   <-- veth -->  vh0
    tfcs-<pid>-<k>-1    eth0 10.77.<x>.2/24 (+ lo)   <-- veth -->  vh1
    tfcs-<pid>-<k>-2    eth0 10.77.<x>.3/24 (+ lo)   <-- veth -->  vh2

``ip netns exec`` gives a process its own network stack but keeps the machine's hostname, so every
command also runs in a fresh UTS namespace with the hostname ``tfcs-host-<i>`` (``unshare --uts``):
ranks in different namespaces then look like different hosts to the rendezvous, as on real machines.

``NetnsHosts(n, own_hostnames=False)`` keeps the machine's hostname in every namespace (containers
that share a hostname but not a network).

``close()`` always kills what still runs inside the namespaces (by pid, from ``ip netns pids``) and
deletes them; ``cleanup_stale()`` does the same for namespaces left by killed earlier runs (those
whose creating pid is gone).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Dict, List, Optional, Sequence

from tf_commstrategy.core.shared_memory import pid_alive

PREFIX = "tfcs-"
_counter = itertools.count()
_NAME_RE = re.compile(r"^tfcs-(\d+)-\d+-(?:\d+|br)$")


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be built here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    try:
        p = _ip("netns", "list", check=False, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns list` failed: {e}"
    if p.returncode != 0:
        return f"`ip netns` is unavailable: {p.stderr.strip()}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    p = _ip("netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _netns_names() -> List[str]:
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running inside namespace ``ns`` (by pid)."""
    p = _ip("netns", "pids", ns, check=False)
    for tok in p.stdout.split():
        try:
            pid = int(tok)
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    for _ in range(20):
        if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in _netns_names():
            return
        time.sleep(0.1)


def cleanup_stale() -> List[str]:
    """Delete tfcs-* namespaces whose creating process is gone (left by killed earlier runs)."""
    removed = []
    for ns in _netns_names():
        m = _NAME_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            _delete(ns)
            removed.append(ns)
        elif ns.startswith(PREFIX) and ns.endswith("-probe") and not pid_alive(int(ns.split("-")[1])):
            _delete(ns)
            removed.append(ns)
    return removed


_PROBE = textwrap.dedent("""
    import socket, sys, threading, time
    me, port, others = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    srv = socket.create_server((me, port))
    srv.settimeout(10)
    def accept():
        for _ in others:
            try:
                c, _ = srv.accept(); c.close()
            except OSError:
                return
    t = threading.Thread(target=accept, daemon=True); t.start()
    end = time.monotonic() + 10
    for o in others:
        while True:
            try:
                socket.create_connection((o, port), timeout=1).close(); break
            except OSError as e:
                if time.monotonic() > end:
                    sys.exit(f"{me} cannot reach {o}:{port}: {e}")
                time.sleep(0.05)
    t.join(10)
    sys.exit(1 if t.is_alive() else 0)
""")


class NetnsHosts:
    """``n`` namespaces ("hosts") on one bridge. Use as a context manager; ``close()`` always cleans up."""

    def __init__(self, n: int, subnet: Optional[int] = None, own_hostnames: bool = True):
        self.n = n
        self.own_hostnames = own_hostnames
        tag = f"{os.getpid()}-{next(_counter)}"
        self.bridge_ns = f"{PREFIX}{tag}-br"
        self.names = [f"{PREFIX}{tag}-{i}" for i in range(n)]
        x = subnet if subnet is not None else 1 + os.getpid() % 250
        self.addresses = [f"10.77.{x}.{i + 1}" for i in range(n)]
        self.hostnames = ([f"tfcs-host-{i}" for i in range(n)] if own_hostnames
                          else [socket.gethostname()] * n)
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        try:
            self._build()
            self.check_connectivity()
        except BaseException:
            self.close()
            raise

    # -- building ------------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        cleanup_stale()
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            self._add_ns(ns)
            # both ends are created inside our namespaces: the bridge port in the bridge namespace, eth0 in the host's
            _ip("-n", self.bridge_ns, "link", "add", f"vh{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", f"vh{i}", "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", f"vh{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def check_connectivity(self, port: int = 29399, timeout: float = 30.0) -> None:
        """Every host opens a TCP connection to every other host's address (and accepts theirs)."""
        if self.n < 2:
            return
        procs = [self.popen(i, [sys.executable, "-c", _PROBE, self.addresses[i], str(port)]
                            + [a for j, a in enumerate(self.addresses) if j != i],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for i in range(self.n)]
        problems = []
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            if p.returncode != 0:
                problems.append(f"host {i}: rc={p.returncode} {out.decode(errors='replace').strip()}")
        if problems:
            raise RuntimeError("namespace connectivity check failed: " + "; ".join(problems))

    # -- running commands --------------------------------------------------------------------------
    def wrap(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside host ``i``: its network namespace and (unless ``own_hostnames=False``) its own
        hostname."""
        if not self.own_hostnames:
            return ["ip", "netns", "exec", self.names[i], *argv]
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[i], *argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None, **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.wrap(i, argv), env=env, stdin=subprocess.DEVNULL, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 60.0,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(i, argv), env=env, stdin=subprocess.DEVNULL, timeout=timeout, **kw)

    # -- faults --------------------------------------------------------------------------------------
    def link_down(self, i: int) -> None:
        """Pull host ``i``'s cable: its bridge port goes down (the peer eth0 loses carrier). No RST, no FIN:
        packets to and from the host are dropped silently."""
        _ip("-n", self.bridge_ns, "link", "set", f"vh{i}", "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"vh{i}", "up")

    def kill_host(self, i: int) -> None:
        """Host ``i`` dies: SIGKILL to every process in its namespace. Its kernel stays, as a machine's
        network card would not: the peers' connections are closed by it (FIN / RST), unlike a cut link."""
        _kill_inside(self.names[i])

    def shape(self, rate: str = "1gbit", burst: str = "256kb", latency: str = "50ms") -> None:
        """Every link at ``rate``, both ways (``tc tbf`` on each host's eth0 and on its bridge port; this
        kernel has no netem, so a rate can be set and a delay cannot)."""
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.bridge_ns, f"vh{i}")):
                p = subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                    "burst", burst, "latency", latency], capture_output=True, text=True, timeout=20)
                if p.returncode != 0:
                    raise RuntimeError(f"tc tbf on {where}/{dev} failed: {p.stderr.strip()}")

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._created):
            _delete(ns)
        self._created.clear()

    def __enter__(self) -> "NetnsHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
