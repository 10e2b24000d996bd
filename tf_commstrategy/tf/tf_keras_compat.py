"""The one place where tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``) is taught about CommStrategy.

tf_keras gathers ``predict`` outputs across workers only for ``MultiWorkerMirroredStrategy``
instances; for any other strategy it concatenates this worker's replicas only. CommStrategy is on
purpose not an MWMS instance (tf_keras would then also sum per-batch training logs across
workers), so ``reduce_per_replica(..., "concat")`` is routed through tf_keras's own multi-worker
concatenation (``strategy.gather`` -> our all-gather), in the same replica order it uses for MWMS.
The metric reads of one ``get_metrics_result`` share one fused reduction (``fused_sync_on_read``);
every other reduction is left to tf_keras unchanged. Saving (``Model.save`` / ``save_weights``,
``tf_keras.models.save_model``) reads replica-local variables (metric state) locally, so rank 0 can
save alone. Also, ``verbose="auto"`` (the default of fit/evaluate/predict) shows the progress bar on
rank 0 only, and a tf_commstrategy error inside fit/evaluate/predict surfaces as itself (chained from
TF's ``UnknownError``). The ``DataHandler`` reads its steps-per-execution counter, a MirroredVariable
under the scope, from the counter's first component at every step (``FirstComponentReads``).

Every patch is a short function below, listed in ``PATCHES`` (see ``keras_patches``).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import values

from .keras_patches import (Patches, agree_on_steps, gathering_predictions, is_comm_multi_worker, reading_locally,
                            unwrapping_errors)


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


def _multi_worker_concat():
    from tf_keras.src.engine import training
    return training._multi_worker_concat


def get_verbosity(original):
    """``verbose="auto"`` (tf_keras's default) under CommStrategy: the progress bar on rank 0 only."""
    def wrapper(verbose, distribute_strategy):
        from .strategy import CommStrategy
        if verbose == "auto" and isinstance(distribute_strategy, CommStrategy) and \
                distribute_strategy.extended._id_in_cluster != 0:
            return 0
        return original(verbose, distribute_strategy)
    return wrapper


def infer_steps(original):
    """Uneven data: workers whose datasets have different numbers of batches must still run the same
    number of steps (every step issues collectives). They agree on the largest count; a worker that
    runs out earlier gets empty batches from tf.distribute's partial-batch handling (the global
    "has data" count is all-reduced at every step), so the epoch ends at the same step everywhere."""
    def wrapper(self, steps, dataset):
        inferred = original(self, steps, dataset)
        if steps is not None or not is_comm_multi_worker(tf.distribute.get_strategy()):
            return inferred
        return agree_on_steps(inferred)
    return wrapper


def data_handler_init(original):
    """steps_per_execution: the DataHandler reads the model's counter with ``.numpy()`` at every step.
    Made under the scope, the counter is a MirroredVariable, whose read in cross-replica context resolves
    the current device and copies the value. Every component holds the same value (the counter is only
    assigned in cross-replica context, which writes all of them), so the handler reads the first
    component and writes through the variable."""
    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from .strategy import CommStrategy
        counter = self._steps_per_execution
        if (isinstance(counter, values.MirroredVariable)
                and isinstance(counter.distribute_strategy, CommStrategy)):
            self._steps_per_execution = FirstComponentReads(counter)
    return wrapper


def get_metrics_result(original):
    """tf_keras reads every metric (each Mean: total and count) at every step, one reduction per
    variable. Under CommStrategy the reads of one get_metrics_result share ONE fused collective."""
    def wrapper(self):
        from .strategy import CommStrategy
        strategy = self.distribute_strategy
        if not isinstance(strategy, CommStrategy):
            return original(self)
        variables = [v for m in self.metrics for v in m.variables]
        with strategy.extended.fused_sync_on_read(variables):
            return original(self)
    return wrapper


def train_step(original):
    """One collective per train step: the default train_step updates the metrics before the optimizer
    step (they only need the predictions) so that their cross-worker reads ride on the gradients'
    all-reduce (CommExtended.piggyback_reads). A model that overrides compute_metrics, or a
    train_step of the user's own, keeps tf_keras's order (and two collectives per step)."""
    def wrapper(self, data):
        from tf_keras.src.engine import data_adapter, training
        strategy = self.distribute_strategy
        if (not is_comm_multi_worker(strategy)
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


_TRAINING = "tf_keras.src.engine.training:Model."
PATCHES = Patches("tf_keras", "tf_keras", ((2, 16), (2, 22)), {
    "tf_keras.src.engine.training:reduce_per_replica": gathering_predictions(_multi_worker_concat),
    "tf_keras.src.engine.training:_get_verbosity": get_verbosity,
    "tf_keras.src.engine.data_adapter:DataHandler._infer_steps": infer_steps,
    "tf_keras.src.engine.data_adapter:DataHandler.__init__": data_handler_init,
    _TRAINING + "get_metrics_result": get_metrics_result,
    _TRAINING + "train_step": train_step,
    # saving on one rank (``if tfcs.rank() == 0: model.save(path)``): the .keras and SavedModel formats
    # read the metrics' state, and a cross-worker read there would be a collective no other rank joins
    _TRAINING + "save": reading_locally,
    _TRAINING + "save_weights": reading_locally,
    "tf_keras.src.saving.saving_api:save_model": reading_locally,
    # a PeerLostError (etc.) inside a step reaches Keras as tf.errors.UnknownError: re-raise ours
    **{_TRAINING + name: unwrapping_errors for name in
       ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")},
})


def install() -> None:
    """Teach tf_keras about ``CommStrategy`` (idempotent; ``CommStrategy()`` calls it). Does nothing
    when tf_keras is not installed.

    Raises:
      ConfigurationError: the installed tf_keras is not a version these patches were written for.
    """
    PATCHES.install()
