"""TF tensors in, TF tensors out: the collective core called from a graph through a stateful
``tf.numpy_function``.

Why stateful: TF's automatic control dependencies run the stateful ops of a ``tf.function`` in program
order, so every rank issues its collectives in the same order (a stateless callback may be
reordered, and ranks would then disagree). The order is checked at run time by each collective's
sequence number and signature, never by trace-time counters: Keras traces its train function more
than once. Why ``numpy_function`` rather than ``py_function``: its arguments arrive as numpy views
of the tensors' memory, and results in 64-byte aligned arrays leave as tensors without a copy, where
``py_function`` makes an eager tensor of every argument and result, which costs a copy or an
allocation each.

Eagerly, the numpy work runs directly with no py_function in between.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from ..config import parse_compression
from ..core.reduce_ops import ReduceOp, check_dtype
from ..errors import (CollectiveError, ConfigurationError, NotInitializedError, TfcsError,
                      UnsupportedOperationError)
from ..process import default_group

HOST = "/device:CPU:0"


def check_not_xla(what: str) -> None:
    """Refuse to build a collective inside an XLA-compiled function.

    Args:
      what: the op's name, for the message.

    Raises:
      UnsupportedOperationError: called while tracing a ``jit_compile=True`` function.
    """
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise UnsupportedOperationError(
            f"{what} cannot run inside an XLA-compiled function (jit_compile=True): tf_commstrategy's "
            "collectives are Python calls (tf.numpy_function), which XLA cannot compile",
            fix="compile with jit_compile=False (the default); to keep XLA for the math, jit-compile only "
                "the forward/backward function and leave the gradient all-reduce outside it")


class _ErrorLog:
    """The tf_commstrategy errors raised inside graph callbacks: TF turns them into a generic
    ``tf.errors.UnknownError`` on the way out, so entry points (``unwrap_errors``) re-raise ours."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0
        self.last: Optional[TfcsError] = None

    def record(self, error: TfcsError) -> None:
        with self._lock:
            self.count += 1
            self.last = error


errors_seen = _ErrorLog()


@contextlib.contextmanager
def unwrap_errors():
    """Inside this block, a TF error caused by a tf_commstrategy error surfaces as that error.

    TensorFlow reports an exception raised inside a ``tf.function``'s collective as
    ``tf.errors.UnknownError`` with our message in its text. Here the original typed error
    (``PeerLostError``, ``CollectiveTimeoutError``, ...) is raised instead, chained from TF's
    (``raise ours from tf_error``). ``model.fit`` / ``evaluate`` / ``predict`` do this by
    themselves under ``CommStrategy``; use it around custom training loops.

    Raises:
      TfcsError: the collective error behind a TF error raised in the block.
    """
    mark = errors_seen.count
    try:
        yield
    except tf.errors.OpError as e:
        if errors_seen.count != mark and errors_seen.last is not None:
            raise errors_seen.last from e
        from .native_path import typed_error  # the compiled all-reduce reports through TF's error
        from .. import process
        group = process.default_group() if process.is_initialized() else None
        ours = typed_error(e, getattr(group, "workers", None))
        if ours is None:
            raise
        if group is not None:
            cause = group.failure()
            if cause is not None and type(ours) is CollectiveError:  # the op stopped because the group failed
                ours = cause
            elif not isinstance(ours, NotInitializedError):  # (a graph of a group shut down: not this one's)
                group.abort(ours)  # the group is unusable now, as after a failed Python collective
        raise ours from e


def host_view(t) -> np.ndarray:
    """A read-only numpy view of a host tensor's memory, without a copy (``Tensor.numpy()`` copies).

    TensorFlow's documented zero-copy route is ``np.asarray(memoryview(t))``; bfloat16, which the
    buffer protocol cannot describe, goes through the tensor's own array view, marked read-only.
    """
    try:
        return np.asarray(memoryview(t))
    except (TypeError, ValueError, BufferError):
        arr = np.asarray(t._numpy())  # pylint: disable=protected-access
        view = arr.view()
        view.flags.writeable = False
        return view


_outputs_share_memory: Optional[bool] = None
_shape_tensors: dict = {}


def _shape_tensor(shape):
    """The shape as a host int32 tensor (what Empty takes), made once per shape (not one constant op per call)."""
    key = tuple(int(d) for d in shape)
    t = _shape_tensors.get(key)
    if t is None:
        if len(_shape_tensors) > 4096:
            _shape_tensors.clear()
        t = _shape_tensors[key] = tf.constant(key, dtype=tf.int32, shape=[len(key)])
    return t


