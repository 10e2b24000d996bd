"""Horovod's TensorFlow API on tf_commstrategy: ``import tf_commstrategy.horovod as hvd`` in place of
``import horovod.tensorflow as hvd`` or ``import horovod.tensorflow.keras as hvd``.

The names of both Horovod modules (TensorFlow 2), with Horovod's signatures and defaults:

* basics (``basics.py``): ``init``, ``shutdown``, ``size``, ``rank``, ``local_*``, ``cross_*``, build
  flags, ``ProcessSet`` (only ``global_process_set`` is supported);
* collectives (``ops.py``): ``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
  ``broadcast``, ``broadcast_``, ``reducescatter``, ``grouped_reducescatter``, ``alltoall``, ``barrier``,
  ``join`` and the reductions ``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` (``Adasum`` raises
  ``UnsupportedOperationError``);
* ``Compression`` (``compression.py``); ``broadcast_variables``, ``broadcast_object``,
  ``allgather_object`` (``functions.py``);
* the Keras half: ``DistributedOptimizer``, ``load_model`` (``optimizer.py``), ``DistributedGradientTape``,
  ``PartialDistributedGradientTape`` (``gradient_tape.py``), ``callbacks``.

Importing this package imports TensorFlow. Where Horovod's semantics and the core's differ (names,
``join``, process sets), ``ops.py`` and ``basics.py`` say how.
"""

from .basics import (HorovodNotInitializedError, ProcessSet, add_process_set, ccl_built, cross_rank, cross_size,
                     cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set, init, is_homogeneous,
                     is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                     rank, remove_process_set, rocm_built, shutdown, size)
from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall, barrier, broadcast,
                  broadcast_, check_num_rank_power_of_2, grouped_allgather, grouped_allreduce, grouped_reducescatter,
                  handle_average_backwards_compatibility, join, local_rank_op, local_size_op, process_set_included_op,
                  rank_op, reducescatter, size_op)

from . import callbacks
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .optimizer import DistributedOptimizer, load_model

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "HorovodNotInitializedError",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "reducescatter", "grouped_reducescatter", "alltoall", "barrier", "join",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object",
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape", "load_model", "callbacks",
]
