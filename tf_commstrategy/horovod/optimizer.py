"""Horovod's Keras ``DistributedOptimizer`` and ``load_model``, for tf_keras optimizers, without a strategy.

As in Horovod, ``DistributedOptimizer(opt)`` builds a subclass of ``type(opt)`` with the same class
name and returns ``subclass.from_config(opt.get_config())``: a new optimizer with the same settings
(the state of ``opt`` is not carried over). The subclass all-reduces the gradients where Keras
computes them: ``compute_gradients`` (tf_keras's current optimizers; ``model.fit`` calls it through
``minimize``), ``_compute_gradients`` and ``get_gradients`` (the legacy ``tf_keras.optimizers.legacy.*``).
Every gradient of a step travels in ONE ``grouped_allreduce`` (``GradientReducer``); Horovod sends one
all-reduce per gradient and fuses them at run time. A gradient passed straight to ``apply_gradients``
is not reduced (as in Horovod): custom loops use ``DistributedGradientTape``.

The subclass carries the names under which Keras exports the wrapped class, so ``get_config``,
``tf_keras.optimizers.serialize`` and saved models name the plain optimizer ("Adam", module
``keras.optimizers``): a checkpoint or saved model loads without this package.

``backward_passes_per_step=N`` sums the gradients of N steps locally (in variables of the wrapper,
not of the optimizer, so not in checkpoints) and all-reduces and applies them at every N-th step;
the other steps only count ``iterations``, as Horovod's ``LocalGradientAggregationHelperEager``.

Each process is one replica (Horovod's model: every process reads its own shard of the data). Under a
``tf.distribute`` strategy with several replicas the strategy would reduce the gradients a second
time, so that is refused; with ``tf_commstrategy.CommStrategy`` use the plain optimizer instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional

import tensorflow as tf
import tf_keras

from ..errors import ConfigurationError, UnsupportedOperationError
from .basics import global_process_set
from .compression import Compression
from .gradient_tape import GradientReducer, check_groups, reduce_global
from .ops import Average, Sum

_KERAS3_FIX = ("use tf_keras (set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported, so that tf.keras is tf_keras, "
               "or import tf_keras), or train the Keras 3 model with the plain optimizer under "
               "tf_commstrategy.CommStrategy()")


class CallableList(list):
    """A list of variables that can also be called: both ``opt.variables`` and ``opt.variables()`` work."""

    def __call__(self):
        return self


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What ``DistributedOptimizer`` was asked for; shared by every optimizer of one wrapped class."""

    name: Optional[str]
    device_dense: str
    device_sparse: str
    compression: object
    sparse_as_dense: bool
    gradient_predivide_factor: float
    op: int
    backward_passes_per_step: int
    average_aggregated_gradients: bool
    groups: object
    process_set: object
    scale_local_gradients: bool


