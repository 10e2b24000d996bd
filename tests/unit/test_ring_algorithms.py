"""The ring algorithms of core.ring against numpy, with an in-memory link between threads.

Tiny chunk sizes force many chunks per segment, so the pipelining paths (forwarding a chunk at
the next step as soon as it is reduced) are exercised without any network.
"""

import queue
import ml_dtypes
import threading

import numpy as np
import pytest

from tf_commstrategy.core import ring
from tf_commstrategy.core.reduce_ops import ReduceOp


class MemLink(ring.RingLink):
    def __init__(self, rank, size, inboxes):
        self.rank, self.size, self._in = rank, size, inboxes
        self.sent = 0

    def send(self, key, payload):
        self._in[(self.rank + 1) % self.size].put((key, bytes(payload)))
        self.sent += 1

    def recv(self, key):
        got_key, payload = self._in[self.rank].get(timeout=10)
        assert got_key == key, f"rank {self.rank} expected {key}, got {got_key}"
        return payload


def run_ring(size, fn):
    inboxes = [queue.Queue() for _ in range(size)]
    links = [MemLink(r, size, inboxes) for r in range(size)]
    out, errs = [None] * size, []

    def body(r):
        try:
            out[r] = fn(links[r])
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert not errs, errs
    return out, links


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 7, 33])
@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_allreduce_matches_numpy(size, n, chunk):
    rng = np.random.default_rng(size * 100 + n)
    inputs = [rng.integers(-50, 50, n).astype(np.int64) for _ in range(size)]
    out, links = run_ring(size, lambda l: ring.allreduce(l, inputs[l.rank].copy(), ReduceOp.SUM, chunk))
    for r in range(size):
        np.testing.assert_array_equal(out[r], np.sum(inputs, axis=0))
    if size > 1:  # every step sends at least one message, even for empty segments
        assert all(l.sent >= 2 * (size - 1) for l in links)


@pytest.mark.parametrize("op,ref", [(ReduceOp.MIN, np.min), (ReduceOp.MAX, np.max), (ReduceOp.PROD, np.prod)])
def test_allreduce_other_ops(op, ref):
    inputs = [np.array([1, -2, 3, 2, 5, -1, 2], dtype=np.int32) * (r % 2 * 2 - 1) + r for r in range(3)]
    out, _ = run_ring(3, lambda l: ring.allreduce(l, inputs[l.rank].copy(), op, 2))
    for o in out:
        np.testing.assert_array_equal(o, ref(inputs, axis=0))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [0, 1, 5, 9])
def test_reduce_scatter_uses_array_split_rule(size, rows):
    inputs = [np.arange(rows * 3, dtype=np.int64).reshape(rows, 3) + 10 * r for r in range(size)]
    total = np.sum(inputs, axis=0)

    def fn(l):
        flat = inputs[l.rank].reshape(-1).copy()
        lo, hi = ring.reduce_scatter(l, flat, ReduceOp.SUM, rows, 3, 2)
        return flat[lo:hi].reshape(-1, 3)

    out, _ = run_ring(size, fn)
    for r, piece in enumerate(np.array_split(total, size)):
        np.testing.assert_array_equal(out[r], piece)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allgather_variable_blocks(size):
    blocks = [np.arange(r * 2 + (r % 2), dtype=np.float32) + 100 * r for r in range(size)]
    counts = [b.size for b in blocks]

    def fn(l):
        out = np.zeros(sum(counts), np.float32)
        off = sum(counts[:l.rank])
        out[off:off + counts[l.rank]] = blocks[l.rank]
        return ring.allgather(l, out, counts, 3)

    out, _ = run_ring(size, fn)
    for o in out:
        np.testing.assert_array_equal(o, np.concatenate(blocks))


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("root", [0, 1, 4])
def test_broadcast_any_root(size, root):
    if root >= size:
        pytest.skip("root outside world")
    data = [np.full(11, r, dtype=np.int16) for r in range(size)]
    out, _ = run_ring(size, lambda l: ring.broadcast(l, data[l.rank].copy(), root, 4))
    for o in out:
        np.testing.assert_array_equal(o, data[root])


