"""Collective backends. Importing this package registers every backend that ships with tfcs."""

from .grpc import backend as _grpc  # noqa: F401  (registers "grpc")
