"""The strategy's all-reduce as a compiled TensorFlow op when every rank shares one host's memory.

``CommCrossDeviceOps`` hands a step's host gradients (float32 or float64) to ``NativeAllReduce``
instead of the ``tf.numpy_function`` bridge: one op reads the tensors where they are and writes the
outputs it allocates, through the host backend's shared all-reduce buffers (``native/
shm_allreduce.cc``). No Python and no GIL in the step, no concatenation before the collective and no
split after it (docs/benchmarks.md compares ``model.fit`` with it and without it).

When: ``TFCS_NATIVE`` is ``auto`` (default) or ``1``, the job has at least 2 ranks, all of them
share one host's memory (same host, /dev/shm and pid namespace: the same facts that choose the shm
transport), the job did not ask for another transport (``tcp``, ``unix``, ``grpc``), the op builds
(``native_build``), and the host backend has its shared all-reduce buffers. Every rank says whether
it can, and the op is used only if all can: a collective step, taken when the first ``CommStrategy`` of a process group is made.
Where only the op's build or its registration stands in the way (a fallback, not a choice), every rank
logs a WARNING with the reason and the fix (``TFCS_NATIVE=0`` silences it).

The buffers: the host backend's shared all-reduce buffers (``Backend.shared_slots``), whose one-round
protocol the op runs in compiled code: the same segments, words and collective numbers as the backend's
own collectives, under one lock per process (``TfcsTurn``, which the backend then holds for each of its
collectives). So the op's calls and the backend's collectives are one sequence: a rank in the op and a
peer in a different collective of the same number report the mismatch at once, from either side. Every
rank registers the buffers in the library's process-wide table under their name (addresses, layout,
this rank, every rank's pid); a graph holds only the name (the op's ``segment`` attribute): the kernel
looks it up when it runs, so a graph run in another process, or after shutdown, fails with a typed error
instead of touching memory that is not the buffers. Before the backend unmaps the buffers, this rank
marks itself gone in its state word (peers waiting for it fail at once) and the library marks the name
shut down, under the lock every call holds.

Errors: the op's errors carry a tag (``[tfcs-native:timeout]``, ...) that ``typed_error`` turns into
the package's typed errors; ``tensor_ops.unwrap_errors`` raises them from ``fit`` and custom loops.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import weakref
from typing import List, Optional

import tensorflow as tf

from .. import config
from ..core import cpus
from ..errors import (CollectiveAbortedError, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError,
                      ConfigurationError, NotInitializedError, PeerLostError, TfcsError)

log = logging.getLogger("tf_commstrategy")

STATE_SHUTDOWN, STATE_FAILED = 1, 5  # the op's kShutdown, kFailed (the values of a rank's state word)
_TAG = re.compile(r"\[tfcs-native:(\w+)(?::(\d+))?\]\s*")
_STATES = {2: "the ranks called different collectives", 3: "timed out", 4: "a peer process died",
           5: "the process group failed"}
#: the fix a fallback's WARNING names, by where the reason comes from (the op's build, or its registration)
BUILD_FIX = ("install a C++ compiler (g++, or set CXX to one) and restart the job, or prebuild the op with "
             "`python -m tf_commstrategy.tf.native_build` (docs/backends.md)")
OTHER_FIX = "do what the reason says and restart the job"  # a refused cache, a stuck lock: the reason names it
SILENCE = "or set TFCS_NATIVE=0 to keep the Python path without this warning"
MISMATCH_FIX = ("every rank must issue the same collectives in the same order with the same tensors; look for a "
                "collective (or a callback, metric or strategy.run) that only some ranks call")
_by_group: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_attempts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


SPIN_US_OWN_CORE = 20000  # a wait of up to 20 ms (most of a training step's straggling) never sleeps
SPIN_US_SHARED_CORES = 200  # ranks outnumber the cores: a spinning rank would hold back the one it waits for


def spin_microseconds(ranks_on_host: int) -> int:
    """How long a wait yields the CPU in a loop before it sleeps: long when every rank has a core.

    A rank that sleeps leaves its core idle and wakes a poll after its peer arrived, so the short waits of
    ranks taking turns in training would cost a poll each time; waits longer than the spin
    (a rank evaluating or saving) still sleep."""
    return SPIN_US_OWN_CORE if cpus.usable_cores() >= ranks_on_host else SPIN_US_SHARED_CORES


class NativeAllReduce:
    """The compiled all-reduce of one process group, or None from ``for_group`` where it cannot run."""

    def __init__(self, group, slots, lib):
        self.group, self._lib = group, lib
        self.name = slots.name  # the op's `segment` attribute: the graph holds no address
        self._spin_us = spin_microseconds(group.size)
        self._counters = _c_function("TfcsShmCounters", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)])
        self._state = _c_function("TfcsShmState", [ctypes.c_char_p, ctypes.c_uint64], ctypes.c_int64)

    # -- set-up ----------------------------------------------------------------------------------
    @classmethod
    def for_group(cls, group) -> Optional["NativeAllReduce"]:
        """This group's compiled all-reduce (set up on the first call: a collective step), or None.

        Raises:
          ConfigurationError: ``TFCS_NATIVE=1`` and some rank cannot use it (the reason is named).
        """
        if group in _by_group:
            return _by_group[group]
        native = cls._setup(group)
        _by_group[group] = native
        return native

    @classmethod
    def _setup(cls, group) -> Optional["NativeAllReduce"]:
        mode = config.native_from_env()
        if group.size < 2 or group.store is None:
            return None
        _attempts[group] = attempt = _attempts.get(group, 0) + 1  # keys of their own for a retry after an error
        prefix = f"native/{attempt}"
        why, lib, choice, slots = cls._local_reason(group, mode)
        store, rank, size, t = group.store, group.rank, group.size, group.rendezvous_timeout
        if not why:  # registered on every rank that can, before the verdict: a rank that cannot unregisters
            why = _register(slots)
        # every rank says whether it can, why not (a choice, or a fallback and its fix), and whether it
        # requires the op: the same verdict everywhere
        fix = BUILD_FIX if ("compiler" in why or "build failed" in why) else OTHER_FIX
        store.set(f"{prefix}/can/{rank}", json.dumps({"why": why, "required": mode == "on", "choice": choice,
                                                      "fix": fix}))
        said = [json.loads(store.get(f"{prefix}/can/{r}", t)) for r in range(size)]
        bad = [(r, x) for r, x in enumerate(said) if x["why"]]
        if bad:
            if slots is not None and not why:
                _release(slots.name)
            _report(rank, bad, required=any(x["required"] for x in said))
            return None
        native = cls(group, slots, lib)
        slots.share_turn(_Turn())  # from here on the backend's collectives and the op's take turns
        slots.on_close(native.close)
        group.add_failure_hook(native.fail)
        group.add_failure_source(native.error)
        if rank == 0:
            log.info("tf_commstrategy: the strategy's all-reduce runs as a compiled op in the shared all-reduce "
                     "buffers (%d ranks on one host)", size)
        return native

    @staticmethod
    def _local_reason(group, mode: str):
        """Why this rank cannot use the op ("" if it can), the loaded op module, whether the reason is a
        choice (off, several hosts, another transport, no shared buffers) rather than a fallback, and
        the host backend's shared slots."""
        if mode == "off":
            return "off (TFCS_NATIVE=0)", None, True, None
        if len({x.shm_key for x in group.workers}) != 1:
            return "the ranks do not all share one host's memory", None, True, None
        asked = config.parse_transport(group.transport)
        if asked not in ("auto", "shm"):
            return f"transport {asked!r} was asked for", None, True, None
        slots = group.backend("grpc").shared_slots()  # built here if not yet: a collective step of its own
        if slots is None:
            return ("the host backend has no shared all-reduce buffers (TFCS_SHM_FUSION_BYTES=0, or they could "
                    "not be made: see its warning)"), None, True, None
        from . import native_build
        # a wait for another rank's build ends before the peers stop waiting for this rank's answer
        lib, why = native_build.library(wait_s=group.rendezvous_timeout)
        return ("" if lib is not None else why), lib, False, slots

    # -- use -------------------------------------------------------------------------------------
    def handles(self, tensors) -> bool:
        """Whether one call can take these tensors: all float32 or all float64, on the host."""
        if not tensors:
            return False
        dtype = tensors[0].dtype
        if dtype not in (tf.float32, tf.float64) or any(t.dtype != dtype for t in tensors):
            return False
        from .device_path import on_gpu
        return not any(on_gpu(t) for t in tensors)

    def allreduce(self, tensors, mean: bool, timeout: Optional[float]) -> List[tf.Tensor]:
        """SUM (or MEAN when ``mean``) of ``tensors`` over every rank, as new tensors of the same shapes.

        Raises:
          ConfigurationError: ``timeout`` is not a number of seconds > 0 (None: the group's deadline).
          CollectiveError: a subclass, eagerly; inside a ``tf.function`` TF's error carries the tag that
            ``unwrap_errors`` turns into it.
        """
        timeout = config.call_timeout(timeout, self.group.timeout, self.group.rank)  # > 0, or ConfigurationError
        with tf.device("/device:CPU:0"):
            try:
                return list(self._lib.tfcs_shm_all_reduce(inputs=list(tensors), segment=self.name, timeout=timeout,
                                                          spin_us=self._spin_us, mean=bool(mean)))
            except tf.errors.OpError as e:  # eagerly: the typed error now, and the group is unusable
                ours = typed_error(e, getattr(self.group, "workers", None))
                if ours is None:
                    raise
                if not isinstance(ours, NotInitializedError):
                    self.group.abort(ours)
                raise ours from e

    # -- what it has done ------------------------------------------------------------------------
    def _count(self, i: int) -> int:
        out = (ctypes.c_uint64 * 3)()
        return int(out[i]) if self._counters(self.name.encode(), out) == 0 else 0

    def calls(self) -> int:
        """How many calls this rank has made."""
        return self._count(0)

    def busy_seconds(self) -> float:
        """Time this rank has spent inside the op, waiting for its peers included."""
        return self._count(1) * 1e-9

    def wait_seconds(self) -> float:
        """The part of ``busy_seconds`` this rank spent waiting for its peers (their data not there yet,
        or its slot still being read): the rest is its own copying and summing."""
        return self._count(2) * 1e-9

    # -- failure and shutdown --------------------------------------------------------------------
    def error(self) -> Optional[TfcsError]:
        """Why a call of this rank's failed (its state word), or None while it is healthy: the process
        group counts it as its own failure (``ProcessGroup.failure``), also when no ``unwrap_errors`` saw it."""
        state = int(self._state(self.name.encode(), 0))
        if state in (0, -1, STATE_SHUTDOWN):
            return None
        return CollectiveError(f"a compiled all-reduce failed ({_STATES.get(state, state)})", rank=self.group.rank,
                               fix="shut down (tfcs.shutdown()) and restart the job; errors are not recoverable "
                                   "inside one process group")

    def fail(self, error: BaseException) -> None:
        """The process group failed (a lost peer, a timeout, an abort from another rank): a call of
        this rank that waits ends within 50 ms, peers waiting for this rank too, and later calls fail."""
        self._state(self.name.encode(), STATE_FAILED)

    def close(self) -> None:
        """This rank leaves, before the backend unmaps the buffers: peers waiting for it fail at once,
        and its own later calls fail cleanly.

        The state word first (a call of this rank still waiting sees it within 50 ms and ends), then the
        library marks the name shut down under the lock every call holds, so no call is summing while
        the buffers go."""
        self._state(self.name.encode(), STATE_SHUTDOWN)
        _release(self.name)


