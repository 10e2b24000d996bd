"""Ring algorithms over a link to the two ring neighbours, independent of the transport.

A *link* (``RingLink``) sends to the right neighbour ((rank + 1) % size) and receives from the left
one; ``key`` is ``(step, chunk)``, and the link adds the collective's sequence number and signature.

Every ring step moves at least one message (an empty chunk for empty segments), so ranks that
disagree about a collective meet a signature check on the very first message.

Pipelining: the buffer is cut into ``size`` segments and each segment into chunks. A chunk received
and reduced at step s is sent on at step s + 1 straight away, so reduction of one chunk overlaps the
transfer of the next ones and the whole all-reduce is one stream of chunk sends per rank.
"""

from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveMismatchError
from .reduce_ops import ReduceOp, combine_into, combine_to, finish_mean, needs_wide_accumulator, reduce_in_rank_order


class RingLink(abc.ABC):
    """What the ring algorithms talk to: this rank's place in one ring and its two neighbours.

    Attributes:
      rank: this rank's position in the ring; ``size``: the ring's length.
      seq: the collective's number, for error messages (None: none).
    """

    rank: int
    size: int
    seq: Optional[int] = None

    @property
    def global_rank(self) -> int:
        """This rank's rank in the job (differs from ``rank`` on a ring of some of the job's ranks)."""
        return self.rank

    @property
    def left_rank(self) -> int:
        """The left neighbour's rank in the job."""
        return (self.rank - 1) % self.size

    @abc.abstractmethod
    def send(self, key: Tuple[int, int], payload) -> None:
        """Send ``payload`` (a uint8 view) to the right neighbour; copies or writes it before returning."""

    @abc.abstractmethod
    def recv(self, key: Tuple[int, int]):
        """The bytes the left neighbour sent for ``key``; blocks until they arrive (the link's deadline)."""

    def recv_into(self, key: Tuple[int, int], dst: np.ndarray):
        """The payload for ``key``, read straight into ``dst`` (uint8) where the link can; the array
        returned is then ``dst``, else the caller copies it. By default it cannot."""
        return self.recv(key)


class _Single(RingLink):
    """The link of a world of one: ring functions then do no communication at all."""

    rank, size = 0, 1

    def send(self, key, payload) -> None:
        raise AssertionError("a world of one sends nothing")

    def recv(self, key):
        raise AssertionError("a world of one receives nothing")


#: the link of every collective in a world of one
SINGLE = _Single()


def chunk_ranges(lo: int, hi: int, chunk_elems: int, cuts: Sequence[int] = ()) -> List[Tuple[int, int]]:
    """[lo, hi) in pieces of at most chunk_elems, also cut at ``cuts``; an empty range still yields
    one empty piece.

    Args:
      lo: first element.
      hi: one past the last element.
      chunk_elems: the largest piece, in elements.
      cuts: offsets no piece may straddle (the array boundaries of a ``Spans`` buffer).

    Returns:
      ``(start, stop)`` pairs covering [lo, hi) in order.
    """
    if hi <= lo:
        return [(lo, lo)]
    inner = [c for c in cuts if lo < c < hi]
    if not inner:
        return [(a, min(a + chunk_elems, hi)) for a in range(lo, hi, chunk_elems)]
    out = []
    for a0, b0 in zip([lo] + inner, inner + [hi]):
        out += [(a, min(a + chunk_elems, b0)) for a in range(a0, b0, chunk_elems)]
    return out


