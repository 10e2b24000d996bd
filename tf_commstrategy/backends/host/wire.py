"""Data-message framing and the receive mailbox of the gRPC ring.

A data message is one raw-bytes gRPC stream message::

    header (struct HEADER) | signature (utf-8, sig_len bytes) | payload (raw array bytes)

The header names the collective's sequence number, the ring step and chunk index (together: the
mailbox key), and the sender's rank. Every message carries the collective's signature, so a receiver
detects a mismatched call at its first message instead of reducing garbage or waiting forever.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ... import config
from ...errors import PeerLostError

MAGIC = b"TFCS"
VERSION = 1
HEADER = struct.Struct("<4sBQIIIH")  # magic, version, seq, step, chunk, sender, sig_len
BYE_STEP = 0xFFFFFFFF               # sender closes its stream cleanly (shutdown)
#: A neighbour is never more than one collective ahead; frames for collectives further out (or
#: already finished) name no collective of this job and are dropped, logged once.
SEQ_WINDOW = 64

Key = Tuple[int, int, int]           # (seq, step, chunk)


class MalformedMessage(ValueError):
    pass


def encode(seq: int, step: int, chunk: int, sender: int, sig: bytes, payload) -> bytes:
    """One copy: header, signature and payload joined into the bytes object gRPC sends."""
    return b"".join((HEADER.pack(MAGIC, VERSION, seq, step, chunk, sender, len(sig)), sig, payload))


def encode_bye(sender: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, BYE_STEP, 0, sender, 0)


def decode(msg: bytes, world_size: int):
    """Returns (seq, step, chunk, sender, sig, payload memoryview) or raises MalformedMessage."""
    if len(msg) < HEADER.size:
        raise MalformedMessage(f"message of {len(msg)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, seq, step, chunk, sender, sig_len = HEADER.unpack_from(msg)
    if magic != MAGIC or version != VERSION:
        raise MalformedMessage(f"bad magic/version {magic!r}/{version}")
    if sender >= world_size:
        raise MalformedMessage(f"sender rank {sender} outside world of {world_size}")
    end = HEADER.size + sig_len
    if end > len(msg):
        raise MalformedMessage("signature runs past the end of the message")
    view = memoryview(msg)
    return seq, step, chunk, sender, bytes(view[HEADER.size:end]), view[end:]


class Mailbox:
    """Messages that arrived from peers, keyed by (seq, step, chunk); takers wait with a deadline.

    ``fail`` poisons the mailbox: every current and future ``take`` raises that error. A peer's
    stream that closes (cleanly or not) is recorded, so a take waiting on that peer fails at once.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._msgs: Dict[Key, Tuple[bytes, memoryview]] = {}
        self._error: Optional[BaseException] = None
        self._gone: Dict[int, BaseException] = {}
        self._seq_sig: Dict[int, bytes] = {}  # first signature seen per collective, to spot mismatches early
        self.remote_error: Optional[BaseException] = None
        self.on_fail: Optional[Callable[[BaseException], None]] = None  # told of the first failure
        self.current = 0        # the oldest collective not finished here (set by the backend)
        self.rejected = 0       # frames dropped for naming no current collective
        self.on_reject = None   # called with a description on the first rejected frame

    def deposit(self, key: Key, sig: bytes, payload: memoryview) -> bool:
        """Store a frame; False (frame dropped) when its collective is finished or too far ahead."""
        with self._cv:
            if not self.current <= key[0] <= self.current + SEQ_WINDOW:
                self.rejected += 1
                if self.rejected == 1 and self.on_reject is not None:
                    self.on_reject(f"frame for collective #{key[0]} while at #{self.current}")
                return False
            self._msgs[key] = (sig, payload)
            self._seq_sig.setdefault(key[0], sig)
            self._cv.notify_all()
            return True

    def take(self, key: Key, deadline: float, sender: int, sig: Optional[bytes] = None, health=None, pump=None):
        """Wait for ``key`` from ``sender`` until ``deadline`` (time.monotonic()).

        Returns (sig, payload) or None on timeout. When any message of the same collective (same
        seq) has arrived under another signature than ``sig``, returns (that_sig, None) at once: the
        ranks disagree and the awaited key may never come. Raises the poisoning error, or the peer's
        PeerLostError if its stream ended before the message came. ``health()``, called about once
        a second while waiting, may return an error to raise (e.g. our own stream to a peer broke).
        ``pump()``, when given, is called while waiting and returns True while it still has frames to
        write (a shared-memory outbound): the wait then polls every half millisecond.
        """
        with self._cv:
            while True:
                item = self._msgs.pop(key, None)
                if item is not None:
                    return item
                seen = self._seq_sig.get(key[0])
                if sig is not None and seen is not None and seen != sig:
                    return seen, None
                if self._error is not None:
                    raise self._error
                if sender in self._gone:
                    # A peer that failed itself reports why (Abort) before it goes: give that report a
                    # moment to arrive, so survivors blame the real cause, not a failing survivor.
                    grace_end = time.monotonic() + config.GONE_GRACE_S
                    while self._error is None and time.monotonic() < grace_end:
                        self._cv.wait(grace_end - time.monotonic())
                    raise self._error if self._error is not None else self._gone[sender]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if health is not None:
                    problem = health()
                    if problem is not None:
                        raise problem
                busy = pump is not None and pump()
                self._cv.wait(min(left, 0.0005 if busy else 1.0))

    def forget(self, seq: int) -> None:
        """Collective ``seq`` completed: drop its signature record; frames for it are stale from now on."""
        with self._cv:
            self._seq_sig.pop(seq, None)
            self.current = max(self.current, seq + 1)

    def fail(self, error: BaseException, remote: bool = False) -> None:
        """Poison the mailbox; ``remote``: the error was reported by another rank (not to be re-broadcast).
        The first failure is passed to ``on_fail`` (if set), outside the lock."""
        with self._cv:
            first = self._error is None
            if first:
                self._error = error
                if remote:
                    self.remote_error = error
            self._cv.notify_all()
        if first and self.on_fail is not None:
            self.on_fail(error)

    def error_now(self) -> Optional[BaseException]:
        return self._error

    def is_gone(self, rank: int) -> bool:
        return rank in self._gone

    def peer_gone(self, rank: int, error: PeerLostError) -> None:
        with self._cv:
            self._gone.setdefault(rank, error)
            self._cv.notify_all()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def pending(self) -> int:
        with self._cv:
            return len(self._msgs)

