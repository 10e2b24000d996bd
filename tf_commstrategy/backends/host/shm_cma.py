"""Cross-memory attach: a rank reads a peer's private array straight out of the peer's address space.

Linux's ``process_vm_readv`` copies bytes from another process of the same user into ours in one
kernel copy, with no shared segment in between. With every rank on one host it lets an all-reduce of
ordinary (private) numpy arrays skip the ring's staging copies: rank r reads the peers' r-th segment
into a small buffer of its own, reduces it into its own array, and then reads every other reduced
segment straight from its owner's array (``SharedBuffers.direct``). With 2 ranks that is 3.5 bytes of
memory traffic per byte of the array instead of the staged ring's 4.5: large all-reduces are bound
by memory bandwidth.

The kernel allows it only where the reader may ptrace the target (same user, and the Yama LSM's
``ptrace_scope`` at 0, or at 1 with the target naming the reader: done for the one peer of a 2-rank
job; no seccomp filter refusing the call, as some container runtimes install). Whether it works is
therefore *tried*, not assumed: at setup every rank publishes a random token's address over the
authenticated store, every rank reads every peer's token, and the path is used only if every rank
read every token (``probe``). ``TFCS_SHM_CMA=0`` turns
it off; any other size is the smallest all-reduce that takes it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
from typing import Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("tf_commstrategy")

#: Yama's "this process may ptrace me": lets the one peer of a 2-rank job read this rank (ptrace_scope 1)
PR_SET_PTRACER = 0x59616D61
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
TOKEN_BYTES = 16


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = None


def _syscalls():
    """libc's ``process_vm_readv`` and ``prctl`` (bound on first use, never at import)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        libc.prctl.restype = ctypes.c_int
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = libc
    return _libc


def read(pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``remote_addr`` in process ``pid`` to ``local_addr`` in this one.

    Raises:
      OSError: with the kernel's errno (ESRCH: the process is gone; EPERM: not allowed to read it;
        EFAULT: the range is not mapped there or here), or EIO when the kernel copied only part of it
        (the remote range ends early).
    """
    libc = _syscalls()
    done = 0
    while done < nbytes:
        local = _IoVec(local_addr + done, nbytes - done)
        remote = _IoVec(remote_addr + done, nbytes - done)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"process_vm_readv from pid {pid}: {os.strerror(e)}")
        if got == 0:
            raise OSError(errno.EIO, f"process_vm_readv from pid {pid}: read {done} of {nbytes} bytes")
        done += got


def read_array(pid: int, remote_addr: int, into: np.ndarray) -> None:
    """``into`` (C-contiguous) filled from ``into.nbytes`` bytes at ``remote_addr`` in process ``pid``."""
    if into.nbytes:
        read(pid, into.ctypes.data, remote_addr, into.nbytes)


def yama_scope() -> int:
    """The Yama LSM's ``kernel.yama.ptrace_scope`` (0 where Yama is absent): 0 any process of the user
    may read another, 1 only ancestors or a process the target names, 2 only with CAP_SYS_PTRACE,
    3 none."""
    try:
        with open(YAMA_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


_named = {"pid": 0, "uses": 0}  # the peer this process named with PR_SET_PTRACER, and for how many groups


def allow_peer_to_read(peer_pids: Sequence[int]) -> Optional[int]:
    """Where Yama's ptrace_scope is 1 only a process's ancestors may read it, and the workers are
    siblings. With one peer this rank names it as its one permitted reader (``PR_SET_PTRACER``; Yama
    drops the exception when that process exits, and ``forget_reader`` withdraws it when the job does
    not use the reads or shuts down). With more peers it changes nothing: Yama has no list of readers,
    and allowing any process of the user (as some MPI libraries do) would undo what ptrace_scope 1
    protects against, so the probe fails and the job keeps its other paths. Nothing is changed under
    any other scope, nor when another group of this process has named another peer (Yama keeps one).

    Returns:
      the pid named (pass it to ``forget_reader``), or None.
    """
    if len(peer_pids) != 1 or yama_scope() != 1:
        return None
    pid = int(peer_pids[0])
    if _named["uses"] and _named["pid"] != pid:
        return None
    try:
        if _named["uses"] == 0 and _syscalls().prctl(PR_SET_PTRACER, pid, 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    _named["pid"] = pid
    _named["uses"] += 1
    return pid


def forget_reader(pid: Optional[int]) -> None:
    """Withdraw ``pid`` as this process's permitted reader once no group needs it (no-op for None)."""
    if pid is None or _named["pid"] != pid or _named["uses"] == 0:
        return
    _named["uses"] -= 1
    if _named["uses"] == 0:
        try:
            _syscalls().prctl(PR_SET_PTRACER, 0, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        _named["pid"] = 0


def probe(store, prefix: str, rank: int, size: int, pids: Sequence[int], min_bytes: int, timeout: float
          ) -> Tuple[int, Optional[str], Optional[int]]:
    """One collective setup step: whether every rank of the job can read every peer's memory.

    Every rank calls it at the same point. Each publishes its threshold ``min_bytes`` (0: off) and the
    address of a random token, reads every peer's token with ``process_vm_readv`` and compares it with
    the value published, then publishes whether all reads matched. The token stays alive until every
    rank has answered.

    Returns:
      ``(min_bytes, why, named)``: ``min_bytes`` and ``why`` the same on every rank: the largest threshold
      any rank asked for, or 0 when any rank turned the path off or could not read a peer (``why`` then
      says which and why); ``named`` the peer this rank allowed to read it (Yama), for ``forget_reader``
      at shutdown, or None.

    Raises:
      whatever the store raises (RendezvousError at its deadline).
    """
    token = np.frombuffer(bytearray(secrets.token_bytes(TOKEN_BYTES)), dtype=np.uint8)
    why = None if min_bytes > 0 else "turned off (TFCS_SHM_CMA=0)"
    named = allow_peer_to_read([p for q, p in enumerate(pids) if q != rank]) if why is None else None
    store.set(f"{prefix}/token/{rank}", json.dumps({"addr": int(token.ctypes.data), "token": token.tobytes().hex(),
                                                    "bytes": int(min_bytes), "why": why}))
    theirs = {q: json.loads(store.get(f"{prefix}/token/{q}", timeout)) for q in range(size) if q != rank}
    if why is None:
        got = np.empty(TOKEN_BYTES, np.uint8)
        for q, t in sorted(theirs.items()):
            if t["why"]:
                why = f"rank {q}: {t['why']}"
                break
            try:
                read_array(pids[q], t["addr"], got)
            except (OSError, AttributeError) as e:  # AttributeError: a libc without process_vm_readv
                why = f"cannot read rank {q}'s memory (pid {pids[q]}): {e}"
                break
            if got.tobytes().hex() != t["token"]:
                why = f"read another value than rank {q} published (pid {pids[q]} is not that rank here)"
                break
    store.set(f"{prefix}/ok/{rank}", "1" if why is None else "0:" + why)
    answers = {q: store.get(f"{prefix}/ok/{q}", timeout) for q in range(size) if q != rank}
    del token  # every rank has read it (or given up)
    if why is None:
        for q, a in sorted(answers.items()):
            if a != "1":
                why = f"rank {q}: {a[2:]}"
                break
    if why is not None:
        forget_reader(named)
        return 0, why, None
    return max([int(min_bytes)] + [int(t["bytes"]) for t in theirs.values()]), None, named