def test_mean_float_and_integer_floor():
    fin = [np.array([1.0, 2.0], np.float32) * (r + 1) for r in range(4)]
    out, _ = run_ring(4, lambda l: ring.allreduce(l, fin[l.rank].copy(), ReduceOp.MEAN, 1))
    np.testing.assert_allclose(out[0], np.mean(fin, axis=0))
    iin = [np.array([1, 2, 3]) + r for r in range(4)]
    out, _ = run_ring(4, lambda l: ring.allreduce(l, iin[l.rank].copy(), ReduceOp.MEAN, 1))
    np.testing.assert_array_equal(out[2], np.sum(iin, axis=0) // 4)


@pytest.mark.parametrize("dtype,big", [(np.float16, 2048.0), (ml_dtypes.bfloat16, 256.0)])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_low_precision_sums_accumulate_in_float32(dtype, big, op):
    # big + 1 is a tie that rounds back to big in this dtype, so adding the three inputs
    # big, 1, 1 hop by hop in the dtype loses both ones for the elements whose ring order starts at
    # the big value. Accumulated in float32 and rounded once, every element is exactly big + 2.
    inputs = [np.array([big, big, big], dtype), np.ones(3, dtype), np.ones(3, dtype)]
    out, _ = run_ring(3, lambda l: ring.allreduce(l, inputs[l.rank].copy(), op, 1))
    want = (big + 2) / (3 if op is ReduceOp.MEAN else 1)
    for o in out:
        assert o.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(o.astype(np.float64), np.full(3, np.float64(np.array(want, dtype))))

    def rs(l):
        flat = inputs[l.rank].copy()
        lo, hi = ring.reduce_scatter(l, flat, op, 3, 1, 1)
        return flat[lo:hi]
    out, _ = run_ring(3, rs)
    assert [float(o[0]) for o in out] == [float(np.array(want, dtype))] * 3


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.PROD])
def test_small_allreduce_by_allgather_matches_numpy_and_is_bitwise_identical(size, op):
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(37).astype(np.float32) for _ in range(size)]
    out, links = run_ring(size, lambda l: ring.allreduce(l, inputs[l.rank].copy(), op, 5, small_bytes=1 << 20))
    ref = {ReduceOp.SUM: np.sum, ReduceOp.MEAN: np.mean, ReduceOp.MAX: np.max, ReduceOp.PROD: np.prod}[op]
    np.testing.assert_allclose(out[0], ref(np.stack(inputs).astype(np.float64), axis=0), rtol=1e-5)
    for o in out[1:]:
        np.testing.assert_array_equal(o, out[0])
    assert all(l.sent == (size - 1) * 8 for l in links)  # W-1 all-gather steps of 8 chunks: the small path ran


def test_low_precision_small_path_accumulates_in_float32():
    inputs = [np.array([2048.0] * 3, np.float16), np.ones(3, np.float16), np.ones(3, np.float16)]
    out, _ = run_ring(3, lambda l: ring.allreduce(l, inputs[l.rank].copy(), ReduceOp.SUM, 1, small_bytes=1 << 20))
    for o in out:
        np.testing.assert_array_equal(o.astype(np.float64), [2050.0] * 3)


class _HostRingLink(ring.RingLink):
    """Position 1 of a 2-rank ring whose members are job ranks 4 and 6 (a hierarchical leader ring):
    the left neighbour sends a chunk one element short."""
    rank, size, seq, global_rank, left_rank = 1, 2, 17, 6, 4

    def send(self, key, payload):
        pass

    def recv(self, key):
        return np.ones(2, np.float32).tobytes()


def test_a_short_chunk_names_job_ranks_and_the_collective():
    from tf_commstrategy.errors import CollectiveMismatchError
    with pytest.raises(CollectiveMismatchError) as info:
        ring.allreduce(_HostRingLink(), np.ones(6, np.float32), ReduceOp.SUM, 1000)
    e = info.value
    assert (e.rank, e.remote_rank, e.seq) == (6, 4, 17)
    assert "from rank 4" in str(e) and "collective #17" in str(e)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("wire,unit", [(np.float16, 2.0 ** -11), (ml_dtypes.bfloat16, 2.0 ** -8)])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
@pytest.mark.parametrize("small", [0, 1 << 20])
def test_compressed_allreduce_travels_narrow_within_its_rounding_bound(size, wire, unit, op, small):
    """Every chunk crosses the link as ``wire`` (half the float32 bytes), the result holds wire values,
    identical on every rank, within (2W - 1) roundings of the sum of magnitudes (W + 1 for a mean's
    division); out of place reads ``src`` only."""
    n = 37
    rng = np.random.default_rng(size)
    inputs = [(rng.standard_normal(n) * 50).astype(np.float32) for _ in range(size)]
    sizes = []

    def body(link):
        send = link.send
        link.send = lambda key, payload: sizes.append(len(payload)) or send(key, payload)
        src = inputs[link.rank].copy()
        out = ring.allreduce(link, np.empty(n, np.float32), op, 4, small_bytes=small, src=src, wire=np.dtype(wire))
        np.testing.assert_array_equal(src, inputs[link.rank])
        return out
    out, _ = run_ring(size, body)
    ref = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    bound = (2 * size - 1 + (op is ReduceOp.MEAN)) * unit * np.abs(np.stack(inputs)).sum(axis=0)
    if op is ReduceOp.MEAN:
        ref, bound = ref / size, bound / size
    for r in range(size):
        assert out[r].dtype == np.float32
        np.testing.assert_array_equal(out[r], out[0])
        np.testing.assert_array_equal(out[r].astype(wire).astype(np.float32), out[r])
        assert (np.abs(out[r] - ref) <= bound).all(), (r, float(np.abs(out[r] - ref).max()))
    assert sizes and all(s % np.dtype(wire).itemsize == 0 and s <= 4 * np.dtype(wire).itemsize or small
                         for s in sizes), sizes
    assert sum(sizes) == (size * (size - 1) * n * 2 if small else 2 * (size - 1) * n * 2), sum(sizes)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_alltoall_passes_every_block_to_its_rank(size, chunk):
    rng = np.random.default_rng(size * 10 + chunk)
    counts = rng.integers(0, 4, (size, size)).tolist()  # zeros included: empty blocks and steps
    blocks = {(o, d): rng.standard_normal(counts[o][d]).astype(np.float32) for o in range(size) for d in range(size)}
    inputs = [np.concatenate([blocks[(o, d)] for d in range(size)]) for o in range(size)]
    out, _ = run_ring(size, lambda l: ring.alltoall(l, inputs[l.rank], counts, chunk))
    for r in range(size):
        np.testing.assert_array_equal(out[r], np.concatenate([blocks[(o, r)] for o in range(size)]))