def even_bounds(n: int, parts: int) -> List[int]:
    """Bounds that cut ``n`` elements into ``parts`` segments whose sizes differ by at most one.

    Args:
      n: number of elements.
      parts: number of segments (the ring's size).

    Returns:
      ``parts + 1`` bounds, from 0 to ``n``.
    """
    return [i * n // parts for i in range(parts + 1)]


def array_split_bounds(rows: int, parts: int) -> List[int]:
    """Row bounds with np.array_split's rule: the first rows % parts pieces get one extra row.

    Args:
      rows: number of rows.
      parts: number of pieces.

    Returns:
      ``parts + 1`` row bounds, from 0 to ``rows``.
    """
    base, extra = divmod(rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _as_bytes(a: np.ndarray):
    return a.view(np.uint8) if a.size else b""


def _incoming(link, key, dtype, expect: int, into: Optional[np.ndarray] = None) -> np.ndarray:
    """The chunk for ``key`` as an array of ``dtype``; with ``into`` (its destination) a link that can
    (``recv_into``: a raw socket) reads it straight there, and the array returned is then ``into``."""
    payload = link.recv_into(key, into.view(np.uint8)) if into is not None and into.size else link.recv(key)
    arr = np.frombuffer(payload, dtype=dtype)
    if arr.size != expect:
        # job ranks (on a hierarchical host or leader ring the positions differ)
        left, seq = link.left_rank, link.seq
        raise CollectiveMismatchError(
            (f"collective #{seq}: " if seq is not None else "")
            + f"received {arr.size} elements for step {key[0]} chunk {key[1]} from rank {left}, expected {expect}",
            rank=link.global_rank, seq=seq, remote_rank=left,
            fix="every rank must pass buffers of the same shape and dtype")
    return arr


def _reduce_scatter_steps(link, flat: np.ndarray, op: ReduceOp, chunks: Sequence, then_send_final: bool,
                          src: Optional[np.ndarray] = None):
    """Ring reduce-scatter: afterwards rank r holds the reduction of segment r in ``flat``.

    Step s sends segment (r - s - 1) and receives + reduces segment (r - s - 2).
    When ``then_send_final`` the reduced segment r is sent as the first all-gather step.
    With ``src`` this rank's values are read from ``src`` and the reductions written to ``flat``
    (out of place: no copy of the input first); without, ``flat`` holds the input and is reduced in place.
    """
    W, r = link.size, link.rank
    own = flat if src is None else src
    for c, (a, b) in enumerate(chunks[(r - 1) % W]):
        link.send((0, c), _as_bytes(own[a:b]))
    for s in range(W - 1):
        seg = (r - s - 2) % W
        last = s == W - 2
        for c, (a, b) in enumerate(chunks[seg]):
            incoming = _incoming(link, (s, c), flat.dtype, b - a)
            dst = flat[a:b]
            if src is None:
                combine_into(dst, incoming, op)
            else:
                combine_to(dst, src[a:b], incoming, op)
            if not last or then_send_final:
                link.send((s + 1, c), _as_bytes(dst))


def _allgather_steps(link, flat: np.ndarray, chunks: Sequence, step0: int, send_first: bool):
    """Ring all-gather in place: rank r starts holding segment r and ends holding all of them.

    Step t sends segment (r - t) and receives segment (r - t - 1) (copy). Global step ids start at step0.
    """
    W, r = link.size, link.rank
    if send_first:
        for c, (a, b) in enumerate(chunks[r]):
            link.send((step0, c), _as_bytes(flat[a:b]))
    for t in range(W - 1):
        seg = (r - t - 1) % W
        for c, (a, b) in enumerate(chunks[seg]):
            dst = flat[a:b]
            incoming = _incoming(link, (step0 + t, c), flat.dtype, b - a, into=dst)
            if incoming.size and incoming.ctypes.data != dst.ctypes.data:  # not read in place: copy
                dst[...] = incoming
            if t < W - 2:
                link.send((step0 + t + 1, c), _as_bytes(flat[a:b]))


def allreduce_by_allgather(link, flat: np.ndarray, op: ReduceOp, chunk_elems: int) -> np.ndarray:
    """Small-message all-reduce: ring all-gather of every rank's whole buffer, then a local reduction
    in rank order (identical bits on every rank). W - 1 ring steps instead of 2 (W - 1): half the
    latency for small buffers, at the price of moving (W - 1) x the buffer instead of 2 (W - 1) / W x.

    Args:
      link: the ring link (``rank``, ``size``, ``send``, ``recv``).
      flat: this rank's 1-D contiguous buffer; overwritten with the result.
      op: the reduction.
      chunk_elems: pipelining unit, in elements.

    Returns:
      ``flat``, holding the reduction.

    Raises:
      CollectiveMismatchError: a neighbour sent a block of another size.
    """
    W, r = link.size, link.rank
    n = flat.size
    gathered = np.empty(n * W, dtype=flat.dtype)
    gathered[r * n:(r + 1) * n] = flat
    allgather(link, gathered, [n] * W, chunk_elems)
    flat[...] = reduce_in_rank_order(gathered.reshape(W, n), op)
    return flat


def _allreduce_wide(link, flat: np.ndarray, op: ReduceOp, chunks: Sequence, bounds: Sequence[int]) -> np.ndarray:
    """The ring all-reduce of ``allreduce`` for float16 / bfloat16 sums, means and products, in place.

    The reduce-scatter half runs on a float32 copy, so the partials travel and add up in float32; this
    rank's reduced segment is rounded once into ``flat``, and the all-gather half moves the rounded values.
    """
    W, r = link.size, link.rank
    acc = flat.astype(np.float32)
    _reduce_scatter_steps(link, acc, op, chunks, then_send_final=False)
    lo, hi = bounds[r], bounds[r + 1]
    if op is ReduceOp.MEAN:
        finish_mean(acc[lo:hi], W)
    flat[lo:hi] = acc[lo:hi]
    _allgather_steps(link, flat, chunks, step0=W - 1, send_first=True)
    return flat


def _allreduce_narrow(link, flat: np.ndarray, op: ReduceOp, wire: np.dtype, chunks: Sequence,
                      bounds: Sequence[int], src: Optional[np.ndarray]) -> np.ndarray:
    """The ring all-reduce of ``allreduce`` for a compressed SUM / MEAN (``wire``: float16 or bfloat16).

    Chunk by chunk, so the conversions overlap the link: this rank's values are narrowed as they are
    sent, each incoming partial sum is widened, added to this rank's values in the buffer's own dtype
    and narrowed again before it goes on; this rank's reduced segment is narrowed once (after a MEAN's
    division) and the all-gather half moves the narrow values, each chunk widened into ``flat`` as it
    arrives.
    """
    W, r = link.size, link.rank
    own = flat if src is None else src
    gathered = np.empty(flat.size, dtype=wire)
    for c, (a, b) in enumerate(chunks[(r - 1) % W]):
        link.send((0, c), _as_bytes(own[a:b].astype(wire)))
    for s in range(W - 1):
        seg = (r - s - 2) % W
        last = s == W - 2
        for c, (a, b) in enumerate(chunks[seg]):
            acc = _incoming(link, (s, c), wire, b - a).astype(flat.dtype)
            acc += own[a:b]
            if last:
                if op is ReduceOp.MEAN:
                    finish_mean(acc, W)
                gathered[a:b] = acc
            else:
                link.send((s + 1, c), _as_bytes(acc.astype(wire)))
    for c, (a, b) in enumerate(chunks[r]):
        link.send((W - 1, c), _as_bytes(gathered[a:b]))
        flat[a:b] = gathered[a:b]
    for t in range(W - 1):
        for c, (a, b) in enumerate(chunks[(r - t - 1) % W]):
            dst = gathered[a:b]
            incoming = _incoming(link, (W - 1 + t, c), wire, b - a, into=dst)
            if incoming.size and incoming.ctypes.data != dst.ctypes.data:  # not read in place: copy
                dst[...] = incoming
            if t < W - 2:
                link.send((W + t, c), _as_bytes(dst))
            flat[a:b] = dst
    return flat


def allreduce(link, flat: np.ndarray, op: ReduceOp, chunk_elems: int, small_bytes: int = 0,
              src: Optional[np.ndarray] = None, wide: bool = True, wire: Optional[np.dtype] = None) -> np.ndarray:
    """Ring all-reduce of a 1-D contiguous array; returns ``flat``.

    In place (``flat`` holds the input), or with ``src`` out of place: ``src`` is read, never written,
    and ``flat`` (same size, any contents) receives the result; this saves copying the input first.
    ``flat`` and ``src`` may be ``core.spans.Spans`` (several arrays read and written where they are,
    e.g. a gradient list: chunks are then also cut at the arrays' boundaries) on the ring path
    proper: more than one rank, not the all-gather path, no float32 accumulator.

    Buffers with ``nbytes * (size - 1) <= small_bytes`` take ``allreduce_by_allgather`` instead.

    float16 / bfloat16 sums, means and products travel as float32 partials through the
    reduce-scatter half and are rounded once, so the result is the float32 reduction rounded
    (as if accumulated in float32); the all-gather half moves the rounded values. With ``wide=False``
    (a compressed all-reduce, ``core.compression``) the partials travel in the buffer's own dtype, each
    step's sum rounded to it: half the bytes of the reduce-scatter half, a rounding per step.

    With ``wire`` (float16 or bfloat16; a compressed SUM / MEAN of a float32 / float64 ``flat``,
    ``core.compression``) every chunk travels as ``wire``: added up in ``flat``'s dtype at each step and
    rounded to ``wire`` before it goes on; the result is the ``wire`` values, the same on every rank.

    Args:
      link: the ring link (``rank``, ``size``, ``send``, ``recv``).
      flat: this rank's 1-D contiguous buffer; overwritten with the result.
      op: the reduction.
      chunk_elems: pipelining unit, in elements.
      small_bytes: threshold of the all-gather path (0: never).
      src: this rank's input when not ``flat`` (out of place).
      wide: float16 / bfloat16 partials travel as float32 (see above).
      wire: the dtype a compressed all-reduce travels as (see above); ``chunk_elems`` counts its elements.

    Returns:
      ``flat``, holding the reduction over every rank.

    Raises:
      CollectiveMismatchError: a neighbour sent a chunk of another size (another shape or dtype).
    """
    W, r = link.size, link.rank
    wide = wide and needs_wide_accumulator(flat.dtype, op)
    if src is not None and (W == 1 or (small_bytes > 0 and flat.nbytes * (W - 1) <= small_bytes) or wide):
        flat[...] = src  # these paths work in place
        src = None
    if W == 1:
        if op is ReduceOp.MEAN:
            finish_mean(flat, W)
        return flat
    if wire is not None and small_bytes > 0 and flat.size * wire.itemsize * (W - 1) <= small_bytes:
        narrow = (flat if src is None else src).astype(wire)
        flat[...] = allreduce_by_allgather(link, narrow, op, chunk_elems)
        return flat
    if small_bytes > 0 and flat.nbytes * (W - 1) <= small_bytes:
        return allreduce_by_allgather(link, flat, op, chunk_elems)
    bounds = even_bounds(flat.size, W)
    cuts = sorted(set(getattr(flat, "cuts", ())) | set(getattr(src, "cuts", ())))
    chunks = [chunk_ranges(bounds[i], bounds[i + 1], chunk_elems, cuts) for i in range(W)]
    if wire is not None:
        return _allreduce_narrow(link, flat, op, np.dtype(wire), chunks, bounds, src)
    if wide:
        return _allreduce_wide(link, flat, op, chunks, bounds)
    if op is ReduceOp.MEAN:
        # Divide this rank's own segment before it is sent: once a chunk is handed to the link it may
        # still be leaving from this memory (zero-copy socket sends), so nothing sent is touched again.
        _reduce_scatter_steps(link, flat, op, chunks, then_send_final=False, src=src)
        for a, b in chunks[r]:
            finish_mean(flat[a:b], W)
        _allgather_steps(link, flat, chunks, step0=W - 1, send_first=True)
        return flat
    _reduce_scatter_steps(link, flat, op, chunks, then_send_final=True, src=src)
    _allgather_steps(link, flat, chunks, step0=W - 1, send_first=False)
    return flat


def reduce_scatter(link, flat: np.ndarray, op: ReduceOp, rows: int, row_elems: int,
                   chunk_elems: int) -> Tuple[int, int]:
    """In-place ring reduce-scatter along rows; returns rank's element range [lo, hi) of ``flat``.

    Args:
      link: the ring link.
      flat: this rank's 1-D contiguous buffer (rows x row_elems elements); [lo, hi) ends up reduced.
      op: the reduction.
      rows: number of rows (the first dimension), split with np.array_split's rule.
      row_elems: elements per row.
      chunk_elems: pipelining unit, in elements.

    Returns:
      ``(lo, hi)``: the element range of ``flat`` that holds this rank's reduced piece.

    Raises:
      CollectiveMismatchError: a neighbour sent a chunk of another size.
    """
    W, r = link.size, link.rank
    bounds = [b * row_elems for b in array_split_bounds(rows, W)]
    lo, hi = bounds[r], bounds[r + 1]
    work = flat.astype(np.float32) if needs_wide_accumulator(flat.dtype, op) else flat
    if W > 1:
        chunks = [chunk_ranges(bounds[i], bounds[i + 1], chunk_elems) for i in range(W)]
        _reduce_scatter_steps(link, work, op, chunks, then_send_final=False)
    if op is ReduceOp.MEAN:
        finish_mean(work[lo:hi], W)
    if work is not flat:
        flat[lo:hi] = work[lo:hi]
    return lo, hi


def allgather(link, out: np.ndarray, elem_counts: Sequence[int], chunk_elems: int) -> np.ndarray:
    """Ring all-gather of variable-size blocks: ``out`` already holds this rank's block at its offset.

    Args:
      link: the ring link.
      out: 1-D buffer of ``sum(elem_counts)`` elements, this rank's block already in place.
      elem_counts: the size of every rank's block, in rank order.
      chunk_elems: pipelining unit, in elements.

    Returns:
      ``out``, holding every block.

    Raises:
      CollectiveMismatchError: a neighbour sent a chunk of another size.
    """
    W = link.size
    if W > 1:
        offs = [0]
        for n in elem_counts:
            offs.append(offs[-1] + n)
        chunks = [chunk_ranges(offs[i], offs[i + 1], chunk_elems) for i in range(W)]
        _allgather_steps(link, out, chunks, step0=0, send_first=True)
    return out


def broadcast(link, flat: np.ndarray, root: int, chunk_elems: int) -> np.ndarray:
    """Pipelined broadcast along the ring from ``root``, in place.

    The rank left of the root closes the ring with an empty acknowledgement, so the root also
    receives one message (its signature is checked like everybody's) and returns only once the
    data has reached every rank.

    Args:
      link: the ring link.
      flat: 1-D buffer: the data on the root, overwritten with it elsewhere.
      root: the rank whose data everybody gets.
      chunk_elems: pipelining unit, in elements.

    Returns:
      ``flat``, holding root's data.

    Raises:
      CollectiveMismatchError: a neighbour sent a chunk of another size.
    """
    W, r = link.size, link.rank
    if W == 1:
        return flat
    chunks = chunk_ranges(0, flat.size, chunk_elems)
    right_is_root = (r + 1) % W == root
    if r == root:
        for c, (a, b) in enumerate(chunks):
            link.send((0, c), _as_bytes(flat[a:b]))
        _incoming(link, (1, 0), np.uint8, 0)
        return flat
    for c, (a, b) in enumerate(chunks):
        incoming = _incoming(link, (0, c), flat.dtype, b - a)
        flat[a:b] = incoming
        if not right_is_root:
            link.send((0, c), _as_bytes(flat[a:b]))
    if right_is_root:
        link.send((1, 0), b"")
    return flat


def alltoall(link, flat: np.ndarray, counts: Sequence[Sequence[int]], chunk_elems: int) -> np.ndarray:
    """Ring all-to-all of variable-size blocks: rank o's block for rank d reaches d, passed along the ring.

    ``flat`` holds this rank's blocks one after the other, in rank order of their destinations
    (``counts[r][d]`` elements for rank d). At step t this rank sends its right neighbour the blocks of
    origin r - t that still have to travel further (those for r + 1 ... r - t - 1, in ring order); what
    it receives at step t is the block of origin r - 1 - t for itself, followed by the ones it passes on
    at step t + 1, so forwarding is a slice of what arrived. W - 1 steps; a block for the rank k places
    to the right crosses k links (the ring's links are all there is between ranks).

    Args:
      link: the ring link.
      flat: 1-D, this rank's ``sum(counts[rank])`` elements; only read.
      counts: ``counts[o][d]``: elements rank o sends rank d, the same table on every rank.
      chunk_elems: pipelining unit, in elements.

    Returns:
      A new 1-D array: the blocks for this rank, in rank order of their origins.

    Raises:
      CollectiveMismatchError: a neighbour sent a chunk of another size.
    """
    W, r = link.size, link.rank
    offs = np.concatenate([[0], np.cumsum(counts[r])]).astype(np.int64)
    out_offs = np.concatenate([[0], np.cumsum([counts[o][r] for o in range(W)])]).astype(np.int64)
    out = np.empty(int(out_offs[-1]), dtype=flat.dtype)
    out[out_offs[r]:out_offs[r + 1]] = flat[offs[r]:offs[r + 1]]
    # step 0: this rank's blocks for r + 1, ..., r - 1, in ring order
    outgoing = np.concatenate([flat[offs[d]:offs[d + 1]] for d in ((r + k) % W for k in range(1, W))]) \
        if W > 1 else flat[:0]
    for t in range(W - 1):
        for c, (a, b) in enumerate(chunk_ranges(0, outgoing.size, chunk_elems)):
            link.send((t, c), _as_bytes(outgoing[a:b]))
        origin = (r - 1 - t) % W
        dests = [(r + k) % W for k in range(W - 1 - t)]  # r itself first, then the ones passed on
        expect = sum(counts[origin][d] for d in dests)
        incoming = np.empty(expect, dtype=flat.dtype)
        for c, (a, b) in enumerate(chunk_ranges(0, expect, chunk_elems)):
            incoming[a:b] = _incoming(link, (t, c), flat.dtype, b - a)
        mine = counts[origin][r]
        out[out_offs[origin]:out_offs[origin + 1]] = incoming[:mine]
        outgoing = incoming[mine:]
    return out
