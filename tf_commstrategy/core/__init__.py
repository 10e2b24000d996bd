"""The framework-agnostic collective core: reduction ops, ring algorithms, backends, process group.

Nothing under this package imports TensorFlow.
"""
