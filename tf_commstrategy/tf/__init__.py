"""The TF layer: ``CommStrategy``, its cross-device ops, tensor conversion, per-call options.

Imports TensorFlow; the collective core below it does not.
"""

from .options import CommOptions
from .strategy import CommExtended, CommStrategy, local_replica_reads

__all__ = ["CommStrategy", "CommExtended", "CommOptions", "local_replica_reads"]
