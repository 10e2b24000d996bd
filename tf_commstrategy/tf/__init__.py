"""The TF layer: ``CommStrategy``, its cross-device ops, tensor conversion, per-call options.

Imports TensorFlow; the collective core below it does not.
"""

from .options import CommOptions
from .strategy import CommStrategy, CommExtended

__all__ = ["CommStrategy", "CommExtended", "CommOptions"]