class _Turn:
    """The library's lock (``TfcsTurn``) as the lock the host backend holds for each collective: one
    collective at a time per process, the op's and the backend's, as they share a sequence and slots.
    ctypes lets go of the GIL while a call waits for it."""

    def __init__(self):
        self._turn = _c_function("TfcsTurn", [ctypes.c_int], None)

    def acquire(self) -> bool:
        self._turn(1)
        return True

    def release(self) -> None:
        self._turn(0)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _c_function(name: str, argtypes, restype=ctypes.c_int):
    """One of the library's C entry points (``native_build.ENTRY_POINTS``), through ctypes."""
    from . import native_build
    fn = getattr(native_build.cdll, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _register(slots) -> str:
    """Register the backend's shared slots under their name in the library's table for this process: ""
    or why not."""
    register = _c_function("TfcsShmRegister", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64),
                                               ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int,
                                               ctypes.POINTER(ctypes.c_int64)])
    size = slots.size
    err = register(slots.name.encode(), (ctypes.c_int64 * size)(*slots.addresses),
                   (ctypes.c_int64 * len(slots.layout))(*slots.layout), slots.rank, size,
                   (ctypes.c_int64 * size)(*slots.pids))
    return f"cannot register the shared buffers {slots.name} in the op's table ({os.strerror(err)})" if err else ""


