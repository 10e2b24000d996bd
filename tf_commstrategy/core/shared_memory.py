"""Shared-memory primitives of the data paths on one host: segments, futex bells, fences, liveness.

* ``Segment``: a file in ``/dev/shm`` created by its owner with ``O_EXCL``, mode 0600, under an
  unguessable name (``tfcs-shm-<pid>-<kind>-<random>.<pid namespace>``) that travels only over the
  authenticated control plane, mapped by the peers (``attach`` refuses other users' files and loose
  modes), unlinked by its owner as soon as every peer has mapped it. ``remove_stale_segments``
  removes those whose creator died in the short window before that (same pid namespace only).
  The space is reserved when a segment is created (``posix_fallocate``), so a ``/dev/shm`` too small
  for it (containers default to 64 MiB) fails there, not with SIGBUS later.
* ``Bell``: a 32-bit futex word a rank sleeps on and its peers bump and wake; the word after it
  counts the sleepers, so a ring makes the wake-up syscall only when someone sleeps.
* ``fence``: a full memory barrier off x86 (C11 ``atomic_thread_fence``; x86 keeps stores, and
  loads, in order).
* ``spin_seconds``, ``SLICE_S``, ``YIELD_S``: how the waits built on these spin, yield and sleep;
  ``pid_alive`` and ``reported_cause`` tell a dead peer from one that reported its own failure.

Used by the ring's shared-memory links (``shm_transport``) and the shared all-reduce buffers
(``shm_buffers``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import platform
import secrets
import time
from typing import Optional

import numpy as np

from .. import config
from . import cpus

log = logging.getLogger("tf_commstrategy")

SHM_DIR = "/dev/shm"
PREFIX = "tfcs-shm-"
HEADER_BYTES = 4096
ALIGN = 64
BELL_BYTES = 4096
YIELD_S = 0.002
SLICE_S = 0.05   # longest sleep between checks of the abort state / the peer / the deadline
SPIN_S = 50e-6   # busy wait before sleeping, when every rank of this host has a core of its own


def spin_seconds(ranks_on_host: int) -> float:
    """How long a wait spins before it sleeps: ``SPIN_S`` when every rank of this host has a core (a
    spin then only burns an idle core), 0 when ranks outnumber cores (it would delay the rank waited for)."""
    return SPIN_S if cpus.usable_cores() >= ranks_on_host else 0.0

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "i386": 240, "i686": 240,
              "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """``futex(2)`` wait / wake on a 32-bit word in a shared mapping (not process-private)."""

    def __init__(self):
        if _SYS_FUTEX is None or not os.path.exists("/proc/self"):
            raise OSError(f"no futex syscall number known for {platform.machine()} / this OS")
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        self._syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                      ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0))

    def wake(self, addr: int) -> None:
        self._syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                      ctypes.c_int(2 ** 30), None, None, ctypes.c_int(0))


_futex: Optional[Futex] = None


def _load_atomic_add():
    """libatomic's ``__atomic_fetch_add_4`` (sequentially consistent), or None where it is missing."""
    try:
        lib = ctypes.CDLL("libatomic.so.1")
        fn = lib.__atomic_fetch_add_4
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    fn.restype = ctypes.c_uint32
    return fn


def _load_thread_fence():
    """libatomic's C11 ``atomic_thread_fence`` (a full barrier: ``dmb ish`` on arm64, ``sync`` on
    POWER), or None where this libatomic lacks it (before GCC 7)."""
    try:
        fn = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return fn


_atomic_add = _load_atomic_add()
_thread_fence = _load_thread_fence()
_SEQ_CST = 5


def futex() -> Futex:
    global _futex
    if _futex is None:
        _futex = Futex()
    return _futex


