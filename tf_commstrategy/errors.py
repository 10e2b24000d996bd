"""The one error hierarchy of tf_commstrategy.

Every error the package raises on purpose derives from :class:`TfcsError`::

    TfcsError
    ├── ConfigurationError          bad argument / environment value, init twice with other settings
    ├── NotInitializedError         a collective before tfcs.init()
    ├── RendezvousError             workers could not find each other before the deadline
    ├── CollectiveError             a collective could not complete
    │   ├── CollectiveTimeoutError  a peer did not deliver before the deadline
    │   ├── CollectiveMismatchError ranks called different collectives (op/dtype/shape/root/order)
    │   ├── PeerLostError           a peer process went away or its connection broke
    │   └── CollectiveAbortedError  another rank aborted the group after its own error
    └── BackendUnavailableError     the chosen backend cannot run here (missing library, no GPU, ...)

Messages follow one pattern: what happened, on which rank, the value seen, what
was expected, and what to do about it.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "TfcsError",
    "ConfigurationError",
    "NotInitializedError",
    "RendezvousError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveMismatchError",
    "PeerLostError",
    "CollectiveAbortedError",
    "BackendUnavailableError",
    "UnsupportedOperationError",
]


class TfcsError(RuntimeError):
    """Base class of every error raised by tf_commstrategy."""

    def __init__(self, message: str, *, rank: Optional[int] = None, fix: Optional[str] = None):
        self.rank = rank
        self.fix = fix
        text = message
        if rank is not None and not message.startswith("rank "):
            text = f"rank {rank}: {message}"
        if fix:
            text = f"{text}. Fix: {fix}"
        super().__init__(text)


class ConfigurationError(TfcsError, ValueError):
    """An argument or ``TFCS_*`` environment variable has a value that cannot work."""


class UnsupportedOperationError(TfcsError, TypeError):
    """The operation is not defined for this dtype / buffer / backend combination."""


class NotInitializedError(TfcsError):
    """A collective or query was made before :func:`tf_commstrategy.init`."""


class RendezvousError(TfcsError):
    """The workers could not find each other (coordinator unreachable, missing ranks, deadline)."""

    def __init__(self, message: str, *, address: Optional[str] = None, **kw):
        self.address = address
        super().__init__(message, **kw)


class CollectiveError(TfcsError):
    """A collective operation could not complete."""

    def __init__(self, message: str, *, seq: Optional[int] = None, **kw):
        self.seq = seq
        super().__init__(message, **kw)


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete before its deadline.

    Attributes:
      waiting_for: ranks whose data had not arrived when the deadline passed.
    """

    def __init__(self, message: str, *, waiting_for: Sequence[int] = (), **kw):
        self.waiting_for = list(waiting_for)
        super().__init__(message, **kw)


class CollectiveMismatchError(CollectiveError):
    """Ranks disagree on the collective they are running (op, dtype, shape, root or order).

    Attributes:
      local_signature: what this rank called.
      remote_signature: what the other rank called.
      remote_rank: the rank that disagreed.
    """

    def __init__(self, message: str, *, local_signature: str = "", remote_signature: str = "",
                 remote_rank: Optional[int] = None, **kw):
        self.local_signature = local_signature
        self.remote_signature = remote_signature
        self.remote_rank = remote_rank
        super().__init__(message, **kw)


class PeerLostError(CollectiveError):
    """A peer process died or its connection broke.

    Attributes:
      peer_rank: the rank that was lost.
      peer_address: its data-server address.
    """

    def __init__(self, message: str, *, peer_rank: Optional[int] = None,
                 peer_address: Optional[str] = None, **kw):
        self.peer_rank = peer_rank
        self.peer_address = peer_address
        super().__init__(message, **kw)


class CollectiveAbortedError(CollectiveError):
    """Another rank hit an error and aborted the whole group; the original cause is in the message."""

    def __init__(self, message: str, *, origin_rank: Optional[int] = None, **kw):
        self.origin_rank = origin_rank
        super().__init__(message, **kw)


class BackendUnavailableError(TfcsError):
    """The requested backend cannot run on this machine (library missing, no GPU, wrong tensor)."""
