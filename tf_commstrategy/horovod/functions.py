"""Horovod's helpers over the collectives: broadcast a model's variables, broadcast or gather any
picklable Python object.

Objects travel pickled (cloudpickle when it is installed, as Horovod uses, else the standard
``pickle``) through the direct API on numpy arrays: their length first, then the bytes. They run
eagerly; inside a ``tf.function`` they would run once, while tracing, so they refuse to.
"""

from __future__ import annotations

import pickle

import numpy as np
import tensorflow as tf

from .. import collectives as _collectives
from ..errors import UnsupportedOperationError
from .basics import check_process_set, global_process_set, joined_group
from .ops import broadcast_, check_root

try:  # lambdas, closures and classes of __main__ pickle by value with cloudpickle
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle


def _begin(process_set, what: str):
    """Check the call (another process set, inside a tf.function), then that the job is joined."""
    check_process_set(process_set, what)
    if not tf.executing_eagerly():
        raise UnsupportedOperationError(
            f"{what} runs eagerly: inside a tf.function it would run once, while the function is traced",
            fix=f"call hvd.{what} outside tf.function")
    return joined_group()


def _as_bytes(obj) -> np.ndarray:
    return np.frombuffer(bytearray(_pickler.dumps(obj)), np.uint8)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign root's values to ``variables`` on every process: one fused transfer per device and dtype.

    Args:
      variables: tf.Variables (or Keras 3 variables), in the same order with the same shapes and dtypes on
        every process.
      root_rank: the rank whose values everybody gets.
      process_set: only the global process set.
      inplace: accepted; the variables are assigned root's values either way.

    Returns:
      None eagerly; inside a ``tf.function`` an op that groups the assignments.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: another process set, or a dtype the core does not take.
      CollectiveError: a subclass, from the collective.
    """
    by_device = {}
    for v in variables:
        by_device.setdefault(getattr(v, "device", ""), []).append(v)  # a Keras 3 variable names no device
    done = [broadcast_(vs, root_rank, process_set=process_set) for vs in by_device.values()]
    if tf.executing_eagerly():
        return None
    return tf.group(*[x for values in done for x in values])


def broadcast_global_variables(root_rank):
    """Broadcast TensorFlow 1's global variables (graph mode only, as Horovod).

    Args:
      root_rank: the rank whose values everybody gets.

    Returns:
      An op that groups the assignments.

    Raises:
      UnsupportedOperationError: called eagerly (a RuntimeError, as Horovod's).
    """
    if tf.executing_eagerly():
        raise UnsupportedOperationError(
            "hvd.broadcast_global_variables() does not support eager execution",
            fix="use `hvd.broadcast_variables(<model/optimizer variables>)` instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Root's ``obj`` on every process, pickled.

    Args:
      obj: any picklable object (its value matters on the root only).
      root_rank: the rank whose object everybody gets.
      session: TensorFlow 1's session; ignored.
      name: accepted, unused.
      process_set: only the global process set.

    Returns:
      ``obj`` itself on the root; an unpickled copy of it elsewhere.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      ConfigurationError: ``root_rank`` is not a rank of the job.
      UnsupportedOperationError: another process set, or called inside a ``tf.function``.
      CollectiveError: a subclass, from the collectives.
    """
    g = _begin(process_set, "broadcast_object")
    root = check_root(root_rank, "broadcast_object")
    payload = _as_bytes(obj) if g.rank == root else None
    length = np.array([payload.size if payload is not None else 0], np.int64)
    length = _collectives.broadcast(length, root)
    data = _collectives.broadcast(payload if payload is not None else np.empty(int(length[0]), np.uint8), root)
    if g.rank == root:
        return obj
    return pickle.loads(data.tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``f(obj)`` that returns ``broadcast_object(obj, root_rank, ...)``.

    Args:
      root_rank, session, name, process_set: as for ``broadcast_object``.

    Returns:
      The function.
    """
    def _bcast(obj):
        return broadcast_object(obj, root_rank, session=session, name=name, process_set=process_set)
    return _bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every process's ``obj``, pickled and gathered, in rank order.

    Args:
      obj: any picklable object.
      session: TensorFlow 1's session; ignored.
      name: accepted, unused.
      process_set: only the global process set.

    Returns:
      A list with one object per process (unpickled copies, this process's too).

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
      UnsupportedOperationError: another process set, or called inside a ``tf.function``.
      CollectiveError: a subclass, from the collectives.
    """
    _begin(process_set, "allgather_object")
    payload = _as_bytes(obj)
    lengths = _collectives.allgather(np.array([payload.size], np.int64))
    data = _collectives.allgather(payload)
    ends = np.cumsum(lengths)
    return [pickle.loads(data[end - n:end].tobytes()) for n, end in zip(lengths, ends)]
