"""The collective-backend interface and the registry that resolves "grpc", "nccl" and "auto".

A backend is built once per process group (lazily, on first use) and moves framework-neutral
buffers: numpy arrays for grpc, cupy arrays (or DLPack capsules) for nccl. Backends never import
TensorFlow. Each public method validates nothing the caller already validated; ``ProcessGroup``
and the direct API check arguments, backends do the moving.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Dict, List, Optional, Protocol, Sequence

from ..errors import BackendUnavailableError, CollectiveMismatchError, ConfigurationError, UnsupportedOperationError
from .reduce_ops import ReduceOp


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the interface every backend implements; callers read these
    instead of probing for methods.

    Attributes:
      out_arrays: ``allreduce(buf, op, timeout, out=array)`` writes the result into ``array``
        (numpy, C-contiguous, ``buf``'s shape and dtype; ``out=buf`` reduces in place).
      shared_arrays: ``shared_empty(shape, dtype, timeout)`` gives arrays the host's ranks share.
      device_arrays: the backend moves GPU memory (cupy arrays, DLPack producers), not host memory.
    """

    out_arrays: bool = False
    shared_arrays: bool = False
    device_arrays: bool = False


@dataclasses.dataclass(frozen=True)
class BackendStats:
    """What a backend has done since it was built; backends may return a subclass with more fields.

    Attributes:
      collectives: the collectives this rank has issued on the backend.
      collective_bytes: the bytes of the buffers this rank's collectives moved, as they travel (after
        compression: a float32 buffer all-reduced with ``compression="fp16"`` counts half its size).
    """

    collectives: int = 0
    collective_bytes: int = 0


class CollectiveWatch(Protocol):
    """A layer above with collectives of its own that do not go through the backends (the TF layer's
    compiled all-reduce), told when this rank is inside a backend collective
    (``ProcessGroup.add_collective_watch``)."""

    def python_enter(self) -> None:
        """This rank enters a backend collective."""

    def python_leave(self) -> None:
        """This rank left it."""

    def python_problem(self, seq: int, sig: str) -> Optional[CollectiveMismatchError]:
        """While this rank waits in backend collective ``seq`` [``sig``]: the error to raise when the
        ranks called different collectives (a peer waits in one of the layer's own), or None."""


class Group(Protocol):
    """What a backend uses of the process group that builds it (``ProcessGroup`` is one).

    Attributes:
      rank, size: this process's rank and the job's size.
      workers: every rank's published ``WorkerInfo`` (host, addresses, pid, shared-memory key), in rank order.
      store: the job's key-value store (``set``, ``get``, ``add``, ``barrier``), over the control plane.
      timeout: the default deadline of a collective, in seconds.
      rendezvous_timeout: the deadline of setup steps, in seconds.
      chunk_bytes: the ring's chunk size (None: chosen per transport).
      transport: the data path asked for ("auto", "shm", "unix", "tcp", "grpc").
      token: the job's shared secret (None: none configured).
      tls: the TLS settings (None: plaintext control plane).
      collective_watches: the layers told of this rank's backend collectives.
    """

    rank: int
    size: int
    workers: Sequence
    store: object
    timeout: float
    rendezvous_timeout: float
    chunk_bytes: Optional[int]
    transport: str
    token: Optional[str]
    tls: object
    collective_watches: Sequence[CollectiveWatch]

    def failed(self, error: BaseException) -> None:
        """A backend reports the error that made it unusable (from any thread)."""

    def layer_failure(self) -> Optional[BaseException]:
        """The error that made a layer above unusable (its own collectives), or None."""

    def built_backend(self, name: str) -> Optional["Backend"]:
        """The backend ``name`` if the group has built it, else None (never builds one)."""


