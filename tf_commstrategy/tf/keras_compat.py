"""The one place where tf_keras is taught about CommStrategy.

tf_keras gathers ``predict`` outputs across workers only for ``MultiWorkerMirroredStrategy``
instances; for any other strategy it concatenates this worker's replicas only. CommStrategy is on
purpose not an MWMS instance (tf_keras would then also sum per-batch training logs across
workers), so ``reduce_per_replica(..., "concat")`` is routed through tf_keras's own multi-worker
concatenation (``strategy.gather`` -> our all-gather), in the same replica order it uses for MWMS.
The metric reads of one ``get_metrics_result`` share one fused reduction (``fused_sync_on_read``);
every other reduction is left to tf_keras unchanged. Saving (``Model.save`` / ``save_weights``,
``tf_keras.models.save_model``, ``tf.saved_model.save``) reads replica-local variables (metric state)
locally, so rank 0 can save alone. Also, ``verbose="auto"`` (the default of
fit/evaluate/predict) shows the progress bar on rank 0 only, and a tf_commstrategy error inside
fit/evaluate/predict surfaces as itself (chained from TF's ``UnknownError``). The ``DataHandler``
reads its steps-per-execution counter, a MirroredVariable under the scope, from the counter's first
component at every step (``FirstComponentReads``).
"""

from __future__ import annotations

import functools
import sys

import tensorflow as tf
from tensorflow.python.distribute import values

_installed = False
_warned_uneven = False


def agree_on_steps(local_steps):
    """The number of steps every worker runs when each inferred ``local_steps`` from its own data
    (None: unknown). Equal counts are kept; different ones become the largest (the others get empty
    batches at the end); if any worker does not know, nobody does (each runs to the end of data)."""
    global _warned_uneven
    import numpy as np
    from .. import collectives
    mine = np.array([-1 if local_steps is None else int(local_steps)], np.int64)
    every = collectives.allgather(mine, backend="grpc")  # a host array: never the default nccl
    if (every == every[0]).all():
        return local_steps
    if not _warned_uneven:
        _warned_uneven = True
        import logging
        logging.getLogger("tf_commstrategy").warning(
            "tf_commstrategy: workers have different numbers of batches per epoch (%s); every worker runs %s "
            "steps, and workers out of data contribute empty batches", every.tolist(),
            "until all are out of data" if (every < 0).any() else int(every.max()))
    return None if (every < 0).any() else int(every.max())


class FirstComponentReads:
    """A MirroredVariable whose ``numpy()`` reads its first component; every other use, writes
    included, goes to the variable itself (all its components).

    For a variable that is only ever written in cross-replica context (all components equal), such as
    tf_keras's steps-per-execution counter."""

    def __init__(self, variable):
        self.variable = variable

    def numpy(self):
        return self.variable._primary.numpy()  # pylint: disable=protected-access

    def __getattr__(self, name):
        return getattr(self.variable, name)


def _wrap_once(owner, name: str, build) -> None:
    """Replace ``owner.name`` by ``build(original)``, once: a wrapper already in place (a second
    ``install``) is left alone. The wrapper keeps the original's name and docstring, and the original
    stays reachable as its ``__wrapped__``."""
    original = getattr(owner, name)
    if getattr(original, "_tfcs_wrapper", False):
        return
    wrapper = functools.wraps(original, updated=())(build(original))
    wrapper._tfcs_wrapper = True
    setattr(owner, name, wrapper)


