"""Shared-memory data path between ring neighbours on one host.

Each rank ``c`` whose left neighbour ``p`` is on the same host (same hostname, boot id, network, mount
and pid namespace) owns a *ring segment*: a single-producer / single-consumer byte ring in ``/dev/shm``
that ``p`` writes frames into and ``c`` reads them from, in the calling threads, without a copy on
the receiving side (the ring reduces straight out of shared memory). Every rank with a shared-memory
link also owns a *bell*: one 32-bit futex word that its neighbours bump and wake when they wrote
data for it or freed space it waits for. Waits spin briefly when the host has a core per rank, then
sleep on the bell (``futex``) in short slices; each slice checks the abort state (peer lost, timeout,
mismatch reported over gRPC), the neighbour's process and the deadline, so no wait is unbounded.

Layout of a ring segment::

    [0, 8)      head: bytes written so far (producer)       own cache line
    [64, 72)    tail: bytes consumed so far (consumer)      own cache line
    [128, 132)  closed flag (producer shut down cleanly)
    [4096, ...) data area of ``capacity`` bytes: frames, each 64-byte aligned and contiguous
                (a WRAP frame sends the reader back to the start)

A frame is ``FRAME`` (magic, sig_len, seq, step, chunk, nbytes), the collective's signature, then
the payload at the next 64-byte boundary. The producer publishes ``head`` only after the frame's
bytes are in place; x86's ordering makes that sufficient, elsewhere a futex syscall (a full barrier)
separates the two.

Lifecycle and security: segments are created by their owner with ``O_EXCL``, mode 0600, under an
unguessable name (``tfcs-shm-<pid>-<random>``) that travels only over the authenticated control plane
(the coordinator). Once both neighbours have mapped them, the owner unlinks them: nothing is left in
``/dev/shm`` after that, even if the job is killed. A segment left by a job killed during that short
window is recognised by its dead owner pid and removed at the next start. A ``/dev/shm`` too small
for the segment (containers default to 64 MiB) is found when the space is reserved
(``posix_fallocate``), and the link falls back to Unix sockets with one warning.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import platform
import secrets
import struct
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError
from . import wire

log = logging.getLogger("tf_commstrategy")

SHM_DIR = "/dev/shm"
PREFIX = "tfcs-shm-"
HEADER_BYTES = 4096
ALIGN = 64
FRAME = struct.Struct("<IIQIIQ")  # magic, sig_len, seq, step, chunk, nbytes (32 bytes)
MAGIC_FRAME = 0x54464653  # "SFFT"
MAGIC_WRAP = 0x57524150   # "PARW"
HEAD, TAIL, CLOSED = 0, 8, 16  # indices into the segment header viewed as uint64 (offsets 0, 64, 128)
BELL_BYTES = 4096
YIELD_S = 0.002
SLICE_S = 0.05   # longest sleep between checks of the abort state / the peer / the deadline
SPIN_S = 50e-6   # busy wait before sleeping, when every rank of this host has a core of its own


def spin_seconds(ranks_on_host: int) -> float:
    """How long a wait spins before it sleeps: ``SPIN_S`` when every rank of this host has a core (a
    spin then only burns an idle core), 0 when ranks outnumber cores (it would delay the rank waited for)."""
    return SPIN_S if (os.cpu_count() or 1) >= ranks_on_host else 0.0

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


_atomic_add = _load_atomic_add()
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


def _align(n: int) -> int:
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
    """The inode of this process's pid namespace ("" where unknown): a segment's name carries its
    creator's, since /dev/shm may be shared by containers whose pids mean different processes."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


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
        name = f"{PREFIX}{os.getpid()}-{kind}-{secrets.token_hex(12)}.{_pid_namespace() or 0}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not with SIGBUS later
            except OSError:
                os.unlink(path)
                raise
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm, owner=True)

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


