"""How many CPU cores this process may use: one answer for every decision that depends on it (how
waits spin, the ring's chunk size, TensorFlow's thread pools).

The count is the process's affinity mask (which ``taskset``, Slurm's ``--cpus-per-task`` and cpusets
narrow), further limited by a cgroup CPU quota (a container's ``--cpus``, Kubernetes' CPU limit:
``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1), rounded up. A quota of
1.5 CPUs on a 64-core host counts as 2: ranks that each expect a core of their own would otherwise
spin while the one they wait for is throttled. ``os.cpu_count()`` counts the machine's cores and is
not used.
"""

from __future__ import annotations

import math
import os
from typing import Optional

_CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
_CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def quota_cores(v2: str = _CGROUP_V2, v1=_CGROUP_V1) -> Optional[float]:
    """The cgroup's CPU quota in cores, or None when there is none (or it cannot be read).

    Args:
      v2: the cgroup v2 ``cpu.max`` file ("QUOTA PERIOD" or "max PERIOD").
      v1: the cgroup v1 quota and period files (a quota of -1 means none).
    """
    text = _read(v2)
    if text:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    quota, period = _read(v1[0]), _read(v1[1])
    try:
        q, p = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, limited by a cgroup CPU quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = quota_cores()
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)
