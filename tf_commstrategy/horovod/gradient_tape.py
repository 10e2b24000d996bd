"""Horovod's ``DistributedGradientTape``, and the gradient all-reduce it shares with ``DistributedOptimizer``.

``GradientReducer`` is Horovod's ``_make_allreduce_grads_fn``, with one difference in how the
gradients travel: Horovod issues one all-reduce per gradient and fuses them at run time (its tensor
fusion); here every gradient of a step goes to ONE ``grouped_allreduce`` (one fused transfer per
dtype), or one per group when ``groups`` asks for groups. Gradients of worker-local sources
(``register_local_source`` / ``register_local_var``) stay out of it and are divided by ``size()``
when ``scale_local_gradients`` is set, as in Horovod.

``DistributedGradientTape(tape)`` returns an object of a subclass of the tape's class with the same
class name, which shares the recorded operations of ``tape`` (as Horovod's does): wrap the tape after
the ``with`` block, or wrap a fresh ``tf.GradientTape()`` and record with it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, List, Optional, Sequence, Set

import tensorflow as tf

from ..errors import ConfigurationError
from .basics import global_process_set, size
from .compression import Compression
from .ops import Average, grouped_allreduce


def set_size(process_set) -> int:
    """The number of processes in ``process_set`` (the job's size for the global set).

    Args:
      process_set: a Horovod ``ProcessSet``.

    Returns:
      Its size; ``size()`` when the set does not know it.

    Raises:
      HorovodNotInitializedError: ``hvd.init()`` has not been called.
    """
    n = process_set.size() if callable(getattr(process_set, "size", None)) else None
    return size() if n is None else int(n)


def check_groups(num_groups, groups):
    """Horovod's ``num_groups`` / ``groups`` arguments as one ``groups`` value.

    Args:
      num_groups: deprecated number of groups (0: none).
      groups: None, a positive number of groups, or a list of lists of variables.

    Returns:
      None, an int > 0, or the list.

    Raises:
      ConfigurationError: ``groups`` is neither (a ValueError, as Horovod's).
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is None or isinstance(groups, list):
        return groups
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        return groups
    raise ConfigurationError(f"groups should be a non-negative integer or a list of list of tf.Variable, "
                             f"got {groups!r}",
                             fix="pass a number of groups > 0, a list of lists of variables, or None")


def split_list(items: Sequence, n: int) -> List[list]:
    """``items`` cut into ``n`` consecutive chunks of nearly equal length (Horovod's ``split_list``).

    Args:
      items: what to split.
      n: the number of chunks.

    Returns:
      ``n`` lists (some empty when there are fewer items than chunks).
    """
    d, r = divmod(len(items), n)
    return [list(items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)]) for i in range(n)]