def available() -> Optional[str]:
    """None when shared memory links can work here, else the reason they cannot."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    try:
        futex()
    except OSError as e:
        return str(e)
    return None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _pid_namespace() -> str:
    """The inode of this process's pid namespace ("0" where unknown): a segment's name carries its
    creator's, since /dev/shm may be shared by containers whose pids mean different processes."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def remove_stale_segments(only_pids=None) -> int:
    """Unlink this user's ``tfcs-shm-*`` segments whose creator is dead (or is in ``only_pids``,
    a set of pids known dead, e.g. by tfcs-run after its workers exited). Returns how many.

    Only segments created in this pid namespace are judged: a pid from another one (a container
    sharing /dev/shm) says nothing about whether its creator is alive.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    mine = _pid_namespace()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            ns = name.rsplit(".", 1)[1] if "." in name else None
            if ns is not None and ns != mine:
                continue
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            path = os.path.join(SHM_DIR, name)
            if os.stat(path).st_uid != os.getuid():
                continue
            dead = (pid in only_pids) if only_pids is not None else not pid_alive(pid)
            if dead:
                os.unlink(path)
                removed += 1
        except (ValueError, OSError):
            continue
    return removed


class Segment:
    """A mapped file in /dev/shm: created (``create``) by its owner or opened (``attach``) by a neighbour."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool):
        self.path, self.mm, self.owner = path, mm, owner
        self.size = len(mm)
        self.u8 = np.frombuffer(mm, dtype=np.uint8)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    @classmethod
    def create(cls, size: int, kind: str) -> "Segment":
        """Raises OSError (e.g. ENOSPC when /dev/shm is too small)."""
        name = f"{PREFIX}{os.getpid()}-{kind}-{secrets.token_hex(12)}.{_pid_namespace()}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not with SIGBUS later
            mm = mmap.mmap(fd, size)
            seg = cls(path, mm, owner=True)
        except BaseException:  # no segment nobody can clean up: its creator is alive, so no sweep takes it
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return seg

    @classmethod
    def attach(cls, path: str) -> "Segment":
        if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise OSError(f"refusing to map {path!r}: not a tf_commstrategy segment")
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise OSError(f"refusing to map {path!r}: owned by uid {st.st_uid} with mode {oct(st.st_mode)}")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes when that view does
            log.debug("tf_commstrategy: %s stays mapped until its last view is released", self.path)


def map_all_ranks(store, prefix: str, rank: int, size: int, seg: Optional[Segment], why: Optional[str],
                  facts: dict, timeout: float, check=None):
    """One collective step in which every rank publishes its own segment and maps every peer's.

    Every rank calls it at the same point, with ``seg`` (its new segment) or ``why`` it has none. It
    publishes the segment's name with ``facts`` over the authenticated ``store``, reads every peer's,
    calls ``check(theirs)`` (which may raise), maps the peers' segments, and learns whether every rank
    succeeded. Its own segment is unlinked once every rank has answered, so nothing stays in /dev/shm.

    Returns:
      ``(peers, why, own, theirs)``: ``peers`` {rank: Segment} mapped here, or {} with ``why`` when
      any rank failed (every rank alike; ``seg`` is then closed too); ``own`` whether the cause is this
      rank's (its own ``why``, or a peer's segment it could not map) rather than a peer's, which that
      peer reports; ``theirs`` {rank: the facts it published (with "path" and "why")}.

    Raises:
      whatever the store or ``check`` raises, after closing every mapping, unlinking ``seg`` and
      sweeping the segments of dead creators (a peer killed mid-setup).
    """
    own = why is not None
    peers, theirs = {}, {}
    try:
        store.set(f"{prefix}/seg/{rank}", json.dumps(dict(facts, path=seg.path if seg else None, why=why)))
        theirs = {q: json.loads(store.get(f"{prefix}/seg/{q}", timeout)) for q in range(size) if q != rank}
        if check is not None:
            check(theirs)
        if why is None:
            for q, t in theirs.items():
                if not t["path"]:
                    why = f"rank {q}: {t['why']}"
                    break
                try:
                    peers[q] = Segment.attach(t["path"])
                except OSError as e:
                    why, own = f"cannot map rank {q}'s segment: {e}", True
                    break
        store.set(f"{prefix}/ok/{rank}", "1" if why is None else "0")
        # Every rank's answer, not the first "0": a rank that stopped reading at a peer's "0" would unlink
        # its segment while a later peer is still mapping it (that peer then fails on a missing file).
        everyone = all([store.get(f"{prefix}/ok/{q}", timeout) == "1" for q in range(size) if q != rank])
    except BaseException:
        for s in peers.values():
            s.close()
        if seg is not None:
            seg.unlink()
            seg.close()
        remove_stale_segments()  # and a peer's, if it died before unlinking it (kill -9 mid-setup)
        raise
    if seg is not None:
        seg.unlink()  # every peer has mapped it (or given up)
    if why is None and not everyone:
        why = "a peer could not create or map its segment"
    if why is not None:
        for s in list(peers.values()) + ([seg] if seg is not None else []):
            s.close()
        return {}, why, own, theirs
    return peers, None, own, theirs


