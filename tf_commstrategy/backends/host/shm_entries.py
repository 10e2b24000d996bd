"""Which collective each rank of the shared all-reduce buffers is in, and the errors that follow when
they differ: every rank publishes the collective it enters (number + 1, then its signature text) in
its own header, where its peers' waits read it; a piece's or a slot's header names the collective its
data belongs to."""

from __future__ import annotations

from typing import Optional, Sequence

from ...core.shared_memory import fence
from ...errors import CollectiveMismatchError
from .shm_layout import DIRECT_PIECE, ENTERED, ENTERED_SIG, ENTERED_SIG_AT, INFO, SIG_AT, SIG_MAX


class Entries:
    """The entry words of every rank's segment, seen from this rank.

    Args:
      rank: this rank.
      segs, ctl: every rank's segment and its header as uint64 words, by rank.
      peers: the other ranks.
      describe: ``describe(rank)``: the rank's host and address, for messages.
    """

    def __init__(self, rank: int, segs: dict, ctl: dict, peers: Sequence[int], describe):
        self.rank, self.segs, self.ctl, self.peers = rank, segs, ctl, list(peers)
        self._describe = describe
        self._entered_sig: Optional[str] = None  # the signature text in my header now

    def enter(self, seq: int, sig: str) -> None:
        """Publish the collective this rank has just entered (every kind, ring ones too)."""
        ctl = self.ctl[self.rank]
        if sig is not self._entered_sig:  # the text already there stays right for the old and the new seq
            sig_b = sig.encode()[:SIG_MAX]
            ctl[ENTERED] = 0  # readers that catch the text half-written see 0 (or the new seq) and skip it
            fence()
            self.segs[self.rank].mm[ENTERED_SIG_AT:ENTERED_SIG_AT + len(sig_b)] = sig_b
            ctl[ENTERED_SIG] = len(sig_b)
            fence()
            self._entered_sig = sig
        ctl[ENTERED] = seq + 1

    def conflict(self, seq: int, sig: str) -> Optional[CollectiveMismatchError]:
        """A peer in collective ``seq`` under another signature: the mismatch error, else None."""
        sig_b = sig.encode()[:SIG_MAX]
        for q in self.peers:
            ctl = self.ctl.get(q)
            if ctl is None or int(ctl[ENTERED]) != seq + 1:
                continue
            fence()
            n = int(ctl[ENTERED_SIG])
            theirs = bytes(self.segs[q].mm[ENTERED_SIG_AT:ENTERED_SIG_AT + min(n, SIG_MAX)])
            fence()
            if int(ctl[ENTERED]) == seq + 1 and theirs != sig_b:  # still that collective: the text is its
                text = theirs.decode(errors="replace")
                return CollectiveMismatchError(
                    f"collective #{seq} mismatch: this rank called [{sig}] but rank {q} called [{text}]",
                    rank=self.rank, seq=seq, local_signature=sig, remote_signature=text, remote_rank=q,
                    fix="every rank must issue the same collectives in the same order with the same op, dtype, "
                        "shape and root")
        return None

    def check(self, q: int, seq: int, piece: int, n: int, sig_b: bytes, sig: str) -> None:
        theirs = tuple(int(x) for x in self.ctl[q][INFO:INFO + 4])
        their_sig = bytes(self.segs[q].mm[SIG_AT:SIG_AT + theirs[3]])
        if theirs[:3] == (seq, piece, n) and their_sig == sig_b:
            return
        # the piece header may still describe the peer's last large piece (it took the one-round small
        # path this time): the signature it entered this collective with names its call
        entered = self.conflict(seq, sig)
        if entered is not None:
            raise entered
        self.mismatch(q, seq, sig, piece, n, theirs[0], their_sig, theirs[1], theirs[2])

    def mismatch(self, q: int, seq: int, sig: str, piece: int, n: int, their_seq: int, their_sig: bytes,
                  their_piece: int, their_n: int):
        text = their_sig.decode(errors="replace")

        def what(p):
            return "shared-array handshake" if p == DIRECT_PIECE else f"piece {p}"
        raise CollectiveMismatchError(
            f"collective #{seq} mismatch in the shared-memory all-reduce: this rank called [{sig}] ({what(piece)}, "
            f"{n} elements) but rank {q} called #{their_seq} [{text}] ({what(their_piece)}, {their_n} elements)",
            rank=self.rank, seq=seq, local_signature=sig, remote_signature=text, remote_rank=q,
            fix="every rank must issue the same collectives in the same order with the same op, dtype and shape")

