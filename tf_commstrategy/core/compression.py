"""Compression of reductions on the wire: float32 and float64 sums and means travel as float16 or bfloat16.

A compressed all-reduce rounds this rank's values to the wire dtype, moves and adds them in that dtype
(each ring step adds in float32 and rounds the partial sum back, as NCCL and MPI do for float16), and
converts the result back to the buffer's dtype: half the bytes of float32 (a quarter of float64) on
every link, at the price of the wire dtype's precision. float16 keeps 11 significant bits and
overflows beyond 65504; bfloat16 keeps float32's range but only 8 significant bits.

Only sums and means of float32 / float64 buffers are compressed: min, max and product would change
meaning under rounding, and float16 / bfloat16 / integer buffers are not wider than the wire.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .reduce_ops import BFLOAT16, ReduceOp

_WIRE = {"fp16": np.dtype(np.float16), "bf16": BFLOAT16}


def wire_dtype(compression: str, dtype, op: ReduceOp) -> Optional[np.dtype]:
    """The dtype a reduction of ``dtype`` buffers travels as under ``compression``, or None when it
    travels as it is (no compression, not a sum or mean, or a buffer not wider than the wire dtype).

    Args:
      compression: a canonical name (``config.parse_compression``).
      dtype: the buffer's dtype.
      op: the reduction.
    """
    wire = _WIRE.get(compression)
    if wire is None or op not in (ReduceOp.SUM, ReduceOp.MEAN):
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:  # a name numpy does not know is not a floating dtype it could narrow
        return None
    return wire if dt.kind == "f" and dt.itemsize > wire.itemsize else None
