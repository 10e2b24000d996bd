"""How the host backend runs one collective: one at a time, numbered, under a deadline, on a link that
checks the peers' signatures, and how a failure ends the group on every rank.

A collective's body gets a ``CollectiveLink`` (``ring_link``) for the job's ring (None in a job of one
rank). The first error makes the backend unusable: it is kept, every pending and later call raises it,
and the other ranks are told (``Peers.tell_abort``) so that they fail at once instead of at their
deadline. A layer above with collectives of its own (the TF layer's compiled all-reduce) learns of
every backend collective through the group's collective watches.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from ... import config
from ...errors import CollectiveError, TfcsError
from .ring_link import CollectiveLink


class CollectiveRunner:
    """Numbering, locking, deadlines and failure of the host backend's collectives.

    Args:
      backend: the host backend (its group, mailbox, peers, ring and shared-buffer flags).
    """

    def __init__(self, backend):
        self._b = backend
        self.rank, self.size = backend.rank, backend.size
        self.lock = threading.Lock()
        self.seq = 0          # collectives started by this rank
        self.busy_s = 0.0     # seconds spent inside them
        self.failed: Optional[BaseException] = None

    def run(self, sig: str, timeout: Optional[float], body: Callable):
        """Run ``body(link)`` as collective number ``seq`` with signature ``sig``; returns its result.

        Raises:
          ConfigurationError: ``timeout`` is not a number of seconds > 0 (the group stays usable).
          CollectiveError: a subclass; the backend is unusable afterwards.
        """
        b = self._b
        timeout = config.call_timeout(timeout, b.group.timeout, self.rank)
        with self.lock:
            self._raise_if_failed()
            seq = self.seq
            self.seq += 1
            if self.size == 1:
                return body(None)
            t0 = time.monotonic()
            link = CollectiveLink(b, b.layout.ring, seq, sig, t0 + timeout, timeout)
            flags = b.layout.direct
            if flags is not None:  # the shared buffers' flags say which collective this rank is in
                flags.entries.enter(seq, sig)
            watches = b.group.collective_watches
            for w in watches:
                w.python_enter()
            try:
                result = body(link)
                link.finish()
                b.mailbox.forget(seq)
                return result
            except TfcsError as e:
                if getattr(e, "await_report", False):
                    reported = self.reported_cause(e)
                    if reported is not e:
                        self.fail(reported)
                        raise reported from None
                self.fail(e)
                raise
            except Exception as e:
                err = CollectiveError(f"collective #{seq} [{sig}] failed: {e!r}", rank=self.rank, seq=seq)
                self.fail(err)
                raise err from e
            finally:
                for w in watches:
                    w.python_leave()
                self.busy_s += time.monotonic() - t0

    def run_setup_step(self, step: Callable):
        """Run ``step()`` (a collective step outside the ring, such as allocating shared arrays) under
        the collective lock; its ``TfcsError`` fails the group as a collective's would."""
        with self.lock:
            self._raise_if_failed()
            try:
                return step()
            except TfcsError as e:  # ranks may now disagree on what they hold: the group is done
                self.fail(e)
                raise

    def _raise_if_failed(self) -> None:
        if self.failed is None:  # a layer above whose own collectives failed (the compiled all-reduce)
            above = self._b.group.layer_failure()
            if above is not None:
                self.fail(above)
        if self.failed is not None:
            raise CollectiveError(f"the process group is unusable after an earlier error: {self.failed}",
                                  rank=self.rank,
                                  fix="shut down (tfcs.shutdown()) and restart the job; errors are not "
                                      "recoverable inside one process group")

    def reported_cause(self, error: BaseException) -> BaseException:
        """``error`` came from a neighbour's connection closing: wait up to ``config.GONE_GRACE_S`` for
        the failure another rank reports over gRPC (the real cause), else keep ``error``."""
        end = time.monotonic() + config.GONE_GRACE_S
        while time.monotonic() < end:
            reported = self._b.mailbox.error_now()
            if reported is not None:
                return reported
            time.sleep(0.01)
        return error

    def failure(self) -> Optional[BaseException]:
        return self.failed or self._b.mailbox.error_now()  # an Abort from another rank counts, idle or not

    def fail(self, error: BaseException, notify_peers: bool = True) -> None:
        """Make the backend unusable with ``error`` and (unless it came from another rank) tell the peers."""
        if self.failed is not None:
            return
        self.failed = error
        mailbox = self._b.mailbox
        mailbox.fail(error)
        if notify_peers and self.size > 1 and not self._b.peers.came_from_a_peer(error, mailbox.remote_error):
            self._b.peers.tell_abort(error)
