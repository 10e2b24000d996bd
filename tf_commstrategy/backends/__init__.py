"""Collective backends. Importing this package registers every backend that ships with tfcs."""

from . import nccl as _nccl  # noqa: F401  (registers "nccl")
from .grpc import backend as _grpc  # noqa: F401  (registers "grpc")