class Bell:
    """A futex word in a segment: ``ring`` bumps and wakes, ``wait`` sleeps until it moves.

    The word after it ([4, 8) of the segment) counts the threads asleep on the bell, so ``ring`` makes
    the wake-up syscall only when someone sleeps (most waits end while spinning or yielding: the
    syscall for nobody cost ~4 us, six of them per small all-reduce with 4 ranks). Both counters
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
            _atomic_add(self._addr, 1, _SEQ_CST)  # a full barrier: the stores before it, then the read below
            if self._word[1] == 0:
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


def _fence() -> None:
    """Order the frame's bytes before ``head`` (and ``head`` before reading the frame) off x86, where
    stores are not kept in order: a sequentially consistent atomic is a full barrier."""
    if not _X86:
        if _atomic_add is not None:
            _atomic_add(ctypes.addressof(_fence_word), 0, _SEQ_CST)
        else:
            futex().wake(ctypes.addressof(_fence_word))  # the syscall orders memory as well


def reported_cause(error: BaseException, abort) -> BaseException:
    """A neighbour that failed itself reports why (Abort, over gRPC) before it goes: wait a moment
    (``wire.GONE_GRACE_S``) for that report from ``abort()``, so this rank raises the real cause rather
    than blaming the neighbour; else ``error``."""
    end = time.monotonic() + wire.GONE_GRACE_S
    while abort is not None:
        problem = abort()
        if problem is not None:
            return problem
        if time.monotonic() >= end:
            break
        time.sleep(0.01)
    return error


class _Waiter:
    """The shared wait loop of both ends: spin, then sleep on my bell, checking aborts and the peer."""

    def __init__(self, my_bell: Bell, peer_rank: int, peer_pid: int, my_rank: int, describe, spin_s: float):
        self.bell, self.peer_rank, self.peer_pid, self.my_rank = my_bell, peer_rank, peer_pid, my_rank
        self._describe, self.spin_s = describe, spin_s
        # With more ranks than cores a busy spin only delays the rank we wait for, and a futex wake-up
        # costs a scheduler round trip per hop: yield the CPU for a while first (measured with 4 ranks on
        # 2 cores: 8 B all-reduce 645 -> 244 us), then sleep on the bell.
        self.yield_s = YIELD_S if spin_s == 0 else 0.0

    def lost(self) -> PeerLostError:
        return PeerLostError(f"rank {self.peer_rank} ({self._describe(self.peer_rank)}) is gone: its process "
                             f"exited or was killed while rank {self.my_rank} shared memory with it",
                             rank=self.my_rank, peer_rank=self.peer_rank,
                             fix=f"look at rank {self.peer_rank}'s log; restart the job (tfcs-run --max-restarts)")

    def explain(self, error: BaseException, abort) -> BaseException:
        return reported_cause(error, abort)

    def until(self, ready: Callable[[], bool], deadline: float, abort, pump=None) -> bool:
        """Wait until ``ready()``; False at the deadline. Raises what ``abort()`` returns, or PeerLostError."""
        if ready():
            return True
        spin_end = time.monotonic() + self.spin_s
        while True:
            seen = self.bell.value()
            _fence()  # read the bell before the data's state (see shm_fusion)
            busy = pump() if pump is not None else False
            if ready():
                return True
            now = time.monotonic()
            if now < spin_end:
                continue
            if now < spin_end + self.yield_s:
                os.sched_yield()  # more ranks than cores: let the rank we wait for run, without a wake-up
                continue
            problem = abort() if abort is not None else None
            if problem is not None:
                raise problem
            if not pid_alive(self.peer_pid):
                if ready():
                    return True
                raise self.explain(self.lost(), abort)
            if now >= deadline:
                return ready()
            # frames still queued for a socket outbound: come back soon to write them
            self.bell.wait(seen, min(0.0005 if busy else SLICE_S, deadline - now))


class _RingEnd:
    """One end of a ring segment: its control words, its data area, the neighbour's bell."""

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        self.ring, self.peer_bell, self.waiter = ring, peer_bell, waiter
        self.my_rank, self.peer_rank = my_rank, peer_rank
        self.capacity = ring.size - HEADER_BYTES
        self._ctl = np.frombuffer(ring.mm, dtype=np.uint64, count=HEADER_BYTES // 8)
        self._data = ring.u8[HEADER_BYTES:]


class ShmSender(_RingEnd):
    """Frames to the right neighbour through its ring segment (the ``send_frame`` / ``drain`` interface
    of the socket and gRPC streams). A frame that does not fit yet is queued and written when the
    neighbour frees space: by ``pump`` (called from every wait of this rank) or ``drain``."""

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        super().__init__(ring, peer_bell, waiter, my_rank, peer_rank)
        self._head = int(self._ctl[HEAD])
        self._pending = deque()
        self.max_frame = self.capacity // 4

    def _write(self, item) -> bool:
        hdr_len, total, header, sig, payload = item
        pos = self._head % self.capacity
        wrap = self.capacity - pos if pos + total > self.capacity else 0
        tail = int(self._ctl[TAIL])
        if self.capacity - (self._head - tail) < wrap + total:
            return False
        if wrap:
            self._data[pos:pos + FRAME.size] = np.frombuffer(FRAME.pack(MAGIC_WRAP, 0, 0, 0, 0, 0), np.uint8)
            self._head += wrap
            pos = 0
        self._data[pos:pos + len(header)] = np.frombuffer(header, np.uint8)
        if sig:
            self._data[pos + FRAME.size:pos + FRAME.size + len(sig)] = np.frombuffer(sig, np.uint8)
        n = payload.nbytes
        if n:
            self._data[pos + hdr_len:pos + hdr_len + n] = payload
        _fence()
        self._head += total
        self._ctl[HEAD] = self._head
        return True

    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        view = np.frombuffer(payload, dtype=np.uint8) if len(payload) else np.empty(0, np.uint8)
        n = view.nbytes
        hdr_len = _align(FRAME.size + len(sig))
        total = _align(hdr_len + n)
        if total > self.max_frame:
            raise ValueError(f"a {n}-byte chunk does not fit the shared-memory ring of {self.capacity} bytes")
        item = (hdr_len, total, FRAME.pack(MAGIC_FRAME, len(sig), seq, step, chunk, n), sig, view)
        if not self._pending and self._write(item):
            self.peer_bell.ring()
            return
        self._pending.append(item)

    def pump(self) -> bool:
        """Write queued frames that fit now; True while some are still queued."""
        wrote = False
        while self._pending and self._write(self._pending[0]):
            self._pending.popleft()
            wrote = True
        if wrote:
            self.peer_bell.ring()
        return bool(self._pending)

    def drain(self, timeout: float, abort=None) -> None:
        """Wait until every queued frame is written (the caller may then reuse the buffers)."""
        if not self._pending:
            return
        deadline = time.monotonic() + timeout
        if not self.waiter.until(lambda: not self.pump(), deadline, abort):
            raise CollectiveTimeoutError(
                f"could not hand data to rank {self.peer_rank} through shared memory before the deadline: it "
                f"stopped reading (stalled or stuck)", rank=self.my_rank, waiting_for=[self.peer_rank],
                fix=f"rank {self.peer_rank} is stuck; see its log, or raise the deadline (TFCS_TIMEOUT)")

    def broken(self) -> Optional[PeerLostError]:
        return None if pid_alive(self.waiter.peer_pid) else self.waiter.lost()

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.drain(timeout)
        except Exception:
            pass
        self._ctl[CLOSED] = 1
        self.peer_bell.ring()
        self._pending.clear()
        self._data = None
        self._ctl = None
        self.ring.close()


class ShmReceiver(_RingEnd):
    """Frames from the left neighbour, read in place from this rank's ring segment."""

    def __init__(self, ring: Segment, peer_bell: Bell, waiter: _Waiter, my_rank: int, peer_rank: int):
        super().__init__(ring, peer_bell, waiter, my_rank, peer_rank)
        self._tail = int(self._ctl[TAIL])
        self._held = 0  # bytes of the frame handed out by the last take, released at the next one

    def release(self) -> None:
        """The caller is done with the last payload: give its space back to the producer."""
        if self._held:
            self._tail += self._held
            self._held = 0
            self._ctl[TAIL] = self._tail
            self.peer_bell.ring()

    def take(self, key, deadline: float, sig: bytes, abort=None, outbound=None):
        """The frame for ``key`` = (seq, step, chunk): (sig, payload uint8 view) or None at the deadline.
        ``outbound`` (this rank's stream to its right neighbour) is pumped while waiting.

        The view stays valid until the next ``take`` / ``release``. A frame of the same collective
        under another signature returns (its sig, None) like the mailbox; a frame of another collective
        or position means the ranks run different code and raises through the caller's mismatch check.
        """
        self.release()
        ctl = self._ctl

        def ready():
            return int(ctl[HEAD]) > self._tail or int(ctl[CLOSED]) != 0

        pump = getattr(outbound, "pump", None)
        if pump is not None and not hasattr(outbound, "wait_fd"):
            # a shared-memory outbound: the neighbour rings our bell when it frees space, so the wait
            # may sleep; only a socket outbound with queued frames needs the short polls
            shm_pump = pump

            def pump():
                shm_pump()
                return False
        if not self.waiter.until(ready, deadline, abort, pump):
            return None
        while True:
            if int(ctl[HEAD]) <= self._tail:  # closed, nothing left
                raise self.waiter.explain(PeerLostError(
                    f"rank {self.peer_rank} ({self.waiter._describe(self.peer_rank)}) shut down its process "
                    f"group while rank {self.my_rank} still expected data from it", rank=self.my_rank,
                    peer_rank=self.peer_rank, fix="every rank must make the same collective calls; a rank left early"),
                    abort)
            _fence()
            pos = self._tail % self.capacity
            magic, sig_len, seq, step, chunk, n = FRAME.unpack_from(self.ring.mm, HEADER_BYTES + pos)
            if magic == MAGIC_WRAP:
                self._tail += self.capacity - pos
                continue
            if magic != MAGIC_FRAME:
                raise PeerLostError(f"the shared-memory ring from rank {self.peer_rank} is corrupt (magic "
                                    f"{magic:#x} at offset {pos})", rank=self.my_rank, peer_rank=self.peer_rank,
                                    fix="report this as a bug")
            hdr_len = _align(FRAME.size + sig_len)
            got_sig = bytes(self.ring.mm[HEADER_BYTES + pos + FRAME.size:HEADER_BYTES + pos + FRAME.size + sig_len])
            self._held = _align(hdr_len + n)
            if (seq, step, chunk) != tuple(key):
                if seq == key[0] and got_sig != sig:
                    return got_sig, None
                text = f"frame for collective #{seq} step {step} chunk {chunk} [{got_sig.decode(errors='replace')}]"
                return text.encode(), None
            return got_sig, self._data[pos + hdr_len:pos + hdr_len + n]

    def close(self) -> None:
        self._held = 0
        self._data = None
        self._ctl = None
        self.ring.close()


def ring_bytes(chunk_bytes: int) -> int:
    """Segment size for a ring whose chunks are at most ``chunk_bytes``: room for four frames."""
    return HEADER_BYTES + max(4 << 20, 4 * _align(chunk_bytes + 4096))


class ShmLinks:
    """Sets up this rank's shared-memory links over the coordinator store (a collective step of init).

    For the link p -> c (p = c - 1): c creates its ring and bell and publishes their names; p maps
    them, c maps p's bell; p declares the link ("1") only if all of that worked, else "0" and both
    ends fall back to Unix sockets. Each owner unlinks its segments once its neighbours have mapped
    them (or given up), so nothing stays in /dev/shm.
    """

    def __init__(self, store, rank: int, left: int, right: int, want_in: bool, want_out: bool, pids, describe,
                 chunk_bytes: int, timeout: float, spin_s: float, prefix: str = "shm"):
        """``left`` / ``right``: the global ranks of this ring's neighbours; ``prefix`` names this ring's
        keys in the store (one set of links per ring: the job's ring, and the hierarchy's sub-rings)."""
        self.rank = rank
        self.sender: Optional[ShmSender] = None
        self.receiver: Optional[ShmReceiver] = None
        reason = None
        bell = ring = None
        if want_in or want_out:
            reason = available()
            if reason is None:
                removed = remove_stale_segments()
                if removed:
                    log.warning("tf_commstrategy rank %d: removed %d stale shared-memory segment(s) left by "
                                "killed jobs in %s", rank, removed, SHM_DIR)
                try:
                    bell = Segment.create(BELL_BYTES, "bell")
                    if want_in:
                        ring = Segment.create(ring_bytes(chunk_bytes), "ring")
                except OSError as e:
                    free = _free_mib()
                    reason = (f"cannot reserve {ring_bytes(chunk_bytes) >> 20} MiB in {SHM_DIR} ({e}; "
                              f"{free} MiB free)")
                    for seg in (bell, ring):
                        if seg is not None:
                            seg.unlink()
                            seg.close()
                    bell = ring = None
        left_bell = right_ring = right_bell = None
        try:
            mine = {"bell": bell.path if bell else None, "ring": ring.path if ring else None, "why": reason}
            store.set(f"{prefix}/seg/{rank}", json.dumps(mine))
            self.fallback_reason = reason
            my_bell = Bell(bell) if bell else None
            # the left neighbour's bell: I ring it when I free space in my ring
            if want_in and my_bell is not None:
                theirs = json.loads(store.get(f"{prefix}/seg/{left}", timeout))
                try:
                    left_bell = Bell(Segment.attach(theirs["bell"])) if theirs["bell"] else None
                except OSError as e:
                    self.fallback_reason = f"cannot map rank {left}'s bell: {e}"
            if want_in:
                store.set(f"{prefix}/bellok/{rank}", "1" if left_bell is not None else "0")
            # my outbound: map the right neighbour's ring and bell
            out_ok = False
            if want_out:
                theirs = json.loads(store.get(f"{prefix}/seg/{right}", timeout))
                if my_bell is not None and theirs["ring"] and theirs["bell"]:
                    try:
                        right_ring = Segment.attach(theirs["ring"])
                        right_bell = Bell(Segment.attach(theirs["bell"]))
                    except OSError as e:
                        self.fallback_reason = f"cannot map rank {right}'s segments: {e}"
                elif theirs.get("why"):
                    self.fallback_reason = f"rank {right}: {theirs['why']}"
                bell_ok = store.get(f"{prefix}/bellok/{right}", timeout) == "1"
                out_ok = right_ring is not None and right_bell is not None and bell_ok
                store.set(f"{prefix}/link/{right}", "1" if out_ok else "0")
                if out_ok:
                    waiter = _Waiter(my_bell, right, pids[right], rank, describe, spin_s)
                    self.sender = ShmSender(right_ring, right_bell, waiter, rank, right)
                else:
                    for seg in (right_ring, right_bell.seg if right_bell else None):
                        if seg is not None:
                            seg.close()
            if want_in:
                in_ok = store.get(f"{prefix}/link/{rank}", timeout) == "1"
                if in_ok:
                    waiter = _Waiter(my_bell, left, pids[left], rank, describe, spin_s)
                    self.receiver = ShmReceiver(ring, left_bell, waiter, rank, left)
                elif ring is not None:
                    ring.unlink()
                    ring.close()
            # everyone who maps my segments has done so (or given up): unlink them
            if ring is not None:
                ring.unlink()
            if bell is not None:
                bell.unlink()
        except BaseException:  # the store failed us (a neighbour gone, a deadline): leave nothing in /dev/shm
            for seg in (bell, ring):
                if seg is not None:
                    seg.unlink()
                    seg.close()
            for seg in (left_bell.seg if left_bell else None, right_ring, right_bell.seg if right_bell else None):
                if seg is not None:
                    seg.close()
            raise
        self.bell = my_bell
        self.fell_back = (want_in and self.receiver is None) or (want_out and self.sender is None)
        if self.fell_back:
            log.warning("tf_commstrategy rank %d: shared memory unavailable (%s); using Unix sockets instead",
                        rank, self.fallback_reason or "a neighbour could not use it")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


def _free_mib() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize >> 20
    except OSError:
        return -1