class GradientReducer:
    """All-reduces the gradients of one step: ONE ``grouped_allreduce`` for all of them, or one per group.

    With ``op=Average`` the average is split around the sum as Horovod does: each rank's gradient is
    multiplied by ``1 / gradient_predivide_factor`` before the sum and the sum by
    ``gradient_predivide_factor / size()`` after it. With a single process nothing is reduced.

    Args:
      name: prefix of the name scope of the reduction.
      device_dense, device_sparse: passed on (the core places the transfer).
      compression: ``Compression.none`` or ``Compression.fp16``.
      sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
      op: ``Average`` or another Horovod reduction.
      gradient_predivide_factor: see above (``op=Average`` only).
      groups: None (one group), a number of groups (the gradients cut into that many consecutive
        groups), or lists of variables or of their ``ref()`` (each list one group; every other gradient a
        group of its own).
      process_set: the global process set.

    Raises:
      ConfigurationError: ``gradient_predivide_factor`` other than 1 with another op than ``Average``.
    """

    def __init__(self, name: str, device_dense='', device_sparse='', compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, groups=None,
                 process_set=global_process_set):
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ConfigurationError(f"gradient_predivide_factor={gradient_predivide_factor} not supported with "
                                     f"op != Average (got op={op!r})",
                                     fix="use op=hvd.Average or gradient_predivide_factor=1.0")
        self.name = name
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale = gradient_predivide_factor if op == Average else 1.0
        self.groups = groups
        self.process_set = process_set

    def _split(self, positions: List[int], variables: Sequence) -> List[List[int]]:
        """The positions of the gradients to reduce, cut into the groups that travel together."""
        if self.groups is None:
            return [positions]
        if isinstance(self.groups, int):
            return [g for g in split_list(positions, self.groups) if g]
        where = {}
        for k, group in enumerate(self.groups):
            for v in group:  # variables, or their refs
                where.setdefault(v.ref() if hasattr(v, "ref") else v, k)
        split: List[List[int]] = [[] for _ in self.groups]
        alone = []
        for i in positions:
            k = where.get(variables[i].ref()) if variables is not None else None
            (alone.append([i]) if k is None else split[k].append(i))
        return [g for g in split if g] + alone

    def __call__(self, grads: Sequence, variables: Optional[Sequence] = None, use_generic_names=False) -> list:
        """The reduced gradients, in order (None stays None).

        Args:
          grads: one step's gradients (tf.Tensor, tf.IndexedSlices or None), in the same order on every rank.
          variables: their variables (needed when ``groups`` is a list of lists).
          use_generic_names: name each group's collective ``grad_<k>`` (names are not used to match
            collectives here; accepted for Horovod's signature).

        Returns:
          The gradients, all-reduced over the process set.

        Raises:
          UnsupportedOperationError: an op or dtype the collectives do not take.
          CollectiveError: a subclass, from the collective.
        """
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if set_size(self.process_set) <= 1:
            return grads
        positions = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        with tf.name_scope(self.name + "_Allreduce"):
            for k, group in enumerate(self._split(positions, variables)):
                reduced = grouped_allreduce([grads[i] for i in group], device_dense=self.device_dense,
                                            device_sparse=self.device_sparse, compression=self.compression,
                                            op=self.op, prescale_factor=self.prescale,
                                            postscale_factor=self.postscale, process_set=self.process_set,
                                            name=f"grad_{k}" if use_generic_names else None,
                                            ignore_name_scope=use_generic_names)
                for i, r in zip(group, reduced):
                    out[i] = r
        return out


