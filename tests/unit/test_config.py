"""Sizes and environment variables: parsed values, and errors that name the variable."""

import pytest

from tf_commstrategy.config import env_value, parse_size
from tf_commstrategy.errors import ConfigurationError


@pytest.mark.parametrize("text,want", [
    ("0", 0), ("8", 8), ("4K", 4096), ("4kb", 4096), ("256KiB", 256 << 10), ("64M", 64 << 20),
    (" 1GiB ", 1 << 30), ("1.5M", 3 << 19), ("12B", 12),
])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text,match", [
    ("", "cannot parse"), ("M", "cannot parse"), ("4X", "cannot parse"), ("four", "cannot parse"),
    ("1e400", "cannot parse"), ("inf", "cannot parse"), ("nan", "cannot parse"), ("-4M", "negative"),
])
def test_bad_sizes_are_refused(text, match):
    with pytest.raises(ConfigurationError, match=match):
        parse_size(text)


@pytest.mark.parametrize("raw", ["1e400", "-4M", "lots"])
def test_a_bad_variable_is_named_in_the_error(raw):
    with pytest.raises(ConfigurationError) as e:
        env_value("TFCS_CHUNK_BYTES", parse_size, None, {"TFCS_CHUNK_BYTES": raw})
    assert "TFCS_CHUNK_BYTES" in str(e.value) and repr(raw) in str(e.value)


def test_unset_or_empty_gives_the_default():
    assert env_value("TFCS_CHUNK_BYTES", parse_size, 7, {}) == 7
    assert env_value("TFCS_CHUNK_BYTES", parse_size, 7, {"TFCS_CHUNK_BYTES": ""}) == 7


@pytest.mark.parametrize("chunk", [0, (128 << 20) + 1, 2 << 30])
def test_a_ring_chunk_outside_its_limits_is_refused_before_the_rendezvous(chunk):
    """A chunk over one gRPC message (TFCS_CHUNK_BYTES=2G) used to fail the first collective with a
    frame-size error that asked for a bug report."""
    from tf_commstrategy.process_group import GroupSettings, ProcessGroup
    from tf_commstrategy.rendezvous.cluster_env import ClusterSpec
    settings = GroupSettings.resolve(ClusterSpec(0, 2, 0, "127.0.0.1:1", ""), chunk_bytes=chunk, rendezvous_timeout=2,
                                      environ={})
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        ProcessGroup(settings)  # no rendezvous attempted: the coordinator address above is never dialled


def test_log_level():
    from tf_commstrategy.config import log_level_from_env
    assert log_level_from_env({}) is None
    assert log_level_from_env({"TFCS_LOG_LEVEL": " info "}) == "INFO"
    with pytest.raises(ConfigurationError, match="TFCS_LOG_LEVEL"):
        log_level_from_env({"TFCS_LOG_LEVEL": "chatty"})


@pytest.mark.parametrize("text,want", [
    (None, "none"), ("", "none"), ("off", "none"), ("FP16", "fp16"), (" half ", "fp16"), ("float16", "fp16"),
    ("bf16", "bf16"), ("bfloat16", "bf16"),
])
def test_compression_names(text, want):
    from tf_commstrategy.config import compression_from_env, parse_compression
    assert parse_compression(text) == want
    env = {} if text is None else {"TFCS_COMPRESSION": text}
    assert compression_from_env(env) == want


def test_an_unknown_compression_is_refused_naming_the_variable():
    from tf_commstrategy.config import compression_from_env
    with pytest.raises(ConfigurationError, match="TFCS_COMPRESSION.*int8|int8.*TFCS_COMPRESSION"):
        compression_from_env({"TFCS_COMPRESSION": "int8"})


def test_what_compression_narrows():
    import ml_dtypes
    import numpy as np

    from tf_commstrategy.core.compression import wire_dtype
    from tf_commstrategy.core.reduce_ops import ReduceOp
    S, M = ReduceOp.SUM, ReduceOp.MEAN
    assert wire_dtype("fp16", np.float32, S) == np.float16
    assert wire_dtype("fp16", np.float64, M) == np.float16
    assert wire_dtype("bf16", np.float32, M) == np.dtype(ml_dtypes.bfloat16)
    assert wire_dtype("bf16", "float32", S) == np.dtype(ml_dtypes.bfloat16)  # the nccl backend's dtype names
    for dtype in (np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.bool_, "no such dtype"):
        assert wire_dtype("fp16", dtype, S) is None, dtype
    for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD):
        assert wire_dtype("fp16", np.float32, op) is None, op
    assert wire_dtype("none", np.float32, S) is None


def test_bench_hosts():
    from tf_commstrategy.config import bench_hosts_from_env
    assert bench_hosts_from_env(2, {}) == ["127.0.0.1", "127.0.0.1"]
    assert bench_hosts_from_env(2, {"TFCS_BENCH_HOSTS": "10.0.0.1, 10.0.0.2"}) == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(ConfigurationError, match="TFCS_BENCH_HOSTS.*1 addresses for 2 ranks"):
        bench_hosts_from_env(2, {"TFCS_BENCH_HOSTS": "10.0.0.1"})
