"""GPU arrays outside TensorFlow, told apart from host arrays without importing a GPU library.

* ``is_device_array``: cupy arrays, ``Bfloat16Array`` and CUDA DLPack producers (a torch or JAX GPU
  tensor); ``is_gpu_buffer`` also says yes to a framework tensor whose ``device`` string names a GPU.
* ``Bfloat16Array``: bfloat16 values in a uint16 cupy array (cupy before 14 has no bfloat16).
* ``to_host``: a GPU operand staged through host memory for a backend that moves host memory, as
  Horovod does without NCCL.

cupy is imported only when a device array is actually met.
"""

from __future__ import annotations

import re
from typing import Callable, Tuple

import numpy as np

from ..errors import UnsupportedOperationError
from .reduce_ops import BFLOAT16

_DEVICE_TYPE = re.compile(r"(?:^|/)(?:device:)?(?!task:|replica:)([A-Za-z_]+):\d+$", re.IGNORECASE)


def is_cupy(x) -> bool:
    """True for a cupy array (by its type's module: cupy is not imported)."""
    return type(x).__module__.split(".")[0] == "cupy"


class Bfloat16Array:
    """bfloat16 values stored in a uint16 cupy array (NCCL reduces them as ``ncclBfloat16``).

    Args:
      data: a ``cupy.ndarray`` of dtype uint16 holding the bfloat16 bit patterns.

    Raises:
      UnsupportedOperationError: ``data`` is not a uint16 cupy array.
    """

    __slots__ = ("data",)
    __tfcs_device_buffer__ = True

    def __init__(self, data):
        if not is_cupy(data) or str(data.dtype) != "uint16":
            raise UnsupportedOperationError(
                f"Bfloat16Array needs a uint16 cupy array, got {type(data).__name__} of dtype "
                f"{getattr(data, 'dtype', '?')}", fix="pass cupy.asarray(bf16_numpy.view(numpy.uint16))")
        self.data = data

    @property
    def shape(self):
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def dtype(self):
        """``numpy.dtype(ml_dtypes.bfloat16)`` (its ``str`` is "bfloat16")."""
        return BFLOAT16

    def __repr__(self) -> str:
        return f"Bfloat16Array(shape={self.shape}, device={self.data.device.id})"


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


def to_host(x) -> Tuple[object, Callable[[object], object]]:
    """Copy a GPU operand to host memory, for a backend that moves host memory (grpc).

    Used when "auto" (or an explicit backend="grpc") meets a GPU buffer and nccl cannot take it:
    the data is staged through the host, as Horovod does without NCCL.

    Args:
      x: a cupy array, a ``Bfloat16Array`` or a CUDA DLPack producer.

    Returns:
      ``(numpy_array, back)``: ``back(numpy_result)`` copies a result to the GPU, as what the
      caller gets back for ``x`` (a cupy array, or a ``Bfloat16Array``).
    """
    import cupy
    if isinstance(x, Bfloat16Array):
        return cupy.asnumpy(x.data).view(BFLOAT16), lambda r: Bfloat16Array(cupy.asarray(np.asarray(r).view(np.uint16)))
    arr = x if is_cupy(x) else cupy.from_dlpack(x)
    device = arr.device

    def back(r):
        with device:
            return cupy.asarray(r)

    return cupy.asnumpy(arr), back
