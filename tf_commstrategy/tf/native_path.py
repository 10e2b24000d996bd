"""The strategy's all-reduce as a compiled TensorFlow op when every rank shares one host's memory.

``CommCrossDeviceOps`` hands a step's host gradients (float32 or float64) to ``NativeAllReduce``
instead of the ``tf.numpy_function`` bridge: one op reads the tensors where they are and writes the
outputs it allocates, through a shared-memory segment that every rank maps (``native/
shm_allreduce.cc``). No Python and no GIL in the step, no concatenation before the collective and no
split after it (docs/benchmarks.md compares ``model.fit`` with it and without it).

When: ``TFCS_NATIVE`` is ``auto`` (default) or ``1``, the job has at least 2 ranks, all of them
share one host's memory (same host, /dev/shm and pid namespace: the same facts that choose the shm
transport), the job did not ask for another transport (``tcp``, ``unix``, ``grpc``), the op builds
(``native_build``), and the segment can be made. Every rank says whether it can, and the op is used
only if all can: a collective step, taken when the first ``CommStrategy`` of a process group is made.
Where only the op's build or its segment stands in the way (a fallback, not a choice), every rank
logs a WARNING with the reason and the fix (``TFCS_NATIVE=0`` silences it).

The segment: created by rank 0 (mode 0600, an unguessable name, ``shared_memory.Segment``), its name
sent over the authenticated store, mapped by every rank, registered under its name in the library's
process-wide table (address, layout, this rank, every rank's pid), and unlinked by rank 0 once all
have mapped it. A graph holds only the name (the op's ``segment`` attribute): the kernel looks it up
when it runs, so a graph run in another process, or after shutdown, fails with a typed error instead
of touching memory that is not the segment. The mapping is never unmapped while the process lives
(this module's views of it stay valid): at shutdown this rank marks itself gone in the segment (peers
waiting for it fail at once), and the library marks the name shut down (a later call through an old
graph fails cleanly) and swaps the shared pages for private memory that says "shut down", which
gives them back.

Errors: the op's errors carry a tag (``[tfcs-native:timeout]``, ...) that ``typed_error`` turns into
the package's typed errors; ``tensor_ops.unwrap_errors`` raises them from ``fit`` and custom loops.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import time
import weakref
from typing import List, Optional

import numpy as np
import tensorflow as tf

from .. import config
from ..core import cpus
from ..errors import (CollectiveAbortedError, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError,
                      ConfigurationError, NotInitializedError, PeerLostError, TfcsError)

log = logging.getLogger("tf_commstrategy")

SLOT_BYTES = 4 << 20  # each rank's two slots: a step's gradients in pieces of at most this many bytes
STATE_SHUTDOWN, STATE_FAILED, STATE_DIVERGED = 1, 5, 6  # the op's kShutdown, kFailed, kDiverged
_TAG = re.compile(r"\[tfcs-native:(\w+)(?::(\d+))?\]\s*")
_STATES = {2: "ranks passed different tensors", 3: "timed out", 4: "a peer process died",
           5: "the process group failed", 6: "the ranks called different collectives"}
#: a rank inside this op and a peer inside a Python-path collective, both for this long: they diverged. The
#: op keeps a sequence of its own because TensorFlow orders it against the Python path's collectives
#: differently on different ranks (docs/backends.md), so a shared sequence cannot catch this.
DIVERGE_S = 5.0
DIVERGED_FIX = ("every rank must issue the same collectives in the same order; look for a collective (or a callback, "
                "metric or strategy.run) that only some ranks call")
#: the fix a fallback's WARNING names, by where the reason comes from (the op's build, or its segment)
BUILD_FIX = ("install a C++ compiler (g++, or set CXX to one) and restart the job, or prebuild the op with "
             "`python -m tf_commstrategy.tf.native_build` (docs/backends.md)")
SEGMENT_FIX = "give /dev/shm room for the segment (e.g. `docker run --shm-size=1g`) and restart the job"
OTHER_FIX = "do what the reason says and restart the job"  # a refused cache, a stuck lock: the reason names it
SILENCE = "or set TFCS_NATIVE=0 to keep the Python path without this warning"
_kept: List[object] = []  # every segment this process mapped: never unmapped while it lives (see above)
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

    def __init__(self, group, seg, lib, header_bytes: int, capacity: int):
        self.group, self._seg, self._lib = group, seg, lib
        self.header_bytes, self.capacity = header_bytes, capacity
        self.name = segment_name(seg)  # the op's `segment` attribute: the graph holds no address
        self._spin_us = spin_microseconds(group.size)
        self._words = np.frombuffer(seg.mm, dtype=np.uint64, count=header_bytes // 8)
        # this rank's words in the op's header (shm_allreduce.cc): its state line, and its counters line
        self._states = [_word(group.size, r, line_kind=2) for r in range(group.size)]  # every rank's state word
        self._state = self._states[group.rank]
        self._calls = _word(group.size, group.rank, line_kind=3, offset=2)
        self._busy_ns = _word(group.size, group.rank, line_kind=3, offset=3)
        self._wait_ns = _word(group.size, group.rank, line_kind=3, offset=4)
        # since when each rank is inside this op (the op writes it), and this rank in a Python-path collective
        self._native_since = [_word(group.size, r, line_kind=3, offset=5) for r in range(group.size)]
        self._python_since = _word(group.size, group.rank, line_kind=3, offset=6)
        self.diverge_s = DIVERGE_S

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
        why, lib, choice = cls._local_reason(group, mode)
        store, rank, size, t = group.store, group.rank, group.size, group.rendezvous_timeout
        # every rank says whether it can, why not (a choice, or a fallback and its fix), and whether it
        # requires the op: the same verdict everywhere
        fix = BUILD_FIX if ("compiler" in why or "build failed" in why) else OTHER_FIX
        store.set(f"{prefix}/can/{rank}", json.dumps({"why": why, "required": mode == "on", "choice": choice,
                                                      "fix": fix}))
        said = [json.loads(store.get(f"{prefix}/can/{r}", t)) for r in range(size)]
        bad = [(r, x) for r, x in enumerate(said) if x["why"]]
        if not bad:
            seg, whys = cls._map_segment(group, prefix)
            if seg is not None:
                native = cls(group, seg, lib, _header_bytes(size), SLOT_BYTES)
                group.add_close_hook(native.close)
                group.add_failure_hook(native.fail)
                group.add_failure_source(native.error)
                group.add_collective_watch(native)
                if rank == 0:
                    log.info("tf_commstrategy: the strategy's all-reduce runs as a compiled op through shared "
                             "memory (%d ranks on one host)", size)
                return native
            bad = [(r, {"why": w, "choice": False, "fix": SEGMENT_FIX}) for r, w in whys]
        _report(rank, bad, required=any(x["required"] for x in said))
        return None

    @staticmethod
    def _local_reason(group, mode: str):
        """Why this rank cannot use the op ("" if it can), the loaded op module, and whether the reason
        is a choice (off, several hosts, another transport) rather than a fallback."""
        if mode == "off":
            return "off (TFCS_NATIVE=0)", None, True
        if len({x.shm_key for x in group.workers}) != 1:
            return "the ranks do not all share one host's memory", None, True
        asked = config.parse_transport(group.transport)
        if asked not in ("auto", "shm"):
            return f"transport {asked!r} was asked for", None, True
        from . import native_build
        # a wait for another rank's build ends before the peers stop waiting for this rank's answer
        lib, why = native_build.library(wait_s=group.rendezvous_timeout)
        return ("" if lib is not None else why), lib, False

    @staticmethod
    def _map_segment(group, prefix: str):
        """Rank 0 makes the segment, every rank maps and registers it, rank 0 unlinks it: (segment, []) or
        (None, [(rank, why), ...])."""
        from ..core import shared_memory
        store, rank, size, t = group.store, group.rank, group.size, group.rendezvous_timeout
        nbytes = _header_bytes(size) + size * 2 * SLOT_BYTES
        seg, why = None, ""
        try:
            if rank == 0:
                try:
                    seg = shared_memory.Segment.create(nbytes, "native")
                    store.set(f"{prefix}/seg", seg.path)
                except OSError as e:
                    why = (f"cannot reserve {nbytes >> 20} MiB in {shared_memory.SHM_DIR} ({e}; "
                           f"{shared_memory.free_mib()} MiB free)")
                    store.set(f"{prefix}/seg", "")
            else:
                path = store.get(f"{prefix}/seg", t)
                if path:
                    try:
                        seg = shared_memory.Segment.attach(path)
                    except OSError as e:
                        why = f"cannot map {path} ({e})"
                else:
                    why = "rank 0 could not make the segment"
            if seg is not None and not why:
                why = _register(seg, rank, size, [int(x.pid) for x in group.workers])
            store.set(f"{prefix}/mapped/{rank}", why)
            whys = [store.get(f"{prefix}/mapped/{r}", t) for r in range(size)]
        except BaseException:
            if seg is not None:
                _release(seg)  # registered or not (ENOENT): no name of this process leads to it any more
                if rank == 0:
                    seg.unlink()
            raise
        if rank == 0 and seg is not None:
            seg.unlink()  # every rank mapped it (or gave up): nothing stays in /dev/shm
        bad = [(r, w) for r, w in enumerate(whys) if w]
        if bad:
            if seg is not None:
                _release(seg)  # the name is shut down before the address can be reused
                seg.close()
            return None, bad
        _kept.append(seg)
        return seg, []

    @classmethod
    def ready(cls, group) -> Optional["NativeAllReduce"]:
        """This group's compiled all-reduce if ``for_group`` has set it up already, else None (no collective
        step: any rank may ask at any time)."""
        return _by_group.get(group)

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
                return list(self._lib.tfcs_shm_all_reduce(
                    inputs=list(tensors), segment=self.name, timeout=timeout, spin_us=self._spin_us,
                    mean=bool(mean), diverge_s=float(self.diverge_s)))
            except tf.errors.OpError as e:  # eagerly: the typed error now, and the group is unusable
                ours = typed_error(e, getattr(self.group, "workers", None))
                if ours is None:
                    raise
                if not isinstance(ours, NotInitializedError):
                    self.group.abort(ours)
                raise ours from e

    # -- the collective watch of the Python path (ProcessGroup.add_collective_watch) ----------------
    def python_enter(self) -> None:
        """This rank enters a collective of the Python path: the op of a peer that waits for this rank's
        data all the while reports the ranks as diverged (``DIVERGE_S``)."""
        self._words[self._python_since] = time.monotonic_ns()

    def python_leave(self) -> None:
        self._words[self._python_since] = 0

    def python_problem(self, seq: int, sig: str) -> Optional[CollectiveMismatchError]:
        """While this rank waits in Python-path collective ``seq`` [``sig``]: the error to raise when a
        peer has been inside the compiled all-reduce for ``DIVERGE_S`` s and this rank here as long, or
        when a peer's op found that first (its state word says so before its abort message arrives). This
        rank's state word then says so too, so a peer's op that still waits raises the same error."""
        me = self.group.rank
        for p, word in enumerate(self._states):
            if p != me and int(self._words[word]) == STATE_DIVERGED:
                return self._diverged(seq, sig, p, f"rank {p}, waiting in the compiled all-reduce of the strategy's "
                                                   f"gradients, found that the ranks called different collectives")
        now = time.monotonic_ns()
        mine = int(self._words[self._python_since])
        limit = int(self.diverge_s * 1e9)
        if mine == 0 or now - mine < limit:
            return None
        for p, word in enumerate(self._native_since):
            since = int(self._words[word]) if p != me else 0
            if since and now - since >= limit:
                return self._diverged(seq, sig, p, f"collective #{seq} [{sig}] waited {(now - mine) * 1e-9:.1f} s "
                                                   f"for rank {p}, which has been in the compiled all-reduce of "
                                                   f"the strategy's gradients for {(now - since) * 1e-9:.1f} s: the "
                                                   f"ranks called different collectives")
        return None

    def _diverged(self, seq: int, sig: str, peer: int, message: str) -> CollectiveMismatchError:
        if self._words[self._state] == 0:
            self._words[self._state] = STATE_DIVERGED
        return CollectiveMismatchError(message, rank=self.group.rank, seq=seq, local_signature=sig,
                                       remote_signature="the strategy's gradient all-reduce (compiled)",
                                       remote_rank=peer, fix=DIVERGED_FIX)

    def calls(self) -> int:
        """How many calls this rank has made (the op counts them in the segment)."""
        return int(self._words[self._calls])

    def busy_seconds(self) -> float:
        """Time this rank has spent inside the op, waiting for its peers included (it counts it)."""
        return int(self._words[self._busy_ns]) * 1e-9

    def wait_seconds(self) -> float:
        """The part of ``busy_seconds`` this rank spent waiting for its peers (their data not there yet,
        or its slot still being read): the rest is its own copying and summing."""
        return int(self._words[self._wait_ns]) * 1e-9

    def error(self) -> Optional[TfcsError]:
        """Why a call of this rank's failed (its state word), or None while it is healthy: the process
        group counts it as its own failure (``ProcessGroup.failure``), also when no ``unwrap_errors`` saw it."""
        state = int(self._words[self._state])
        if state in (0, STATE_SHUTDOWN):
            return None
        return CollectiveError(f"a compiled all-reduce failed ({_STATES.get(state, state)})", rank=self.group.rank,
                               fix="shut down (tfcs.shutdown()) and restart the job; errors are not recoverable "
                                   "inside one process group")

    def fail(self, error: BaseException) -> None:
        """The process group failed (a lost peer, a timeout, an abort from another rank): a call of
        this rank that waits ends within 50 ms, peers waiting for this rank too, and later calls fail."""
        if self._words[self._state] == 0:
            self._words[self._state] = STATE_FAILED

    def close(self) -> None:
        """This rank leaves: peers waiting for it fail at once, and its own later calls fail cleanly.

        The state word first (a call of this rank still waiting sees it within 50 ms and ends), then the
        library marks the name shut down and swaps the shared pages for private memory that says "shut
        down", under the lock every call holds, so no call is summing while the pages go."""
        if self._words[self._state] == 0:
            self._words[self._state] = STATE_SHUTDOWN
        err = _release(self._seg)
        if err:
            log.warning("tf_commstrategy rank %d: could not release the compiled all-reduce's shared memory "
                        "(errno %d); it is freed when the process exits", self.group.rank, err)


