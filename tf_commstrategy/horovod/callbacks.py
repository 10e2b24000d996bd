"""Horovod's Keras callbacks (``hvd.callbacks``), with Horovod's timing and formulas.

They differ from ``tf_commstrategy.callbacks`` (made for ``CommStrategy``) where Horovod does:
``BroadcastGlobalVariablesCallback`` broadcasts at the END of the first batch (once the first step has
built the optimizer), not when training begins; ``LearningRateWarmupCallback`` follows Horovod's
schedule (evaluated one batch ahead, with momentum correction), and ``LearningRateScheduleCallback``
and ``BestModelCheckpoint`` exist. The pure parts are shared in ``tf_commstrategy/callbacks/logic.py``.
Each callback (``BestModelCheckpoint`` aside, a tf_keras ``ModelCheckpoint``) is a callback of tf_keras
and of Keras 3 at once.

Momentum correction: when a schedule changes the learning rate from ``old`` to ``new``, the momentum
of the next step is multiplied by ``new / old`` (Goyal et al. 2017). A momentum held in a variable
(``tf_keras.optimizers.legacy.SGD``) is changed for that step and restored after it, as in Horovod.
A momentum that is a Python float (``tf_keras.optimizers.SGD`` and ``RMSprop``, Keras 3's) is part of
the traced training step and cannot change; the momentum buffers are multiplied by ``new / old``
instead, which is the same step for heavy-ball momentum (SGD, RMSprop); for Nesterov SGD it differs in
the look-ahead term by the factor ``new / old`` on the momentum part.
"""

from __future__ import annotations

import logging
import numbers
from typing import Callable, List, Optional, Union

import numpy as np
import tensorflow as tf
import tf_keras

from .. import collectives
from ..callbacks import logic
from ..callbacks.keras_callbacks import Callback, _get_lr, _set_lr
from ..errors import ConfigurationError
from .basics import rank, size

log = logging.getLogger("tf_commstrategy")


def _optimizer_variables(opt) -> List:
    if opt is None:
        return []
    own = opt.variables
    return list(own() if callable(own) else own)


class BroadcastGlobalVariablesCallback(Callback):
    """At the end of the first batch, give every process root's model and optimizer variables.

    The broadcast comes after the first step (as in Horovod), when the optimizer has built its slots;
    that step's update is then overwritten by root's. It happens once per callback object (a second
    ``fit`` with the same callback does not broadcast again). All variables travel in one fused
    broadcast per dtype.

    Args:
      root_rank: the rank whose variables everybody takes.
      device: accepted (the core places the transfer).
      local_variables: a variable or list of variables that each process keeps (not broadcast).

    Attributes:
      broadcast_done: whether the broadcast has happened.

    Raises:
      ConfigurationError: ``local_variables`` holds something that is not a ``tf.Variable``; ``root_rank``
        is not a rank of the job (at the broadcast).
      CollectiveError: a subclass, from the broadcast.
    """

    def __init__(self, root_rank: int, device: str = '', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local: List[tf.Variable] = []
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, tf.Variable):
            local_variables = [local_variables]
        elif not all(isinstance(v, tf.Variable) for v in local_variables):
            raise ConfigurationError("All local variables must be of tf.Variable type.",
                                     fix="pass a tf.Variable or a list of them as local_variables")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var: tf.Variable) -> None:
        """Leave ``var`` out of the broadcast (each process keeps its own value).

        Args:
          var: a variable of the model.
        """
        self._local.append(var)

    def on_train_batch_end(self, batch, logs=None):
        """Broadcast, the first time.

        Args:
          batch: the batch that ended.
          logs: Keras's logs (unused).
        """
        if self.broadcast_done:
            return
        model = self.model
        variables = logic.distinct(list(model.variables) + _optimizer_variables(model.optimizer),
                                   exclude_ids=[id(v) for v in self._local])
        values = logic.broadcast_state([np.asarray(v.numpy()) for v in variables], self.root_rank,
                                       lambda arrs, root: collectives.grouped_broadcast(arrs, root_rank=root))
        for v, value in zip(variables, values):
            v.assign(value)
        self.broadcast_done = True


