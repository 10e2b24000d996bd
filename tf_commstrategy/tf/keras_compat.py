"""The one place where tf_keras is taught about CommStrategy.

tf_keras gathers ``predict`` outputs across workers only for ``MultiWorkerMirroredStrategy``
instances; for any other strategy it concatenates this worker's replicas only. CommStrategy is on
purpose not an MWMS instance (tf_keras would then also sum per-batch training logs across
workers), so ``reduce_per_replica(..., "concat")`` is routed through tf_keras's own multi-worker
concatenation (``strategy.gather`` -> our all-gather), in the same replica order it uses for MWMS.
Every other reduction is left to tf_keras unchanged. Also, ``verbose="auto"`` (the default of
fit/evaluate/predict) shows the progress bar on rank 0 only.
"""

from __future__ import annotations

import tensorflow as tf

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    try:
        from tf_keras.src.engine import training
    except ImportError:  # tf_keras not installed: nothing to teach
        return
    original = training.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        from .strategy import CommStrategy
        if (reduction == "concat" and isinstance(strategy, CommStrategy)
                and strategy.extended._in_multi_worker_mode()):
            return tf.nest.map_structure(lambda v: training._multi_worker_concat(v, strategy), values)
        return original(values, strategy, reduction)

    reduce_per_replica.__wrapped__ = original
    training.reduce_per_replica = reduce_per_replica

    original_verbosity = training._get_verbosity

    def _get_verbosity(verbose, distribute_strategy):
        # verbose="auto" (tf_keras's default) under CommStrategy: the progress bar on rank 0 only.
        from .strategy import CommStrategy
        if verbose == "auto" and isinstance(distribute_strategy, CommStrategy) and \
                distribute_strategy.extended._id_in_cluster != 0:
            return 0
        return original_verbosity(verbose, distribute_strategy)

    _get_verbosity.__wrapped__ = original_verbosity
    training._get_verbosity = _get_verbosity
    _installed = True
