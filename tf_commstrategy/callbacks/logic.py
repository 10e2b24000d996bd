"""What the Keras callbacks do, apart from the Keras base class (so it is unit-testable).

This module imports no TensorFlow: the functions take plain values and the collective calls to use.
(Importing it still runs the package's ``__init__``, which loads the Keras classes and so TensorFlow.)
"""

from __future__ import annotations

import numbers
from typing import Callable, Dict, List, Sequence

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
