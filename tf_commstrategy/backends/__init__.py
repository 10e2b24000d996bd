"""Collective backends. Importing this package registers every backend that ships with tfcs."""

from . import nccl as _nccl  # noqa: F401  (registers "nccl")
from .host import backend as _host  # noqa: F401  (registers "grpc")
