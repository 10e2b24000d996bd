"""Tensor fusion: many small buffers moved as one flat buffer per dtype (one collective each).

Works for any array module with ``reshape``, ``concatenate`` and slicing (numpy, cupy): the module is
taken from the buffers themselves, so this file imports no framework.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence


def _xp(buf):
    mod = type(buf).__module__.split(".")[0]
    if mod == "cupy":
        import cupy
        return cupy
    import numpy
    return numpy


def group_by_dtype(bufs: Sequence) -> "OrderedDict":
    """Indices of ``bufs`` grouped by dtype, in order of first appearance.

    Args:
      bufs: arrays (numpy or cupy).

    Returns:
      ``{dtype name: [indices]}``, the same on every rank for the same inputs.
    """
    groups: "OrderedDict" = OrderedDict()
    for i, b in enumerate(bufs):
        groups.setdefault(str(b.dtype), []).append(i)
    return groups


def flatten(bufs: Sequence, idxs: Sequence[int]):
    """One new flat buffer holding ``bufs[i]`` for ``i`` in ``idxs``, one after the other.

    Args:
      bufs: arrays of one dtype (numpy or cupy).
      idxs: which of them, in order.

    Returns:
      A 1-D array (a copy: the collective may write into it).
    """
    xp = _xp(bufs[idxs[0]])
    parts = [bufs[i].reshape(-1) for i in idxs]
    return parts[0].copy() if len(parts) == 1 else xp.concatenate(parts)


def unflatten(flat, bufs: Sequence, idxs: Sequence[int], out: List) -> None:
    """Cut ``flat`` back into the shapes of ``bufs[i]``, storing the views at ``out[i]``.

    Args:
      flat: the result of the fused collective.
      bufs: the original arrays (for their shapes and sizes).
      idxs: the indices ``flatten`` used, in the same order.
      out: the list to fill.
    """
    off = 0
    for i in idxs:
        n = bufs[i].size
        out[i] = flat[off:off + n].reshape(bufs[i].shape)
        off += n


def fused_allreduce(backend, bufs: Sequence, op, timeout=None, *, compression: str = "none") -> List:
    """All-reduce many buffers with one ``backend.allreduce`` per dtype.

    Args:
      backend: a ``Backend``.
      bufs: the buffers, in the same order on every rank.
      op: the reduction.
      timeout: deadline in seconds for each call (None: the group's).
      compression: as for ``Backend.allreduce``.

    Returns:
      The reduced buffers, in the order of ``bufs``.
    """
    out: List = [None] * len(bufs)
    for _, idxs in group_by_dtype(bufs).items():
        fused = flatten(bufs, idxs)  # a fresh buffer of ours: reduce it in place where the backend can
        flat = (backend.allreduce(fused, op, timeout, out=fused, compression=compression)
                if backend.capabilities.out_arrays else backend.allreduce(fused, op, timeout, compression=compression))
        unflatten(flat, bufs, idxs, out)
    return out


def fused_broadcast(backend, bufs: Sequence, root: int, timeout=None) -> List:
    """Broadcast many buffers from ``root`` with one ``backend.broadcast`` per dtype.

    Args:
      backend: a ``Backend``.
      bufs: the buffers, in the same order on every rank.
      root: the rank whose data everybody gets.
      timeout: deadline in seconds for each call (None: the group's).

    Returns:
      Root's buffers, in the order of ``bufs``.
    """
    out: List = [None] * len(bufs)
    for _, idxs in group_by_dtype(bufs).items():
        flat = backend.broadcast(flatten(bufs, idxs), root, timeout)
        unflatten(flat, bufs, idxs, out)
    return out
