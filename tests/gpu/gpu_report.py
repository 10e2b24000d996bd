"""The GPU check's summary: the nccl backend's correctness matrix and all-reduce bandwidth, one table.

    PYTHONPATH=. python3 tests/gpu/gpu_report.py [--json FILE]

Runs one rank per visible GPU (``conftest.gpu_world``; one rank on a one-GPU host), on cupy arrays
only (no TensorFlow). Every op x dtype on two shapes is compared with numpy from fresh random inputs
(the seed is printed); the data-movement collectives are checked as in test_nccl_gpu.py; then
float32 all-reduces of 4 MiB, 64 MiB and 1 GiB are timed (median of back-to-back calls; each call
returns once the GPU has finished). Exit status 0 only when every check passed.
"""

import argparse
import json
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu import test_nccl_gpu as T  # noqa: E402
from tests.gpu.conftest import gpu_world  # noqa: E402
from tests.helpers import run_workers  # noqa: E402
from tests.nccl_cases import _pairs, make_input, reference  # noqa: E402

SIZES = [4 << 20, 64 << 20, 1 << 30]


def w_bench(rank, size, sizes):
    cupy, tfcs = T._setup(rank)
    out = {"device": cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode(),
           "cupy": cupy.__version__, "nccl": cupy.cuda.nccl.get_version()}
    for nbytes in sizes:
        x = cupy.ones(nbytes // 4, dtype=cupy.float32)
        iters = 50 if nbytes <= (64 << 20) else 10
        for _ in range(3):
            y = tfcs.allreduce(x, backend="nccl")
        assert float(y[:1].get()[0]) == size
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            tfcs.allreduce(x, backend="nccl")
            times.append(time.perf_counter() - t0)
        out[nbytes] = sorted(times)[len(times) // 2]
        del x, y
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--sizes", default=",".join(str(n) for n in SIZES), help="all-reduce sizes in bytes to time")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    size = gpu_world()
    if size == 0:
        from tf_commstrategy.backends.nccl import availability
        print(f"no GPU check: nccl cannot run here ({availability()})")
        return 2
    seed = T.SEED
    cases = passed = 0
    failures = []
    results = run_workers(T.w_every_op, size, seed, timeout=200)
    for shape in T.SHAPES:
        for d, op in _pairs():
            ref = reference([make_input(r, d, op, seed, shape) for r in range(size)], op, d)
            for rank, (out, _) in enumerate(results):
                cases += 1
                try:
                    T._check(out[(shape, d, op)][0], ref, d, f"{shape} {d} {op} rank {rank}")
                    passed += 1
                except AssertionError as e:
                    failures.append(str(e).splitlines()[0][:200])
    tf_loaded = any(t for _, t in results)
    try:
        T.test_broadcast_allgather_reduce_scatter_grouped_barrier_streams_and_refusals()
        movement = "PASS"
    except AssertionError as e:
        movement = f"FAIL: {str(e).splitlines()[0][:200]}"
    bench = run_workers(w_bench, size, sizes, timeout=200)[0]
    for f in failures[:10]:
        print("FAIL", f)
    ok = passed == cases and movement == "PASS" and not tf_loaded
    print(f"\nnccl backend on {size} x {bench['device']}, cupy {bench['cupy']}, NCCL {bench['nccl']}, seed {seed}\n")
    print("| check | result |")
    print("|---|---|")
    print(f"| allreduce: 5 ops x 9 dtypes (44 pairs) x 2 shapes x {size} rank(s) vs numpy | {passed}/{cases} "
          f"{'PASS' if passed == cases else 'FAIL'} |")
    print(f"| broadcast, allgather (uneven), reduce_scatter, grouped, barrier, stream order, DLPack, host refusal | "
          f"{movement} |")
    print(f"| TensorFlow imported by the nccl path | {'yes (FAIL)' if tf_loaded else 'no'} |")
    print("\n| all-reduce float32 | time (median) | algbw GB/s | busbw GB/s |")
    print("|---|---|---|---|")
    rows = {}
    for nbytes in sizes:
        t = bench[nbytes]
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (size - 1) / size if size > 1 else algbw
        rows[nbytes] = {"time_s": t, "algbw_GBps": algbw, "busbw_GBps": busbw}
        label = f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"
        print(f"| {label} | {t * 1e3:.3f} ms | {algbw:.1f} | {busbw:.1f} |")
    if size == 1:
        print("\n(one GPU: NCCL runs a one-rank communicator; busbw is reported as algbw)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": size, "device": bench["device"], "cupy": bench["cupy"], "nccl": bench["nccl"],
                       "seed": seed, "cases": cases, "passed": passed, "movement": movement,
                       "tf_loaded": tf_loaded, "allreduce": {str(k): v for k, v in rows.items()},
                       "date": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
