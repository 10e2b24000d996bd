"""``tf_commstrategy.horovod`` against Horovod's own API (horovod.tensorflow, TF2): the signatures and
defaults of its public functions, written out here from Horovod's source; the errors before
``hvd.init()``; what is refused (Adasum, process sets) before any job is joined; Compression."""

import inspect
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import tf_commstrategy as tfcs  # noqa: E402
import tf_commstrategy.horovod as hvd  # noqa: E402
from tf_commstrategy.errors import ConfigurationError, NotInitializedError, UnsupportedOperationError  # noqa: E402

NONE = inspect.Parameter.empty
COMPRESSION_NONE, GLOBAL_SET, AVERAGE = object(), object(), object()  # Compression.none, global_process_set, Average

#: name -> [(parameter, default)], from horovod/tensorflow/__init__.py, mpi_ops.py, functions.py and
#: horovod/common/basics.py, process_sets.py
HOROVOD_SIGNATURES = {
    "init": [("comm", None), ("process_sets", None)],
    "shutdown": [], "is_initialized": [], "size": [], "local_size": [], "cross_size": [], "rank": [],
    "local_rank": [], "cross_rank": [], "is_homogeneous": [], "mpi_threads_supported": [], "mpi_enabled": [],
    "mpi_built": [], "gloo_enabled": [], "gloo_built": [], "nccl_built": [], "ddl_built": [], "ccl_built": [],
    "cuda_built": [], "rocm_built": [],
    "allreduce": [("tensor", NONE), ("average", None), ("device_dense", ""), ("device_sparse", ""),
                  ("compression", COMPRESSION_NONE), ("op", None), ("prescale_factor", 1.0),
                  ("postscale_factor", 1.0), ("name", None), ("process_set", GLOBAL_SET),
                  ("ignore_name_scope", False)],
    "grouped_allreduce": [("tensors", NONE), ("average", None), ("device_dense", ""), ("device_sparse", ""),
                          ("compression", COMPRESSION_NONE), ("op", None), ("prescale_factor", 1.0),
                          ("postscale_factor", 1.0), ("process_set", GLOBAL_SET), ("ignore_name_scope", False),
                          ("name", None)],
    "allgather": [("tensor", NONE), ("name", None), ("ignore_name_scope", False), ("process_set", GLOBAL_SET)],
    "grouped_allgather": [("tensors", NONE), ("name", None), ("ignore_name_scope", False),
                          ("process_set", GLOBAL_SET)],
    "broadcast": [("tensor", NONE), ("root_rank", NONE), ("name", None), ("ignore_name_scope", False),
                  ("process_set", GLOBAL_SET)],
    "broadcast_": [("variables", NONE), ("root_rank", NONE), ("name", None), ("process_set", GLOBAL_SET)],
    "alltoall": [("tensor", NONE), ("splits", None), ("name", None), ("ignore_name_scope", False),
                 ("process_set", GLOBAL_SET)],
    "reducescatter": [("tensor", NONE), ("device_dense", ""), ("compression", COMPRESSION_NONE), ("op", AVERAGE),
                      ("name", None), ("process_set", GLOBAL_SET), ("ignore_name_scope", False),
                      ("prescale_factor", 1.0), ("postscale_factor", 1.0)],
    "grouped_reducescatter": [("tensors", NONE), ("device_dense", ""), ("compression", COMPRESSION_NONE),
                              ("op", AVERAGE), ("process_set", GLOBAL_SET), ("prescale_factor", 1.0),
                              ("postscale_factor", 1.0)],
    "join": [],
    "size_op": [("process_set_id", 0), ("name", None)],
    "local_size_op": [("name", None)], "rank_op": [("name", None)], "local_rank_op": [("name", None)],
    "process_set_included_op": [("process_set_id", 0), ("name", None)],
    "broadcast_variables": [("variables", NONE), ("root_rank", NONE), ("process_set", GLOBAL_SET),
                            ("inplace", False)],
    "broadcast_global_variables": [("root_rank", NONE)],
    "broadcast_object": [("obj", NONE), ("root_rank", 0), ("session", None), ("name", None),
                         ("process_set", GLOBAL_SET)],
    "broadcast_object_fn": [("root_rank", 0), ("session", None), ("name", None), ("process_set", GLOBAL_SET)],
    "allgather_object": [("obj", NONE), ("session", None), ("name", None), ("process_set", GLOBAL_SET)],
    "add_process_set": [("process_set", NONE)],
    "remove_process_set": [("process_set", NONE)],
    "handle_average_backwards_compatibility": [("op", NONE), ("average", NONE)],
    "check_num_rank_power_of_2": [("num_rank", NONE)],
}
# torch's hvd.barrier (horovod/torch/mpi_ops.py): horovod.tensorflow has none
EXTRA_SIGNATURES = {"barrier": [("process_set", GLOBAL_SET)]}

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


