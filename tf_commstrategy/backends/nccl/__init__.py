"""The "nccl" backend: NVIDIA NCCL through cupy (``cupy.cuda.nccl``), for GPU buffers.

Importing this package imports neither cupy nor TensorFlow; ``backend.NcclBackend`` needs cupy
(any build: cupy-cuda12x, cupy-cuda13x, ...) and the NCCL library it loads.
``Bfloat16Array`` (in ``buffers``) carries bfloat16 data in uint16 cupy arrays.

``availability()`` says, without side effects, why nccl cannot run here (or None when it can);
selecting nccl where it cannot run raises ``BackendUnavailableError`` at once with that reason.
"""

from __future__ import annotations

from typing import Optional

from ...core.backend import register_backend, unavailable
from ...core.device_arrays import Bfloat16Array  # noqa: F401  (public: bfloat16 data for the nccl backend)


def availability() -> Optional[str]:
    """None when nccl can run here, else the reason it cannot."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        return f"cupy cannot load the NCCL library ({e})"
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        return ("cupy cannot load the NCCL library (libnccl.so.2 was not found; the nvidia-nccl-cu12 or "
                "-cu13 wheel provides it)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises CUDARuntimeError without a driver
        return f"no visible GPU (CUDA runtime: {e})"
    if count == 0:
        return "no visible GPU"
    return None


_FIX = ("install the nccl extra (pip install 'tf_commstrategy[nccl]': cupy-cuda12x and the NCCL runtime; "
        "'tf_commstrategy[nccl-cu13]' for a CUDA 13 driver) on a "
        "machine with an NVIDIA GPU, or use backend='grpc' / CommunicationOptions(implementation=RING)")


def make_backend(group):
    problem = availability()
    if problem is not None:
        raise unavailable("nccl", problem, _FIX)
    from .backend import NcclBackend
    return NcclBackend(group)


register_backend("nccl", make_backend, availability)
