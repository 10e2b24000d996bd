"""Keras callbacks for multi-worker training (Horovod's, for Keras 3 and tf_keras on TF >= 2.16).

Each callback is a Keras 3 ``keras.callbacks.Callback`` and a tf_keras ``tf_keras.callbacks.Callback``
at once (``Callback`` below), so the same object serves a model of either flavour.

Place ``MetricAverageCallback`` *before* callbacks that act on epoch logs (EarlyStopping,
ReduceLROnPlateau, ModelCheckpoint(save_best_only=True), CSVLogger, TensorBoard): they then see the
averaged values, and every worker takes the same decision.
"""

from __future__ import annotations

from typing import Optional

import keras as keras3
import numpy as np
import tf_keras as keras

from .. import collectives, process
from ..errors import ConfigurationError
from . import logic


class Callback(keras3.callbacks.Callback, keras.callbacks.Callback):
    """A callback both Keras flavours accept: Keras 3's class (its ``model`` property, ``set_model`` and
    hooks come first) with tf_keras's attributes and batch-hook queries (``_implements_*_batch_hooks``)."""

    def __init__(self):
        keras3.callbacks.Callback.__init__(self)
        self.validation_data = None      # tf_keras's attributes; its __init__ would assign ``model``,
        self._chief_worker_only = None   # a read-only property of Keras 3's class
        self._supports_tf_logs = False