def _divided(grad, n: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n


def reduce_global(reduce: Callable, grads: Sequence, sources: Sequence, local_refs: Set, scale_local: bool,
                  process_set, use_generic_names=False) -> list:
    """Reduce the gradients of the global sources; leave (and with ``scale_local`` divide by the set's size)
    those of the local ones.

    Args:
      reduce: ``reduce(grads, sources, use_generic_names) -> grads`` (a ``GradientReducer``).
      grads: the gradients, in the order of ``sources``.
      sources: variables or tensors.
      local_refs: ``ref()`` of the worker-local sources.
      scale_local: divide local gradients by the process set's size (Horovod's ``scale_local_gradients``).
      process_set: the process set.
      use_generic_names: passed to ``reduce``.

    Returns:
      The gradients in the order of ``sources``.

    Raises:
      CollectiveError: a subclass, from the collective.
    """
    keys = [s.ref() for s in sources]
    shared = [i for i, k in enumerate(keys) if k not in local_refs]
    out = list(grads)
    reduced = reduce([grads[i] for i in shared], [sources[i] for i in shared], use_generic_names)
    for i, r in zip(shared, reduced):
        out[i] = r
    if scale_local and local_refs:
        n = float(set_size(process_set))
        for i, k in enumerate(keys):
            if k in local_refs and out[i] is not None:
                out[i] = _divided(out[i], n)
    return out


class _DistributedGradientTape:
    """The methods a ``DistributedGradientTape`` adds to the tape's class (see ``DistributedGradientTape``)."""

    def _hvd_setup(self, reducer: GradientReducer, process_set, scale_local_gradients: bool) -> None:
        self._hvd_reducer = reducer
        self._hvd_process_set = process_set
        self._hvd_scale_local = scale_local_gradients
        self._local_sources = set()

    def register_local_source(self, source):
        """Keep ``source``'s gradient worker-local: it is not all-reduced (divided by ``size()`` when
        ``scale_local_gradients`` is set).

        Args:
          source: a variable or tensor passed to ``gradient`` later.
        """
        self._local_sources.add(source.ref())

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient``, then every gradient of a global source all-reduced in one collective.

        Args:
          target: what to differentiate.
          sources: a variable or tensor, or a nested structure of them.
          output_gradients: as for ``tf.GradientTape.gradient``.
          use_generic_names: Horovod's argument (collectives are matched by order here).
          unconnected_gradients: as for ``tf.GradientTape.gradient`` (keyword: Horovod's fourth positional
            argument is ``use_generic_names``).

        Returns:
          The gradients, in the structure of ``sources``.

        Raises:
          CollectiveError: a subclass, from the collective (e.g. CollectiveMismatchError when ranks pass
            different sources).
        """
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = reduce_global(self._hvd_reducer, tf.nest.flatten(grads), flat_sources, self._local_sources,
                             self._hvd_scale_local, self._hvd_process_set, use_generic_names)
        return tf.nest.pack_sequence_as(sources, flat)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient``, split into the pairs of the local sources and those of the global ones.

        Args:
          target: what to differentiate.
          sources: a list of variables or tensors.
          output_gradients: as for ``gradient``.
          use_generic_names: as for ``gradient``.

        Returns:
          ``(local, global)``: two lists of ``(source, gradient)`` pairs, each in the order of ``sources``.
        """
        grads = self.gradient(target, sources, output_gradients=output_gradients,
                              use_generic_names=use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if s.ref() in self._local_sources else shared).append((s, g))
        return local, shared


@functools.lru_cache(maxsize=None)
def _tape_class(base: type) -> type:
    """A subclass of ``base`` with the same name that all-reduces in ``gradient``."""
    return type(base.__name__, (_DistributedGradientTape, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__})


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """A tape whose ``gradient`` all-reduces the gradients (default: averages them) over the processes.

    The returned tape is of a subclass of ``type(gradtape)`` with the same name and shares the
    operations ``gradtape`` recorded. Every gradient of one ``gradient`` call travels in ONE fused
    collective (``groups``: one per group). Works eagerly and inside ``tf.function``; every process must
    call ``gradient`` with the same sources in the same order.

    Args:
      gradtape: the ``tf.GradientTape`` that recorded (or will record) the computation.
      device_dense, device_sparse: accepted (the core places the transfer).
      compression: ``Compression.none`` or ``Compression.fp16``.
      sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
      op: the reduction (default ``Average``).
      gradient_predivide_factor: with ``Average``, divide by it before the sum and multiply by
        ``factor / size()`` after.
      num_groups: deprecated: ``groups``.
      groups: None, a number of groups, or a list of lists of variables.
      process_set: only the global process set.
      scale_local_gradients: divide the gradients of registered local sources by ``size()``.

    Returns:
      The distributed tape.

    Raises:
      ConfigurationError: bad ``groups``, or ``gradient_predivide_factor`` with another op than Average.
    """
    groups = check_groups(num_groups, groups)
    reducer = GradientReducer("DistributedGradientTape", device_dense, device_sparse, compression, sparse_as_dense,
                              op, gradient_predivide_factor, groups, process_set)
    base = type(gradtape)
    if issubclass(base, _DistributedGradientTape):  # wrapping again replaces the settings
        base = base.__mro__[2]
    cls = _tape_class(base)
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the recorded tape, persistence, watched variables
    tape._recording = False  # recording goes on (or ends) in gradtape's own context
    tape._hvd_setup(reducer, process_set, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """``DistributedGradientTape`` with the trainable weights of ``local_layers`` registered as local sources.

    Args:
      gradtape, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set, scale_local_gradients: as for ``DistributedGradientTape``.
      local_layers: a Keras layer or a list of them whose gradients stay worker-local.

    Returns:
      The distributed tape.

    Raises:
      ConfigurationError: an element of ``local_layers`` has no ``trainable_weights``, or bad ``groups``.
    """
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ConfigurationError("All local layers must be of tf.keras.layers.Layer type.",
                                 fix="pass Keras layers as local_layers")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
