"""GPU buffers for the nccl backend: cupy arrays, bfloat16 held in uint16, and DLPack producers.

What the nccl backend accepts, and what it gives back:

* a ``cupy.ndarray`` -> a ``cupy.ndarray`` (bool and every dtype of ``types.nccl_dtypes()``);
* ``Bfloat16Array(u16)``, a uint16 cupy array whose bits are bfloat16 values (cupy before 14 has no
  bfloat16 arrays; ``ml_dtypes.bfloat16`` numpy data ``.view(np.uint16)`` goes in as it is) -> the
  same wrapper; cupy >= 14's own bfloat16 arrays are cupy arrays like any other;
* any object with ``__dlpack__`` on a CUDA device (a torch or JAX GPU tensor) -> a ``cupy.ndarray``
  that shares memory with nothing of the caller's (the result is new memory); the input is imported
  without a copy through ``cupy.from_dlpack``, which asks the producer to order its stream before
  cupy's current stream (the DLPack stream protocol).

A host buffer (numpy, a CPU tensor) is refused with ``UnsupportedOperationError``: nccl moves
device memory only, and the fix is ``backend='grpc'`` or ``'auto'``.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

from ...core.device_arrays import Bfloat16Array, is_cupy
from ...errors import UnsupportedOperationError


class DeviceBuffer:
    """One collective operand: a C-contiguous cupy array and the logical dtype it holds.

    Attributes:
      array: the cupy array (its own dtype is the storage dtype: uint16 for bfloat16).
      dtype: the logical dtype name ("float32", "bfloat16", "bool", ...).
    """

    __slots__ = ("array", "dtype")

    def __init__(self, array, dtype: str):
        self.array = array
        self.dtype = dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def size(self) -> int:
        return int(self.array.size)

    @property
    def ptr(self) -> int:
        return int(self.array.data.ptr)

    @property
    def device_id(self) -> int:
        return int(self.array.device.id)

    def like(self, shape=None) -> "DeviceBuffer":
        """A new, uninitialised buffer of the same storage and logical dtype on the same device."""
        import cupy
        with self.array.device:
            arr = cupy.empty(self.shape if shape is None else shape, dtype=self.array.dtype)
        return DeviceBuffer(arr, self.dtype)


def is_device_buffer(x) -> bool:
    """True for what the nccl backend takes as it is: cupy arrays and ``Bfloat16Array``."""
    return is_cupy(x) or getattr(type(x), "__tfcs_device_buffer__", False)


def _host_refusal(x) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"the nccl backend moves GPU memory, but got a host buffer ({type(x).__module__}.{type(x).__name__})",
        fix="pass a cupy array or a GPU tensor, or use backend='grpc' (or 'auto', which sends host buffers "
            "to grpc)")


def to_device(x) -> Tuple[DeviceBuffer, Callable[[DeviceBuffer], object]]:
    """Turn ``x`` into a ``DeviceBuffer`` without a copy (a non-contiguous cupy array is compacted).

    Args:
      x: a cupy array, a ``Bfloat16Array``, or a CUDA DLPack producer (``__dlpack__``).

    Returns:
      ``(buffer, wrap)``: ``wrap(result_buffer)`` turns a result into what the caller gets back
      (a cupy array, or a ``Bfloat16Array`` for a ``Bfloat16Array`` input).

    Raises:
      UnsupportedOperationError: ``x`` is on the host, or its dtype is not one nccl moves.
    """
    import cupy
    if isinstance(x, Bfloat16Array):
        return DeviceBuffer(cupy.ascontiguousarray(x.data), "bfloat16"), lambda b: Bfloat16Array(b.array)
    if is_cupy(x):
        arr = x
    elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind = x.__dlpack_device__()[0]
        if int(kind) not in (2, 13):  # kDLCUDA, kDLCUDAManaged (kDLCPU is 1)
            raise _host_refusal(x)
        try:
            arr = cupy.from_dlpack(x)
        except Exception as e:
            raise UnsupportedOperationError(
                f"cupy could not import a {type(x).__name__} through DLPack ({e})",
                fix="pass a cupy array; for bfloat16 pass Bfloat16Array(uint16 view of the data)") from None
    else:
        raise _host_refusal(x)
    arr = cupy.ascontiguousarray(arr)
    name = str(arr.dtype)
    return DeviceBuffer(arr, name), lambda b: b.array


def to_devices(xs: Sequence) -> Tuple[List[DeviceBuffer], List[Callable]]:
    """``to_device`` for each of ``xs``; they must all be on one GPU.

    Args:
      xs: the operands.

    Returns:
      ``(buffers, wraps)``.

    Raises:
      UnsupportedOperationError: a host buffer, an unsupported dtype, or buffers on different GPUs.
    """
    pairs = [to_device(x) for x in xs]
    bufs = [p[0] for p in pairs]
    devices = sorted({b.device_id for b in bufs})
    if len(devices) > 1:
        raise UnsupportedOperationError(
            f"one nccl call got buffers on GPUs {devices}", fix="put every buffer of one call on the same GPU")
    return bufs, [p[1] for p in pairs]


def bf16_bits_from_f32(f32, xp):
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even; a NaN stays a (quiet) NaN.

    Args:
      f32: float32 array.
      xp: its array module (cupy; numpy in tests).

    Returns:
      A uint16 array of the same shape.
    """
    bits = f32.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    # rounding a NaN whose low 16 bits are set (CUDA's canonical NaN is 0x7FFFFFFF) would carry into
    # the sign and exponent: 0x7FFFFFFF -> 0x8000 (-0.0). Keep it a NaN, with its sign.
    nan = ((bits >> 16) & xp.uint32(0x8000)) | xp.uint32(0x7FC0)
    return xp.where(xp.isnan(f32), nan, rounded).astype(xp.uint16)


def narrowed(b: DeviceBuffer, wire) -> DeviceBuffer:
    """A new buffer holding ``b``'s floating values rounded to ``wire`` (numpy float16 or bfloat16; bfloat16
    is held in uint16, rounded to nearest even), for a compressed all-reduce (``core.compression``)."""
    import cupy
    with b.array.device:
        if str(wire) == "bfloat16":
            return DeviceBuffer(bf16_bits_from_f32(b.array.astype(cupy.float32), cupy), "bfloat16")
        return DeviceBuffer(b.array.astype(cupy.float16), "float16")


def widened(r: DeviceBuffer, like: DeviceBuffer) -> DeviceBuffer:
    """The result ``r`` of a compressed all-reduce, converted back to the dtype of ``like``."""
    import cupy
    with r.array.device:
        arr = r.array
        if r.dtype == "bfloat16":
            arr = (arr.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        return DeviceBuffer(arr.astype(like.array.dtype), like.dtype)
