import ml_dtypes
import numpy as np
import pytest

from tf_commstrategy.core.reduce_ops import ReduceOp, check_dtype, combine_into, finish_mean
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