class BroadcastGlobalVariablesCallback(Callback):
    """At the start of every ``fit``, give every worker root's model and optimizer variables.

    The optimizer's slots are built first, so they exist and are broadcast too. Useful when workers
    start from different states: weights loaded from a checkpoint on the root only, different seeds,
    or a model built outside ``CommStrategy``'s scope. Works with ``CommStrategy`` and with a plain
    single-device strategy per worker (it uses the direct collective API).

    A model that is not built when ``fit`` starts on some worker (a ``Sequential`` without an input
    shape, a subclassed model) has no variables yet: the broadcast then happens at the end of the first
    batch, once the first step has built the model and the optimizer (as Horovod does). Every worker
    takes the same decision (they agree on it with one small all-reduce).

    Args:
      root_rank: the rank whose state everybody takes.

    Attributes:
      broadcasts: how many times the state was broadcast (once per ``fit``).

    Raises:
      ConfigurationError: ``root_rank`` is not a rank of the job (at the start of ``fit``).
      CollectiveError: a subclass, from the broadcast.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcasts = 0
        self._pending = False

    def on_train_begin(self, logs=None):
        """Broadcast now if the model is built on every worker, else after the first batch.

        Args:
          logs: Keras's logs (unused).
        """
        collectives._check_root(self.root_rank)  # pylint: disable=protected-access  (now, not after a batch)
        built_here = bool(self.model.built)
        built = built_here
        if process.size() > 1:  # a model loaded on the root only may be built there alone
            built = bool(collectives.allreduce(np.array([int(built_here)], np.int32), op="min")[0])
        self._pending = not built
        if built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        """The deferred broadcast, once the first step has built the model and the optimizer.

        Args:
          batch: the batch that ended.
          logs: Keras's logs (unused).
        """
        if self._pending:
            self._pending = False
            self._broadcast()

    def _broadcast(self):
        model = self.model
        opt = model.optimizer
        with model.distribute_strategy.scope():
            built = getattr(opt, "_built", False) or getattr(opt, "built", False)  # tf_keras / Keras 3
            if opt is not None and hasattr(opt, "build") and not built:
                opt.build(model.trainable_variables)
            elif opt is not None and hasattr(opt, "_create_all_weights"):  # tf_keras.optimizers.legacy.*
                opt._create_all_weights(model.trainable_variables)  # pylint: disable=protected-access
        opt_vars = [] if opt is None else (opt.variables() if callable(opt.variables) else opt.variables)
        variables = list(model.variables) + list(opt_vars)
        # one variable object may appear twice (shared layers); broadcast each once
        unique, seen = [], set()
        for v in variables:
            if id(v) not in seen:
                seen.add(id(v))
                unique.append(v)
        values = logic.broadcast_state([np.asarray(v.numpy()) for v in unique], self.root_rank,
                                       lambda arrs, root: collectives.grouped_broadcast(arrs, root_rank=root))
        for v, val in zip(unique, values):
            v.assign(val)
        self.broadcasts += 1


class MetricAverageCallback(Callback):
    """At epoch end, replace every scalar in ``logs`` (training and ``val_*``) by its mean over workers.

    With local metrics (``CommStrategy(sync_metrics=False)`` or no CommStrategy) this makes the epoch
    logs global; with global metrics it changes nothing (identical values are left as they are).
    Keys are reduced in sorted order, so every rank issues the same collectives.

    Raises:
      CollectiveError: a subclass, from the all-reduce (e.g. ranks with different log keys).
    """

    def on_epoch_end(self, epoch, logs=None):
        """Average the scalars of ``logs`` over workers, in place (nothing to do with one worker).

        Args:
          epoch: the epoch that ended.
          logs: the epoch logs, changed in place.
        """
        if logs is None or process.size() == 1:
            return
        logic.average_logs(logs, lambda a, op: collectives.allreduce(a, op=op))


class LearningRateWarmupCallback(Callback):
    """Gradual learning-rate warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``,
    adjusted every batch (Goyal et al. 2017, "Accurate, Large Minibatch SGD"; Horovod's callback).

    Args:
      initial_lr: the learning rate reached at the end of the warmup (usually base_lr * size).
      warmup_epochs: number of epochs the warmup lasts.
      steps_per_epoch: batches per epoch (default: what each ``fit`` reports; a dataset of unknown
        length needs it).
      verbose: 1 prints the learning rate on rank 0 when the warmup ends.

    Attributes:
      current_lr: the learning rate last set (None before the first batch).
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self._given_steps = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self.current_lr = None

    def on_train_begin(self, logs=None):
        """Take ``steps_per_epoch`` from this ``fit`` when it was not given.

        Args:
          logs: Keras's logs (unused).

        Raises:
          ConfigurationError: not given, and ``fit`` does not know the epoch's length.
        """
        if self._given_steps is not None:
            self.steps_per_epoch = self._given_steps
            return
        steps = self.params.get("steps")  # re-read at every fit: the next one may have other data
        if not steps:
            raise ConfigurationError(
                f"LearningRateWarmupCallback cannot tell how many batches an epoch has: fit() reports "
                f"steps={steps!r} (a dataset of unknown length, e.g. from a generator or after filter())",
                rank=process.rank() if process.is_initialized() else None,
                fix="pass steps_per_epoch= to LearningRateWarmupCallback (or to fit())")
        self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch, logs=None):
        """Remember the epoch, for the per-batch schedule.

        Args:
          epoch: the epoch that begins.
      logs: Keras's logs (unused).
        """
        self._epoch = epoch

    def lr_at(self, epoch: int, batch: int) -> float:
        """The learning rate of batch ``batch`` of epoch ``epoch`` during the warmup.

        Args:
          epoch: 0-based epoch.
          batch: 0-based batch within the epoch.

        Returns:
          ``initial_lr`` times the warmup multiplier (1 / size at the start, 1 at the end).
        """
        frac = epoch + float(batch) / max(1, self.steps_per_epoch)
        return self.initial_lr * logic.warmup_multiplier(frac, process.size() if process.is_initialized() else 1,
                                                         self.warmup_epochs)

    def on_train_batch_begin(self, batch, logs=None):
        """Set the optimizer's learning rate for this batch while the warmup lasts.

        Args:
          batch: the batch within the epoch.
      logs: Keras's logs (unused).
        """
        if self._epoch >= self.warmup_epochs:
            return
        self.current_lr = self.lr_at(self._epoch, batch)
        _set_lr(self.model.optimizer, self.current_lr)

    def on_epoch_end(self, epoch, logs=None):
        """At the warmup's last epoch set ``initial_lr``; record the learning rate as ``logs["lr"]``.

        Args:
          epoch: the epoch that ended.
          logs: the epoch logs; ``lr`` is added.
        """
        if epoch + 1 == int(np.ceil(self.warmup_epochs)):
            self.current_lr = self.initial_lr
            _set_lr(self.model.optimizer, self.initial_lr)
            if self.verbose and (not process.is_initialized() or process.rank() == 0):
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        if logs is not None:
            logs["lr"] = float(np.asarray(_get_lr(self.model.optimizer)))


def _lr_var(opt):
    return getattr(opt, "learning_rate", None) if hasattr(opt, "learning_rate") else opt.lr


def _set_lr(opt, value: float) -> None:
    var = _lr_var(opt)
    if hasattr(var, "assign"):
        var.assign(value)
    else:
        keras.backend.set_value(var, value)


def _get_lr(opt):
    var = _lr_var(opt)
    return var.numpy() if hasattr(var, "numpy") else var


def verbosity(verbose="auto") -> int:
    """``verbose`` argument for fit/evaluate/predict: the progress bar on rank 0 only.

    ``model.fit(..., verbose=tfcs.callbacks.verbosity())``; under ``CommStrategy`` the default
    ``verbose="auto"`` already does this.

    Args:
      verbose: what rank 0 should use; "auto" (or None) means 1.

    Returns:
      ``verbose`` on rank 0 (1 for "auto"), 0 on the other ranks for "auto", ``verbose`` otherwise.
    """
    return logic.rank0_verbosity(verbose, process.rank() if process.is_initialized() else 0)
