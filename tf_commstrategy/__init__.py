"""tf_commstrategy: data-parallel training across worker processes for TensorFlow / tf_keras.

Layers (data flows downwards only; docs/architecture.md, checked by tests/unit/test_layers.py):

* Keras callbacks (``tf_commstrategy.callbacks``)
* the TF layer: ``CommStrategy``, its cross-device ops, tensor conversion (``tf_commstrategy.tf``)
* the direct API (``collectives``, ``process``, ``process_group``): numpy / cupy buffers
* ``backends``, ``rendezvous`` and the collective core (``core``): no TensorFlow import
* ``config`` and ``errors``

Importing this package does not import TensorFlow; the TF layer loads on first use:
``tfcs.CommStrategy``, ``tfcs.CommOptions``, ``tfcs.unwrap_errors`` and ``tfcs.callbacks`` are
imported when first accessed.
"""

import importlib as _importlib

from . import collectives as _collectives
from .collectives import (allgather, allreduce, alltoall, barrier, broadcast, grouped_allreduce,
                          grouped_broadcast, reduce_scatter, shared_empty)
from .core.reduce_ops import ReduceOp
from .errors import (BackendUnavailableError, CollectiveAbortedError, CollectiveError,
                     CollectiveMismatchError, CollectiveTimeoutError, ConfigurationError,
                     NotInitializedError, PeerLostError, RendezvousError, TfcsError,
                     UnsupportedOperationError)
from .process import init, is_initialized, local_rank, local_size, rank, shutdown, size

__version__ = "0.1.0"

# A tf.Tensor passed to tfcs.allreduce and friends loads the TF layer, which registers its handling.
_collectives.register_tensor_loader("tensorflow", lambda: _importlib.import_module(".tf", __name__))

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "grouped_allreduce", "broadcast", "grouped_broadcast", "allgather", "reduce_scatter",
    "alltoall", "barrier", "shared_empty", "ReduceOp",
    "TfcsError", "ConfigurationError", "NotInitializedError", "RendezvousError", "CollectiveError",
    "CollectiveTimeoutError", "CollectiveMismatchError", "PeerLostError", "CollectiveAbortedError",
    "BackendUnavailableError", "UnsupportedOperationError",
]


def __getattr__(name):  # lazy access to the TF layer, so `import tf_commstrategy` stays light
    if name in ("CommStrategy", "CommOptions"):
        from . import tf as _tf
        return getattr(_tf, name)
    if name == "unwrap_errors":
        from .tf.tensor_ops import unwrap_errors
        return unwrap_errors
    if name == "callbacks":
        return _importlib.import_module(".callbacks", __name__)
    raise AttributeError(f"module 'tf_commstrategy' has no attribute {name!r}")
