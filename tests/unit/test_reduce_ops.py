import ml_dtypes
import numpy as np
import pytest

from tf_commstrategy.core.reduce_ops import ReduceOp, check_dtype, combine_into, finish_mean, reduce_in_rank_order
from tf_commstrategy.errors import ConfigurationError, UnsupportedOperationError


def test_parse_accepts_strings_enums_and_tf_style_names():
    class FakeTfOp:  # tf.distribute.ReduceOp.SUM has .name == "SUM"
        name = "SUM"
    assert ReduceOp.parse("Mean") is ReduceOp.MEAN
    assert ReduceOp.parse(ReduceOp.MAX) is ReduceOp.MAX
    assert ReduceOp.parse(FakeTfOp()) is ReduceOp.SUM
    with pytest.raises(ConfigurationError, match="unknown reduction op"):
        ReduceOp.parse("avg")


def test_bool_only_for_min_max():
    check_dtype(np.bool_, ReduceOp.MAX)
    with pytest.raises(UnsupportedOperationError, match="not defined for bool"):
        check_dtype(np.bool_, ReduceOp.SUM)
    with pytest.raises(UnsupportedOperationError, match="not supported"):
        check_dtype(np.complex64, ReduceOp.SUM)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_mean_divides_in_float32(dtype):
    x = np.array([3.0, 5.0], dtype=dtype)
    finish_mean(x, 2)
    np.testing.assert_array_equal(x.astype(np.float32), [1.5, 2.5])


def test_bool_min_max_are_and_or():
    a = np.array([True, True, False, False])
    combine_into(a, np.array([True, False, True, False]), ReduceOp.MIN)
    np.testing.assert_array_equal(a, [True, False, False, False])
    b = np.array([True, True, False, False])
    combine_into(b, np.array([True, False, True, False]), ReduceOp.MAX)
    np.testing.assert_array_equal(b, [True, True, True, False])


@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float16, ml_dtypes.bfloat16])
def test_reduce_in_rank_order_matches_numpy_and_leaves_the_blocks_alone(op, dtype):
    rng = np.random.default_rng(7)
    blocks = [rng.uniform(0.5, 2.0, 11).astype(dtype) if np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16
              else rng.integers(-20, 20, 11).astype(dtype) for _ in range(3)]
    kept = [b.copy() for b in blocks]
    wide = np.stack([b.astype(np.float64) for b in blocks])
    want = {"sum": wide.sum(0), "min": wide.min(0), "max": wide.max(0), "prod": wide.prod(0),
            "mean": wide.sum(0) // 3 if np.dtype(dtype).kind == "i" else wide.mean(0)}[op]
    got = reduce_in_rank_order(blocks, ReduceOp.parse(op))
    low = np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    if low and op in ("sum", "mean", "prod"):
        assert got.dtype == np.float32  # the accumulator, rounded by the caller
    tol = {np.dtype(np.float32): 1e-6, np.dtype(np.int32): 0}.get(np.dtype(dtype), 1e-2)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=0)
    for b, k in zip(blocks, kept):
        np.testing.assert_array_equal(b, k)