def segment_name(seg) -> str:
    """The name a segment is registered under in the library, and the op's ``segment`` attribute."""
    return os.path.basename(seg.path)


def _c_function(name: str, argtypes, restype=ctypes.c_int):
    """One of the library's C entry points (``native_build.ENTRY_POINTS``), through ctypes."""
    from . import native_build
    fn = getattr(native_build.cdll, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _register(seg, rank: int, size: int, pids: List[int]) -> str:
    """Register ``seg`` under its name in the library's table for this process: "" or why not."""
    register = _c_function("TfcsShmRegister", [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                               ctypes.POINTER(ctypes.c_int64)])
    err = register(segment_name(seg).encode(), seg.addr, len(seg.mm), _header_bytes(size), SLOT_BYTES, rank, size,
                   (ctypes.c_int64 * size)(*pids))
    return f"cannot register the segment {segment_name(seg)} in the op's table ({os.strerror(err)})" if err else ""


def _release(seg) -> int:
    """Mark ``seg``'s name shut down in the library and give its shared pages back: 0, or errno."""
    return _c_function("TfcsShmRelease", [ctypes.c_char_p])(segment_name(seg).encode())


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


def _word(size: int, rank: int, line_kind: int, offset: int = 0) -> int:
    """Index (in uint64 words) of ``rank``'s word ``offset`` in line ``line_kind`` of the op's header:
    64-byte lines, ``size`` of each kind (0 ready, 1 done, 2 state, 3 signatures and counters: calls at
    offset 2, busy_ns at 3, wait_ns at 4, native_since at 5, python_since at 6)."""
    return (line_kind * size + rank) * 8 + offset


def _header_bytes(size: int) -> int:
    return -(-(64 * 4 * size) // 4096) * 4096


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
        return CollectiveMismatchError(message, rank=rank, fix="every rank must issue the same collectives in "
                                                               "the same order with the same tensors")
    if kind == "diverged":
        return CollectiveMismatchError(message, rank=rank, remote_rank=int(who) if who else None,
                                       fix=DIVERGED_FIX)
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