class Bell:
    """A futex word in a segment: ``ring`` bumps and wakes, ``wait`` sleeps until it moves.

    The word after it ([4, 8) of the segment) counts the threads asleep on the bell, so ``ring`` makes
    the wake-up syscall only when someone sleeps (most waits end while spinning or yielding, and a
    small all-reduce rings several bells: a syscall each would cost more than the reduction). Both counters
    change by sequentially consistent atomics, which order them: either the ringer sees the sleeper's
    count, or the sleeper's ``futex`` call sees the bumped word and returns at once.
    """

    def __init__(self, seg: Segment):
        self.seg = seg
        self._word = np.frombuffer(seg.mm, dtype=np.uint32, count=2, offset=0)
        self._addr = seg.addr
        self._sleepers = seg.addr + 4

    def value(self) -> int:
        return int(self._word[0])

    def ring(self) -> None:
        # Every peer rings this bell: an atomic increment never loses one (without libatomic a lost
        # increment can only delay a waiter to its next 50 ms slice, never hang it).
        if _atomic_add is not None:
            _atomic_add(self._addr, 1, _SEQ_CST)
            # read the sleeper count after the bump. x86's locked add is a full barrier, so a plain read
            # will do; elsewhere read it with a sequentially consistent atomic too (a store followed by
            # a load needs a full fence there)
            sleepers = self._word[1] if _X86 else _atomic_add(self._sleepers, 0, _SEQ_CST)
            if sleepers == 0:
                return
        else:
            self._word[0] += 1
        futex().wake(self._addr)

    def wait(self, seen: int, timeout_s: float) -> None:
        if _atomic_add is None:
            futex().wait(self._addr, seen, timeout_s)
            return
        _atomic_add(self._sleepers, 1, _SEQ_CST)
        try:
            futex().wait(self._addr, seen, timeout_s)
        finally:
            _atomic_add(self._sleepers, 0xFFFFFFFF, _SEQ_CST)  # - 1


_fence_word = ctypes.c_uint32(0)


def fence() -> None:
    """A full memory barrier off x86: orders the frame's bytes before ``head`` (and ``head`` before
    reading the frame), the buffers before their ``ready`` / ``done`` words, and reads of a peer's
    data before the word that lets it overwrite them.

    On x86 nothing is needed: every call site orders store -> store, load -> load or load -> store,
    which x86 keeps in order. Elsewhere: C11 ``atomic_thread_fence(seq_cst)`` from libatomic. An
    atomic read-modify-write of some other word would not do: on arm64 without LSE it is a
    load-acquire / store-release pair, which lets a plain store before it and one after it both fall
    between the two and be seen in either order. Without that function, a futex wake (the kernel's
    futex_wake issues a full barrier, ``smp_mb``) orders memory at the cost of a syscall."""
    if not _X86:
        if _thread_fence is not None:
            _thread_fence(_SEQ_CST)
        else:
            futex().wake(ctypes.addressof(_fence_word))


def reported_cause(error: BaseException, abort) -> BaseException:
    """A neighbour that failed itself reports why (Abort, over gRPC) before it goes: wait a moment
    (``config.GONE_GRACE_S``) for that report from ``abort()``, so this rank raises the real cause rather
    than blaming the neighbour; else ``error``."""
    end = time.monotonic() + config.GONE_GRACE_S
    while abort is not None:
        problem = abort()
        if problem is not None:
            return problem
        if time.monotonic() >= end:
            break
        time.sleep(0.01)
    return error


def free_mib() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize >> 20
    except OSError:
        return -1