def new_host_tensor(shape, dtype: tf.DType):
    """An uninitialized host tensor and a writable numpy view of its memory, or None where TensorFlow
    does not expose it (verified once per process, on the first non-empty tensor; bfloat16, which the
    buffer protocol cannot describe, is never verified): a collective then writes its result straight
    into the tensor it returns, with no conversion copy afterwards."""
    global _outputs_share_memory
    if dtype == tf.bfloat16 or _outputs_share_memory is False:
        return None
    with tf.device(HOST):  # eagerly TF would place it on a GPU when there is one; _numpy() is then a copy
        t = tf.raw_ops.Empty(shape=_shape_tensor(shape), dtype=dtype, init=False)
    if "CPU" not in t.device.upper():
        return None
    view = t._numpy()  # pylint: disable=protected-access
    if not isinstance(view, np.ndarray) or not view.flags.writeable:
        return None
    if view.size == 0:
        return t, view
    if _outputs_share_memory is None:
        _outputs_share_memory = np.asarray(memoryview(t)).ctypes.data == view.ctypes.data
    return (t, view) if _outputs_share_memory else None


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an ``align``-byte boundary: TensorFlow takes a
    numpy result that is aligned as its tensor's memory, and copies one that is not."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _run_eager(fn: Callable, ts: Sequence[tf.Tensor], into: bool) -> list:
    """``run_numpy``'s eager work: ``fn`` on host views of ``ts``; returns its outputs (arrays or tensors).

    With ``into`` the outputs are fresh host tensors written through their numpy views, so they are
    returned with no copy; where TensorFlow exposes no such view they are numpy arrays instead.
    """
    ins = [host_view(t) for t in ts]
    if into:
        made = [new_host_tensor(t.shape, t.dtype) for t in ts]
        if all(m is not None for m in made):
            fn(ins, [m[1] for m in made])
            return [m[0] for m in made]
        outs = [np.empty(a.shape, a.dtype) for a in ins]
        fn(ins, outs)
        return outs
    return [np.asarray(o) for o in fn(ins)]


def _numpy_function_body(fn: Callable, into: bool) -> Callable:
    """The callback of ``run_numpy``'s ``tf.numpy_function``: ``fn`` on read-only views of its arguments.

    The arguments arrive as views of the tensors' memory, writable as TF hands them over; ``fn`` gets
    them read-only. With ``into`` the outputs are 64-byte aligned arrays, which become the result
    tensors with no copy. TF wraps what a callback raises, so a ``TfcsError`` is noted in
    ``errors_seen`` for ``unwrap_errors`` first.
    """
    def call(*arrays):
        try:
            ins = []
            for a in arrays:
                v = np.asarray(a).view()
                v.flags.writeable = False  # never written
                ins.append(v)
            if into:
                outs = [aligned_empty(a.shape, a.dtype) for a in ins]  # become the result tensors, no copy
                fn(ins, outs)
                return outs
            return [np.asarray(o) for o in fn(ins)]
        except TfcsError as e:
            errors_seen.record(e)
            raise
    return call