def _check_no_replica_strategy() -> None:
    """Refuse a strategy with several replicas in sync: it would reduce the gradients a second time.

    Raises:
      UnsupportedOperationError: under such a strategy.
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        raise UnsupportedOperationError(
            f"hvd.DistributedOptimizer averages gradients over the processes itself, and "
            f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas would reduce them again",
            fix="build and compile the model without a strategy (one process per device, as with Horovod), or "
                "use the plain optimizer under tf_commstrategy.CommStrategy()")


class _LocalAggregation:
    """Horovod's ``backward_passes_per_step``: sums N steps' gradients, then all-reduces and applies once.

    ``compute`` adds the step's gradients to one accumulator per variable and counts the pass; at the
    N-th pass it returns the all-reduced sums (divided by N with ``average``) and zeroes the
    accumulators, on the other passes the local sums. ``apply`` applies at the N-th pass only (the
    counter is back at 0 then) and otherwise only counts ``iterations``. Both run eagerly and inside
    ``tf.function`` (``tf.cond`` on the counter, the same on every rank).

    Args:
      passes: N (> 1).
      average: divide the sums by N.
      sparse_as_dense: accumulate ``tf.IndexedSlices`` as dense tensors.
      reduce: ``reduce(grads, variables) -> grads``, the all-reduce of the optimizer.
    """

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, reduce: Callable):
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.reduce = reduce
        self.counter: Optional[tf.Variable] = None
        self.sums: Dict = {}

    def _build(self, grads: List, variables: List) -> None:
        with tf.init_scope():  # created once, outside any tf.function being traced
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvd_backward_passes")
            for g, v in zip(grads, variables):
                if g is not None and v.ref() not in self.sums:
                    self.sums[v.ref()] = tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False,
                                                     name="hvd_aggregated_gradient")

    def compute(self, grads, variables) -> list:
        """Add this pass's gradients; the all-reduced sums at the N-th pass, else the local sums.

        Args:
          grads: this pass's gradients (None for variables without one).
          variables: their variables.

        Returns:
          The gradients to hand to ``apply_gradients``, in order.

        Raises:
          UnsupportedOperationError: a ``tf.IndexedSlices`` gradient without ``sparse_as_dense``.
        """
        grads, variables = list(grads), list(variables)
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise UnsupportedOperationError(
                        "IndexedSlices are not supported when `backward_passes_per_step` > 1 and `sparse_as_dense` "
                        "is False", fix="pass sparse_as_dense=True to DistributedOptimizer")
                grads[i] = tf.convert_to_tensor(g)
        self._build(grads, variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        sums = []
        for i in present:
            acc = self.sums[variables[i].ref()]
            acc.assign_add(grads[i])
            sums.append(acc.read_value())
        self.counter.assign_add(1)
        chosen = [variables[i] for i in present]

        def reduce_and_clear():
            reduced = self.reduce(sums, chosen)
            if self.average:
                reduced = [r / tf.cast(self.passes, r.dtype) for r in reduced]
            self.counter.assign(0)
            for i in present:
                acc = self.sums[variables[i].ref()]
                acc.assign(tf.zeros_like(acc))
            return reduced

        result = tf.cond(tf.equal(self.counter, self.passes), reduce_and_clear, lambda: sums) if present else []
        out = list(grads)
        for i, r in zip(present, result):
            out[i] = r
        return out

    def apply(self, optimizer, apply_fn: Callable):
        """Run ``apply_fn`` (the optimizer's own ``apply_gradients``) at the N-th pass; else count the step.

        Args:
          optimizer: the optimizer (its ``iterations`` counts every pass, as in Horovod).
          apply_fn: applies the gradients.

        Returns:
          ``iterations`` after the step, as a tensor.
        """
        def apply():
            apply_fn()
            return tf.identity(optimizer.iterations)

        def skip():
            optimizer.iterations.assign_add(1)
            return tf.identity(optimizer.iterations)

        if self.counter is None:  # apply_gradients before any computed gradient: nothing aggregated
            return apply()
        return tf.cond(tf.equal(self.counter, 0), apply, skip)


class _State:
    """An optimizer's all-reduce state (a plain object: Keras's attribute tracking leaves it alone)."""

    def __init__(self, settings: _Settings, default_name: str, reduce_now: Callable):
        self.settings = settings
        self.reducer = GradientReducer(settings.name or default_name, settings.device_dense, settings.device_sparse,
                                       settings.compression, settings.sparse_as_dense, settings.op,
                                       settings.gradient_predivide_factor, settings.groups, settings.process_set)
        self.local_refs = set()
        self.aggregation = None
        if settings.backward_passes_per_step > 1:
            self.aggregation = _LocalAggregation(settings.backward_passes_per_step,
                                                 settings.average_aggregated_gradients, settings.sparse_as_dense,
                                                 reduce_now)


class _DistributedOptimizer:
    """The methods ``DistributedOptimizer`` adds to the optimizer's class (placed before it in the MRO)."""

    _HAS_AGGREGATE_GRAD = True
    _hvd_settings: _Settings

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hvd_setup()

    def _hvd_setup(self) -> None:
        self._hvd = _State(type(self)._hvd_settings, "Distributed" + type(self).__name__, self._hvd_reduce_now)

    @property
    def variables(self):
        """The optimizer's variables, as a list that can be called too (``variables()``)."""
        own = super().variables
        return CallableList(own if isinstance(own, list) else own())

    def register_local_var(self, var):
        """Keep ``var``'s gradient worker-local: not all-reduced (divided by ``size()`` when
        ``scale_local_gradients`` is set).

        Args:
          var: a trainable variable of the model.
        """
        self._hvd.local_refs.add(var.ref())

    def _hvd_reduce_now(self, grads, variables) -> list:
        s = self._hvd.settings
        return reduce_global(self._hvd.reducer, grads, variables, self._hvd.local_refs, s.scale_local_gradients,
                             s.process_set)

    def _hvd_allreduce(self, grads, variables) -> list:
        _check_no_replica_strategy()
        if self._hvd.aggregation is not None:
            return self._hvd.aggregation.compute(grads, variables)
        return self._hvd_reduce_now(grads, variables)

    def _hvd_reduce_pairs(self, grads_and_vars) -> list:
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return grads_and_vars
        grads, variables = zip(*grads_and_vars)
        return list(zip(self._hvd_allreduce(list(grads), list(variables)), variables))

    def compute_gradients(self, loss, var_list, tape=None):
        """The optimizer's gradients of ``loss``, all-reduced over the processes.

        Args:
          loss: a tensor (with ``tape``) or a callable.
          var_list: the variables, or a callable returning them.
          tape: the ``tf.GradientTape`` that computed ``loss``.

        Returns:
          ``(gradient, variable)`` pairs.

        Raises:
          UnsupportedOperationError: under a strategy with several replicas.
          CollectiveError: a subclass, from the collective.
        """
        if hasattr(super(), "_compute_gradients"):  # legacy optimizers
            return self._compute_gradients(loss, var_list, None, tape)
        return self._hvd_reduce_pairs(super().compute_gradients(loss, var_list, tape))

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Legacy optimizers' gradient computation (``minimize`` calls it), all-reduced.

        Args:
          loss, var_list, grad_loss, tape: as for the optimizer's ``_compute_gradients``.

        Returns:
          ``(gradient, variable)`` pairs.
        """
        if not hasattr(super(), "_compute_gradients"):
            return self.compute_gradients(loss, var_list, tape)
        return self._hvd_reduce_pairs(super()._compute_gradients(loss, var_list, grad_loss, tape))

    def get_gradients(self, loss, params):
        """Legacy optimizers' graph-mode gradients, all-reduced.

        Args:
          loss: the loss tensor.
          params: the variables.

        Returns:
          The gradients, in the order of ``params``.
        """
        return self._hvd_allreduce(super().get_gradients(loss, params), params)

    def _hvd_build(self, grads_and_vars) -> None:
        """Create the optimizer's variables before ``tf.cond`` (so none is created in a branch)."""
        with tf.init_scope():
            if hasattr(self, "_create_all_weights"):  # legacy optimizers
                self._create_all_weights([v for g, v in grads_and_vars if g is not None])
            else:
                self.build([v for _, v in grads_and_vars])

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Apply the gradients; with ``backward_passes_per_step=N``, only at every N-th pass.

        Args:
          grads_and_vars: ``(gradient, variable)`` pairs.
          *args, **kwargs: passed to the optimizer's ``apply_gradients``.

        Returns:
          What the optimizer's ``apply_gradients`` returns; with N > 1, ``iterations`` as a tensor.
        """
        aggregation = self._hvd.aggregation
        own = super().apply_gradients
        if aggregation is None:
            return own(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        self._hvd_build(grads_and_vars)
        return aggregation.apply(self, lambda: own(grads_and_vars, *args, **kwargs))


def _is_keras3(obj) -> bool:
    return any(c.__module__.split(".")[0] == "keras" for c in type(obj).__mro__)


def _check_optimizer(optimizer, what: str) -> None:
    """Refuse what cannot be wrapped.

    Raises:
      UnsupportedOperationError: a Keras 3 optimizer, or an object that is no tf_keras optimizer.
    """
    if _is_keras3(optimizer):
        raise UnsupportedOperationError(
            f"{what}: Keras 3 optimizers ({type(optimizer).__module__}.{type(optimizer).__name__}) are not wrapped "
            f"yet: tf_commstrategy.horovod wraps tf_keras optimizers (tf_keras.optimizers.* and "
            f"tf_keras.optimizers.legacy.*)", fix=_KERAS3_FIX)
    if not isinstance(optimizer, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)):
        raise UnsupportedOperationError(
            f"{what}: {type(optimizer).__name__} is not a tf_keras optimizer (TensorFlow 1's "
            f"tf.compat.v1.train.Optimizer and graph sessions are not supported)",
            fix="wrap a tf_keras.optimizers.* or tf_keras.optimizers.legacy.* optimizer, or use "
                "hvd.DistributedGradientTape in a custom loop")


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type, settings: _Settings) -> type:
    """A subclass of ``base`` with ``base``'s name, module and Keras export names that all-reduces."""
    namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                 "_hvd_settings": settings}
    for attr in ("_keras_api_names", "_keras_api_names_v1"):  # serialized under the plain class's public name
        if attr in base.__dict__:
            namespace[attr] = base.__dict__[attr]
    return type(base.__name__, (_DistributedOptimizer, base), namespace)


