"""Compression on the wire (``compression="fp16"|"bf16"``): the bytes the ring links carry, the values
against numpy, and the same option through the TF layer, ``CommStrategy`` and the Horovod API.

One 3-rank job over raw TCP links (the ring: every byte crosses a link) checks every fact; results are
compared in the parent with numpy.
"""

import numpy as np
import pytest

from tests.helpers import run_workers

N = 1 << 18  # 1 MiB of float32: above the small all-gather path, several chunks per segment
RING = {"TFCS_TRANSPORT": "tcp", "TFCS_SHM_CMA": "0"}


def _x(rank, dtype=np.float32, n=N):
    return np.random.default_rng(100 + rank).standard_normal(n).astype(dtype) * 3


def _sent(tfcs, call):
    """(result, bytes the ring links carried, collective bytes) of one call."""
    from tf_commstrategy.process import default_group
    before = default_group().backend("grpc").stats()
    out = call()
    after = default_group().backend("grpc").stats()
    return out, after.bytes_sent - before.bytes_sent, after.collective_bytes - before.collective_bytes


def w_compression(rank, size):
    import tensorflow as tf

    import tf_commstrategy as tfcs
    import tf_commstrategy.horovod as hvd
    tfcs.init()
    x = _x(rank)
    r = {"paths": None}
    r["none"] = _sent(tfcs, lambda: tfcs.allreduce(x, "sum"))
    r["fp16"] = _sent(tfcs, lambda: tfcs.allreduce(x, "sum", compression="fp16"))
    r["bf16"] = _sent(tfcs, lambda: tfcs.allreduce(x, "sum", compression="bf16"))
    r["fp16 mean"] = _sent(tfcs, lambda: tfcs.allreduce(x, "mean", compression="fp16"))
    r["f64 fp16"] = _sent(tfcs, lambda: tfcs.allreduce(x.astype(np.float64), "sum", compression="fp16"))
    r["f64 none"] = _sent(tfcs, lambda: tfcs.allreduce(x.astype(np.float64), "sum"))
    ints = (x * 100).astype(np.int32)
    r["int fp16"] = _sent(tfcs, lambda: tfcs.allreduce(ints, "sum", compression="fp16"))
    r["max fp16"] = _sent(tfcs, lambda: tfcs.allreduce(x, "max", compression="fp16"))
    r["grouped fp16"] = _sent(tfcs, lambda: tfcs.grouped_allreduce([x[:1000], x[1000:], ints], "sum",
                                                                   compression="fp16"))
    # the TF layer, eagerly and in a graph, and the Horovod API's Compression.fp16
    t = tf.constant(x)
    r["tf fp16"] = _sent(tfcs, lambda: tfcs.allreduce(t, "sum", compression="fp16").numpy())

    @tf.function
    def in_graph():
        return tfcs.grouped_allreduce([t, t * 2], "sum", compression="bf16")
    r["tf graph bf16"] = _sent(tfcs, lambda: in_graph()[1].numpy())
    hvd.init()
    r["hvd fp16"] = _sent(tfcs, lambda: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16).numpy())
    r["hvd none"] = _sent(tfcs, lambda: hvd.allreduce(t, op=hvd.Sum).numpy())
    # CommStrategy(compression=...) and a call's CommOptions over it
    strategy = tfcs.CommStrategy(compression="fp16")
    v = strategy.experimental_distribute_values_from_function(lambda ctx: t)
    mean = tf.distribute.ReduceOp.MEAN
    r["strategy fp16"] = _sent(tfcs, lambda: strategy.reduce(mean, v, axis=None).numpy())
    r["strategy none"] = _sent(tfcs, lambda: strategy.experimental_local_results(strategy.extended.batch_reduce_to(
        mean, [(v, v)], options=tfcs.CommOptions(compression="none"))[0])[0].numpy())
    from tf_commstrategy.process import default_group
    r["paths"] = dict(default_group().backend("grpc").stats().allreduces_by_path)
    # ranks that disagree on compression called different collectives
    try:
        tfcs.allreduce(x, "sum", compression="fp16" if rank == 0 else "none", timeout=20)
        r["mismatch"] = None
    except tfcs.TfcsError as e:
        r["mismatch"] = (type(e).__name__, str(e))
    return r


