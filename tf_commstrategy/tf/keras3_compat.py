"""The one place where Keras 3 (``import keras``; ``tf.keras`` on TensorFlow 2.16+) is taught about
CommStrategy.

Keras 3's TensorFlow trainer runs its steps with ``strategy.run`` and sums the gradients with
``ReplicaContext.all_reduce`` (so through ``CommCrossDeviceOps``), but it treats every strategy that is
not a ``MultiWorkerMirroredStrategy`` as one worker's. What this module changes, for models, optimizers
and callbacks under a ``CommStrategy`` only:

* **Gradients are all-reduced first** (``apply``): before clipping, loss-scale checks and the update,
  so ``clipnorm`` / ``global_clipnorm`` clip the global gradient and a ``LossScaleOptimizer`` decides
  "finite" from the same all-reduced gradients on every worker (a worker whose own gradients overflow
  cannot skip a collective the others run). Keras's own all-reduce in the update step then has nothing
  left to do.
* **Logs are global at every step** (``_make_function``): the metrics' state (SUM / ON_READ variables)
  is all-reduced once per step and the results computed from it (``Metric.stateless_result``
  semantics, through a ``StatelessScope``). In the default ``train_step`` the metrics are updated
  before the optimizer step and their state rides on the gradients' all-reduce: one collective per
  step. A ``train_step`` of the user's own gets one more (its logs' metric entries are global, its
  other scalar entries are averaged over replicas in the same collective). At epoch end
  ``get_metrics_result`` reads all metric state in one fused collective.
* ``predict`` concatenates every worker's outputs in order (``gathering_predictions``); the
  shape-learning reduce of the first batch (``_maybe_symbolic_build``) takes this worker's first
  replica's batch, without a collective.
* Uneven data: workers agree on the number of steps of an epoch (``TFEpochIterator``).
* ``verbose="auto"``: the progress bar on rank 0 only; tf_commstrategy errors surface as themselves.
* Saving reads replica-local state locally (``if tfcs.rank() == 0: model.save(path)`` never hangs);
  ``ModelCheckpoint`` and ``BackupAndRestore`` write on the chief only, and a restore gives every
  worker the chief's state and epoch.

Every patch is a short function below, listed in ``PATCHES`` (see ``keras_patches``).
"""

from __future__ import annotations

import inspect
import threading

import tensorflow as tf
from tensorflow.python.distribute import values as value_lib

from .keras_patches import (Patches, agree_on_steps, gathering_predictions, is_comm, is_comm_multi_worker,
                            reading_locally, unwrapping_errors)

_local = threading.local()  # per replica thread: the step being traced (StepSync) and reduced-apply depth