class MetricAverageCallback(Callback):
    """At the end of every epoch, replace every scalar of the logs by its average over the processes.

    Keys are reduced in sorted order, so every process issues the same collectives. Put it before the
    callbacks that read the epoch logs (ReduceLROnPlateau, EarlyStopping, TensorBoard, ...), so that
    every process takes the same decision.

    Args:
      device: accepted (the core places the transfer).

    Raises:
      CollectiveError: a subclass, from the all-reduce (e.g. processes with different log keys).
    """

    def __init__(self, device: str = ''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        """Average the logs in place.

        Args:
          epoch: the epoch that ended.
          logs: the epoch logs.
        """
        if logs is None or size() == 1:
            return
        logic.average_logs(logs, lambda a, op: collectives.allreduce(a, op=op))


class LearningRateScheduleCallback(Callback):
    """Between ``start_epoch`` and ``end_epoch``, set the learning rate to ``initial_lr * multiplier(epoch)``.

    A constant ``multiplier`` means exponential decay: ``multiplier ** (epoch - start_epoch)``. With
    ``staircase`` the rate changes at the first batch of each epoch (integer epochs); without, at every
    batch (``epoch + batch / steps_per_epoch``). The epoch logs get ``lr``.

    Args:
      initial_lr: the rate the multiplier scales (usually the base rate times ``size()``).
      multiplier: a number, or a function of the (fractional) epoch.
      start_epoch: first epoch of the schedule.
      end_epoch: the epoch where it stops (exclusive; None: never).
      staircase: per epoch (True) or per batch (False).
      momentum_correction: scale the momentum for the step after each change (see the module's docstring).
      steps_per_epoch: batches per epoch (per batch schedules; default: what ``fit`` reports).

    Raises:
      ConfigurationError: ``initial_lr`` is None; at the start of ``fit``, a per batch schedule that
        cannot tell the epoch's length.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ConfigurationError("Parameter `initial_lr` is required",
                                     fix="pass the learning rate the schedule scales")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.restore_momentum = None
        self.current_epoch = None
        self.multiplier = multiplier if callable(multiplier) else logic.exponential_multiplier(multiplier,
                                                                                                 start_epoch)
        self._warned = False

    def on_train_begin(self, logs=None):
        """Find ``steps_per_epoch`` for a per batch schedule.

        Args:
          logs: Keras's logs (unused).

        Raises:
          ConfigurationError: ``fit`` does not know the epoch's length and none was given.
        """
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = logic.steps_from_params(self.params or {})
            if not self.steps_per_epoch:
                raise ConfigurationError(
                    f"Could not autodetect the number of steps per epoch (fit() reports {self.params!r})",
                    rank=rank(), fix=f"pass steps_per_epoch= to {type(self).__name__}() (or to fit())")

    def on_epoch_begin(self, epoch, logs=None):
        """Remember the epoch.

        Args:
          epoch: the epoch that begins.
          logs: Keras's logs (unused).
        """
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        """Set this batch's learning rate (and momentum) while the schedule lasts.

        Args:
          batch: the batch within the epoch.
          logs: Keras's logs (unused).
        """
        epoch = logic.schedule_epoch(self.current_epoch, batch, self.start_epoch, self.end_epoch, self.staircase,
                                     self.steps_per_epoch)
        if epoch is not None:
            self._adjust_learning_rate(epoch)

    def on_train_batch_end(self, batch, logs=None):
        """Restore a momentum variable changed for the batch.

        Args:
          batch: the batch that ended.
          logs: Keras's logs (unused).
        """
        if self.restore_momentum:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        """Record the learning rate as ``logs["lr"]``.

        Args:
          epoch: the epoch that ended.
          logs: the epoch logs.
        """
        if logs is not None:
            logs["lr"] = float(np.asarray(_get_lr(self.model.optimizer)))

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        old_lr = float(np.asarray(_get_lr(opt)))
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(opt, new_lr)
        if not self.momentum_correction or not hasattr(opt, "momentum"):
            return
        momentum = opt.momentum
        if hasattr(momentum, "assign"):  # a variable: change it for this step (restored after the batch)
            self.restore_momentum = float(np.asarray(momentum.numpy()))
            momentum.assign(logic.corrected_momentum(self.restore_momentum, new_lr, old_lr))
        elif isinstance(momentum, numbers.Number) and momentum != 0:
            self._scale_momentum_buffers(opt, logic.corrected_momentum(1.0, new_lr, old_lr))

    def _scale_momentum_buffers(self, opt, factor: float) -> None:
        """Multiply the momentum buffers by ``factor`` (none yet before the first step: nothing to do)."""
        if factor == 1.0:
            return
        buffers = getattr(opt, "momentums", None)
        if buffers is None:
            buffers = getattr(opt, "_momentums", None)
        if buffers is None:
            if getattr(opt, "_built", False) or getattr(opt, "built", False):
                if not self._warned:
                    self._warned = True
                    log.warning("%s: no momentum correction for %s (its momentum buffers are not where SGD and "
                                "RMSprop keep them)", type(self).__name__, type(opt).__name__)
            return
        for m in buffers:
            m.assign(m * tf.cast(factor, m.dtype))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup: from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``, every batch.

    Horovod's formula (Goyal et al. 2017), evaluated one batch ahead so that the last batch of the
    warmup runs at ``initial_lr``: ``lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` with
    ``e = epoch + (batch + 1) / steps_per_epoch``.

    Args:
      initial_lr: the rate at the end of the warmup (usually the base rate times ``size()``).
      warmup_epochs: the warmup's length in epochs.
      momentum_correction: scale the momentum for the step after each change.
      steps_per_epoch: batches per epoch (default: what ``fit`` reports).
      verbose: 1 prints on rank 0 when the warmup ends.

    Raises:
      ConfigurationError: at the start of ``fit``, when it cannot tell the epoch's length.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        def multiplier(epoch):
            return logic.horovod_warmup_multiplier(epoch, size(), warmup_epochs, self.steps_per_epoch)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        """Record ``lr``; at the warmup's last epoch, say so on rank 0 with ``verbose``.

        Args:
          epoch: the epoch that ended.
          logs: the epoch logs.
        """
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            new_lr = float(np.asarray(_get_lr(self.model.optimizer)))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")


class BestModelCheckpoint(tf_keras.callbacks.ModelCheckpoint):
    """A tf_keras ``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``).

    As in Horovod, it has no path of its own: set ``filepath`` before ``fit`` (Horovod's Spark estimators
    do). Every process must pass it to ``fit`` (the decision reads the epoch logs: put
    ``MetricAverageCallback`` first); save on rank 0 only by giving the other ranks a scratch path.

    Args:
      monitor: the logged quantity to watch.
      verbose: 1 prints when a model is saved.
      save_weights_only: save the weights only.
      mode: "auto", "min" or "max".
      save_freq: "epoch" or a number of batches.
    """

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto', save_freq='epoch'):
        super().__init__(filepath=None, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
