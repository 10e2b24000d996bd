"""Horovod's basics on tf_commstrategy's process group: ``init``, ranks and sizes, build flags, process sets.

``init`` joins the job through ``tf_commstrategy.init()`` (rank, size and coordinator come from the
environment: ``TFCS_*``, ``horovodrun``'s ``HOROVOD_*``, MPI, Slurm, ...; see
``rendezvous/cluster_env.py``). Before it, every query raises the ``ValueError`` Horovod raises,
with Horovod's text.

Hosts are told apart as the local rank does: by hostname and boot id (``WorkerInfo.host_key``).
``cross_rank`` / ``cross_size`` follow Horovod's cross communicator: the processes with the same
local rank, in rank order (with the same number of processes on every host: the index of this
host and the number of hosts).

Only the global process set exists: a collective over a subset of the ranks needs sub-groups in the
collective core (their own ring, sequence numbers and mismatch checks), which it does not have.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import process as _process
from ..core.backend import availability as _availability
from ..errors import ConfigurationError, NotInitializedError, UnsupportedOperationError

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
_SUBSETS = ("process sets other than the global one are not supported: a collective over a subset of the ranks "
            "needs sub-groups in tf_commstrategy's collective core (a process group over some ranks, with its own "
            "ring, sequence numbers and mismatch checks), which it does not have")
_SUBSETS_FIX = "run the collective on every rank (process_set=hvd.global_process_set, the default)"


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """A query or collective before ``hvd.init()``: Horovod's ``ValueError`` (same text), and ours."""


