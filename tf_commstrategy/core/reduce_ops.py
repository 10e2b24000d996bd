"""Reduction operations and the dtypes they accept, on numpy buffers (no framework imports)."""

from __future__ import annotations

import enum
from typing import Union

import numpy as np

from ..errors import ConfigurationError, UnsupportedOperationError

try:  # bfloat16 comes from ml_dtypes (a TensorFlow dependency, also installed by this package)
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    BFLOAT16 = None


class ReduceOp(str, enum.Enum):
    """How values from all ranks are combined."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def parse(cls, op: Union[str, "ReduceOp"]) -> "ReduceOp":
        """The ``ReduceOp`` a user spelling stands for.

        Args:
          op: a ``ReduceOp``, a name ("sum", "MEAN", ...) or ``tf.distribute.ReduceOp.SUM`` / ``MEAN``.

        Returns:
          The matching ``ReduceOp``.

        Raises:
          ConfigurationError: not one of sum, mean, min, max, prod.
        """
        if isinstance(op, ReduceOp):
            return op
        name = getattr(op, "name", op)  # accepts tf.distribute.ReduceOp.SUM / MEAN too
        try:
            return cls(str(name).lower())
        except ValueError:
            raise ConfigurationError(
                f"unknown reduction op {op!r}",
                fix=f"use one of {[o.value for o in cls]}") from None


_SUPPORTED = {
    np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
    np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64),
    np.dtype(np.bool_),
}
if BFLOAT16 is not None:
    _SUPPORTED.add(BFLOAT16)

_LOW_PRECISION = {np.dtype(np.float16)} | ({BFLOAT16} if BFLOAT16 is not None else set())


def supported_dtypes():
    """The dtypes every collective accepts (bool only for min / max and data movement).

    Returns:
      A list of numpy dtypes, sorted by name.
    """
    return sorted(_SUPPORTED, key=str)


def check_dtype(dtype: np.dtype, op: ReduceOp = None) -> None:
    """Check that a collective is defined for ``dtype`` (and ``op``).

    Args:
      dtype: anything ``np.dtype`` accepts.
      op: the reduction, or None for data movement (broadcast, all-gather).

    Raises:
      UnsupportedOperationError: the dtype is not supported, or bool with an op other than min / max.
    """
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED:
        raise UnsupportedOperationError(
            f"dtype {dtype} is not supported",
            fix=f"cast to one of {[str(d) for d in supported_dtypes()]}")
    if dtype == np.bool_ and op not in (None, ReduceOp.MIN, ReduceOp.MAX):
        raise UnsupportedOperationError(
            f"op {op.value!r} is not defined for bool tensors (only min and max are)",
            fix="cast to an integer dtype first, or use op='max' (logical or) / 'min' (logical and)")


def needs_wide_accumulator(dtype: np.dtype, op: "ReduceOp") -> bool:
    """float16 / bfloat16 sums, means and products are accumulated in float32 (see core.ring).

    Args:
      dtype: the buffer's dtype.
      op: the reduction.

    Returns:
      True when the reduction must run on a float32 copy.
    """
    return np.dtype(dtype) in _LOW_PRECISION and op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PROD)


def combine_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """``dst = dst (op) src`` in place (MEAN combines as SUM; the division comes at the end).

    Args:
      dst: the accumulator, changed in place.
      src: the incoming values, same shape.
      op: the reduction.

    Raises:
      ConfigurationError: an unknown op.
    """
    combine_to(dst, dst, src, op)


def combine_to(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """``out = a (op) b`` (out of place; MEAN combines as SUM).

    Args:
      out: where the result goes (may be ``a``).
      a, b: the operands, same shape as ``out``.
      op: the reduction.

    Raises:
      ConfigurationError: an unknown op.
    """
    if op is ReduceOp.SUM or op is ReduceOp.MEAN:
        np.add(a, b, out=out)
    elif op is ReduceOp.PROD:
        np.multiply(a, b, out=out)
    elif op is ReduceOp.MIN:
        np.minimum(a, b, out=out)
    elif op is ReduceOp.MAX:
        np.maximum(a, b, out=out)
    else:  # pragma: no cover
        raise ConfigurationError(f"unknown op {op}")


def finish_mean(buf: np.ndarray, world_size: int) -> None:
    """Turn a sum into a mean in place. Integers use floor division (documented).

    Args:
      buf: the sum over all ranks, changed in place.
      world_size: the number of ranks.
    """
    if world_size == 1:
        return
    if np.issubdtype(buf.dtype, np.integer):
        np.floor_divide(buf, world_size, out=buf)
    elif buf.dtype in _LOW_PRECISION:
        buf[...] = buf.astype(np.float32) / np.float32(world_size)
    else:
        np.divide(buf, buf.dtype.type(world_size), out=buf)


def reduce_in_rank_order(blocks, op: ReduceOp) -> np.ndarray:
    """Every rank's values combined locally, rank 0 first: the same bits wherever it runs.

    float16 / bfloat16 sums, means and products are accumulated in float32; a MEAN is divided by
    ``len(blocks)``.

    Args:
      blocks: one array per rank, in rank order, same shape and dtype; only read.
      op: the reduction.

    Returns:
      A new array: the reduction, in the float32 accumulator where one was needed (the caller rounds
      it when it writes the result into an array of the blocks' dtype).
    """
    wide = needs_wide_accumulator(blocks[0].dtype, op)
    acc = blocks[0].astype(np.float32) if wide else blocks[0].copy()
    for other in blocks[1:]:
        combine_into(acc, other.astype(np.float32) if wide else other, op)
    if op is ReduceOp.MEAN:
        finish_mean(acc, len(blocks))
    return acc