def _release(name: str) -> int:
    """Mark ``name`` shut down in the library (after a call in progress ends): 0, or errno."""
    return _c_function("TfcsShmRelease", [ctypes.c_char_p])(name.encode())


def _report(rank: int, bad, required: bool) -> None:
    """Say why the op does not run, the same on every rank: a ConfigurationError when some rank requires
    it; a WARNING on every rank when every reason is a fallback (its build, its segment), with the reason
    and its fix; an INFO on rank 0 when a rank chose otherwise (several hosts, a transport: not an error)."""
    r, first = bad[0]
    if required:  # on every rank, as soon as one requires it
        raise ConfigurationError(f"TFCS_NATIVE=1, but the compiled all-reduce cannot run: rank {r}: {first['why']}",
                                 rank=rank, fix="fix what is named, or unset TFCS_NATIVE (the Python path "
                                                "is used where the op cannot run)")
    if all(not x.get("choice") for _, x in bad):
        log.warning("tf_commstrategy rank %d: the compiled all-reduce cannot run, so the strategy's all-reduce "
                    "uses the slower Python path: rank %d: %s. Fix: %s; %s", rank, r, first["why"],
                    first.get("fix") or BUILD_FIX, SILENCE)
    elif rank == 0 and not first["why"].startswith("off"):
        log.info("tf_commstrategy: the strategy's all-reduce stays on the Python path (rank %d: %s)", r,
                 first["why"])