def joined_group():
    """The job's process group, for the collectives of this package.

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    if not _process.is_initialized():
        raise HorovodNotInitializedError(_NOT_INITIALIZED)
    return _process.default_group()


class ProcessSet:
    """A set of ranks that run collectives together; only the global one (every rank) is supported.

    Attributes:
      process_set_id: 0 for the global set; None for a set that is not registered.
      ranks: the ranks, sorted (the global set's are filled in by ``init``).
      mpi_comm: always None (no MPI).
    """

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        """Describe a set of ranks.

        Args:
          ranks_or_comm: a sequence of ranks (an MPI communicator is not supported).

        Raises:
          ConfigurationError: a rank is not an int.
          UnsupportedOperationError: ``ranks_or_comm`` is not a sequence (an mpi4py communicator).
        """
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise UnsupportedOperationError(
                f"ProcessSet got a {type(ranks_or_comm).__name__}, not a list of ranks: process sets from an MPI "
                "communicator need MPI, which tf_commstrategy does not use", fix="pass a list of ranks") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ConfigurationError(f"ProcessSet should be initialized with a list of process ranks, got {ranks!r}",
                                     fix="pass a list of ints")
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """The number of processes in the set, or None for a set that is not registered.

        Raises:
          HorovodNotInitializedError: ``init`` has not been called.
        """
        if self.process_set_id is None:
            return None
        return size()

    def rank(self) -> Optional[int]:
        """This process's rank in the set, or None for a set that is not registered.

        Raises:
          HorovodNotInitializedError: ``init`` has not been called.
        """
        if self.process_set_id is None:
            return None
        return rank()

    def included(self) -> Optional[bool]:
        """Whether this process is in the set (None when the set has no ranks yet).

        Raises:
          HorovodNotInitializedError: ``init`` has not been called.
        """
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def check_process_set(process_set, what: str) -> None:
    """Refuse a collective on any process set but the global one.

    Args:
      process_set: the ``process_set=`` argument.
      what: the collective's name, for the message.

    Raises:
      UnsupportedOperationError: another process set.
    """
    if process_set is global_process_set or getattr(process_set, "process_set_id", None) == 0:
        return
    raise unsupported_process_set(what, process_set)


def unsupported_process_set(what: str, got) -> UnsupportedOperationError:
    """The error for a collective ``what`` asked to run on the process set ``got`` (not the global one).

    Args:
      what: the call, for the message.
      got: the process set (or its id), for the message.

    Returns:
      The error, naming what the core lacks.
    """
    return UnsupportedOperationError(f"{what}: {_SUBSETS} (got {got})", fix=_SUBSETS_FIX)


def add_process_set(process_set):
    """Horovod adds a process set after ``init`` here; tf_commstrategy has only the global one.

    Args:
      process_set: a ``ProcessSet`` or a list of ranks.

    Raises:
      UnsupportedOperationError: always (``_SUBSETS`` says what is missing).
    """
    raise UnsupportedOperationError(f"add_process_set({process_set}): {_SUBSETS}", fix=_SUBSETS_FIX)


def remove_process_set(process_set) -> bool:
    """Horovod removes a process set added by ``add_process_set``; none can be added here.

    Args:
      process_set: a ``ProcessSet``.

    Returns:
      False: the global set is never removed, and no other set is registered.
    """
    return False


def init(comm=None, process_sets=None) -> None:
    """Join the job (a collective: every process calls it); a second call changes nothing.

    Args:
      comm: must be None (Horovod takes a list of ranks or an MPI communicator here).
      process_sets: None, [] or "dynamic" (``add_process_set`` then says what is missing).

    Raises:
      UnsupportedOperationError: ``comm`` given, or process sets besides the global one.
      ConfigurationError: bad settings in the environment (see ``tf_commstrategy.init``).
      RendezvousError: the other processes could not be met before the deadline.
    """
    if comm is not None:
        raise UnsupportedOperationError(
            f"hvd.init(comm={comm!r}): a communicator or a subset of the ranks is not supported; every process "
            "started for the job takes part", fix="call hvd.init() without comm")
    dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    if process_sets is not None and not dynamic and list(process_sets):
        raise UnsupportedOperationError(f"hvd.init(process_sets=...): {_SUBSETS}", fix=_SUBSETS_FIX)
    if not _process.is_initialized():
        _process.init()
    global_process_set.ranks = list(range(_process.size()))
    from ..tf import install_keras_patches, setup_compiled_allreduce
    install_keras_patches()  # model.fit raises our typed errors, as under CommStrategy
    # float gradients then take the compiled all-reduce, as under CommStrategy (a collective step: every
    # process is here, in init)
    setup_compiled_allreduce()


def shutdown() -> None:
    """Leave the job (``tf_commstrategy.shutdown``); harmless when not initialized."""
    _process.shutdown()


def is_initialized() -> bool:
    """Whether ``init`` has joined the job (and ``shutdown`` has not left it)."""
    return _process.is_initialized()


def size() -> int:
    """The number of processes in the job.

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return joined_group().size


def rank() -> int:
    """This process's rank, 0..size()-1.

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return joined_group().rank


def local_size() -> int:
    """The number of processes on this host.

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return joined_group().local_size


def local_rank() -> int:
    """This process's index among the processes on its host.

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return joined_group().local_rank


def _hosts() -> Tuple[Dict[int, int], List[List[int]]]:
    """(each rank's index on its host, the ranks of each host), hosts in the order of their lowest rank."""
    ranks_of: Dict[tuple, List[int]] = {}
    index: Dict[int, int] = {}
    for w in sorted(joined_group().workers, key=lambda w: w.rank):
        same = ranks_of.setdefault(w.host_key, [])
        index[w.rank] = len(same)
        same.append(w.rank)
    return index, list(ranks_of.values())


def _cross() -> Tuple[int, int]:
    """(cross rank, cross size): this process's place among the processes with its local index."""
    index, _ = _hosts()
    me = joined_group().rank
    peers = [r for r in sorted(index) if index[r] == index[me]]
    return peers.index(me), len(peers)


def cross_size() -> int:
    """The number of processes with this process's local rank: one per host that has that many
    processes (with the same count on every host, the number of hosts).

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return _cross()[1]


def cross_rank() -> int:
    """This process's index among the processes with its local rank (the index of its host, hosts
    in the order of their lowest rank, with the same count on every host).

    Raises:
      HorovodNotInitializedError: ``init`` has not been called.
    """
    return _cross()[0]


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes (False before ``init``, as Horovod)."""
    if not _process.is_initialized():
        return False
    _, hosts = _hosts()
    return len({len(h) for h in hosts}) == 1


def mpi_threads_supported() -> bool:
    """Horovod's question about MPI; MPI is never enabled here.

    Raises:
      ConfigurationError: always, with Horovod's text for a build without MPI enabled (a ValueError).
    """
    raise ConfigurationError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")


def mpi_enabled() -> bool:
    """False: tf_commstrategy moves data with its own backends, not MPI."""
    return False


def mpi_built() -> bool:
    """False: no MPI support is compiled in."""
    return False


def gloo_enabled() -> bool:
    """False: no Gloo."""
    return False


def gloo_built() -> bool:
    """False: no Gloo."""
    return False


def nccl_built() -> int:
    """NCCL's version code when tf_commstrategy's nccl backend can load here (cupy with NCCL), else 0.

    Horovod returns the NCCL version it was compiled with, or 0; here it is the version cupy loads
    (1 when it loads but does not say).
    """
    if _availability("nccl") is not None:
        return 0
    try:
        from cupy.cuda import nccl
        return int(nccl.get_version()) or 1
    except Exception:  # noqa: BLE001 - loadable but silent about its version
        return 1


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Whether GPU tensors can be reduced on the GPU here: the nccl backend can load."""
    return nccl_built() != 0


def rocm_built() -> bool:
    """False: no ROCm."""
    return False