@pytest.fixture
def not_joined():
    if tfcs.is_initialized():
        pytest.skip("a job is joined in this test process")


def _expected_default(marker):
    return {id(COMPRESSION_NONE): hvd.Compression.none, id(GLOBAL_SET): hvd.global_process_set,
            id(AVERAGE): 0}.get(id(marker), marker)


@pytest.mark.parametrize("name", sorted({**HOROVOD_SIGNATURES, **EXTRA_SIGNATURES}))
def test_signatures_and_defaults_are_horovods(name):
    want = {**HOROVOD_SIGNATURES, **EXTRA_SIGNATURES}[name]
    params = list(inspect.signature(getattr(hvd, name)).parameters.values())
    assert [p.name for p in params] == [n for n, _ in want]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params), params
    for p, (n, default) in zip(params, want):
        expected = _expected_default(default)
        if expected is hvd.Compression.none or expected is hvd.global_process_set:
            assert p.default is expected, (name, n, p.default)
        else:
            assert p.default == expected and type(p.default) is type(expected), (name, n, p.default)


def test_reductions_have_horovods_values():
    # horovod/common/message.h: enum ReduceOp { AVERAGE = 0, SUM = 1, ADASUM = 2, MIN = 3, MAX = 4, PRODUCT = 5 }
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.global_process_set.process_set_id == 0


@pytest.mark.parametrize("query", ["size", "rank", "local_size", "local_rank", "cross_size", "cross_rank"])
def test_queries_before_init_raise_horovods_value_error(not_joined, query):
    with pytest.raises(ValueError) as e:
        getattr(hvd, query)()
    assert str(e.value) == NOT_INITIALIZED
    assert isinstance(e.value, NotInitializedError)


def test_collectives_and_sets_before_init(not_joined):
    assert hvd.is_initialized() is False and hvd.is_homogeneous() is False
    for call in (lambda: hvd.allreduce(tf.ones([2])), lambda: hvd.allgather(tf.ones([2])),
                 lambda: hvd.broadcast(tf.ones([2]), 0), lambda: hvd.reducescatter(tf.ones([2])),
                 lambda: hvd.grouped_allreduce([tf.ones([2])]), lambda: hvd.join(), lambda: hvd.barrier(),
                 lambda: hvd.broadcast_object(1), lambda: hvd.allgather_object(1),
                 lambda: hvd.global_process_set.size(), lambda: hvd.global_process_set.rank()):
        with pytest.raises(ValueError, match="^Horovod has not been initialized; use hvd.init\\(\\).$"):
            call()
    hvd.shutdown()  # harmless when not initialized


def test_adasum_and_other_ops_are_refused_with_a_reason(not_joined):
    for call in (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum),
                 lambda: hvd.grouped_allreduce([tf.ones([2])], op=hvd.Adasum)):
        with pytest.raises(UnsupportedOperationError, match="Adasum reduction is not implemented"):
            call()
    with pytest.raises(UnsupportedOperationError, match="reducescatter supports only Average and Sum, got op=Min"):
        hvd.reducescatter(tf.ones([4]), op=hvd.Min)
    with pytest.raises(ConfigurationError, match="op=7 is not a Horovod reduction"):
        hvd.allreduce(tf.ones([2]), op=7)
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)


