"""Host tensors reach the collectives without copies, and results are written straight into tensors."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from tf_commstrategy.tf import tensor_ops  # noqa: E402


def test_host_view_is_a_read_only_view_of_the_tensor_memory():
    t = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    v = tensor_ops.host_view(t)
    assert v.shape == (3, 4) and v.dtype == np.float32 and not v.flags.writeable
    assert v.ctypes.data == np.asarray(memoryview(t)).ctypes.data  # the tensor's own buffer: no copy
    with pytest.raises(ValueError):
        v[0, 0] = 1.0


def test_host_view_of_bfloat16_has_the_right_values_and_is_read_only():
    t = tf.cast(tf.constant([1.5, -2.0, 3.25]), tf.bfloat16)
    v = tensor_ops.host_view(t)
    assert str(v.dtype) == "bfloat16" and not v.flags.writeable
    np.testing.assert_array_equal(v.astype(np.float32), [1.5, -2.0, 3.25])


def test_new_host_tensor_view_writes_into_the_tensor():
    made = tensor_ops.new_host_tensor(tf.TensorShape([2, 3]), tf.float32)
    assert made is not None  # this TensorFlow exposes its host buffers
    t, view = made
    view[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("in_function", [False, True])
def test_run_numpy_into_fills_fresh_output_tensors_and_keeps_inputs_intact(in_function):
    a = tf.constant(np.arange(5, dtype=np.float32))
    b = tf.constant(np.arange(3, dtype=np.int64))

    def fn(ins, outs):
        assert not ins[0].flags.writeable and not ins[1].flags.writeable
        for i, o in zip(ins, outs):
            o[...] = i * 2
        return outs

    def go(x, y):
        return tensor_ops.run_numpy(fn, [x, y], [x.dtype, y.dtype], [x.shape, y.shape], into=True)

    outs = tf.function(go)(a, b) if in_function else go(a, b)
    np.testing.assert_array_equal(outs[0].numpy(), np.arange(5) * 2.0)
    np.testing.assert_array_equal(outs[1].numpy(), np.arange(3) * 2)
    np.testing.assert_array_equal(a.numpy(), np.arange(5))  # inputs unchanged


def test_bfloat16_and_empty_outputs_do_not_turn_the_fast_path_off():
    assert tensor_ops.new_host_tensor(tf.TensorShape([3]), tf.bfloat16) is None  # converted instead
    t, v = tensor_ops.new_host_tensor(tf.TensorShape([0]), tf.float32)
    assert t.shape == (0,) and v.size == 0
    assert tensor_ops.new_host_tensor(tf.TensorShape([4]), tf.float32) is not None


@pytest.mark.parametrize("shape,dtype", [((5,), np.float32), ((2, 3), np.int64), ((), np.float64), ((0,), np.int8),
                                         ((7,), np.float16)])
def test_aligned_empty_starts_on_a_64_byte_boundary_with_the_shape_and_dtype(shape, dtype):
    for _ in range(8):  # numpy's own allocations are only 16-byte aligned: try several
        a = tensor_ops.aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % 64 == 0  # an empty array has no memory to share


def test_in_a_function_inputs_arrive_without_a_copy_and_results_leave_without_one():
    x = tf.constant(np.arange(1 << 16, dtype=np.float32))  # large enough for TF to align it
    seen = {}

    def fn(ins, outs):
        seen["in"], seen["out"] = ins[0].ctypes.data, outs[0].ctypes.data
        outs[0][...] = ins[0] + 1
        return outs

    @tf.function
    def go(t):
        y = tensor_ops.run_numpy(fn, [t], [t.dtype], [t.shape], into=True)[0]
        return y, t  # both tensors' buffers are compared below

    y, t = go(x)
    np.testing.assert_array_equal(y.numpy(), np.arange(1 << 16) + 1)
    assert seen["in"] == np.asarray(memoryview(t)).ctypes.data  # the input tensor's own memory
    assert seen["out"] == np.asarray(memoryview(y)).ctypes.data  # the result became the output tensor