def run_numpy(fn: Callable[[List[np.ndarray]], List[np.ndarray]], tensors: Sequence[tf.Tensor],
              out_dtypes: Sequence[tf.DType], out_shapes: Sequence, name: str = "tfcs_collective",
              into: bool = False):
    """Run ``fn`` on the tensors' numpy values, eagerly or as one stateful numpy_function on the host.

    The inputs reach ``fn`` as read-only views of the tensors' memory (no copy).

    Args:
      fn: ``fn(list of numpy arrays) -> list of numpy arrays``; runs the collectives. With ``into``:
        ``fn(inputs, outputs)`` writes output i (same shape and dtype as input i) into ``outputs[i]``.
      tensors: its inputs.
      out_dtypes: the dtypes of its outputs.
      out_shapes: the static shapes to set on the outputs (None dimensions allowed).
      name: the op's name in the graph.
      into: outputs are shaped like the inputs and written in place into fresh tensors.

    Returns:
      A list of tensors, one per output.

    Raises:
      UnsupportedOperationError: inside an XLA-compiled function.
      TfcsError: a subclass, from ``fn`` (eagerly; inside a ``tf.function`` TF wraps it, see
        ``unwrap_errors``).
    """
    check_not_xla(name)
    if tf.executing_eagerly():
        ts = [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t) for t in tensors]  # e.g. a variable
        return [o if isinstance(o, tf.Tensor) else tf.convert_to_tensor(o, dtype=d)
                for o, d in zip(_run_eager(fn, ts, into), out_dtypes)]

    with tf.device(HOST):
        outs = tf.numpy_function(_numpy_function_body(fn, into), list(tensors), list(out_dtypes), stateful=True,
                                 name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return list(outs)


def _backend(name, arr=None):
    return default_group().resolve_backend(name, arr if arr is not None else np.empty(0))


def run_collective(call: Callable, backend: Optional[str], tensors: Sequence[tf.Tensor],
                   out_dtypes: Sequence[tf.DType], out_shapes: Sequence, name: str,
                   into: bool = False) -> List[tf.Tensor]:
    """``call(backend_object, arrays) -> arrays`` on the host (numpy, grpc), or on the GPU (cupy,
    nccl; see ``device_path``) when the call's backend is nccl on GPU tensors. With ``into`` (host
    path; outputs shaped like the inputs) ``call(backend_object, arrays, outputs)`` writes the results
    into ``outputs``, which become the returned tensors without a copy."""
    from .device_path import run_device, use_device_path
    if use_device_path(backend, tensors):
        nccl = default_group().backend("nccl")
        return run_device(lambda arrs: call(nccl, arrs), tensors, out_dtypes, out_shapes, name=name)
    if into:
        return run_numpy(lambda arrs, outs: call(_backend(backend, arrs[0]), arrs, outs), tensors, out_dtypes,
                         out_shapes, name=name, into=True)
    return run_numpy(lambda arrs: call(_backend(backend, arrs[0]), arrs), tensors, out_dtypes, out_shapes, name=name)


def _tensor(x):
    return tf.convert_to_tensor(x)


def accepts(x) -> bool:
    """True for TensorFlow's tensors and variables (the direct API hands them to this module)."""
    return type(x).__module__.startswith("tensorflow")


def allreduce(x, op="sum", *, backend: Optional[str] = None, timeout: Optional[float] = None,
              compression: Optional[str] = None):
    """``tfcs.allreduce`` for a tf.Tensor (eager or inside tf.function); returns a tensor.

    Args:
      x: a tensor (or anything ``tf.convert_to_tensor`` accepts).
      op: "sum" | "mean" | "min" | "max" | "prod" (or ``tf.distribute.ReduceOp``).
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for this call.
      compression: "none" | "fp16" | "bf16" (None: the job's); a compressed call takes the backend's
        path, not the compiled all-reduce.

    Returns:
      The reduced tensor, same shape and dtype.

    Raises:
      UnsupportedOperationError: a dtype/op combination is not supported, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    op = ReduceOp.parse(op)
    t = _tensor(x)
    check_dtype(t.dtype.as_numpy_dtype, op)
    comp = compression_of(compression)
    compiled = _compiled_allreduce([t], op, backend, timeout) if comp == "none" else None
    if compiled is not None:
        return compiled[0]
    out, = run_collective(lambda b, a: [b.allreduce(a[0], op, timeout, compression=comp)], backend, [t],
                          [t.dtype], [t.shape], name="tfcs_allreduce")
    return out


def compression_of(compression: Optional[str]) -> str:
    """A call's compression: its own, else the job's (``tfcs.init(compression=)``, ``TFCS_COMPRESSION``)."""
    return parse_compression(compression) if compression is not None else default_group().compression


def _compiled_allreduce(ts: List[tf.Tensor], op: ReduceOp, backend: Optional[str], timeout: Optional[float]):
    """SUM / MEAN of host float tensors through the group's compiled all-reduce, where a ``CommStrategy``
    or ``setup_compiled_allreduce`` has set it up (every rank decides alike: the same group, dtypes and
    devices); None where the Python path must run."""
    if op not in (ReduceOp.SUM, ReduceOp.MEAN) or backend not in (None, "auto", "grpc"):
        return None
    from .native_path import NativeAllReduce
    native = NativeAllReduce.ready(default_group())
    if native is None or not native.handles(ts):
        return None
    check_not_xla("the all-reduce")
    return native.allreduce(ts, op == ReduceOp.MEAN, timeout)


def setup_compiled_allreduce() -> bool:
    """Set up the default group's compiled all-reduce (shared-memory all-reduce of host float tensors, one
    op with no ``tf.numpy_function``), which the tensor all-reduces of this layer then take. A collective
    step: every rank calls it at the same point (``CommStrategy()`` does, and ``hvd.init``).

    Returns:
      Whether it runs (False where it cannot: ranks on several hosts, ``TFCS_NATIVE=0``, no compiler).

    Raises:
      ConfigurationError: ``TFCS_NATIVE=1`` and some rank cannot use it (the reason is named).
    """
    from .native_path import NativeAllReduce
    return NativeAllReduce.for_group(default_group()) is not None


def grouped_allreduce(xs: List, op="sum", *, backend: Optional[str] = None, timeout: Optional[float] = None,
                      compression: Optional[str] = None):
    """``tfcs.grouped_allreduce`` for tensors: one fused collective per dtype.

    Args:
      xs: tensors.
      op: the reduction.
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for each fused transfer.
      compression: as for ``allreduce``.

    Returns:
      The reduced tensors, in order.

    Raises:
      UnsupportedOperationError: a dtype/op combination is not supported, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    op = ReduceOp.parse(op)
    ts = [_tensor(x) for x in xs]
    for t in ts:
        check_dtype(t.dtype.as_numpy_dtype, op)
    comp = compression_of(compression)
    compiled = _compiled_allreduce(ts, op, backend, timeout) if comp == "none" else None
    if compiled is not None:
        return compiled
    return run_collective(lambda b, arrs: b.batch_allreduce(arrs, op, timeout, compression=comp), backend, ts,
                          [t.dtype for t in ts], [t.shape for t in ts], name="tfcs_grouped_allreduce")