def _bound(xs, unit, steps):
    """An elementwise bound of the rounding error: each input rounded once, each of ``steps`` partial sums
    once more, each by at most ``unit`` of the sum of magnitudes."""
    return (len(xs) + steps) * unit * np.abs(np.stack(xs)).sum(axis=0)


@pytest.mark.timeout(300)
def test_compression_halves_the_bytes_and_stays_within_the_rounding_bound():
    size = 3
    res = run_workers(w_compression, size, timeout=240, env=RING)
    xs = [_x(r) for r in range(size)]
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    fp16_u, bf16_u = 2.0 ** -11, 2.0 ** -8
    for rank, r in enumerate(res):
        assert r["paths"].get("ring", 0) >= 10 and set(r["paths"]) == {"ring"}, r["paths"]
        y, sent, moved = r["none"]
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
        assert sent > 0 and moved == N * 4
        for name, unit, wire in (("fp16", fp16_u, np.float16), ("bf16", bf16_u, "bfloat16")):
            yc, sent_c, moved_c = r[name]
            assert yc.dtype == np.float32
            assert sent_c * 2 == sent and moved_c * 2 == moved, (name, sent_c, sent)  # half the bytes on every link
            err = np.abs(yc - ref)
            assert (err <= _bound(xs, unit, size - 1)).all(), (name, float(err.max()))
            assert err.max() > 1e-3  # really rounded (float32 would be far closer)
            import ml_dtypes  # noqa: F401 (registers "bfloat16")
            np.testing.assert_array_equal(yc.astype(wire).astype(np.float32), yc)  # the wire dtype's values
            np.testing.assert_array_equal(yc, res[0][name][0])  # the same bits on every rank
        ym, sent_m, _ = r["fp16 mean"]
        assert sent_m * 2 == sent
        assert (np.abs(ym - ref / size) <= _bound(xs, fp16_u, size) / size + 1e-6).all()
        y64, sent64, moved64 = r["f64 fp16"]
        assert y64.dtype == np.float64 and sent64 * 4 == r["f64 none"][1] and moved64 == N * 2
        yi, sent_i, _ = r["int fp16"]  # integers are not narrowed: exact
        np.testing.assert_array_equal(yi, sum((x * 100).astype(np.int32) for x in xs))
        assert sent_i == sent
        ymax, sent_max, _ = r["max fp16"]  # min / max are not narrowed: exact
        np.testing.assert_array_equal(ymax, np.max(np.stack(xs), axis=0))
        assert sent_max == sent
        grouped, _, moved_g = r["grouped fp16"]
        assert moved_g == N * 2 + N * 4  # the float32 group narrowed, the int32 one not
        assert (np.abs(np.concatenate(grouped[:2]) - ref) <= _bound(xs, fp16_u, size - 1)).all()
        np.testing.assert_array_equal(grouped[2], sum((x * 100).astype(np.int32) for x in xs))
        for name in ("tf fp16", "hvd fp16"):
            yt, sent_t, _ = r[name]
            assert sent_t * 2 == sent, (name, sent_t, sent)
            assert (np.abs(yt - ref) <= _bound(xs, fp16_u, size - 1)).all(), name
        yg, sent_g, _ = r["tf graph bf16"]
        assert abs(sent_g - sent) <= 4 * size  # two float32 tensors as bfloat16: one's float32 bytes (the
        # ring's segments of 2 N and N elements round differently)
        assert (np.abs(yg - 2 * ref) <= 2 * _bound(xs, bf16_u, size - 1)).all()
        yh, sent_h, _ = r["hvd none"]
        assert sent_h == sent
        np.testing.assert_allclose(yh, ref, rtol=1e-5, atol=1e-4)
        ys, sent_s, _ = r["strategy fp16"]
        assert sent_s * 2 == sent
        assert (np.abs(ys - ref / size) <= _bound(xs, fp16_u, size) / size + 1e-6).all()
        yn, sent_n, _ = r["strategy none"]
        assert sent_n == sent
        np.testing.assert_allclose(yn, ref / size, rtol=1e-5, atol=1e-4)
        cls, msg = r["mismatch"]
        assert cls == "CollectiveMismatchError", (rank, cls, msg)
        assert "wire=float16" in msg, msg