_SYNCED = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def _replica_ctx_of_comm():
    """The replica context when code runs in one of a CommStrategy's replicas, else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not is_comm(ctx.strategy) or ctx.strategy.num_replicas_in_sync < 2:
        return None
    return ctx


class StepSync:
    """One train / test step's metric state, all-reduced once across every replica of the job.

    Also, in a train step, the moving statistics of ``BatchNormalization`` layers: Keras 3 keeps them as
    mirrored variables that each replica updates from its own batch (aggregation "none"); they are
    averaged over all replicas in the same collective, so every worker holds the same statistics (the
    moving mean equals one process's on the global batch; the moving variance is the mean of the
    replicas' batch variances).

    Args:
      model: the Keras 3 model whose ``metrics`` are synced.
      train: whether the step trains (updates moving statistics).
      defer_apply: hold the optimizer's ``apply`` back until the step has updated its metrics, then run
        it with the metric state riding on the gradients' all-reduce (only for Keras's own
        ``train_step`` with its own ``compute_metrics``, which read no weights after the update).
    """

    def __init__(self, model, train: bool, defer_apply: bool):
        self.model = model
        self.defer_apply = defer_apply
        self.piggyback = defer_apply  # the metric state is final when the held-back step runs
        self.deferred = None      # (optimizer, grads, variables) held back by the apply wrapper
        self.reduced = None       # the metric variables' global values, once reduced
        self.variables = [kv for m in model.metrics for kv in m.variables
                          if isinstance(kv.value, value_lib.SyncOnReadVariable) and kv.value.aggregation in _SYNCED]
        self.averaged = _moving_statistics(model) if train else []

    def local_states(self):
        """This replica's values of the metric variables and moving statistics (a replica-context read
        is local)."""
        return [tf.convert_to_tensor(kv.value) for kv in self.variables + self.averaged]

    def take_reduced(self, summed, num_replicas: int) -> None:
        """Keep the summed metric states (MEAN-aggregated ones divided by the replica count) and
        assign the averaged moving statistics."""
        n = len(self.variables)
        self.reduced = [s / tf.cast(num_replicas, s.dtype) if kv.value.aggregation == tf.VariableAggregation.MEAN
                        else s for kv, s in zip(self.variables, summed[:n])]
        for kv, s in zip(self.averaged, summed[n:]):
            kv.value.assign(s / tf.cast(num_replicas, s.dtype))  # aggregation "none": this replica's copy

    def finish(self, logs):
        """Run a held-back optimizer step, reduce the state if nothing carried it, and return ``logs``
        with every metric result computed from the global state."""
        if self.deferred is not None:
            optimizer, grads, variables = self.deferred
            self.deferred = None
            optimizer.apply(grads, variables)  # the apply wrapper reduces grads + local_states()
        if not self.variables and not self.averaged:
            return logs
        if self.reduced is None:  # a train_step of the user's own: its other scalar logs ride along
            logs = self._reduce_with(logs)
        if not isinstance(logs, dict) or not self.variables:
            return logs
        from keras.src.backend.common.stateless_scope import StatelessScope
        with StatelessScope(state_mapping=list(zip(self.variables, self.reduced))):
            metric_logs = self.model.get_metrics_result()
        return {k: metric_logs.get(k, v) for k, v in logs.items()}

    def _reduce_with(self, logs):
        """Reduce the local state in one collective, with the scalar float entries of ``logs`` that are
        not metric results; returns ``logs`` with those entries averaged over replicas."""
        extra = []
        if isinstance(logs, dict):
            metric_keys = set(self.model.get_metrics_result())
            extra = [k for k, v in sorted(logs.items()) if k not in metric_keys and _float_scalar(v)]
        ctx = tf.distribute.get_replica_context()
        n = ctx.strategy.num_replicas_in_sync
        states = self.local_states()
        summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, states + [logs[k] for k in extra])
        self.take_reduced(summed[:len(states)], n)
        if not extra:
            return logs
        return dict(logs, **{k: s / tf.cast(n, s.dtype) for k, s in zip(extra, summed[len(states):])})


def _moving_statistics(model):
    """The moving statistics of the model's BatchNormalization layers that each replica updates alone."""
    from keras.src.layers.normalization.batch_normalization import BatchNormalization
    out = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, BatchNormalization):
            out += [kv for kv in (layer.moving_mean, layer.moving_variance)
                    if isinstance(kv.value, value_lib.MirroredVariable)
                    and kv.value.aggregation == tf.VariableAggregation.NONE]
    return out


def _float_scalar(value) -> bool:
    return isinstance(value, tf.Tensor) and value.shape.rank == 0 and value.dtype.is_floating


def _all_reduce_grads(ctx, grads, extra):
    """SUM-all-reduce the present gradients and ``extra`` tensors in one collective; None gradients
    stay None. Returns (gradients, reduced extra)."""
    present = [g for g in grads if g is not None]
    reduced = list(ctx.all_reduce(tf.distribute.ReduceOp.SUM, present + list(extra)))
    it = iter(reduced[:len(present)])
    return [None if g is None else next(it) for g in grads], reduced[len(present):]


def _receives_reduced(optimizer) -> bool:
    return getattr(_local, "reduced_depth", 0) > 0 or getattr(optimizer, "_tfcs_receives_reduced", False)