def install() -> None:
    """Teach tf_keras about ``CommStrategy`` (idempotent; ``CommStrategy()`` calls it).

    Does nothing when tf_keras is not installed.
    """
    global _installed
    if _installed:
        return
    try:
        from tf_keras.src.engine import training
    except ImportError:  # tf_keras not installed: nothing to teach
        return
    def reduce_per_replica(original):
        def wrapper(values, strategy, reduction):
            from .strategy import CommStrategy
            if (reduction == "concat" and isinstance(strategy, CommStrategy)
                    and strategy.extended._in_multi_worker_mode()):
                return tf.nest.map_structure(lambda v: training._multi_worker_concat(v, strategy), values)
            return original(values, strategy, reduction)
        return wrapper
    _wrap_once(training, "reduce_per_replica", reduce_per_replica)

    def get_verbosity(original):
        def wrapper(verbose, distribute_strategy):
            # verbose="auto" (tf_keras's default) under CommStrategy: the progress bar on rank 0 only.
            from .strategy import CommStrategy
            if verbose == "auto" and isinstance(distribute_strategy, CommStrategy) and \
                    distribute_strategy.extended._id_in_cluster != 0:
                return 0
            return original(verbose, distribute_strategy)
        return wrapper
    _wrap_once(training, "_get_verbosity", get_verbosity)

    # Uneven data: workers whose datasets have different numbers of batches must still run the same
    # number of steps (every step issues collectives). They agree on the largest count; a worker that
    # runs out earlier gets empty batches from tf.distribute's partial-batch handling (the global
    # "has data" count is all-reduced at every step), so the epoch ends at the same step everywhere.
    from tf_keras.src.engine import data_adapter

    def infer_steps(original):
        def wrapper(self, steps, dataset):
            inferred = original(self, steps, dataset)
            strategy = tf.distribute.get_strategy()
            from .strategy import CommStrategy
            if steps is not None or not isinstance(strategy, CommStrategy) or \
                    not strategy.extended._in_multi_worker_mode():
                return inferred
            return agree_on_steps(inferred)
        return wrapper
    _wrap_once(data_adapter.DataHandler, "_infer_steps", infer_steps)

    # steps_per_execution: the DataHandler reads the model's counter with ``.numpy()`` at every step. Made
    # under the scope, the counter is a MirroredVariable, whose read in cross-replica context resolves the
    # current device and copies the value (103 us against 27 us for a plain variable on the 2-core VM).
    # Every component holds the same value (the counter is only assigned in cross-replica context, which
    # writes all of them), so the handler reads the first component and writes through the variable.
    def data_handler_init(original):
        def wrapper(self, *args, **kwargs):
            original(self, *args, **kwargs)
            from .strategy import CommStrategy
            counter = self._steps_per_execution
            if (isinstance(counter, values.MirroredVariable)
                    and isinstance(counter.distribute_strategy, CommStrategy)):
                self._steps_per_execution = FirstComponentReads(counter)
        return wrapper
    _wrap_once(data_adapter.DataHandler, "__init__", data_handler_init)

    # Metrics: tf_keras reads every metric (each Mean: total and count) at every step, one reduction
    # per variable. Under CommStrategy the reads of one get_metrics_result share ONE fused collective.
    def get_metrics_result(original):
        def wrapper(self):
            from .strategy import CommStrategy
            strategy = self.distribute_strategy
            if not isinstance(strategy, CommStrategy):
                return original(self)
            variables = [v for m in self.metrics for v in m.variables]
            with strategy.extended.fused_sync_on_read(variables):
                return original(self)
        return wrapper
    _wrap_once(training.Model, "get_metrics_result", get_metrics_result)

    # One collective per train step: the default train_step updates the metrics before the optimizer
    # step (they only need the predictions) so that their cross-worker reads ride on the gradients'
    # all-reduce (CommExtended.piggyback_reads). A model that overrides compute_metrics, or a
    # train_step of the user's own, keeps tf_keras's order (and two collectives per step).
    def train_step(original):
        def wrapper(self, data):
            from .strategy import CommStrategy
            strategy = self.distribute_strategy
            if (not isinstance(strategy, CommStrategy) or not strategy.extended._in_multi_worker_mode()
                    or type(self).compute_metrics is not training.Model.compute_metrics):
                return original(self, data)
            x, y, sample_weight = data_adapter.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x, y, y_pred, sample_weight)
            self._validate_target_and_loss(y, loss)
            self.compiled_metrics.update_state(y, y_pred, sample_weight)
            with strategy.extended.piggyback_reads([v for m in self.metrics for v in m.variables]):
                self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            return self.get_metrics_result()
        return wrapper
    _wrap_once(training.Model, "train_step", train_step)

    # Saving on one rank (``if tfcs.rank() == 0: model.save(path)``): the .keras and SavedModel
    # formats read the metrics' state, and a cross-worker read there would be a collective that no
    # other rank joins. While saving, replica-local variables are read locally (this worker's own).
    # Every entry point: the Model methods, tf_keras's save_model function (bound under four module
    # names) and TensorFlow's SavedModel writer, which tf.saved_model.save and tf_keras's SavedModel
    # format both call (TensorFlow reads every saved variable's attributes outside its save context).
    from tensorflow.python.saved_model import save as tf_save
    from tf_keras.src.saving import saving_api
    from .strategy import local_replica_reads

    def saving_locally(original):
        def wrapper(*args, **kwargs):
            with local_replica_reads():
                return original(*args, **kwargs)
        return wrapper
    for name in ("save", "save_weights"):
        _wrap_once(training.Model, name, saving_locally)
    save_model = saving_api.save_model
    for name, module in list(sys.modules.items()):
        if name.startswith("tf_keras") and getattr(module, "save_model", None) is save_model:
            _wrap_once(module, "save_model", saving_locally)
    _wrap_once(tf_save, "save_and_return_nodes", saving_locally)

    # Errors: a PeerLostError (etc.) inside the train step reaches Keras as tf.errors.UnknownError;
    # fit / evaluate / predict re-raise our typed error instead, chained from TF's.
    from .tensor_ops import unwrap_errors

    def unwrapping(original):
        def wrapper(self, *args, **kwargs):
            with unwrap_errors():
                return original(self, *args, **kwargs)
        return wrapper
    for name in ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"):
        _wrap_once(training.Model, name, unwrapping)
    _installed = True
