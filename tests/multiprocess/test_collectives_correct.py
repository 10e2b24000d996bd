"""Every op x dtype x world size x size against numpy, with real workers on loopback.

Each worker rebuilds every rank's input from the shared seed, computes the numpy reference and
returns how far its result is from it; the parent asserts. Results of small sizes come back whole
and are compared in the parent too.
"""

import ml_dtypes
import numpy as np
import pytest

from tests.helpers import cross_memory_max_ranks, run_workers

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "mean", "min", "max", "prod"]
SIZES = [0, 1, 7, 1000, 2 ** 20 + 3]


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(rank, dtype, op, n, seed):
    rng = np.random.default_rng([seed, rank, n, DTYPES.index(dtype.name if dtype.name != "bfloat16" else "bfloat16")
                                 if dtype.name in DTYPES else 0, OPS.index(op)])
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if op == "prod":  # stay far from overflow: values near 1
        if np.issubdtype(dtype, np.integer):
            return rng.choice(np.array([1, 1, 1, 2, -1] if np.issubdtype(dtype, np.signedinteger) else [1, 1, 2]),
                              n).astype(dtype)
        return rng.uniform(0.8, 1.25, n).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        hi = 30 if dtype.itemsize == 1 else 1000
        lo = 0 if np.issubdtype(dtype, np.unsignedinteger) else -hi
        return rng.integers(lo, hi, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def reference(inputs, op, dtype):
    if op in ("sum", "mean", "prod") and dtype.kind == "f" or dtype == _dtype("bfloat16"):
        wide = np.stack([x.astype(np.float64) for x in inputs])
    else:
        wide = np.stack(inputs)
    if op == "sum":
        r = wide.sum(0)
    elif op == "mean":
        r = wide.sum(0) // len(inputs) if np.issubdtype(dtype, np.integer) else wide.mean(0)
    elif op == "prod":
        r = wide.prod(0)
    elif op == "min":
        r = wide.min(0)
    else:
        r = wide.max(0)
    return r.astype(dtype)


def _tolerance(dtype, op, size):
    if dtype.kind in "iub":
        return 0.0
    return {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[
        "bfloat16" if dtype == _dtype("bfloat16") else dtype.name] * (size if op in ("sum", "prod") else 1)


def matrix_worker(rank, size, seed):
    import tf_commstrategy as tfcs
    tfcs.init()
    report = []
    for dname in DTYPES:
        dtype = _dtype(dname)
        for op in OPS:
            if dname == "bool" and op not in ("min", "max"):
                continue
            for n in SIZES:
                inputs = [make_input(r, dtype, op, n, seed) for r in range(size)]
                got = tfcs.allreduce(inputs[rank], op=op)
                want = reference(inputs, op, dtype)
                assert got.dtype == dtype and got.shape == (n,), (got.dtype, got.shape)
                err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)) /
                                   np.maximum(1.0, np.abs(want.astype(np.float64))))) if n else 0.0
                report.append((dname, op, n, err, got if n <= 1000 else None))
    if size == 1:
        return report, 0
    from tf_commstrategy.process import default_group
    return report, default_group().backend("grpc").stats().cma_allreduces


# Every data path: shared all-reduce buffers (the default when the job is on one host; whole and in
# pieces of 4 KiB), cross-memory reads (the default from 4 MiB on one host; here from 64 KiB), the ring
# over shared memory, unix sockets, gRPC, opt-in raw TCP.
NO_BUFFERS = "shm-ring"  # transport "auto" with the shared all-reduce buffers and cross-memory reads off
SMALL_BUFFERS = "shm-4k"  # ... with 4 KiB buffers, so every large all-reduce goes in many pieces
CROSS_MEMORY = "shm-cma"  # ... every all-reduce above 64 KiB reads the peers' arrays (process_vm_readv)
# World sizes 2-4 on every transport: a 2-rank ring's two links go to the same peer; 3 ranks: an odd
# ring; 4: an even ring of more than one hop (and, for shared memory, more ranks than cores here).
TRANSPORTS = [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (3, SMALL_BUFFERS),
              (2, CROSS_MEMORY), (3, CROSS_MEMORY), (2, NO_BUFFERS), (3, NO_BUFFERS), (4, NO_BUFFERS),
              (2, "unix"), (3, "unix"), (4, "unix"),
              (2, "grpc"), (3, "grpc"), (4, "grpc"), (2, "tcp"), (3, "tcp"), (4, "tcp")]