def optimizer_apply(original):
    """Gradients all-reduced before Keras clips, checks or applies them (see the module docstring)."""
    def wrapper(self, grads, trainable_variables=None):
        ctx = _replica_ctx_of_comm()
        if ctx is None or _receives_reduced(self):
            return original(self, grads, trainable_variables)
        sync = getattr(_local, "sync", None)
        if sync is not None and sync.defer_apply:
            sync.defer_apply = False
            sync.deferred = (self, list(grads), trainable_variables)
            return None
        inner = getattr(self, "inner_optimizer", None)
        if inner is not None:  # a LossScaleOptimizer applies its inner one, in replica threads of its own
            inner._tfcs_receives_reduced = True
        extra = sync.local_states() if sync is not None and sync.piggyback and sync.reduced is None else []
        grads, states = _all_reduce_grads(ctx, list(grads), extra)
        if extra:
            sync.take_reduced(states, ctx.strategy.num_replicas_in_sync)
        _local.reduced_depth = getattr(_local, "reduced_depth", 0) + 1
        try:
            return original(self, grads, trainable_variables)
        finally:
            _local.reduced_depth -= 1
    return wrapper


def all_reduce_sum_gradients(original):
    """Keras's own gradient all-reduce in the update step: nothing to do once ``apply`` reduced them."""
    def wrapper(self, grads_and_vars):
        if _replica_ctx_of_comm() is not None and _receives_reduced(self):
            return list(grads_and_vars)
        return original(self, grads_and_vars)
    return wrapper


def make_function(original):
    """Train and test steps under CommStrategy return global logs (``StepSync``)."""
    def wrapper(self, step_function):
        if not is_comm(self.distribute_strategy) or self.distribute_strategy.num_replicas_in_sync < 2:
            return original(self, step_function)
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        from keras.src.trainers.trainer import Trainer
        default_train = (getattr(step_function, "__func__", None) is TensorFlowTrainer.train_step
                         and type(self).compute_metrics is Trainer.compute_metrics)
        train = getattr(step_function, "__name__", "") == "train_step"

        def step(data):
            sync = StepSync(self, train, defer_apply=default_train)
            previous = getattr(_local, "sync", None)
            _local.sync = sync
            try:
                return sync.finish(step_function(data))
            finally:
                _local.sync = previous
        return original(self, step)
    return wrapper


def get_metrics_result(original):
    """At epoch end (cross-replica context), all metric state in one fused collective."""
    def wrapper(self):
        strategy = self.distribute_strategy
        ctx = tf.distribute.get_replica_context()
        if not is_comm_multi_worker(strategy) or (ctx is not None and is_comm(ctx.strategy)):
            return original(self)  # inside a step, StepSync serves the global values
        with strategy.extended.fused_sync_on_read([kv.value for m in self.metrics for kv in m.variables]):
            return original(self)
    return wrapper


