"""``allreduce_many``: several arrays reduced as one collective, read and written where they are.

Paths: the ring over shared memory with chunks cut at the arrays' boundaries (2 ranks), the shared
all-reduce buffers (3 ranks on one host; also in 4 KiB pieces), the ring with the buffers off, unix
sockets. Every result is compared in the parent against numpy.
"""

import numpy as np
import pytest

from tests.helpers import run_workers

# sizes like a small model's gradients: tiny biases next to a large kernel, and an empty one
SHAPES = [(3, 3, 1, 32), (32,), (0,), (5408, 128), (128,), (128, 10), (10,)]
CASES = [("float32", "sum"), ("float32", "mean"), ("float64", "max"), ("int32", "sum"), ("int64", "mean"),
         ("float16", "sum"), ("float32", "prod")]


def _inputs(rank, dtype, op, seed):
    rng = np.random.default_rng([seed, rank, CASES.index((dtype, op))])
    out = []
    for s in SHAPES:
        if op == "prod":
            out.append(rng.uniform(0.9, 1.1, s).astype(dtype))
        elif np.dtype(dtype).kind == "i":
            out.append(rng.integers(-1000, 1000, s).astype(dtype))
        else:
            out.append(rng.standard_normal(s).astype(dtype))
    return out


def _reference(all_inputs, dtype, op):
    res = []
    for parts in zip(*all_inputs):
        wide = np.stack([p.astype(np.float64) if np.dtype(dtype).kind == "f" else p for p in parts])
        r = {"sum": wide.sum(0), "prod": wide.prod(0), "max": wide.max(0),
             "mean": wide.sum(0) // len(parts) if np.dtype(dtype).kind == "i" else wide.mean(0)}[op]
        res.append(r.astype(dtype))
    return res


def many_worker(rank, size, seed):
    from tf_commstrategy.core.reduce_ops import ReduceOp
    from tf_commstrategy.process import default_group
    import tf_commstrategy as tfcs
    tfcs.init()
    b = default_group().backend("grpc")
    out = {"path": b.stats()["allreduce"], "results": []}
    for dtype, op in CASES:
        mine = _inputs(rank, dtype, op, seed)
        kept = [m.copy() for m in mine]
        outs = [np.full_like(m, 7) for m in mine]
        got = b.allreduce_many(mine, ReduceOp.parse(op), outs=outs)
        inputs_kept = all(np.array_equal(a, k) for a, k in zip(mine, kept))
        again = b.allreduce_many(mine, ReduceOp.parse(op), outs=mine)  # in place
        out["results"].append((dtype, op, all(g is o for g, o in zip(got, outs)), inputs_kept, got,
                               all(g is m for g, m in zip(again, mine)), [a.copy() for a in again]))
    return out


PATHS = [(2, {}, "ring (small: shm-buffers)"), (2, {"TFCS_SHM_FUSION_BYTES": "0"}, "ring"),
         (3, {}, "shm-buffers"), (3, {"TFCS_SHM_FUSION_BYTES": "4K"}, "shm-buffers"),
         (3, {"TFCS_SHM_FUSION_BYTES": "0"}, "ring"), (2, {"TFCS_TRANSPORT": "unix"}, "ring")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size,env,path", PATHS)
def test_allreduce_many_matches_numpy_on_every_path(size, env, path):
    seed = 7 + size
    results = run_workers(many_worker, size, seed, timeout=240, env=env)
    for rank, res in enumerate(results):
        assert res["path"] == path
        for (dtype, op, is_out, kept, got, in_place, again) in res["results"]:
            want = _reference([_inputs(r, dtype, op, seed) for r in range(size)], dtype, op)
            tol = {"float16": 5e-3, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0.0)
            assert is_out and kept and in_place, (dtype, op, is_out, kept, in_place)
            for g, a, w, s in zip(got, again, want, SHAPES):
                assert g.shape == s and g.dtype == np.dtype(dtype)
                np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol * size,
                                           atol=tol * size, err_msg=f"rank {rank} {dtype} {op} {s}")
                np.testing.assert_array_equal(a, g)  # in place gives the same bits
    for other in results[1:]:  # bitwise identical on every rank
        for a, b in zip(results[0]["results"], other["results"]):
            for x, y in zip(a[4], b[4]):
                np.testing.assert_array_equal(x, y)


def mismatch_worker(rank, size):
    from tf_commstrategy.core.reduce_ops import ReduceOp
    from tf_commstrategy.process import default_group
    import tf_commstrategy as tfcs
    tfcs.init()
    b = default_group().backend("grpc")
    # the same total size (beyond the small-message path, which concatenates and would not care), cut
    # differently on rank 0: the chunks would not line up, so the signature tells the calls apart
    parts = [np.ones(40000, np.float32), np.ones(60000, np.float32)] if rank == 0 else [np.ones(100000, np.float32)]
    b.allreduce_many(parts, ReduceOp.SUM, timeout=20)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,env", [(2, {}), (3, {})])
def test_allreduce_many_mismatch_is_a_typed_error(size, env):
    out = run_workers(mismatch_worker, size, timeout=90, env=env, expect_failure=True)
    kinds = {r: v[1][0] for r, v in out.items() if v[0] == "error"}
    assert kinds, out
    assert set(kinds.values()) <= {"CollectiveMismatchError", "CollectiveAbortedError"}, kinds
    assert "CollectiveMismatchError" in kinds.values()
