"""The collective-backend interface and the registry that resolves "grpc", "nccl" and "auto".

A backend is built once per process group (lazily, on first use) and moves framework-neutral
buffers: numpy arrays for grpc, cupy arrays (or DLPack capsules) for nccl. Backends never import
TensorFlow. Each public method validates nothing the caller already validated; ``ProcessGroup``
and the direct API check arguments, backends do the moving.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import BackendUnavailableError, ConfigurationError
from .reduce_ops import ReduceOp


class Backend(abc.ABC):
    """What every collective backend implements. All calls are collective: every rank must make
    the same calls in the same order with matching arguments (checked, see ``signature``)."""

    name: str = "?"

    @abc.abstractmethod
    def allreduce(self, buf, op: ReduceOp, timeout: Optional[float] = None):
        """Return a new buffer holding ``op`` over every rank's ``buf`` (same shape and dtype)."""

    @abc.abstractmethod
    def broadcast(self, buf, root: int, timeout: Optional[float] = None):
        """Return root's ``buf`` on every rank (same shape and dtype on every rank)."""

    @abc.abstractmethod
    def allgather(self, buf, timeout: Optional[float] = None):
        """Concatenate every rank's ``buf`` along axis 0 in rank order; first dims may differ."""

    @abc.abstractmethod
    def reduce_scatter(self, buf, op: ReduceOp, timeout: Optional[float] = None):
        """Reduce, then give rank r the r-th of ``world_size`` pieces of axis 0 (np.array_split rule)."""

    @abc.abstractmethod
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Return once every rank has entered the barrier."""

    def batch_allreduce(self, bufs: Sequence, op: ReduceOp, timeout: Optional[float] = None) -> List:
        """Allreduce many buffers; the default fuses per dtype into one transfer (backends may override)."""
        from .fusion import fused_allreduce
        return fused_allreduce(self, bufs, op, timeout)

    def batch_broadcast(self, bufs: Sequence, root: int, timeout: Optional[float] = None) -> List:
        from .fusion import fused_broadcast
        return fused_broadcast(self, bufs, root, timeout)

    def batch_allgather(self, bufs: Sequence, timeout: Optional[float] = None) -> List:
        return [self.allgather(b, timeout) for b in bufs]

    def accepts(self, buf) -> bool:
        """True when this backend can move ``buf`` without a conversion (used by "auto")."""
        return True

    def close(self) -> None:
        """Release resources; called by ``ProcessGroup.shutdown``."""

    def abort(self, error: BaseException) -> None:
        """Fail every pending and future collective of this backend with ``error``."""


#: name -> factory(process_group) -> Backend
_FACTORIES: Dict[str, Callable] = {}


def register_backend(name: str, factory: Callable) -> None:
    """Register a backend factory under ``name`` (used by grpc and nccl; plugins may add more)."""
    _FACTORIES[name] = factory


def backend_names() -> List[str]:
    return sorted(_FACTORIES) + ["auto"]


def factory_for(name: str) -> Callable:
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ConfigurationError(f"unknown backend {name!r}", fix=f"use one of {backend_names()}") from None


def normalize_backend_name(name: Optional[str]) -> Optional[str]:
    """Map user spellings (including TF's CommunicationImplementation names) to registry names."""
    if name is None:
        return None
    key = getattr(name, "name", name)
    key = str(key).strip().lower()
    aliases = {"ring": "grpc", "grpc": "grpc", "nccl": "nccl", "auto": "auto"}
    if key not in aliases and key not in _FACTORIES:
        raise ConfigurationError(f"unknown backend {name!r}", fix=f"use one of {backend_names()}")
    return aliases.get(key, key)


def unavailable(name: str, why: str, fix: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"backend {name!r} cannot run here: {why}", fix=fix)