def typed_error(error: BaseException, workers=None) -> Optional[TfcsError]:
    """The tf_commstrategy error behind a TF error raised by the compiled all-reduce, or None.

    ``workers`` (the group's ``WorkerInfo`` list) names a lost peer's host, as the Python path's
    ``PeerLostError`` does: the op itself only knows pids."""
    text = getattr(error, "message", None) or str(error)
    m = _TAG.search(text)
    if m is None:
        return None
    kind, who = m.group(1), m.group(2)
    message = text[m.end():].split("\n", 1)[0].strip()
    rank = None
    head = re.match(r"rank (\d+): ", message)
    if head:
        rank, message = int(head.group(1)), message[head.end():]
    if kind == "timeout":
        return CollectiveTimeoutError(message, rank=rank, fix="a rank is slow or stuck (see the other ranks' "
                                                              "logs), or raise the timeout (TFCS_TIMEOUT)")
    if kind == "mismatch":
        return CollectiveMismatchError(message, rank=rank, remote_rank=int(who) if who else None, fix=MISMATCH_FIX)
    if kind == "peer_lost":
        peer = int(who) if who else None
        host = workers[peer].hostname if workers and peer is not None and peer < len(workers) else None
        if host:
            message = message.replace(f"rank {peer} (pid ", f"rank {peer} (host {host}, pid ", 1)
        return PeerLostError(message, rank=rank, peer_rank=peer, peer_address=f"host {host}" if host else None,
                             fix="see that rank's log for why it died; restart the job (tfcs-run --max-restarts)")
    if kind == "aborted":
        return CollectiveAbortedError(message, rank=rank, origin_rank=int(who) if who else None,
                                      fix="see that rank's log for its own error")
    if kind == "shutdown":
        return NotInitializedError(message, rank=rank, fix="call tfcs.init() again (and make a new CommStrategy)")
    if kind == "unregistered":
        return NotInitializedError(message, rank=rank, fix="trace the function anew in this process under a "
                                                           "CommStrategy (a graph exported with the compiled "
                                                           "all-reduce does not carry its shared memory), or set "
                                                           "TFCS_NATIVE=0 when tracing a graph to export")
    return CollectiveError(message, rank=rank, fix="shut down (tfcs.shutdown()) and restart the job")