def maybe_symbolic_build(original):
    """Keras learns the input shapes from the first batch by MEAN-reducing it across replicas; under
    CommStrategy it takes this worker's first replica's batch instead (same shapes, no collective)."""
    def wrapper(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not is_comm(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v, batch)
            break
        return original(self, iterator=None, data_batch=data_batch)
    return wrapper


def _multi_worker_concat():
    from keras.src.backend.tensorflow import trainer
    return trainer._multi_worker_concat


def epoch_iterator_init(original):
    """Uneven data: every worker runs the largest number of steps of an epoch (the others get empty
    batches at the end through tf.distribute's partial-batch handling); see ``agree_on_steps``."""
    def wrapper(self, distribute_strategy=None, *args, **kwargs):
        original(self, distribute_strategy, *args, **kwargs)
        if self.steps_per_epoch is None and is_comm_multi_worker(distribute_strategy):
            self._tfcs_num_batches = agree_on_steps(self._num_batches)
            self._num_batches = self._tfcs_num_batches
    return wrapper


def epoch_iterator_reset(original):
    """``reset`` re-reads the local number of batches: keep the job's agreed one."""
    def wrapper(self):
        original(self)
        if hasattr(self, "_tfcs_num_batches"):
            self._num_batches = self._tfcs_num_batches
    return wrapper


def rank0_progress_and_typed_errors(original):
    """``verbose="auto"`` (the default): the progress bar on rank 0 only; our errors as themselves."""
    signature = inspect.signature(original)
    run = unwrapping_errors(original)

    def wrapper(self, *args, **kwargs):
        if is_comm(self.distribute_strategy) and self.distribute_strategy.extended._id_in_cluster != 0:
            bound = signature.bind(self, *args, **kwargs)
            if bound.arguments.get("verbose", "auto") == "auto":
                bound.arguments["verbose"] = 0
                args, kwargs = bound.args[1:], bound.kwargs
        return run(self, *args, **kwargs)
    return wrapper


def _is_chief(model) -> bool:
    strategy = getattr(model, "distribute_strategy", None)
    return not is_comm(strategy) or strategy.extended.should_checkpoint


def chief_writes(original):
    """A checkpoint callback's write: on the chief only (the others would write the same file)."""
    def wrapper(self, *args, **kwargs):
        if _is_chief(self.model):
            return original(self, *args, **kwargs)
        return None
    return wrapper


def backup_restore_begin(original):
    """``BackupAndRestore``: after the restore, every worker takes the chief's state and epoch (a
    worker that cannot see the backup directory would otherwise start over and wait forever)."""
    def wrapper(self, logs=None):
        original(self, logs)
        strategy = self.model.distribute_strategy
        if not is_comm_multi_worker(strategy):
            return
        import numpy as np
        from .. import collectives
        epoch = collectives.broadcast(np.array([self.model._initial_epoch or 0], np.int64), root_rank=0)
        self.model._initial_epoch = int(epoch[0]) or None
        if not self.model._initial_epoch:
            return
        optimizer = self.model.optimizer
        variables = list(self.model.variables) + (list(optimizer.variables) if optimizer is not None else [])
        values = collectives.grouped_broadcast([np.asarray(v.numpy()) for v in variables], root_rank=0)
        for v, value in zip(variables, values):
            v.assign(value)
    return wrapper


_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer."
_MODEL = "keras.src.models.model:Model."
PATCHES = Patches("Keras 3", "keras", ((3, 12), (3, 16)), {
    "keras.src.backend.tensorflow.optimizer:TFOptimizer.apply": optimizer_apply,
    "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer.apply": optimizer_apply,
    "keras.src.backend.tensorflow.optimizer:TFOptimizer._all_reduce_sum_gradients": all_reduce_sum_gradients,
    _TRAINER + "_make_function": make_function,
    _TRAINER + "_maybe_symbolic_build": maybe_symbolic_build,
    "keras.src.trainers.trainer:Trainer.get_metrics_result": get_metrics_result,
    # resetting a replica-local variable assigns it and reads it back across workers: locally instead
    "keras.src.trainers.trainer:Trainer.reset_metrics": reading_locally,
    # predict: every worker's outputs, in order
    "keras.src.backend.tensorflow.trainer:reduce_per_replica": gathering_predictions(_multi_worker_concat),
    "keras.src.backend.tensorflow.trainer:TFEpochIterator.__init__": epoch_iterator_init,
    "keras.src.backend.tensorflow.trainer:TFEpochIterator.reset": epoch_iterator_reset,
    **{_TRAINER + name: rank0_progress_and_typed_errors for name in ("fit", "evaluate", "predict")},
    **{_TRAINER + name: unwrapping_errors for name in ("train_on_batch", "test_on_batch", "predict_on_batch")},
    _MODEL + "save": reading_locally,
    _MODEL + "save_weights": reading_locally,
    "keras.src.saving.saving_api:save_model": reading_locally,
    "keras.src.saving.saving_api:save_weights": reading_locally,
    "keras.src.callbacks.model_checkpoint:ModelCheckpoint._save_model": chief_writes,
    "keras.src.callbacks.backup_and_restore:BackupAndRestore._save_model": chief_writes,
    "keras.src.callbacks.backup_and_restore:BackupAndRestore.on_train_end": chief_writes,
    "keras.src.callbacks.backup_and_restore:BackupAndRestore.on_train_begin": backup_restore_begin,
})


def install() -> None:
    """Teach Keras 3 about ``CommStrategy`` (idempotent; ``CommStrategy()`` calls it). Does nothing
    when Keras 3 is not installed.

    Raises:
      ConfigurationError: the installed Keras is not a version these patches were written for.
    """
    PATCHES.install()
