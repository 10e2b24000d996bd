"""core.spans and the ring over it: several arrays all-reduced where they are (no concatenation)."""

import numpy as np
import pytest

from tests.unit.test_ring_algorithms import run_ring
from tf_commstrategy import config
from tf_commstrategy.core import ring
from tf_commstrategy.core.reduce_ops import ReduceOp
from tf_commstrategy.core.spans import Spans
from tf_commstrategy.errors import ConfigurationError


def test_slices_are_views_and_copies_cross_boundaries():
    parts = [np.arange(3.0), np.arange(3.0, 4.0), np.empty(0), np.arange(4.0, 9.0)]
    s = Spans(parts)
    assert s.size == 9 and s.cuts == [3, 4, 4] and s.nbytes == 72
    v = s[4:7]
    assert np.shares_memory(v, parts[3]) and v.tolist() == [4.0, 5.0, 6.0]
    s[0:2] = [10.0, 11.0]
    assert parts[0].tolist() == [10.0, 11.0, 2.0]
    with pytest.raises(IndexError):
        s[2:5]  # crosses a boundary: the ring never asks for that
    out = np.empty(6)
    s.read_into(out, 1, 7)
    assert out.tolist() == [11.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    s.write_from(np.array([-1.0, -2.0, -3.0]), 2, 5)
    assert parts[0][2] == -1.0 and parts[1][0] == -2.0 and parts[3][0] == -3.0


def test_chunk_ranges_cut_at_boundaries():
    assert ring.chunk_ranges(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert ring.chunk_ranges(0, 10, 4, cuts=[3, 9, 12]) == [(0, 3), (3, 7), (7, 9), (9, 10)]
    assert ring.chunk_ranges(5, 5, 4, cuts=[5]) == [(5, 5)]


SHAPES = [(7,), (0,), (1,), (5, 3), (2,)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX])
@pytest.mark.parametrize("in_place", [True, False])
def test_ring_allreduce_over_spans_matches_numpy(size, op, in_place):
    rng = np.random.default_rng(size)
    inputs = [[rng.standard_normal(s) for s in SHAPES] for _ in range(size)]
    outs = [[np.full(s, np.nan) for s in SHAPES] for _ in range(size)]

    def body(link):
        mine = [a.copy() for a in inputs[link.rank]]
        if in_place:
            ring.allreduce(link, Spans(mine), op, 4)
            return mine
        ring.allreduce(link, Spans(outs[link.rank]), op, 4, src=Spans(mine))
        assert all(np.array_equal(a, b) for a, b in zip(mine, inputs[link.rank]))  # inputs only read
        return outs[link.rank]
    got, _ = run_ring(size, body)
    for i, s in enumerate(SHAPES):
        stack = np.stack([inputs[r][i] for r in range(size)])
        want = {ReduceOp.SUM: stack.sum(0), ReduceOp.MEAN: stack.mean(0), ReduceOp.MAX: stack.max(0)}[op]
        for r in range(size):
            assert got[r][i].shape == s
            np.testing.assert_allclose(got[r][i], want, rtol=1e-12, atol=1e-12)


def test_shm_buffers_bytes_setting():
    assert config.shm_buffers_bytes_from_env({}) == config.DEFAULT_SHM_FUSION_BYTES
    assert config.shm_buffers_bytes_from_env({"TFCS_SHM_FUSION_BYTES": "0"}) == 0
    assert config.shm_buffers_bytes_from_env({"TFCS_SHM_FUSION_BYTES": "64K"}) == 65536
    with pytest.raises(ConfigurationError, match="TFCS_SHM_FUSION_BYTES"):
        config.shm_buffers_bytes_from_env({"TFCS_SHM_FUSION_BYTES": "lots"})