def transport_env(transport):
    if transport == NO_BUFFERS:
        return {"TFCS_TRANSPORT": "auto", "TFCS_SHM_FUSION_BYTES": "0", "TFCS_SHM_CMA": "0"}
    if transport == CROSS_MEMORY:
        return {"TFCS_TRANSPORT": "auto", "TFCS_SHM_CMA": "1K"}
    if transport == SMALL_BUFFERS:
        return {"TFCS_TRANSPORT": "auto", "TFCS_SHM_FUSION_BYTES": "4K"}
    return {"TFCS_TRANSPORT": transport}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size,transport", TRANSPORTS)
def test_allreduce_matrix_matches_numpy(size, transport):
    seed = 1234 + size
    results = run_workers(matrix_worker, size, seed, timeout=540, env=transport_env(transport))
    # on one host the all-reduces above the cross-memory threshold (4 MiB; 1 KiB for CROSS_MEMORY) that
    # need no float32 accumulator (float16 / bfloat16 sums, means, products do) read the peers' arrays;
    # nothing else does (a path that quietly fell back would pass the numbers alone)
    threshold = {"auto": 4 << 20, SMALL_BUFFERS: 4 << 20, CROSS_MEMORY: 1 << 10}.get(transport)
    want = 0
    if 1 < size <= cross_memory_max_ranks() and threshold is not None:
        want = len([1 for d in DTYPES for op in OPS for n in SIZES
                    if (d != "bool" or op in ("min", "max")) and n * _dtype(d).itemsize >= threshold
                    and n * _dtype(d).itemsize > 64 << 10
                    and not (d in ("float16", "bfloat16") and op in ("sum", "mean", "prod"))])
    assert [c for _, c in results] == [want] * size, ([c for _, c in results], want)
    results = [report for report, _ in results]
    for rank, report in enumerate(results):
        assert len(report) == (len(DTYPES) - 1) * len(OPS) * len(SIZES) + 2 * len(SIZES)
        for dname, op, n, err, got in report:
            dtype = _dtype(dname)
            tol = _tolerance(dtype, op, size)
            assert err <= tol, f"rank {rank} {op} {dname} n={n}: error {err} > {tol}"
            if got is not None:  # small results: checked again here against a fresh numpy reference
                inputs = [make_input(r, dtype, op, n, seed) for r in range(size)]
                want = reference(inputs, op, dtype)
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                           rtol=max(tol, 1e-12), atol=max(tol, 0))
    # bitwise identical on every rank
    for other in results[1:]:
        for a, b in zip(results[0], other):
            if a[4] is not None:
                np.testing.assert_array_equal(a[4], b[4])


