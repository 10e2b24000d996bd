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
    groups: "OrderedDict" = OrderedDict()
    for i, b in enumerate(bufs):
        groups.setdefault(str(b.dtype), []).append(i)
    return groups


def flatten(bufs: Sequence, idxs: Sequence[int]):
    xp = _xp(bufs[idxs[0]])
    parts = [bufs[i].reshape(-1) for i in idxs]
    return parts[0].copy() if len(parts) == 1 else xp.concatenate(parts)


def unflatten(flat, bufs: Sequence, idxs: Sequence[int], out: List) -> None:
    off = 0
    for i in idxs:
        n = bufs[i].size
        out[i] = flat[off:off + n].reshape(bufs[i].shape)
        off += n


def fused_allreduce(backend, bufs: Sequence, op, timeout=None) -> List:
    out: List = [None] * len(bufs)
    for _, idxs in group_by_dtype(bufs).items():
        flat = backend.allreduce(flatten(bufs, idxs), op, timeout)
        unflatten(flat, bufs, idxs, out)
    return out


def fused_broadcast(backend, bufs: Sequence, root: int, timeout=None) -> List:
    out: List = [None] * len(bufs)
    for _, idxs in group_by_dtype(bufs).items():
        flat = backend.broadcast(flatten(bufs, idxs), root, timeout)
        unflatten(flat, bufs, idxs, out)
    return out