def test_average_keyword_maps_to_ops_with_a_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hvd.handle_average_backwards_compatibility(None, True) == hvd.Average
        assert hvd.handle_average_backwards_compatibility(None, False) == hvd.Sum
    assert [w.category for w in caught] == [DeprecationWarning] * 2
    assert hvd.handle_average_backwards_compatibility(None, None) == hvd.Average
    assert hvd.handle_average_backwards_compatibility(hvd.Max, None) == hvd.Max


def test_only_the_global_process_set(not_joined):
    ps = hvd.ProcessSet([2, 0, 1])
    assert ps.ranks == [0, 1, 2] and ps.process_set_id is None and ps.size() is None and ps.rank() is None
    with pytest.raises(ConfigurationError):
        hvd.ProcessSet([0, "1"])
    with pytest.raises(UnsupportedOperationError, match="sub-groups in tf_commstrategy's collective core"):
        hvd.add_process_set([0, 1])
    with pytest.raises(UnsupportedOperationError, match="sub-groups"):
        hvd.add_process_set(ps)
    assert hvd.remove_process_set(ps) is False and hvd.remove_process_set(hvd.global_process_set) is False
    for call in (lambda: hvd.allreduce(tf.ones([2]), process_set=ps),
                 lambda: hvd.allgather(tf.ones([2]), process_set=ps),
                 lambda: hvd.broadcast(tf.ones([2]), 0, process_set=ps), lambda: hvd.barrier(process_set=ps),
                 lambda: hvd.reducescatter(tf.ones([2]), process_set=ps), lambda: hvd.size_op(process_set_id=1),
                 lambda: hvd.broadcast_object(1, process_set=ps)):
        with pytest.raises(UnsupportedOperationError, match="process sets other than the global one"):
            call()
    with pytest.raises(UnsupportedOperationError, match="comm"):
        hvd.init(comm=[0, 1])
    with pytest.raises(UnsupportedOperationError, match="process sets other than the global one"):
        hvd.init(process_sets=[ps])
    assert not tfcs.is_initialized()  # refused before joining anything


def test_build_flags_say_what_this_package_is():
    from tf_commstrategy.core.backend import availability
    assert (hvd.mpi_enabled(), hvd.mpi_built(), hvd.gloo_enabled(), hvd.gloo_built(), hvd.ddl_built(),
            hvd.ccl_built(), hvd.rocm_built()) == (False,) * 7
    nccl_loads = availability("nccl") is None
    assert isinstance(hvd.nccl_built(), int) and (hvd.nccl_built() > 0) == nccl_loads
    assert hvd.cuda_built() is nccl_loads
    with pytest.raises(ValueError, match="Horovod MPI is not enabled"):
        hvd.mpi_threads_supported()


def test_compression_fp16_round_trip_and_none():
    x = tf.constant([1.0, -2.5, 3.140625, 1e-3], tf.float32)
    c, ctx = hvd.Compression.fp16.compress(x)
    assert c.dtype == tf.float16 and ctx == tf.float32
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == tf.float32
    np.testing.assert_allclose(back.numpy(), x.numpy().astype(np.float16).astype(np.float32), rtol=0, atol=0)
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=1e-3)
    d = tf.constant([0.1, 70000.0], tf.float64)  # beyond float16's range: inf, as Horovod's cast gives
    c, ctx = hvd.Compression.fp16.compress(d)
    assert c.dtype == tf.float16 and ctx == tf.float64
    out = hvd.Compression.fp16.decompress(c, ctx).numpy()
    assert out.dtype == np.float64 and abs(out[0] - 0.1) < 1e-4 and np.isinf(out[1])
    i = tf.constant([1, 2, 3], tf.int32)
    c, ctx = hvd.Compression.fp16.compress(i)
    assert c is i and hvd.Compression.fp16.decompress(c, ctx) is c
    c, ctx = hvd.Compression.none.compress(x)
    assert c is x and ctx is None and hvd.Compression.none.decompress(c, ctx) is x
    assert issubclass(hvd.Compression.fp16, hvd.compression.Compressor)