def _settings(name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor, op,
              backward_passes_per_step, average_aggregated_gradients, num_groups, groups, process_set,
              scale_local_gradients) -> _Settings:
    if op != Average and op != Sum:
        raise ConfigurationError(f"op currently only supports Average and Sum, got op={op!r}",
                                 fix="use op=hvd.Average (the default) or op=hvd.Sum")
    groups = check_groups(num_groups, groups)
    if isinstance(groups, list):  # hashable (one class per distinct setting): the variables' refs
        groups = tuple(tuple(v.ref() for v in g) for g in groups)
    return _Settings(name, device_dense, device_sparse, compression, bool(sparse_as_dense),
                     float(gradient_predivide_factor), op, backward_passes_per_step,
                     bool(average_aggregated_gradients), groups, process_set, bool(scale_local_gradients))


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True, *, use_locking=False):
    """A new optimizer like ``optimizer`` that averages (or sums) the gradients over the processes.

    Args:
      optimizer: a tf_keras optimizer (``tf_keras.optimizers.*`` or ``tf_keras.optimizers.legacy.*``;
        ``tf.keras.optimizers.*`` when ``TF_USE_LEGACY_KERAS=1``).
      name: prefix of the all-reduce's name scope (default "Distributed" + the class name).
      device_dense, device_sparse: accepted (the core places the transfer).
      compression: ``Compression.none`` or ``Compression.fp16``.
      sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
      gradient_predivide_factor: with ``Average``: divide by it before the sum, multiply by
        ``factor / size()`` after.
      op: ``Average`` (default) or ``Sum``.
      backward_passes_per_step: sum this many passes locally before each all-reduce and update.
      average_aggregated_gradients: divide those sums by ``backward_passes_per_step``.
      num_groups: deprecated: ``groups``.
      groups: None (all gradients in one collective), a number of groups, or lists of variables.
      process_set: only the global process set.
      scale_local_gradients: divide the gradients of ``register_local_var`` variables by ``size()``.
      use_locking: ``horovod.tensorflow``'s argument for TensorFlow 1 optimizers; ignored (keyword only:
        this function has the positional order of ``horovod.tensorflow.keras``).

    Returns:
      An optimizer of a subclass of ``type(optimizer)`` with the same name, made from ``optimizer``'s config.

    Raises:
      UnsupportedOperationError: a Keras 3 optimizer, no tf_keras optimizer, or called under a strategy with
        several replicas (checked again when the gradients are computed).
      ConfigurationError: another op than Average / Sum, bad ``groups``, ``backward_passes_per_step`` < 1,
        or ``gradient_predivide_factor`` other than 1 with ``Sum``.
    """
    _check_optimizer(optimizer, "hvd.DistributedOptimizer")
    _check_no_replica_strategy()
    settings = _settings(name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor,
                         op, backward_passes_per_step, average_aggregated_gradients, num_groups, groups, process_set,
                         scale_local_gradients)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigurationError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step!r}",
                                 fix="pass an int >= 1")
    base = type(optimizer)
    if issubclass(base, _DistributedOptimizer):  # wrapping again replaces the settings
        base = base.__mro__[2]
    return _distributed_class(base, settings).from_config(optimizer.get_config())


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Load a tf_keras model saved with its optimizer, and make that optimizer a ``DistributedOptimizer``.

    The optimizer loaded with the model (its slots and ``iterations`` included) becomes distributed in
    place, so training resumes from the saved state. Any format ``tf_keras.models.load_model`` reads
    works (``.keras``, ``.h5``, SavedModel), whether the model was saved with or without Horovod.

    Args:
      filepath: the saved model.
      custom_optimizers: optimizer classes of your own the model may use.
      custom_objects: other custom objects for ``tf_keras.models.load_model``.
      compression: the compression of the wrapped optimizer.
      legacy_opts: accepted (Horovod's choice of legacy optimizers; the file says which it holds).

    Returns:
      The model; its ``optimizer`` (when it has one) all-reduces its gradients.

    Raises:
      UnsupportedOperationError: the loaded optimizer is not a tf_keras optimizer.
      ValueError, OSError: from ``tf_keras.models.load_model`` (no such file, not a model).
    """
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = tf_keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, _DistributedOptimizer):
        _check_optimizer(opt, "hvd.load_model")
        settings = _settings(None, '', '', compression, False, 1.0, Average, 1, False, 0, None, global_process_set,
                             True)
        opt.__class__ = _distributed_class(type(opt), settings)
        opt._hvd_setup()
    return model