def movement_worker(rank, size, seed):
    import tf_commstrategy as tfcs
    tfcs.init()
    out = []
    for dname in DTYPES:
        dtype = _dtype(dname)
        for n in SIZES:
            rng = np.random.default_rng([seed, n, DTYPES.index(dname)])
            per_rank = [make_input(r, dtype, "sum" if dname != "bool" else "max", n, seed) for r in range(size)]
            root = int(rng.integers(0, size))
            b = tfcs.broadcast(per_rank[rank], root_rank=root)
            rows = [max(0, n // (r + 1)) for r in range(size)]  # different first dimensions per rank
            mine = np.resize(per_rank[rank], rows[rank] * 1).reshape(rows[rank], 1) if n else \
                np.zeros((0, 1), dtype)
            g = tfcs.allgather(mine)
            rs_op = "max" if dname == "bool" else "sum"
            rs_in = per_rank[rank].reshape(-1, 1) if n else np.zeros((0, 1), dtype)
            rs = tfcs.reduce_scatter(rs_in, op=rs_op)
            small = n <= 1000
            out.append((dname, n, root, b if small else bool(np.array_equal(b, per_rank[root])),
                        g if small else g.shape, rs if small else rs.shape))
    tfcs.barrier()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size,transport", TRANSPORTS)
def test_broadcast_allgather_reduce_scatter_match_numpy(size, transport):
    seed = 99 + size
    results = run_workers(movement_worker, size, seed, timeout=540, env=transport_env(transport))
    for rank, out in enumerate(results):
        for dname, n, root, b, g, rs in out:
            dtype = _dtype(dname)
            per_rank = [make_input(r, dtype, "sum" if dname != "bool" else "max", n, seed) for r in range(size)]
            rows = [max(0, n // (r + 1)) for r in range(size)]
            if n > 1000:
                assert b is True
                assert g == (sum(rows), 1)
                assert rs == (len(np.array_split(np.arange(n), size)[rank]), 1)
                continue
            np.testing.assert_array_equal(b, per_rank[root])
            want_g = np.concatenate([np.resize(per_rank[r], rows[r]).reshape(rows[r], 1) if n else
                                     np.zeros((0, 1), dtype) for r in range(size)])
            np.testing.assert_array_equal(g, want_g)
            stacked = np.stack([p.reshape(-1, 1) for p in per_rank])
            if dname == "bool":
                total = stacked.max(0)
            elif dtype.kind == "f" or dname == "bfloat16":
                total = stacked.astype(np.float64).sum(0).astype(dtype)
            else:
                total = stacked.sum(0).astype(dtype)
            want_rs = np.array_split(total, size)[rank]
            np.testing.assert_allclose(rs.astype(np.float64), want_rs.astype(np.float64),
                                       rtol=_tolerance(dtype, "sum", size), atol=_tolerance(dtype, "sum", size))


def _which_transport(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init()
    return default_group().backend("grpc").stats().transport


@pytest.mark.parametrize("requested,expected", [("auto", "shm"), ("shm", "shm"), ("unix", "unix"), ("grpc", "grpc"),
                                                ("tcp", "tcp")])
def test_transport_choice_per_neighbour_pair(requested, expected):
    assert run_workers(_which_transport, 2, timeout=60, env={"TFCS_TRANSPORT": requested}) == [expected] * 2


def _out_worker(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init()
    report = []
    for n in (0, 7, (1 << 20) + 3):
        for op in ("sum", "mean", "max"):
            ins = [np.random.default_rng(10 * n + r).standard_normal(n) for r in range(size)]
            want = {"sum": sum(ins), "mean": sum(ins) / size, "max": np.max(ins, axis=0) if n else ins[0]}[op]
            x = ins[rank].copy()
            other = np.full_like(x, 123.0)
            got = tfcs.allreduce(x, op=op, out=other)
            report.append((n, op, got is other, bool(np.array_equal(x, ins[rank])), float(np.max(np.abs(got - want)))
                           if n else 0.0))
            got2 = tfcs.allreduce(x, op=op, out=x)  # in place
            report.append((n, op, got2 is x, True, float(np.max(np.abs(x - want))) if n else 0.0))
    try:
        tfcs.allreduce(np.ones(3), out=np.ones(4))
        bad = "accepted"
    except tfcs.UnsupportedOperationError as e:
        bad = str(e)
    z = np.arange(10.0)
    try:
        tfcs.allreduce(z[:-1], out=z[1:])
        overlap = "accepted"
    except tfcs.UnsupportedOperationError as e:
        overlap = str(e)
    return report, bad, overlap


@pytest.mark.parametrize("transport", ["auto", NO_BUFFERS, "unix"])
def test_allreduce_into_out_and_in_place(transport):
    for report, bad, overlap in run_workers(_out_worker, 3, timeout=120, env=transport_env(transport)):
        for n, op, is_out, input_kept, err in report:
            assert is_out and input_kept and err < 1e-12, (n, op, is_out, input_kept, err)
        assert "out= must be" in bad
        assert "overlaps the input" in overlap, overlap