def broadcast(x, root_rank: int = 0, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """``tfcs.broadcast`` for a tensor.

    Args:
      x: a tensor; its value matters on the root only.
      root_rank: the rank whose value everybody gets.
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for this call.

    Returns:
      Root's tensor.

    Raises:
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: the dtype is not supported, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    n = default_group().size
    if not 0 <= int(root_rank) < n:
        raise ConfigurationError(f"root_rank={root_rank} is not a rank of this job of {n}",
                                 rank=default_group().rank, fix=f"use a root in 0..{n - 1}")
    t = _tensor(x)
    check_dtype(t.dtype.as_numpy_dtype)
    out, = run_collective(lambda b, a: [b.broadcast(a[0], int(root_rank), timeout)], backend, [t], [t.dtype],
                          [t.shape], name="tfcs_broadcast")
    return out


def allgather(x, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """``tfcs.allgather`` for a tensor: every rank's tensor concatenated along axis 0.

    Args:
      x: a tensor; first dimensions may differ between ranks.
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for this call.

    Returns:
      The concatenation (first dimension unknown inside a ``tf.function``).

    Raises:
      UnsupportedOperationError: a dtype/op combination is not supported, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    t = _tensor(x)
    check_dtype(t.dtype.as_numpy_dtype)
    shape = tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else tf.TensorShape([None])
    out, = run_collective(lambda b, a: [b.allgather(a[0], timeout)], backend, [t], [t.dtype], [shape],
                          name="tfcs_allgather")
    return out


def reduce_scatter(x, op="sum", *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """``tfcs.reduce_scatter`` for a tensor: this rank's rows of the reduction.

    Args:
      x: a tensor, at least 1-D, same shape on every rank.
      op: the reduction.
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for this call.

    Returns:
      This rank's rows (``np.array_split`` rule) of the reduced tensor.

    Raises:
      UnsupportedOperationError: a dtype/op combination is not supported, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    op = ReduceOp.parse(op)
    t = _tensor(x)
    check_dtype(t.dtype.as_numpy_dtype, op)
    shape = tf.TensorShape([None]).concatenate(t.shape[1:])
    out, = run_collective(lambda b, a: [b.reduce_scatter(a[0], op, timeout)], backend, [t], [t.dtype],
                          [shape], name="tfcs_reduce_scatter")
    return out


def alltoall(x, splits=None, *, backend: Optional[str] = None, timeout: Optional[float] = None):
    """``tfcs.alltoall`` for a tensor: every rank's rows for this one, and how many came from each.

    Args:
      x: a tensor, at least 1-D; trailing dimensions equal on every rank.
      splits: rows for each rank (ints, an array or an integer tensor; None: an even split).
      backend: "grpc" | "nccl" | "auto" for this call only.
      timeout: deadline in seconds for this call.

    Returns:
      ``(received, received_splits)``: a tensor of ``x``'s dtype with the rows from every rank in rank
      order, and an int32 tensor of ``size()`` counts.

    Raises:
      UnsupportedOperationError: bad ``splits``, a dtype the backends do not move, or inside XLA.
      CollectiveError: a subclass, from the collective.
    """
    t = _tensor(x)
    check_dtype(t.dtype.as_numpy_dtype)
    shape = tf.TensorShape([None]).concatenate(t.shape[1:])
    n = default_group().size
    ins = [t] if splits is None else [t, tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64)]

    def call(b, arrs):
        received, counts = b.alltoall(arrs[0], None if len(arrs) == 1 else [int(c) for c in arrs[1]], timeout)
        return [received, np.asarray(counts, dtype=np.int32)]
    out, counts = run_collective(call, backend, ins, [t.dtype, tf.int32], [shape, tf.TensorShape([n])],
                                 name="tfcs_alltoall")
    return out, counts
