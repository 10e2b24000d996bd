"""What the Keras callbacks do, apart from the Keras base class (so it is unit-testable).

This module imports no TensorFlow: the functions take plain values and the collective calls to use.
(Importing it still runs the package's ``__init__``, which loads the Keras classes and so TensorFlow.)
"""

from __future__ import annotations

import numbers
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np


def warmup_multiplier(epoch: float, size: int, warmup_epochs: float) -> float:
    """Gradual warmup (Goyal et al. 2017, as in Horovod): lr = initial_lr * multiplier.

    Starts at 1 / size (epoch 0) and grows linearly to 1 at ``warmup_epochs``; 1 afterwards.
    ``epoch`` is fractional: epoch + batch / steps_per_epoch.

    Args:
      epoch: fractional epoch.
      size: number of workers.
      warmup_epochs: length of the warmup (<= 0: no warmup).

    Returns:
      The multiplier, in [1 / size, 1].
    """
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return 1.0
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1.0)


def scalar_keys(logs: Dict) -> List[str]:
    """Keys of ``logs`` whose values are scalars, sorted: every rank reduces them in the same order.

    Args:
      logs: Keras epoch logs.

    Returns:
      The sorted keys of the numeric scalar entries.
    """
    out = []
    for k, v in logs.items():
        if isinstance(v, numbers.Number) or (hasattr(v, "shape") and np.ndim(v) == 0):
            out.append(k)
    return sorted(out)


def average_logs(logs: Dict, allreduce: Callable[[np.ndarray, str], np.ndarray]) -> Dict:
    """Replace every scalar in ``logs`` by its mean over workers, in place; returns ``logs``.

    Values identical on every worker (global metrics) are left bit-for-bit unchanged: averaging them
    in floating point could change the last bit.

    Args:
      logs: Keras epoch logs, changed in place.
      allreduce: ``allreduce(array, op) -> array`` over all workers (op "sum", "min" or "max").

    Returns:
      ``logs``.
    """
    keys = scalar_keys(logs)
    if not keys:
        return logs
    vals = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
    total = allreduce(vals, "sum")
    lo = allreduce(vals, "min")
    hi = allreduce(vals, "max")
    n = allreduce(np.ones(1, dtype=np.float64), "sum")[0]
    for i, k in enumerate(keys):
        if lo[i] == hi[i]:
            continue  # the same on every worker: already global
        logs[k] = float(total[i] / n)
    return logs


def broadcast_state(arrays: Sequence[np.ndarray], root_rank: int,
                    grouped_broadcast: Callable[[Sequence[np.ndarray], int], List[np.ndarray]]) -> List[np.ndarray]:
    """Root's values of ``arrays`` (fused per dtype into one transfer).

    Args:
      arrays: this worker's values.
      root_rank: the rank whose values everybody takes.
      grouped_broadcast: ``grouped_broadcast(arrays, root) -> arrays``.

    Returns:
      Root's values, in order (an empty list for no arrays, without a collective).
    """
    return list(grouped_broadcast(list(arrays), root_rank)) if arrays else []


def rank0_verbosity(verbose, rank: int, default: int = 1):
    """Keras ``verbose`` for this rank: "auto" means the progress bar on rank 0 and silence elsewhere.

    Args:
      verbose: the requested value; "auto" or None for the rank-dependent default.
      rank: this worker's rank.
      default: what rank 0 gets for "auto".

    Returns:
      The ``verbose`` value to pass to Keras.
    """
    if verbose == "auto" or verbose is None:
        return default if rank == 0 else 0
    return verbose


# -- Horovod's learning-rate schedules (tf_commstrategy.horovod.callbacks) ------------------------------------


def horovod_warmup_multiplier(epoch: float, size: int, warmup_epochs: float, steps_per_epoch: int) -> float:
    """Horovod's warmup multiplier at the fractional ``epoch`` (epoch + batch / steps_per_epoch).

    Horovod evaluates the warmup one batch ahead (``epoch + 1 / steps_per_epoch``), so the last batch of
    the warmup already runs at the full rate and every epoch ends on a round value. The multiplier is
    not clamped: the schedule callback applies it inside the warmup epochs only.

    Args:
      epoch: fractional epoch of the batch about to run.
      size: number of workers.
      warmup_epochs: length of the warmup.
      steps_per_epoch: batches per epoch.

    Returns:
      ``1 / size * ((epoch + 1 / steps_per_epoch) * (size - 1) / warmup_epochs + 1)``.
    """
    epoch = epoch + 1.0 / steps_per_epoch
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1.0)


def exponential_multiplier(multiplier: float, start_epoch: float) -> Callable[[float], float]:
    """A constant multiplier of a schedule as Horovod reads it (since 0.23): exponential decay.

    Args:
      multiplier: the factor per epoch.
      start_epoch: the epoch at which the factor is 1.

    Returns:
      ``f(epoch) = multiplier ** (epoch - start_epoch)``.
    """
    return lambda epoch: multiplier ** (epoch - start_epoch)


def schedule_epoch(epoch: int, batch: int, start_epoch: float, end_epoch: Optional[float], staircase: bool,
                   steps_per_epoch: Optional[int]) -> Optional[float]:
    """The epoch a schedule evaluates its multiplier at before ``batch``, or None when it leaves the rate.

    Args:
      epoch: the current epoch (0-based).
      batch: the batch about to run, within the epoch.
      start_epoch: first epoch of the schedule.
      end_epoch: the epoch where the schedule stops (exclusive; None: never).
      staircase: True: once per epoch, at its first batch, at the integer epoch; False: every batch, at
        the fractional epoch ``epoch + batch / steps_per_epoch``.
      steps_per_epoch: batches per epoch (needed when not ``staircase``).

    Returns:
      The epoch to evaluate the multiplier at, or None outside the schedule (and on later batches of a
      staircase epoch).
    """
    if epoch < start_epoch or (end_epoch is not None and epoch >= end_epoch):
        return None
    if staircase:
        return float(epoch) if batch == 0 else None
    return epoch + float(batch) / steps_per_epoch


def corrected_momentum(momentum: float, new_lr: float, old_lr: float) -> float:
    """Momentum correction (Goyal et al. 2017): the momentum for the one step after a rate change.

    The momentum buffer holds updates scaled by the old rate; multiplying the momentum by
    ``new_lr / old_lr`` for one step makes the step the one the new rate would have built.

    Args:
      momentum: the optimizer's momentum.
      new_lr: the rate of the step about to run.
      old_lr: the rate of the previous step.

    Returns:
      ``momentum * new_lr / old_lr`` (``momentum`` when ``old_lr`` is 0).
    """
    return momentum if old_lr == 0 else momentum * new_lr / old_lr


def steps_from_params(params: Dict) -> Optional[int]:
    """Batches per epoch from a Keras ``fit``'s ``params``, as Horovod detects them.

    Args:
      params: ``callback.params``.

    Returns:
      ``params["steps"]``, else ``samples // batch_size``, else None.
    """
    if params.get("steps"):
        return int(params["steps"])
    if params.get("samples") and params.get("batch_size"):
        return int(params["samples"]) // int(params["batch_size"])
    return None


def distinct(items: Sequence, exclude_ids: Iterable[int] = ()) -> List:
    """``items`` in order, each object once (by identity), without the objects whose ``id`` is excluded.

    Args:
      items: e.g. a model's and its optimizer's variables (a shared layer lists its variables twice).
      exclude_ids: ``id()`` of objects to leave out (e.g. worker-local variables).

    Returns:
      The remaining objects, in their first order.
    """
    out, seen = [], set(exclude_ids)
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out
