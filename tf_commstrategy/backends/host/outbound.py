"""The interface of every data path's sending end: the frames of a ring link to the right neighbour.

Three data paths implement it: gRPC (``transport.PeerStream``: its own thread sends), raw sockets
(``socket_transport.SocketSender``) and shared memory (``shm_transport.ShmSender``), both written from
the calling thread: what does not fit is queued and written by ``pump``, which every wait of this rank
calls, and by ``drain`` at the end of a collective.
"""

from __future__ import annotations

import abc
from typing import Optional

from ...errors import PeerLostError


class Outbound(abc.ABC):
    """Frames to the right neighbour over one data path.

    Attributes:
      wakes_on_space: True when the neighbour wakes this rank as it frees space (shared memory), so a
        wait with frames still queued may sleep; False when queued frames need short polls.
    """

    wakes_on_space = False

    @abc.abstractmethod
    def send_frame(self, seq: int, step: int, chunk: int, sig: bytes, payload) -> None:
        """Send one frame (or queue what does not fit); ``payload`` is not copied when it can be avoided."""

    @abc.abstractmethod
    def drain(self, timeout: float, abort=None) -> None:
        """Return once every queued frame has left (``abort()`` gives an error to raise instead)."""

    @abc.abstractmethod
    def broken(self) -> Optional[PeerLostError]:
        """The error that ended the stream, or None."""

    @abc.abstractmethod
    def close(self, timeout: float = 5.0) -> None:
        """End the stream (the neighbour sees a clean end)."""

    def pump(self) -> bool:
        """Write queued frames as far as the path takes them; True while some are still queued."""
        return False

    def wait_fd(self) -> Optional[int]:
        """A socket to poll for writability while frames are queued, else None."""
        return None
