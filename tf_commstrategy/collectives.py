"""The direct collective API, usable without any strategy: ``tfcs.allreduce(x)`` and friends.

Arguments are validated here, then the chosen backend moves the data. numpy arrays (and anything
``np.asarray`` accepts) come back as numpy arrays. A framework's tensors are handled by the layer of
that framework, which registers a ``TensorHandler`` here (the TF layer does for ``tf.Tensor``: they
come back as tensors, eagerly and inside ``tf.function``); this module never imports a framework.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence

import numpy as np

from .core.backend import normalize_backend_name
from .config import parse_compression
from .core.device_arrays import is_device_array as _is_device_array
from .core.device_arrays import to_host
from .core.reduce_ops import ReduceOp, check_dtype
from .errors import ConfigurationError, UnsupportedOperationError
from .process import default_group


class TensorHandler(Protocol):
    """The collectives of a framework's tensors, registered by that framework's layer
    (``register_tensor_handler``); same arguments and errors as the functions of this module."""

    def accepts(self, x) -> bool:
        """True for a tensor of this framework."""

    def allreduce(self, x, op, *, backend: Optional[str], timeout: Optional[float],
                  compression: Optional[str] = None): ...

    def grouped_allreduce(self, xs: List, op, *, backend: Optional[str], timeout: Optional[float],
                          compression: Optional[str] = None) -> List: ...

    def broadcast(self, x, root_rank: int, *, backend: Optional[str], timeout: Optional[float]): ...

    def allgather(self, x, *, backend: Optional[str], timeout: Optional[float]): ...

    def reduce_scatter(self, x, op, *, backend: Optional[str], timeout: Optional[float]): ...

    def alltoall(self, x, splits, *, backend: Optional[str], timeout: Optional[float]): ...


_handlers: List[TensorHandler] = []
_loaders: Dict[str, Callable[[], None]] = {}


def register_tensor_handler(handler: TensorHandler) -> None:
    """Route the tensors ``handler.accepts`` to ``handler`` (called by a framework's layer on import).

    Args:
      handler: the framework's collectives.
    """
    if handler not in _handlers:
        _handlers.append(handler)


def register_tensor_loader(package: str, load: Callable[[], None]) -> None:
    """Call ``load()`` (which imports a layer that registers its handler) the first time an argument
    whose type comes from ``package`` (a top-level module name, e.g. "tensorflow") meets no handler.

    Args:
      package: the top-level module of the tensor types.
      load: imports the layer.
    """
    _loaders[package] = load


def _handler_for(x) -> Optional[TensorHandler]:
    if type(x) is np.ndarray:  # the common case, answered without looking further
        return None
    for h in _handlers:
        if h.accepts(x):
            return h
    load = _loaders.pop(type(x).__module__.split(".")[0], None)
    if load is None:
        return None
    load()
    return _handler_for(x)


def _as_array(x, what: str):
    if _is_device_array(x):
        return x
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except Exception as e:
            raise UnsupportedOperationError(f"{what} got a {type(x).__name__} that is not an array ({e})",
                                            fix="pass a numpy array, a tf.Tensor or a cupy array") from None
    if arr.dtype == object:
        raise UnsupportedOperationError(f"{what} got an object array", fix="pass a numeric array")
    return arr


def _check(arr, op=None) -> None:
    try:
        dtype = np.dtype(arr.dtype)
    except TypeError:  # a framework's own dtype object (a torch GPU tensor): the device backend checks it
        return
    check_dtype(dtype, op)


def _same(r):
    return r


def _staged(b, x):
    """``(operand for b, back)``: a GPU array meeting a host backend (grpc) goes through host memory
    (as Horovod does without NCCL); ``back`` turns the result into what the caller gets back."""
    if not b.capabilities.device_arrays and _is_device_array(x):
        return to_host(x)
    return x, _same


def _run_batch(b, method: str, arrs: List, *args, **kwargs) -> List:
    pairs = [_staged(b, a) for a in arrs]
    results = getattr(b, method)([p[0] for p in pairs], *args, **kwargs)
    return [p[1](r) for p, r in zip(pairs, results)]


def _backend(name, buf):
    return default_group().resolve_backend(name, buf)


def _check_root(root_rank: int) -> int:
    n = default_group().size
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < n:
        raise ConfigurationError(f"root_rank={root_rank!r} is not a rank of this job of {n}",
                                 rank=default_group().rank, fix=f"use a root in 0..{n - 1}")
    return int(root_rank)


def allreduce(x, op="sum", *, backend: Optional[str] = None, timeout: Optional[float] = None, out=None,
              compression: Optional[str] = None):
    """Reduce ``x`` over all workers; every worker gets the result.

    Args:
      x: numpy array (or array-like), tf.Tensor, or cupy array; same shape and dtype on every rank.
      op: "sum" | "mean" | "min" | "max" | "prod" (or ``tf.distribute.ReduceOp``). Integer means floor.
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for this call (default: the group's, ``TFCS_TIMEOUT``).
      out: numpy only: a C-contiguous array of ``x``'s shape and dtype that receives the result
        (``out=x`` reduces in place, like Horovod's ``allreduce_``; saves allocating the result).
      compression: "none" | "fp16" | "bf16": float32 / float64 sums and means travel as that dtype, half
        the bytes (or less), rounded at every ring step (default: the job's, ``TFCS_COMPRESSION``).

    Returns:
      An array of the same type, shape and dtype as ``x`` (``out`` when given).

    Raises:
      UnsupportedOperationError: dtype/op combination not supported (e.g. sum of bools), or ``out``
        of another shape / dtype / layout, or ``out`` with a backend or tensor type that cannot take it.
      ConfigurationError: unknown op or backend name.
      BackendUnavailableError: the chosen backend cannot run here (e.g. nccl without cupy).
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(x)
    if handler is not None:
        if out is not None:
            raise UnsupportedOperationError(f"out= is supported for numpy arrays on the grpc backend, not for "
                                            f"a {type(x).__name__} input (tensors are immutable)",
                                            fix="drop out= and use the returned tensor")
        return handler.allreduce(x, op, backend=backend, timeout=timeout, compression=compression)
    op = ReduceOp.parse(op)
    arr = _as_array(x, "allreduce")
    _check(arr, op)
    b = _backend(backend, arr)
    comp = compression_of(compression)
    if out is None:
        a, back = _staged(b, arr)
        return back(b.allreduce(a, op, timeout, compression=comp))
    if (not b.capabilities.out_arrays or not isinstance(out, np.ndarray)
            or not isinstance(arr, np.ndarray)):
        raise UnsupportedOperationError(f"out= is supported for numpy arrays on the grpc backend, not for "
                                        f"a {type(arr).__name__} input and a {type(out).__name__} out= on {b.name}",
                                        fix="drop out= and use the returned array")
    return b.allreduce(arr, op, timeout, out=out, compression=comp)


def compression_of(compression: Optional[str]) -> str:
    """A call's compression: its own setting, else the job's (``tfcs.init(compression=)``, ``TFCS_COMPRESSION``).

    Raises:
      ConfigurationError: an unknown name.
    """
    return parse_compression(compression) if compression is not None else default_group().compression


def grouped_allreduce(xs: Sequence, op="sum", *, backend: Optional[str] = None,
                      timeout: Optional[float] = None, compression: Optional[str] = None) -> List:
    """Allreduce a list of arrays as one fused transfer per dtype. Same arguments as ``allreduce``.

    Args:
      xs: arrays (numpy / array-likes, or tf.Tensors), in the same order with the same shapes and
        dtypes on every rank.
      op: "sum" | "mean" | "min" | "max" | "prod" (or ``tf.distribute.ReduceOp``).
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for each fused transfer (default: the group's, ``TFCS_TIMEOUT``).
      compression: as for ``allreduce``.

    Returns:
      A list of reduced arrays (tensors for tensor inputs), in the order of ``xs``.

    Raises:
      UnsupportedOperationError: a dtype/op combination is not supported.
      ConfigurationError: unknown op or backend name.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(xs[0]) if xs else None
    if handler is not None:
        return handler.grouped_allreduce(list(xs), op, backend=backend, timeout=timeout, compression=compression)
    op = ReduceOp.parse(op)
    arrs = [_as_array(x, "grouped_allreduce") for x in xs]
    if not arrs:
        return []
    for a in arrs:
        _check(a, op)
    comp = compression_of(compression)
    return _run_batch(_backend(backend, arrs[0]), "batch_allreduce", arrs, op, timeout, compression=comp)


def broadcast(x, root_rank: int = 0, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """Return root's ``x`` on every worker (same shape and dtype required on every rank).

    Args:
      x: numpy array (or array-like), tf.Tensor, or cupy array: the data on the root, a buffer of the
        same shape and dtype elsewhere.
      root_rank: the rank whose ``x`` everybody gets.
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for this call (default: the group's, ``TFCS_TIMEOUT``).

    Returns:
      Root's ``x``, as an array of the same type as ``x``.

    Raises:
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: the dtype is not supported.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(x)
    if handler is not None:
        return handler.broadcast(x, root_rank, backend=backend, timeout=timeout)
    root = _check_root(root_rank)
    arr = _as_array(x, "broadcast")
    _check(arr)
    b = _backend(backend, arr)
    a, back = _staged(b, arr)
    return back(b.broadcast(a, root, timeout))


def grouped_broadcast(xs: Sequence, root_rank: int = 0, *, backend: Optional[str] = None,
                      timeout: Optional[float] = None) -> List:
    """Broadcast a list of arrays from ``root_rank`` as one fused transfer per dtype.

    Args:
      xs: numpy arrays (or array-likes), in the same order with the same shapes and dtypes on every
        rank; their values matter on the root only.
      root_rank: the rank whose arrays everybody gets.
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for each fused transfer (default: the group's, ``TFCS_TIMEOUT``).

    Returns:
      A list of root's arrays, in the order of ``xs``.

    Raises:
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: a dtype is not supported.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    root = _check_root(root_rank)
    arrs = [_as_array(x, "grouped_broadcast") for x in xs]
    if not arrs:
        return []
    for a in arrs:
        _check(a)
    return _run_batch(_backend(backend, arrs[0]), "batch_broadcast", arrs, root, timeout)


def allgather(x, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """Concatenate every worker's ``x`` along axis 0, in rank order. First dimensions may differ;
    the other dimensions and the dtype must match. A scalar counts as shape (1,).

    Args:
      x: numpy array (or array-like), tf.Tensor, or cupy array.
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for this call (default: the group's, ``TFCS_TIMEOUT``).

    Returns:
      The concatenation, of the same type as ``x``, on every rank.

    Raises:
      CollectiveMismatchError: trailing dimensions or dtypes differ between ranks.
      UnsupportedOperationError: the dtype is not supported.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(x)
    if handler is not None:
        return handler.allgather(x, backend=backend, timeout=timeout)
    arr = _as_array(x, "allgather")
    _check(arr)
    b = _backend(backend, arr)
    a, back = _staged(b, arr)
    return back(b.allgather(a, timeout))


def reduce_scatter(x, op="sum", *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """Reduce ``x`` over all workers, then give rank r the r-th piece of axis 0, split as
    ``np.array_split(result, size())`` does (the first ``len % size`` ranks get one extra row).

    Args:
      x: numpy array (or array-like), tf.Tensor, or cupy array, at least 1-D; same shape and dtype on
        every rank.
      op: "sum" | "mean" | "min" | "max" | "prod" (or ``tf.distribute.ReduceOp``).
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for this call (default: the group's, ``TFCS_TIMEOUT``).

    Returns:
      This rank's rows of the reduced array, of the same type as ``x``.

    Raises:
      UnsupportedOperationError: dtype/op combination not supported.
      ConfigurationError: unknown op or backend name.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(x)
    if handler is not None:
        return handler.reduce_scatter(x, op, backend=backend, timeout=timeout)
    op = ReduceOp.parse(op)
    arr = _as_array(x, "reduce_scatter")
    _check(arr, op)
    b = _backend(backend, arr)
    a, back = _staged(b, arr)
    return back(b.reduce_scatter(a, op, timeout))


def alltoall(x, splits=None, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """Send rank d the ``splits[d]`` rows of ``x`` that follow the rows for the ranks before it, and
    receive every rank's rows for this one (all-to-all along axis 0, as MPI's and Horovod's).

    Args:
      x: numpy array (or array-like), tf.Tensor, or cupy array, at least 1-D; trailing dimensions and
        dtype equal on every rank, the first may differ.
      splits: rows for each rank in rank order (a list, array or tensor of ints adding up to
        ``x.shape[0]``); None: ``x.shape[0]`` divided evenly among the ranks (it must divide).
      backend: "grpc" | "nccl" | "auto" for this call only (default: the group's backend).
      timeout: deadline in seconds for this call (default: the group's, ``TFCS_TIMEOUT``).

    Returns:
      ``(received, received_splits)``: every rank's rows for this one, concatenated in rank order (of
      the same type as ``x``), and how many rows came from each rank (a list of ints; an int32 tensor
      for a tensor ``x``).

    Raises:
      UnsupportedOperationError: a scalar, bad ``splits``, or a backend without all-to-all.
      ConfigurationError: unknown backend name.
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (dtype, trailing shape or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    handler = _handler_for(x)
    if handler is not None:
        return handler.alltoall(x, splits, backend=backend, timeout=timeout)
    arr = _as_array(x, "alltoall")
    _check(arr)
    b = _backend(backend, arr)
    a, back = _staged(b, arr)
    if splits is not None and _is_device_array(splits):
        splits = to_host(splits)[0]
    counts = None if splits is None else [int(c) for c in np.asarray(splits).reshape(-1)]
    received, received_splits = b.alltoall(a, counts, timeout)
    return back(received), received_splits


def barrier(*, backend: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Return once every worker has called ``barrier``.

    Args:
      backend: the backend whose peers to wait for (default: the group's; "auto" means grpc).
      timeout: deadline in seconds (default: the group's, ``TFCS_TIMEOUT``).

    Raises:
      NotInitializedError: ``tfcs.init()`` has not been called.
      CollectiveMismatchError: ranks disagree on the call (op, dtype, shape, root or order).
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
    """
    g = default_group()
    name = normalize_backend_name(backend) or g.default_backend
    g.backend("grpc" if name == "auto" else name).barrier(timeout)


def shared_empty(shape, dtype="float32", *, timeout: Optional[float] = None) -> np.ndarray:
    """A new, uninitialised numpy array in shared memory that the other ranks of this host map too.

    A collective: every rank calls it with the same shape and dtype, in the same order (like
    ``MPI_Win_allocate_shared`` or torch's symmetric memory). An in-place all-reduce of the array
    (``tfcs.allreduce(a, out=a)``, or of the same slice of it on every rank) then reads the peers'
    values where they are: no copy into a transfer buffer and none out of it (``tfcs-bench --buffers
    shared`` measures it). Anything else works on it as on any numpy array. The memory stays mapped until
    ``tfcs.shutdown()``: allocate buffers once and reuse them.

    When the job's ranks do not all share one host's memory (or a rank's /dev/shm cannot hold the
    array: that rank and rank 0 log why), every rank gets a private ``np.empty`` array instead, and
    the all-reduce works as usual.

    Args:
      shape: int or tuple of ints.
      dtype: a numpy dtype (or its name).
      timeout: seconds to wait for the other ranks (default: the group's rendezvous timeout).

    Returns:
      A writeable, C-contiguous numpy array of ``shape`` and ``dtype``.

    Raises:
      ConfigurationError: a negative dimension or a dtype that is not a number.
      CollectiveMismatchError: the ranks asked for different sizes.
      NotInitializedError: ``tfcs.init()`` has not been called.
      RendezvousError: a rank did not arrive before the deadline.
      CollectiveError: the process group failed earlier. After any of these errors the group is
        unusable, as after a failed collective.
    """
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ConfigurationError(f"shared_empty: dtype {dtype!r} is not a numpy dtype ({e})",
                                 fix="pass e.g. np.float32 or 'float32'") from None
    if (dt.kind not in "biufc" or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape)):
        raise ConfigurationError(f"shared_empty: shape {shape!r} / dtype {dt} is not an array of numbers",
                                 fix="pass a tuple of non-negative ints and a numeric dtype")
    return default_group().backend("grpc").shared_empty(tuple(int(d) for d in shape), dt, timeout)
