"""Horovod's TensorFlow collectives (``horovod.tensorflow``'s allreduce, allgather, broadcast, ...) on
tf_commstrategy's core, for ``tf.Tensor``, ``tf.Variable`` and ``tf.IndexedSlices``, eagerly and inside
``tf.function``.

How Horovod's semantics map onto the core:

* Reductions are Horovod's integers (``Average`` 0, ``Sum`` 1, ``Adasum`` 2, ``Min`` 3, ``Max`` 4,
  ``Product`` 5). ``prescale_factor`` multiplies each rank's input before the reduction and
  ``postscale_factor`` the result, in the tensor's dtype (float16 through float32; integers through
  float64, truncated toward zero, as Horovod's C++ casts). ``Average`` is Horovod's sum scaled by
  ``1 / size()`` afterwards: integer averages are truncated toward zero; for floating point tensors the
  core's mean does the division inside the collective.
* Every collective is one stateful ``tf.numpy_function`` of the TF layer (``tf/tensor_ops.py``);
  TensorFlow runs a ``tf.function``'s stateful ops in program order, so every rank issues its
  collectives in the same order, and the core checks each call's op, dtype and shape against the
  other ranks (``CollectiveMismatchError``). Horovod matches collectives by name instead: ``name`` and
  ``ignore_name_scope`` are accepted and unused. ``device_dense`` / ``device_sparse`` are accepted and
  unused too: the core takes the host path, or the nccl path for GPU tensors when that is the backend.
* Gradients are Horovod's: of an all-reduce the same all-reduce (op and scale factors); of an
  all-gather this rank's rows of the all-reduced (``Average``) gradient; of a broadcast the
  all-reduced (``Average``) gradient on the root and zeros elsewhere; of a reduce-scatter the
  all-gather of the gradient, times ``size()`` for ``Sum`` and times the scale factors.
* Grouped calls: ``grouped_allreduce`` and ``broadcast_`` move their tensors in one fused transfer per
  dtype; ``grouped_allgather`` and ``grouped_reducescatter`` run one collective per tensor.

Only the global process set exists (``basics.py``); Adasum is not implemented.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from .. import collectives as _collectives
from ..core.reduce_ops import ReduceOp, check_dtype
from ..errors import ConfigurationError, UnsupportedOperationError
from ..tf import tensor_ops
from .basics import (check_process_set, global_process_set, joined_group, local_rank, local_size, rank, size,
                     unsupported_process_set)
from .compression import Compression

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_CORE_OPS = {Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX, Product: ReduceOp.PROD}
_OP_FIX = "use op=hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product"


def handle_average_backwards_compatibility(op, average):
    """The reduction that ``op`` and the deprecated ``average`` ask for (Horovod's rule).

    Args:
      op: a reduction, or None.
      average: True (Average) / False (Sum) / None.

    Returns:
      ``op``; else ``Average`` or ``Sum`` from ``average`` (with a DeprecationWarning); else ``Average``.

    Raises:
      ConfigurationError: both given (a ValueError, as Horovod's).
    """
    if op is not None:
        if average is not None:
            raise ConfigurationError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank) -> bool:
    """Whether ``num_rank`` is a power of 2 (Horovod's check for Adasum)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _check_op(op, what: str, allowed) -> None:
    """Refuse Adasum and anything that is not one of ``allowed``.

    Raises:
      UnsupportedOperationError: Adasum, or a Horovod reduction ``what`` does not take.
      ConfigurationError: not a Horovod reduction.
    """
    if isinstance(op, (int, np.integer)) and int(op) == Adasum:
        raise UnsupportedOperationError(
            f"{what}: the Adasum reduction is not implemented in tf_commstrategy (its pairwise, projection-weighted "
            "combination of gradients is not an algorithm of the collective core)",
            fix="use op=hvd.Average (the usual choice for gradients) or hvd.Sum")
    if not isinstance(op, (int, np.integer)) or int(op) not in _OP_NAMES:
        raise ConfigurationError(f"{what}: op={op!r} is not a Horovod reduction", fix=_OP_FIX)
    if int(op) not in allowed:
        names = " and ".join(_OP_NAMES[o] for o in allowed)
        raise UnsupportedOperationError(f"{what} supports only {names}, got op={_OP_NAMES[int(op)]}",
                                        fix=f"use op=hvd.{_OP_NAMES[allowed[0]]}")


def check_root(root_rank, what: str) -> int:
    """``root_rank`` as an int, checked against the job's size.

    Raises:
      ConfigurationError: not an int, or not a rank of the job.
    """
    n = size()
    if isinstance(root_rank, (int, np.integer)) and not isinstance(root_rank, bool) and 0 <= root_rank < n:
        return int(root_rank)
    raise ConfigurationError(f"{what}: root_rank={root_rank!r} is not a rank of this job of {n}", rank=rank(),
                             fix=f"use an int in 0..{n - 1}")


def _check_global_id(process_set_id, what: str) -> None:
    """Refuse a process set id other than the global set's (0).

    Raises:
      UnsupportedOperationError: another id.
    """
    if process_set_id != 0:
        raise unsupported_process_set(what, f"process_set_id={process_set_id!r}")


# The core's collectives on tensors: every collective of this module goes through these four.

def _core_allreduce(tensors: List[tf.Tensor], op: ReduceOp, wire: Optional[str] = None) -> List[tf.Tensor]:
    if len(tensors) == 1:
        return [tensor_ops.allreduce(tensors[0], op, compression=wire)]
    return tensor_ops.grouped_allreduce(tensors, op, compression=wire)


def _core_allgather(tensor: tf.Tensor) -> tf.Tensor:
    return tensor_ops.allgather(tensor)


def _core_broadcast(tensors: List[tf.Tensor], root: int) -> List[tf.Tensor]:
    if len(tensors) == 1:
        return [tensor_ops.broadcast(tensors[0], root)]
    for t in tensors:
        check_dtype(t.dtype.as_numpy_dtype)
    return tensor_ops.run_collective(lambda b, arrs: b.batch_broadcast(arrs, root, None), None, tensors,
                                     [t.dtype for t in tensors], [t.shape for t in tensors],
                                     name="hvd_grouped_broadcast")


def _core_reduce_scatter(tensor: tf.Tensor, op: ReduceOp) -> tf.Tensor:
    return tensor_ops.reduce_scatter(tensor, op)


def _scale(t: tf.Tensor, factor: float) -> tf.Tensor:
    """``t * factor`` in ``t``'s dtype as Horovod scales: 16-bit floats through float32, integers through
    float64 and truncated toward zero."""
    if factor == 1.0:
        return t
    if t.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(t, tf.float32) * factor, t.dtype)
    if t.dtype.is_floating:
        return t * tf.constant(factor, t.dtype)
    return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)


def _like(dy, y: tf.Tensor) -> tf.Tensor:
    """An upstream gradient as a dense tensor of ``y``'s dtype (zeros where TensorFlow passes None)."""
    if dy is None:
        return tf.zeros_like(y)
    dy = tf.convert_to_tensor(dy)
    return dy if dy.dtype == y.dtype else tf.cast(dy, y.dtype)


def _with_gradient(forward: Callable, backward: Callable, xs: List[tf.Tensor]) -> List[tf.Tensor]:
    """``forward(xs)`` with Horovod's gradient: ``backward(xs, positions, dys)`` returns the gradients of
    the floating-point inputs at ``positions`` from their outputs' upstream gradients ``dys``."""
    floating = [i for i, x in enumerate(xs) if x.dtype.is_floating]
    if not floating:
        return forward(xs)

    @tf.custom_gradient
    def op(*args):
        ys = forward(list(args))

        def grad(*dys):
            gs = backward(list(args), floating, [_like(dys[i], ys[i]) for i in floating])
            out = [None] * len(args)
            for i, g in zip(floating, gs):
                out[i] = g
            return out
        return ys, grad
    return list(op(*xs))


def _reduce(ts: List[tf.Tensor], op: int, pre: float, post: float, wire: Optional[str] = None) -> List[tf.Tensor]:
    """Horovod's all-reduce of ``ts`` (no gradient): prescale, reduce (``wire``: the core's compression;
    None: the job's), postscale."""
    ts = [_scale(t, pre) for t in ts]
    if op != Average:
        return [_scale(o, post) for o in _core_allreduce(ts, _CORE_OPS[op], wire)]
    if all(t.dtype.is_floating for t in ts):
        return [_scale(o, post) for o in _core_allreduce(ts, ReduceOp.MEAN, wire)]
    return [_scale(o, post / size()) for o in _core_allreduce(ts, ReduceOp.SUM, wire)]


def _allreduce(ts: List[tf.Tensor], op: int, pre: float, post: float, wire: Optional[str] = None) -> List[tf.Tensor]:
    """``_reduce`` whose gradient is the same all-reduce of the upstream gradients."""
    return _with_gradient(lambda xs: _reduce(xs, op, pre, post, wire),
                          lambda xs, where, dys: _allreduce(dys, op, pre, post, wire), ts)


def _compressed_allreduce(ts: List[tf.Tensor], compression, op: int, pre: float, post: float) -> List[tf.Tensor]:
    """``_allreduce`` under a Horovod compressor: the built-in ones name the core's compression
    (``Compressor.wire``), which narrows on the wire itself (partial sums travel narrow too); another
    compressor's ``compress`` / ``decompress`` run around the collective."""
    if compression.wire is not None:
        return _allreduce(ts, op, pre, post, compression.wire)
    pairs = [compression.compress(t) for t in ts]
    reduced = _allreduce([p[0] for p in pairs], op, pre, post)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def _allgather(t: tf.Tensor) -> tf.Tensor:
    """The core's all-gather; gradient: this rank's rows of the averaged upstream gradient."""
    def backward(xs, where, dys):
        g = _allreduce(dys, Average, 1.0, 1.0)[0]
        x = xs[0]
        rows = tf.size(x) if x.shape.rank == 0 else tf.shape(x)[0]  # the core gathers a scalar as one row
        counts = _core_allgather(tf.reshape(rows, [1]))
        start = tf.reduce_sum(counts[:rank()])
        return [tf.reshape(tf.gather(g, tf.range(start, start + rows)), tf.shape(x))]
    return _with_gradient(lambda xs: [_core_allgather(xs[0])], backward, [t])[0]


def _broadcast(t: tf.Tensor, root: int) -> tf.Tensor:
    """The core's broadcast; gradient: the averaged upstream gradient on the root, zeros elsewhere."""
    def backward(xs, where, dys):
        g = _allreduce(dys, Average, 1.0, 1.0)[0]
        return [g if rank() == root else g * 0]
    return _with_gradient(lambda xs: _core_broadcast(xs, root), backward, [t])[0]


def _reducescatter(t: tf.Tensor, op: int, pre: float, post: float) -> tf.Tensor:
    """Horovod's reduce-scatter (Sum or Average); gradient: the all-gathered upstream gradient, times
    ``size()`` for Sum and times the scale factors."""
    def forward(xs):
        x = _scale(xs[0], pre)
        if op == Average and x.dtype.is_floating:
            return [_scale(_core_reduce_scatter(x, ReduceOp.MEAN), post)]
        return [_scale(_core_reduce_scatter(x, ReduceOp.SUM), post / size() if op == Average else post)]

    def backward(xs, where, dys):
        g = dys[0]
        for factor in (size() if op == Sum else 1, pre, post):
            if factor != 1:
                g = g * tf.cast(factor, g.dtype)
        return [_allgather(g)]
    return _with_gradient(forward, backward, [t])[0]


_ALL_OPS = (Average, Sum, Min, Max, Product)


def _begin(process_set, what: str, op=None, allowed=_ALL_OPS) -> None:
    """Check a call's arguments (they need no job), then that the job is joined."""
    check_process_set(process_set, what)
    if op is not None:
        _check_op(op, what, allowed)
    joined_group()


def _allreduce_slices(slices: Sequence[tf.IndexedSlices], op: int, pre: float, post: float, what: str):
    """All-reduce of ``tf.IndexedSlices`` as Horovod does it: all-gather the values, then the indices;
    Average divides the gathered values by ``size()``."""
    if op not in (Sum, Average):
        raise UnsupportedOperationError(f"{what}: Only Sum and Average ops are supported with tf.IndexedSlices",
                                        fix="use op=hvd.Average or hvd.Sum, or densify the gradient")
    if pre != 1.0 or post != 1.0:
        raise UnsupportedOperationError(f"{what}: Pre/postscale_factor are not supported with tf.IndexedSlices",
                                        fix="scale the values yourself, or densify the gradient")
    values = [_allgather(s.values) for s in slices]
    indices = [_core_allgather(s.indices) for s in slices]
    if op == Average:
        values = [v / tf.cast(size(), v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices)]


def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` over every process (default: average); every process gets the result.

    A ``tf.IndexedSlices`` is gathered instead (values and indices), as Horovod does. Also takes
    ``horovod.tensorflow.keras``'s form ``allreduce(value, name)``: a string as the second argument is
    the name.

    Args:
      tensor: a tf.Tensor, tf.Variable, tf.IndexedSlices or anything ``tf.convert_to_tensor`` takes;
        same shape and dtype on every process.
      average: deprecated: True for Average, False for Sum (give ``op`` instead).
      device_dense, device_sparse: accepted, unused (the core places the transfer).
      compression: ``Compression.none`` or ``Compression.fp16``.
      op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
      prescale_factor, postscale_factor: multiply the input before / the result after the reduction.
      name, ignore_name_scope: accepted, unused (collectives are matched by order).
      process_set: only the global process set.

    Returns:
      A tensor of ``tensor``'s shape and dtype (a tf.IndexedSlices for one).

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: Adasum, another process set, a dtype / op the core does not take, or
        tf.IndexedSlices with another op than Sum / Average or with scale factors.
      ConfigurationError: ``op`` and ``average`` both given, or an unknown op.
      CollectiveError: a subclass, from the collective (e.g. CollectiveMismatchError).
    """
    if isinstance(average, str) and name is None:  # horovod.tensorflow.keras: allreduce(value, name)
        name, average = average, None
    op = handle_average_backwards_compatibility(op, average)
    _begin(process_set, "allreduce", op)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_slices([tensor], op, prescale_factor, postscale_factor, "allreduce")[0]
    return _compressed_allreduce([tf.convert_to_tensor(tensor)], compression, op, prescale_factor,
                                 postscale_factor)[0]


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """``allreduce`` of many tensors: the dense ones in one fused transfer per dtype, the
    tf.IndexedSlices gathered first.

    Args:
      tensors: a sequence of tf.Tensor, tf.Variable or tf.IndexedSlices, in the same order with the same
        shapes and dtypes on every process.
      average, device_dense, device_sparse, compression, op, prescale_factor, postscale_factor,
        process_set, ignore_name_scope, name: as for ``allreduce``.

    Returns:
      The reduced tensors, in order (``tensors`` itself when empty).

    Raises:
      Same as ``allreduce``.
    """
    if not tensors:
        return tensors
    op = handle_average_backwards_compatibility(op, average)
    _begin(process_set, "grouped_allreduce", op)
    out = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        gathered = _allreduce_slices([tensors[i] for i in sparse], op, prescale_factor, postscale_factor,
                                     "grouped_allreduce")
        for i, s in zip(sparse, gathered):
            out[i] = s
    if dense:
        reduced = _compressed_allreduce([tf.convert_to_tensor(tensors[i]) for i in dense], compression, op,
                                        prescale_factor, postscale_factor)
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every process's ``tensor`` along the first dimension, in rank order.

    Args:
      tensor: a tf.Tensor or tf.Variable; first dimensions may differ between processes, the others
        and the dtype must match.
      name, ignore_name_scope: accepted, unused.
      process_set: only the global process set.

    Returns:
      The concatenation (first dimension unknown inside a ``tf.function``).

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: another process set, or a dtype the core does not take.
      CollectiveError: a subclass, from the collective.
    """
    _begin(process_set, "allgather")
    return _allgather(tf.convert_to_tensor(tensor))


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``allgather`` of each tensor, in order (one collective per tensor).

    Args:
      tensors: tf.Tensors or tf.Variables.
      name, ignore_name_scope: accepted, unused.
      process_set: only the global process set.

    Returns:
      The concatenations, in order.

    Raises:
      Same as ``allgather``.
    """
    _begin(process_set, "grouped_allgather")
    return [_allgather(tf.convert_to_tensor(t)) for t in tensors]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Root's ``tensor`` on every process.

    Args:
      tensor: a tf.Tensor or tf.Variable; same shape and dtype on every process.
      root_rank: the rank whose value everybody gets.
      name, ignore_name_scope: accepted, unused.
      process_set: only the global process set.

    Returns:
      Root's tensor.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: another process set, or a dtype the core does not take.
      CollectiveError: a subclass, from the collective.
    """
    _begin(process_set, "broadcast")
    return _broadcast(tf.convert_to_tensor(tensor), check_root(root_rank, "broadcast"))


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign root's values to ``variables`` on every process (one fused transfer per dtype).

    The variables end up holding root's values; the values travel through one temporary tensor each.

    Args:
      variables: tf.Variables (or Keras 3 variables), in the same order with the same shapes and dtypes on
        every process.
      root_rank: the rank whose values everybody gets.
      name: accepted, unused.
      process_set: only the global process set.

    Returns:
      The variables' new values.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: another process set, something that is not a variable, or a dtype the
        core does not take.
      CollectiveError: a subclass, from the collective.
    """
    _begin(process_set, "broadcast_")
    variables = list(variables)
    root = check_root(root_rank, "broadcast_")
    for v in variables:
        if not callable(getattr(v, "assign", None)):
            raise UnsupportedOperationError(f"broadcast_ assigns to variables, got a {type(v).__name__}",
                                            fix="pass tf.Variables, or use hvd.broadcast for tensors")
    if not variables:
        return []
    values = _core_broadcast([tf.convert_to_tensor(v) for v in variables], root)
    assigned = [v.assign(x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return [_read(v) for v in variables]
    with tf.control_dependencies([a for a in assigned if a is not None]):
        return [_read(v) for v in variables]


def _read(v) -> tf.Tensor:
    """A variable's value: ``read_value()`` of a tf.Variable; a Keras 3 variable, which has none, converts."""
    read = getattr(v, "read_value", None)
    return read() if callable(read) else tf.convert_to_tensor(v)


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over every process, then give each process its rows of the result: the first
    ``len % size`` ranks one row more (``np.array_split``'s rule, as Horovod).

    Args:
      tensor: a tf.Tensor or tf.Variable of rank >= 1; same shape and dtype on every process.
      device_dense: accepted, unused.
      compression: ``Compression.none`` or ``Compression.fp16``.
      op: ``Average`` (default) or ``Sum``.
      name, ignore_name_scope: accepted, unused.
      process_set: only the global process set.
      prescale_factor, postscale_factor: multiply the input before / the result after the reduction.

    Returns:
      This process's rows of the reduction (first dimension unknown inside a ``tf.function``).

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: another op, another process set, a scalar, or a dtype the core does
        not take.
      ConfigurationError: an unknown op.
      CollectiveError: a subclass, from the collective.
    """
    _begin(process_set, "reducescatter", op, allowed=(Average, Sum))
    t = tf.convert_to_tensor(tensor)
    if t.shape.rank == 0:
        raise UnsupportedOperationError("reducescatter got a scalar; it splits the first dimension",
                                        rank=rank(), fix="pass a tensor of rank >= 1")
    compressed, ctx = compression.compress(t)
    return compression.decompress(_reducescatter(compressed, op, prescale_factor, postscale_factor), ctx)


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of each tensor, in order (one collective per tensor).

    Args:
      tensors: tf.Tensors or tf.Variables of rank >= 1.
      device_dense, compression, op, process_set, prescale_factor, postscale_factor: as for
        ``reducescatter``.

    Returns:
      This process's rows of each reduction, in order (``tensors`` itself when empty).

    Raises:
      Same as ``reducescatter``.
    """
    if not tensors:
        return tensors
    _begin(process_set, "grouped_reducescatter", op, allowed=(Average, Sum))
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor) for t in tensors]


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send process d the ``splits[d]`` rows of ``tensor`` that follow the rows for the processes before it;
    receive every process's rows for this one, concatenated in rank order.

    Args:
      tensor: at least 1-D; trailing dimensions and dtype equal on every process, the first may differ.
      splits: rows for each process in rank order (ints or an integer tensor adding up to the rows);
        None: the rows divided evenly (they must divide).
      name, ignore_name_scope: accepted, unused (collectives are matched by order).
      process_set: only the global process set.

    Returns:
      The received tensor; with ``splits`` given, ``(received, received_splits)`` (int32), as Horovod.
      Its gradient is the all-to-all of the upstream gradient back, with the received splits.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: another process set, a scalar, or bad ``splits``.
      CollectiveError: a subclass, from the collective.
    """
    _begin(process_set, "alltoall")
    t = tf.convert_to_tensor(tensor)
    received, received_splits = _alltoall(t, splits)
    return (received, received_splits) if splits is not None else received


def _alltoall(t: tf.Tensor, splits):
    """The core's all-to-all; gradient: the upstream gradient sent back with the received splits."""
    if not t.dtype.is_floating:
        return tensor_ops.alltoall(t, splits)

    @tf.custom_gradient
    def op(x):
        received, received_splits = tensor_ops.alltoall(x, splits)

        def grad(dy, _dsplits=None):
            back, _ = tensor_ops.alltoall(_like(dy, received), received_splits)
            return tf.reshape(back, tf.shape(x))
        return (received, received_splits), grad
    return op(t)


def _host_call(fn: Callable[[], int], name: str, stateful: bool = True) -> tf.Tensor:
    """``fn()`` as an int32 scalar: at once eagerly, when the op runs inside a ``tf.function`` (one
    stateful op, in program order with the collectives)."""
    if tf.executing_eagerly():
        return tf.constant(fn(), tf.int32)
    if stateful:
        return tensor_ops.run_numpy(lambda arrs: [np.asarray(fn(), np.int32)], [], [tf.int32], [[]], name=name)[0]
    out = tf.numpy_function(lambda: np.asarray(fn(), np.int32), [], tf.int32, stateful=False, name=name)
    out.set_shape([])
    return out


def barrier(process_set=global_process_set):
    """Return once every process has called ``barrier`` (inside a ``tf.function``: once the op runs).

    Args:
      process_set: only the global process set.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: another process set.
      CollectiveError: a subclass, from the barrier.
    """
    _begin(process_set, "barrier")
    _host_call(lambda: _collectives.barrier() or 0, "hvd_barrier")


_joins: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # process group -> join calls so far


def _join_now() -> int:
    """Count this rank in at the coordinator (the count it gets says who came last), then learn the
    last rank from every rank in one all-reduce, which also waits for all of them."""
    g = joined_group()
    if g.size == 1:
        return 0
    k = _joins.get(g, 0)
    _joins[g] = k + 1
    arrived = g.store.add(f"horovod/join/{k}", 1)
    last = _collectives.allreduce(np.array([g.rank if arrived == g.size else -1], np.int64), op="max")
    return int(last[0])


def join():
    """Wait until every process has called ``join``; returns the rank that called it last.

    Unlike Horovod's, a process that has joined does not take part in the collectives of the others:
    every process must make the same collectives before its ``join`` (a process still all-reducing
    while another waits in ``join`` gets a ``CollectiveMismatchError``), and ``join`` waits at most the
    collective deadline (``TFCS_TIMEOUT``).

    Returns:
      An int32 scalar tensor: the last rank to join.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      CollectiveError: a subclass (a mismatch, the deadline, a lost peer).
    """
    joined_group()
    return _host_call(_join_now, "hvd_join")


def size_op(process_set_id=0, name=None):
    """``size()`` as an int32 scalar tensor, read when the op runs.

    Raises:
      UnsupportedOperationError: a process set other than the global one (id 0).
    """
    _check_global_id(process_set_id, "size_op")
    return _host_call(size, name or "hvd_size", stateful=False)


def local_size_op(name=None):
    """``local_size()`` as an int32 scalar tensor, read when the op runs."""
    return _host_call(local_size, name or "hvd_local_size", stateful=False)


def rank_op(name=None):
    """``rank()`` as an int32 scalar tensor, read when the op runs."""
    return _host_call(rank, name or "hvd_rank", stateful=False)


def local_rank_op(name=None):
    """``local_rank()`` as an int32 scalar tensor, read when the op runs."""
    return _host_call(local_rank, name or "hvd_local_rank", stateful=False)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this process is in the process set (always, for the global set), as an int32 scalar tensor.

    Raises:
      UnsupportedOperationError: a process set other than the global one (id 0).
    """
    _check_global_id(process_set_id, "process_set_included_op")
    return _host_call(lambda: 1 if joined_group() else 0, name or "hvd_process_set_included", stateful=False)
