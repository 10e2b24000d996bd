"""Which hosts a ``tfcs-run`` job runs on, and which rank goes where.

Hosts come as horovodrun and mpirun take them:

    -H host1:2,host2:2          (``host`` alone means one slot)
    --hostfile FILE             one host per line: ``host slots=N`` (horovodrun, Open MPI), ``host:N`` or
                                ``host``; ``#`` starts a comment

Ranks fill the hosts in the order given, each host up to its slots: with ``-np 4 -H a:2,b:2`` ranks 0 and
1 run on ``a`` (local ranks 0, 1) and ranks 2 and 3 on ``b``. Rank 0's host also runs the coordinator.
A host that names this machine (``localhost``, a loopback address, this machine's hostname, or an address
of one of its interfaces) runs its workers directly; any other host runs them over ssh.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from typing import List, Sequence

from ..errors import ConfigurationError

_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+?)(?::(?P<colon>\d+))?(?:\s+slots\s*=\s*(?P<slots>\d+))?"
                            r"(?:\s+max[-_]slots\s*=\s*\d+)?$")


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the job and how many workers it can take."""

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one rank runs: its host, its index on that host and how many ranks share the host."""

    rank: int
    host: str
    local_rank: int
    local_size: int


def _split_host_slots(item: str) -> tuple:
    """``host:N`` / ``[v6addr]:N`` / ``host`` -> (host, N or None)."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return host, (rest[1:] if rest.startswith(":") else None)
    if item.count(":") > 1:  # a bare IPv6 address
        return item, None
    host, sep, slots = item.rpartition(":")
    return (host, slots) if sep else (item, None)


def _slots(value, where: str) -> int:
    if value is None:
        return 1
    if not str(value).isdigit() or int(value) < 1:
        raise ConfigurationError(f"{where}: slots must be a whole number >= 1, got {value!r}")
    return int(value)


def parse_hosts(spec: str) -> List[Host]:
    """``-H a:2,b:2`` -> hosts in that order.

    Raises:
      ConfigurationError: an empty host name, slots that are not a whole number >= 1, or a host named twice.
    """
    hosts = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, slots = _split_host_slots(item)
        if not name:
            raise ConfigurationError(f"-H {spec!r}: {item!r} has no host name; write host:slots, e.g. node1:2")
        hosts.append(Host(name, _slots(slots, f"-H {spec!r}, host {name!r}")))
    return _checked(hosts, f"-H {spec!r}")


def parse_hostfile(text: str, path: str = "hostfile") -> List[Host]:
    """The lines of a hostfile (``host slots=N``, ``host:N`` or ``host``; ``#`` comments) -> hosts.

    Raises:
      ConfigurationError: a line of another form, slots that are not a whole number >= 1, or a host named twice.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOSTFILE_LINE.match(line)
        if m is None or (m.group("colon") and m.group("slots")):
            raise ConfigurationError(f"{path}, line {number}: {raw.strip()!r} is not 'host slots=N', 'host:N' "
                                     "or 'host'")
        hosts.append(Host(m.group("host"), _slots(m.group("colon") or m.group("slots"),
                                                  f"{path}, line {number}")))
    return _checked(hosts, path)


def _checked(hosts: List[Host], where: str) -> List[Host]:
    if not hosts:
        raise ConfigurationError(f"{where}: no hosts given; write host:slots, e.g. -H node1:2,node2:2")
    seen = set()
    for h in hosts:
        if h.name in seen:
            raise ConfigurationError(f"{where}: host {h.name!r} is named twice; give it once with all its slots")
        seen.add(h.name)
    return hosts


def place(hosts: Sequence[Host], np: int) -> List[Slot]:
    """Ranks ``0 .. np-1`` on ``hosts``, filling each host's slots in order.

    Raises:
      ConfigurationError: ``np`` is more than the hosts' slots together.
    """
    total = sum(h.slots for h in hosts)
    if np > total:
        raise ConfigurationError(
            f"-np {np} needs {np} slots but the hosts have {total} "
            f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)}); lower -np or give the hosts more slots")
    used, left = [], np
    for h in hosts:
        if left == 0:
            break
        used.append((h.name, min(h.slots, left)))
        left -= used[-1][1]
    slots, rank = [], 0
    for name, count in used:
        for local in range(count):
            slots.append(Slot(rank, name, local, count))
            rank += 1
    return slots


def is_local(host: str) -> bool:
    """True when ``host`` names this machine: a loopback name or address, this hostname, or an address
    that a socket here can bind (an address of one of this machine's interfaces)."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        if addr[0].startswith("127.") or addr[0] == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False