class Backend(abc.ABC):
    """What every collective backend implements. All calls are collective: every rank must make
    the same calls in the same order with matching arguments (checked, see ``signature``).

    Buffers are framework-neutral (numpy arrays for grpc, cupy arrays for nccl). ``timeout`` is
    the call's deadline in seconds; None means the process group's (``TFCS_TIMEOUT``).

    Every collective method may raise:
      CollectiveMismatchError: ranks called different collectives, or with other arguments.
      CollectiveTimeoutError: a peer did not deliver before the deadline.
      PeerLostError: a peer died or its connection broke.
      CollectiveAbortedError: another rank failed and aborted the group.
      CollectiveError: the backend already failed earlier (it stays unusable).

    Attributes:
      name: the registry name ("grpc", "nccl", ...).
      capabilities: what it can do beyond this interface.
    """

    name: str = "?"
    capabilities: Capabilities = Capabilities()
    _failed: Optional[BaseException] = None

    @abc.abstractmethod
    def allreduce(self, buf, op: ReduceOp, timeout: Optional[float] = None, *, compression: str = "none"):
        """Return a new buffer holding ``op`` over every rank's ``buf`` (same shape and dtype).

        Args:
          buf: this rank's contribution; same shape and dtype on every rank.
          op: the reduction.
          timeout: deadline in seconds (None: the group's).
          compression: "none", "fp16" or "bf16" (``core.compression``): float32 / float64 sums and
            means travel as that dtype; the same on every rank (checked with the signature).

        Returns:
          The reduced buffer, of the same shape and dtype, on every rank.
        """

    @abc.abstractmethod
    def broadcast(self, buf, root: int, timeout: Optional[float] = None):
        """Return root's ``buf`` on every rank (same shape and dtype on every rank).

        Args:
          buf: the data on ``root``; a buffer of the same shape and dtype elsewhere.
          root: the rank whose data everybody gets.
          timeout: deadline in seconds (None: the group's).

        Returns:
          Root's data.
        """

    @abc.abstractmethod
    def allgather(self, buf, timeout: Optional[float] = None):
        """Concatenate every rank's ``buf`` along axis 0 in rank order; first dims may differ.

        Args:
          buf: this rank's block; trailing dimensions and dtype equal on every rank.
          timeout: deadline in seconds (None: the group's).

        Returns:
          All blocks, concatenated in rank order.
        """

    @abc.abstractmethod
    def reduce_scatter(self, buf, op: ReduceOp, timeout: Optional[float] = None):
        """Reduce, then give rank r the r-th of ``world_size`` pieces of axis 0 (np.array_split rule).

        Args:
          buf: this rank's contribution; same shape and dtype on every rank.
          op: the reduction.
          timeout: deadline in seconds (None: the group's).

        Returns:
          This rank's piece of the reduced buffer.
        """

    def alltoall(self, buf, splits: Optional[Sequence[int]] = None, timeout: Optional[float] = None):
        """Send rank d the ``splits[d]`` rows of ``buf`` after the ones for ranks before it; receive every
        rank's rows for this one, in rank order (Horovod's and MPI's all-to-all along axis 0).

        Args:
          buf: this rank's rows; trailing dimensions and dtype equal on every rank.
          splits: rows for each rank, in rank order, summing to ``buf.shape[0]`` (``check_splits``); None:
            ``buf.shape[0]`` divided evenly (it must divide).
          timeout: deadline in seconds (None: the group's).

        Returns:
          ``(received, received_splits)``: the rows from every rank concatenated in rank order, and how
          many came from each.

        Raises:
          UnsupportedOperationError: this backend has no all-to-all (the default), or bad ``splits``.
        """
        raise UnsupportedOperationError(f"the {self.name} backend has no alltoall",
                                        fix="use backend='grpc' (host buffers) or 'nccl' (GPU buffers)")

    @abc.abstractmethod
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Return once every rank has entered the barrier.

        Args:
          timeout: deadline in seconds (None: the group's).
        """

    def batch_allreduce(self, bufs: Sequence, op: ReduceOp, timeout: Optional[float] = None, *,
                        compression: str = "none") -> List:
        """Allreduce many buffers; the default fuses per dtype into one transfer (backends may override).

        Args:
          bufs: the buffers, in the same order on every rank.
          op: the reduction.
          timeout: deadline in seconds for each fused transfer (None: the group's).
          compression: as for ``allreduce``.

        Returns:
          The reduced buffers, in the order of ``bufs``.
        """
        from .fusion import fused_allreduce
        return fused_allreduce(self, bufs, op, timeout, compression=compression)

    def batch_broadcast(self, bufs: Sequence, root: int, timeout: Optional[float] = None) -> List:
        """Broadcast many buffers from ``root``, fused per dtype into one transfer each.

        Args:
          bufs: the buffers, in the same order on every rank.
          root: the rank whose data everybody gets.
          timeout: deadline in seconds for each fused transfer (None: the group's).

        Returns:
          Root's buffers, in the order of ``bufs``.
        """
        from .fusion import fused_broadcast
        return fused_broadcast(self, bufs, root, timeout)

    def accepts(self, buf) -> bool:
        """True when this backend can move ``buf`` without a conversion (used by "auto").

        Args:
          buf: a buffer.

        Returns:
          Whether ``buf`` can be passed as it is.
        """
        return True

    def stats(self) -> BackendStats:
        """What this backend has done so far (a subclass of ``BackendStats`` may say more)."""
        return BackendStats()

    def quiesce(self) -> None:
        """Shutdown has begun: peers going away is expected from now on (stop watching them)."""

    def close(self) -> None:
        """Release resources; called by ``ProcessGroup.shutdown``."""

    def failure(self) -> Optional[BaseException]:
        """The error that made this backend unusable (its own, or one another rank reported), else None."""
        return self._failed

    def abort(self, error: BaseException) -> None:
        """Fail every pending and future collective of this backend with ``error``.

        Args:
          error: what the pending and later calls raise.
        """


def check_splits(buf, splits: Optional[Sequence[int]], size: int, rank: int) -> List[int]:
    """The rows of ``buf`` for each rank of an all-to-all, checked.

    Args:
      buf: the rows (axis 0 is split).
      splits: one count per rank, or None to split ``buf.shape[0]`` evenly.
      size, rank: the job's size and this rank (for the message).

    Raises:
      UnsupportedOperationError: a scalar, a count list of the wrong length, negative counts, counts that
        do not add up to the rows, or rows that do not divide evenly when ``splits`` is None.
    """
    if len(getattr(buf, "shape", ())) == 0:
        raise UnsupportedOperationError("alltoall needs at least one dimension to split", rank=rank,
                                        fix="reshape the scalar to shape (1,)")
    rows = int(buf.shape[0])
    if splits is None:
        if rows % size:
            raise UnsupportedOperationError(
                f"alltoall without splits divides the {rows} rows evenly among {size} ranks, and they do not "
                f"divide", rank=rank, fix=f"pass splits= (rows per rank), or a multiple of {size} rows")
        return [rows // size] * size
    counts = [int(c) for c in splits]
    if len(counts) != size or any(c < 0 for c in counts) or sum(counts) != rows:
        raise UnsupportedOperationError(
            f"alltoall splits={counts} must be {size} counts >= 0 adding up to the {rows} rows", rank=rank,
            fix="give one row count per rank, in rank order")
    return counts


#: name -> factory(process_group) -> Backend
_FACTORIES: Dict[str, Callable] = {}
#: name -> availability() -> None if the backend can run here, else why not
_AVAILABILITY: Dict[str, Callable[[], Optional[str]]] = {}


def register_backend(name: str, factory: Callable,
                     availability: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Register a backend factory under ``name`` (used by grpc and nccl; plugins may add more).

    Args:
      name: the name users select it by (``backend=name``, ``TFCS_BACKEND=name``).
      factory: ``factory(process_group) -> Backend``, called once per process group on first use;
        it raises ``BackendUnavailableError`` when the backend cannot run here.
      availability: ``availability() -> None`` when the backend can run in this process, else the
        reason it cannot; cheap, no collective (the "auto" policy asks it). None: always available.
    """
    _FACTORIES[name] = factory
    if availability is not None:
        _AVAILABILITY[name] = availability
    else:
        _AVAILABILITY.pop(name, None)


def availability(name: str) -> Optional[str]:
    """Why backend ``name`` cannot run in this process, or None when it can.

    Args:
      name: a backend name.

    Returns:
      None, or the reason (also "not registered" for a name nobody registered).
    """
    if name not in _FACTORIES:
        return f"the {name} backend is not installed"
    probe = _AVAILABILITY.get(name)
    return probe() if probe is not None else None


def backend_names() -> List[str]:
    """The names a backend can be selected by.

    Returns:
      The registered names, sorted, then "auto".
    """
    return sorted(_FACTORIES) + ["auto"]


def factory_for(name: str) -> Callable:
    """The factory registered under ``name``.

    Args:
      name: a registered backend name (not "auto", which is a policy).

    Returns:
      ``factory(process_group) -> Backend``.

    Raises:
      ConfigurationError: no backend of that name is registered.
    """
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ConfigurationError(f"unknown backend {name!r}", fix=f"use one of {backend_names()}") from None


def normalize_backend_name(name: Optional[str]) -> Optional[str]:
    """Map user spellings (including TF's CommunicationImplementation names) to registry names.

    Args:
      name: e.g. "grpc", "GRPC", "ring", ``CommunicationImplementation.NCCL``, "auto", or None.

    Returns:
      The registry name ("ring" becomes "grpc"), or None for None.

    Raises:
      ConfigurationError: the name is not a known backend.
    """
    if name is None:
        return None
    key = getattr(name, "name", name)
    key = str(key).strip().lower()
    aliases = {"ring": "grpc", "grpc": "grpc", "nccl": "nccl", "auto": "auto"}
    if key not in aliases and key not in _FACTORIES:
        raise ConfigurationError(f"unknown backend {name!r}", fix=f"use one of {backend_names()}")
    return aliases.get(key, key)


def unavailable(name: str, why: str, fix: str) -> BackendUnavailableError:
    """The error a backend factory raises when it cannot run here.

    Args:
      name: the backend.
      why: the reason, e.g. "cupy is not installed".
      fix: what the user can do about it.

    Returns:
      A ``BackendUnavailableError`` to raise.
    """
    return BackendUnavailableError(f"backend {name!r} cannot run here: {why}", fix=fix)
