"""The TF layer: ``CommStrategy``, its cross-device ops, tensor conversion, per-call options.

Imports TensorFlow; the collective core below it does not.
"""

from .. import collectives as _collectives
from . import tensor_ops as _tensor_ops
from .options import CommOptions
from .strategy import CommExtended, CommStrategy, install_keras_patches, local_replica_reads
from .tensor_ops import setup_compiled_allreduce

_collectives.register_tensor_handler(_tensor_ops)  # tf.Tensor arguments of tfcs.allreduce and friends

__all__ = ["CommStrategy", "CommExtended", "CommOptions", "local_replica_reads", "install_keras_patches",
           "setup_compiled_allreduce"]
