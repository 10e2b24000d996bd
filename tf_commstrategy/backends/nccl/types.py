"""How our dtypes and reductions map onto NCCL's (``ncclDataType_t``, ``ncclRedOp_t``).

Buffers are described by a *logical* dtype name (``"float32"``, ``"bfloat16"``, ...): cupy has no
bfloat16 arrays, so bfloat16 data travels in uint16 arrays that NCCL reduces as ``ncclBfloat16``.
bool travels as uint8 (min / max are logical and / or on 0/1 bytes). MEAN is NCCL's SUM followed
by a division on the device (integers: floor division, as on the grpc backend), which works on
every NCCL version (``ncclAvg`` needs 2.10 and is not defined for every dtype).
"""

from __future__ import annotations

from ...core.reduce_ops import ReduceOp
from ...errors import UnsupportedOperationError

#: logical dtype name -> the name of cupy.cuda.nccl's constant
_DTYPES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "bool": "NCCL_UINT8",
    "int32": "NCCL_INT32", "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
}

_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.MEAN: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD",
        ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}


def nccl_dtypes():
    """The logical dtype names the nccl backend moves.

    Returns:
      The names, sorted.
    """
    return sorted(_DTYPES)


def nccl_dtype(nccl, logical: str) -> int:
    """NCCL's data type for ``logical``.

    Args:
      nccl: the ``cupy.cuda.nccl`` module.
      logical: the buffer's logical dtype name.

    Returns:
      The ``ncclDataType_t`` value.

    Raises:
      UnsupportedOperationError: NCCL has no such type (or this NCCL build lacks it, e.g. bfloat16
        before NCCL 2.10).
    """
    const = _DTYPES.get(logical)
    if const is None or not hasattr(nccl, const):
        raise UnsupportedOperationError(
            f"the nccl backend cannot move dtype {logical}",
            fix=f"cast to one of {nccl_dtypes()}, or use backend='grpc'")
    return int(getattr(nccl, const))


def nccl_op(nccl, op: ReduceOp, logical: str) -> int:
    """NCCL's reduction for ``op`` on ``logical`` (MEAN maps to SUM; the division follows).

    Args:
      nccl: the ``cupy.cuda.nccl`` module.
      op: the reduction.
      logical: the buffer's logical dtype name.

    Returns:
      The ``ncclRedOp_t`` value.

    Raises:
      UnsupportedOperationError: bool with an op other than min / max.
    """
    if logical == "bool" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise UnsupportedOperationError(
            f"op {op.value!r} is not defined for bool tensors (only min and max are)",
            fix="cast to an integer dtype first, or use op='max' (logical or) / 'min' (logical and)")
    return int(getattr(nccl, _OPS[op]))
