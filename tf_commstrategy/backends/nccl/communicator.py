"""One NCCL communicator: the unique-id exchange, creation with a deadline, and bounded waits.

* **Unique id.** Rank 0 calls ``ncclGetUniqueId`` (no GPU needed) and publishes the 128 bytes in
  the job's coordinator store under ``nccl/uid/<generation>``; the others read it from there. No
  extra service: the store is the rendezvous every job already has (a one-process job has none,
  and needs none). cupy <= 13 and >= 14 take the id in different forms (``new_nccl_communicator``).
* **Creation.** ``ncclCommInitRank`` blocks until every rank has joined, so it runs in a helper
  thread (cupy releases the GIL) that the caller waits on with a deadline; each rank first marks
  itself in the store (``nccl/joined/<generation>/<rank>``) so that a timeout can name the ranks that
  never came. Unless ``NCCL_RUNTIME_CONNECT`` is set, it is set to 0 before the first communicator:
  NCCL then connects the peers during creation (bounded by that deadline) instead of inside the first
  collective's launch, which blocks the host with no way to time it out.
* **Waiting.** A collective is enqueued on a CUDA stream and completes on the GPU. ``wait`` records
  an event behind it and polls it (for 0.2 ms without sleeping, then sleeping up to 0.25 ms between polls), and on every poll also
  checks the control plane (a peer lost or an abort seen by the gRPC ring) and, every 10 ms,
  ``ncclCommGetAsyncError``. On a deadline, a control-plane failure or an asynchronous NCCL error
  the communicator is aborted (``ncclCommAbort``, which also stops its kernels) and a typed error is
  raised: no wait is unbounded.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from typing import Callable, List, Optional

import numpy as np

from ...errors import CollectiveError, CollectiveTimeoutError, ConfigurationError, RendezvousError, TfcsError

SPIN_S = 2e-4  # polls without sleeping (only yielding the CPU) for this long: small collectives end in tens of us
POLL_MAX_S = 2.5e-4  # then sleeps between polls, growing to this (plus the OS's timer slack, ~50 us)
SETTLE_S = 0.25  # how long a rank told of a peer's failure waits for its own signature verdict (it lands
# within microseconds of the peer's: the same collective), bounding the delay where the check itself hangs
ASYNC_CHECK_S = 0.01


def exchange_unique_id(store, rank: int, generation: int, timeout: float, make_id: Callable[[], bytes]) -> bytes:
    """The NCCL unique id of communicator ``generation``: made on rank 0, read from the store elsewhere.

    Args:
      store: the job's coordinator store (``set`` / ``get`` of text).
      rank: this rank.
      generation: which communicator of the job (0, 1, ...): every rank counts them alike.
      timeout: how long the other ranks wait for rank 0's id.
      make_id: ``nccl.get_unique_id``.

    Returns:
      The id's 128 bytes, the same on every rank.

    Raises:
      RendezvousError: rank 0 did not publish an id in time (or published a malformed one).
    """
    key = f"nccl/uid/{generation}"
    if rank == 0:
        # cupy <= 13 gives C char values (negative where char is signed), cupy >= 14 bytes
        uid = bytes(c & 0xFF for c in make_id())
        if store is not None:  # None: a one-process job, which has no coordinator and no one to tell
            store.set(key, base64.b64encode(uid).decode("ascii"))
        return uid
    try:
        text = store.get(key, timeout)
    except TfcsError as e:
        raise RendezvousError(f"rank 0 did not publish the NCCL unique id of communicator #{generation} "
                              f"within {timeout:g} s ({e})", rank=rank,
                              fix="make every rank call its first nccl collective; rank 0 creates the id "
                                  "on its first call") from None
    uid = base64.b64decode(text)
    if len(uid) != 128:
        raise RendezvousError(f"the NCCL unique id in the store has {len(uid)} bytes, expected 128",
                              rank=rank, fix="every rank must run the same tf_commstrategy version")
    return uid


def comm_id(uid: bytes, signed: bool = True) -> tuple:
    """The id as cupy's ``NcclCommunicator`` takes it: a tuple of 128 C ``char`` values.

    Args:
      uid: the id's 128 bytes.
      signed: whether this platform's ``char`` is signed (x86; Arm and POWER have it unsigned).

    Returns:
      128 ints in -128..127 (``signed``) or 0..255.
    """
    return tuple(np.frombuffer(uid, dtype=np.int8 if signed else np.uint8).tolist())


def new_nccl_communicator(nccl, size: int, uid: bytes, rank: int):
    """``nccl.NcclCommunicator(size, id, rank)`` with the id in the form this cupy takes.

    cupy <= 13 takes a tuple of 128 C ``char`` values (signed on x86, unsigned on Arm and POWER),
    cupy >= 14 the id's 128 bytes; a wrong form is refused by cupy's argument check (``TypeError``
    or ``OverflowError``) before NCCL is called, so trying the forms in turn is safe.

    Args:
      nccl: the ``cupy.cuda.nccl`` module.
      size, rank: the communicator's size and this rank.
      uid: the id's 128 bytes.

    Returns:
      The cupy communicator.
    """
    try:
        return nccl.NcclCommunicator(size, comm_id(uid), rank)
    except OverflowError:  # this platform's char is unsigned: cupy refused the negative values
        return nccl.NcclCommunicator(size, comm_id(uid, signed=False), rank)
    except TypeError as e:
        if "bytes" not in str(e):
            raise
        return nccl.NcclCommunicator(size, bytes(uid), rank)  # cupy >= 14


def prefer_eager_connect(environ=None) -> None:
    """Make NCCL connect peers while the communicator is created (see the module docstring)."""
    env = os.environ if environ is None else environ
    env.setdefault("NCCL_RUNTIME_CONNECT", "0")


NCCL_REMOTE_ERROR = 6  # ncclRemoteError: a peer exited or the network failed


def is_remote_error(e: BaseException) -> bool:
    """cupy 13.0-13.3 turn ncclRemoteError (6), which they cannot name, into ``KeyError(6)`` (cupy#8661)."""
    return isinstance(e, KeyError) and e.args == (NCCL_REMOTE_ERROR,)


def describe_nccl_error(e: BaseException) -> str:
    """The text of an NCCL error, also of the ``KeyError(6)`` of cupy 13.0-13.3, which says nothing."""
    if is_remote_error(e):
        return "ncclRemoteError: a remote rank exited, or the network between the ranks failed"
    return str(e) or repr(e)


class Communicator:
    """A ``cupy.cuda.nccl.NcclCommunicator`` for one GPU of this rank, with bounded waits.

    Attributes:
      comm: the cupy communicator (None once aborted or destroyed).
      device_id: the GPU it drives.
      generation: its number within the job.
    """

    def __init__(self, nccl, comm, device_id: int, generation: int, rank: int, size: int):
        self._nccl = nccl
        self.comm = comm
        self.device_id = device_id
        self.generation = generation
        self.rank = rank
        self.size = size

    @classmethod
    def create(cls, nccl, store, rank: int, size: int, device_id: int, generation: int, deadline: float,
               control_failure: Callable[[], Optional[BaseException]], settings: str = "") -> "Communicator":
        """Create communicator ``generation`` on every rank (a collective call).

        Args:
          nccl: the ``cupy.cuda.nccl`` module.
          store: the job's coordinator store.
          rank, size: this rank and the job's size.
          device_id: this rank's GPU.
          generation: the communicator's number (the same on every rank).
          deadline: ``time.monotonic()`` by which it must exist.
          control_failure: returns the control plane's error once the job failed, else None.
          settings: what every rank must have alike (``"check=1"``): compared once all have joined.

        Returns:
          The communicator.

        Raises:
          ConfigurationError: the ranks' ``settings`` differ (the communicator is aborted).
          CollectiveTimeoutError: some ranks did not join before the deadline (named).
          CollectiveError: NCCL refused (e.g. two ranks on one GPU), or the job failed meanwhile.
          RendezvousError: the unique id did not arrive.
        """
        import cupy
        uid = exchange_unique_id(store, rank, generation, max(0.1, deadline - time.monotonic()),
                                 nccl.get_unique_id)
        if store is not None:
            store.set(f"nccl/joined/{generation}/{rank}", f"{device_id}|{settings}")
        prefer_eager_connect()
        box = {}

        def init():
            try:
                with cupy.cuda.Device(device_id):
                    box["comm"] = new_nccl_communicator(nccl, size, uid, rank)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        t = threading.Thread(target=init, name=f"tfcs-nccl-init-{generation}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            failure = control_failure()
            if failure is not None and t.is_alive():
                raise failure
            if t.is_alive() and time.monotonic() > deadline:
                missing = cls._not_joined(store, size, generation) if store is not None else []
                raise CollectiveTimeoutError(
                    f"NCCL communicator #{generation} was not created before the deadline: ranks {missing} "
                    f"never joined it", rank=rank, waiting_for=missing,
                    fix="make every rank call the same nccl collectives (the first one creates the "
                        "communicator), or raise timeout=")
        if "error" in box:
            raise _init_error(box["error"], rank, size, device_id, generation) from box["error"]
        made = cls(nccl, box["comm"], device_id, generation, rank, size)
        if store is not None and size > 1:
            made._same_settings(store, settings, deadline)
        return made

    def _same_settings(self, store, settings: str, deadline: float) -> None:
        """Every rank has joined (NCCL made the communicator): their settings must be this rank's."""
        for r in range(self.size):
            try:
                theirs = store.get(f"nccl/joined/{self.generation}/{r}",
                                   max(1.0, deadline - time.monotonic())).split("|", 1)[-1]
            except TfcsError as e:
                self.abort()
                raise CollectiveError(f"could not read rank {r}'s nccl settings ({e})", rank=self.rank) from None
            if theirs != settings:
                self.abort()
                raise ConfigurationError(
                    f"the ranks disagree on nccl settings: rank {r} has [{theirs}], rank {self.rank} has "
                    f"[{settings}]; a signature check on one rank would pair with another rank's collective",
                    rank=self.rank, fix="set TFCS_NCCL_CHECK the same on every rank (or leave it unset)")

    @staticmethod
    def _not_joined(store, size: int, generation: int) -> List[int]:
        missing = []
        for r in range(size):
            try:
                store.get(f"nccl/joined/{generation}/{r}", 0.05)
            except Exception:
                missing.append(r)
        return missing

    def wait(self, stream, deadline: float, what: str, seq: int,
             control_failure: Callable[[], Optional[BaseException]],
             on_poll: Optional[Callable[[], None]] = None) -> None:
        """Block until everything queued on ``stream`` so far is done, or fail with a typed error.

        Args:
          stream: the cupy stream the collective was queued on.
          deadline: ``time.monotonic()`` by which it must be done.
          what: the collective's signature, for messages.
          seq: its sequence number.
          control_failure: returns the control plane's error once the job failed, else None.
          on_poll: ``on_poll(settle=False)`` is called on every poll; what it raises ends the wait (the
            signature check's verdict). Once the control plane reports a failure, it is called with
            ``settle=True`` first, so that a rank which would see a mismatch itself says so.

        Raises:
          CollectiveTimeoutError: not done by the deadline (the communicator is aborted).
          CollectiveError: NCCL reported an asynchronous error (the communicator is aborted).
          TfcsError: the control plane's error (a peer was lost, another rank aborted).
        """
        import cupy
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        delay = 0.0
        start = time.monotonic()
        next_async = start + ASYNC_CHECK_S
        while not event.done:
            now = time.monotonic()
            if on_poll is not None:
                on_poll()
            failure = control_failure()
            if failure is not None:
                if on_poll is not None:  # another rank saw a mismatch: this rank's verdict is due as well
                    on_poll(settle=True)
                self.abort()
                raise failure
            if now >= next_async:
                next_async = now + ASYNC_CHECK_S
                self.check_async(what, seq)
            if now > deadline:
                self.abort()
                raise CollectiveTimeoutError(
                    f"nccl collective #{seq} [{what}] did not complete before the deadline (the NCCL "
                    f"communicator was aborted)", rank=self.rank, seq=seq,
                    fix="check that every rank makes the same collectives and that no rank is stuck; raise "
                        "timeout= (or TFCS_TIMEOUT) for very large transfers")
            if now - start < SPIN_S:
                os.sched_yield()  # lets other threads run (the GIL is released); time.sleep(0) can sleep a whole timer slack
                continue
            time.sleep(delay)
            delay = min(POLL_MAX_S, delay * 2 if delay else 2e-5)
        self.check_async(what, seq)

    def check_async(self, what: str, seq: int) -> None:
        """Raise ``CollectiveError`` (after aborting) when NCCL reports an asynchronous error."""
        if self.comm is None:
            raise CollectiveError(f"the NCCL communicator #{self.generation} was aborted", rank=self.rank, seq=seq)
        try:
            self.comm.check_async_error()
        except Exception as e:  # NcclError; cupy 13.0-13.3 raise KeyError(6) for ncclRemoteError instead
            self.abort()
            raise CollectiveError(f"NCCL reported an error during collective #{seq} [{what}]: {describe_nccl_error(e)}",
                                  rank=self.rank, seq=seq,
                                  fix="see the NCCL message; NCCL_DEBUG=WARN prints NCCL's own diagnosis") from e

    def abort(self) -> None:
        """``ncclCommAbort``: stops the communicator's kernels; the communicator is unusable after."""
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # pragma: no cover - aborting a broken communicator may itself fail
                pass

    def destroy(self) -> None:
        """``ncclCommDestroy`` after a clean run."""
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()


def _init_error(e: BaseException, rank: int, size: int, device_id: int, generation: int) -> TfcsError:
    text = describe_nccl_error(e)
    fix = "see the NCCL message; NCCL_DEBUG=WARN prints NCCL's own diagnosis"
    if size > 1 and ("invalid usage" in text.lower() or "INVALID_USAGE" in text):
        fix = ("NCCL refuses two ranks on one GPU: give every rank its own GPU (e.g. "
               "cupy.cuda.Device(tfcs.local_rank()).use(), or CUDA_VISIBLE_DEVICES per rank); "
               "NCCL_DEBUG=WARN shows the duplicate")
    return CollectiveError(f"NCCL could not create communicator #{generation} of {size} ranks on GPU "
                           f"{device_id}: {type(e).__name__}: {text}", rank=rank, fix=fix)
