"""The "auto" backend policy: GPU buffers go to nccl when it can run here, everything else to grpc."""

from __future__ import annotations

import logging

from .backend import availability
from .device_arrays import is_gpu_buffer

log = logging.getLogger("tf_commstrategy")
_announced = set()


def choose(group, buf) -> str:
    """Name of the backend "auto" uses for ``buf``; says once per choice at INFO which one it took."""
    name = "grpc"
    why = "CPU buffer"
    if is_gpu_buffer(buf):
        problem = availability("nccl")
        if problem is None:
            name, why = "nccl", "GPU buffer"
        else:
            why = f"GPU buffer, but nccl cannot run ({problem})"
    if (name, why) not in _announced:
        _announced.add((name, why))
        log.info("tf_commstrategy rank %d: backend 'auto' chose %s (%s)", group.rank, name, why)
    return name
