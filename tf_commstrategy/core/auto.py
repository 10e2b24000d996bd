"""The "auto" backend policy: GPU buffers go to nccl when it can run here, everything else to grpc."""

from __future__ import annotations

import logging
import re

import numpy as np

log = logging.getLogger("tf_commstrategy")
_announced = set()
_DEVICE_TYPE = re.compile(r"(?:^|/)(?:device:)?(?!task:|replica:)([A-Za-z_]+):\d+$", re.IGNORECASE)


def is_device_array(buf) -> bool:
    """True for GPU arrays outside TF: cupy arrays, our ``Bfloat16Array``, CUDA DLPack producers."""
    if type(buf) is np.ndarray:  # the common case, answered without looking further
        return False
    if type(buf).__module__.split(".")[0] == "cupy" or getattr(type(buf), "__tfcs_device_buffer__", False):
        return True
    dev = getattr(buf, "__dlpack_device__", None)
    if dev is None or type(buf).__module__.startswith("tensorflow"):
        return False
    try:
        return int(dev()[0]) in (2, 13)  # kDLCUDA, kDLCUDAManaged
    except Exception:
        return False


def is_gpu_buffer(buf) -> bool:
    if type(buf) is np.ndarray:
        return False
    if is_device_array(buf):
        return True
    dev = getattr(buf, "device", None)  # a tf.Tensor's device string, e.g. '/job:.../device:GPU:0'
    return isinstance(dev, str) and device_type(dev) == "GPU"


def device_type(device: str) -> str:
    """The device type of a TF device string: '/job:gpu_workers/replica:0/task:1/device:CPU:0' -> 'CPU'
    (not the job's name), 'GPU:0' -> 'GPU', '/gpu:1' -> 'GPU'; '' when the string names none."""
    m = _DEVICE_TYPE.search(device)
    return m.group(1).upper() if m else ""


def choose(group, buf) -> str:
    """Name of the backend "auto" uses for ``buf``; says once per choice at INFO which one it took."""
    name = "grpc"
    why = "CPU buffer"
    if is_gpu_buffer(buf):
        from ..core.backend import _FACTORIES
        probe = getattr(_FACTORIES.get("nccl"), "availability", None)
        problem = probe() if probe is not None else "the nccl backend is not installed"
        if problem is None:
            name, why = "nccl", "GPU buffer"
        else:
            why = f"GPU buffer, but nccl cannot run ({problem})"
    if (name, why) not in _announced:
        _announced.add((name, why))
        log.info("tf_commstrategy rank %d: backend 'auto' chose %s (%s)", group.rank, name, why)
    return name
