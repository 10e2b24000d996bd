"""The GPU check's summary: the nccl backend's correctness matrix and all-reduce bandwidth, one table.

    PYTHONPATH=. python3 tests/gpu/gpu_report.py [--json FILE]

Runs one rank per visible GPU (``conftest.gpu_world``; one rank on a one-GPU host, or N ranks on it
with ``TFCS_GPU_EMULATE_HOSTS=N``), on cupy arrays only (no TensorFlow). Every op x dtype on two
shapes is compared with numpy from fresh random inputs (the seed is printed); the data-movement
collectives are checked as in test_nccl_gpu.py; then float32 all-reduces of 4 KiB, 4 MiB, 64 MiB and
1 GiB are timed (median of back-to-back calls; each call returns once the GPU has finished), and,
where PyTorch with CUDA is installed, the same all-reduces through ``torch.distributed`` (NCCL) on
the same ranks: the peer, so the table gives our time over torch's. Exit status 0 only when every
check passed (the timings are reported, never judged).
"""

import argparse
import json
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu import test_nccl_gpu as T  # noqa: E402
from tests.gpu.conftest import emulate_host, emulated_hosts, gpu_world  # noqa: E402
from tests.helpers import free_port, run_workers  # noqa: E402
from tests.nccl_cases import _pairs, make_input, reference  # noqa: E402
from tf_commstrategy.bench.cli import human  # noqa: E402

SIZES = [4 << 10, 4 << 20, 64 << 20, 1 << 30]


def _iters(nbytes: int) -> int:
    return 200 if nbytes <= (64 << 10) else 50 if nbytes <= (64 << 20) else 10


def _median_time(call, sync, nbytes: int) -> float:
    for _ in range(3):
        call()
    sync()
    times = []
    for _ in range(_iters(nbytes)):
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def w_bench(rank, size, sizes):
    cupy, tfcs = T._setup(rank)
    from cupy.cuda import nccl  # a submodule: cupy 14 does not load it with cupy.cuda
    out = {"device": cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode(),
           "cupy": cupy.__version__, "nccl": nccl.get_version()}
    for nbytes in sizes:
        x = cupy.ones(nbytes // 4, dtype=cupy.float32)
        y = tfcs.allreduce(x, backend="nccl")
        assert float(y[:1].get()[0]) == size
        # tfcs.allreduce returns once the GPU has finished: no extra synchronisation
        out[nbytes] = _median_time(lambda: tfcs.allreduce(x, backend="nccl"), lambda: None, nbytes)
        x = y = None  # the memory goes back to the pool before the next size
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def w_bench_torch(rank, size, sizes, port):
    """The same all-reduces through torch.distributed's NCCL process group (in place, as torch does)."""
    emulate_host(rank)
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    v = torch.cuda.nccl.version()
    out = {"torch": torch.__version__, "nccl": ".".join(map(str, v)) if isinstance(v, tuple) else str(v)}
    try:
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
            dist.all_reduce(x)
            assert float(x[0]) == size
            out[nbytes] = _median_time(lambda: dist.all_reduce(x), torch.cuda.synchronize, nbytes)
            x = None
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def _torch_cuda() -> bool:
    if os.environ.get("TFCS_GPU_DRYRUN") == "1":
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


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
    # the signature check's cost: the same all-reduces without it (a one-rank job never checks)
    unchecked = run_workers(w_bench, size, sizes, timeout=200, env={"TFCS_NCCL_CHECK": "0"})[0] if size > 1 else None
    peer = None
    if _torch_cuda():
        try:
            peer = run_workers(w_bench_torch, size, sizes, free_port(), timeout=200)[0]
        except Exception as e:  # noqa: BLE001 - the peer is context, not a check
            print(f"torch.distributed peer not measured: {str(e).splitlines()[0][:300]}")
    for f in failures[:10]:
        print("FAIL", f)
    ok = passed == cases and movement == "PASS" and not tf_loaded
    how = (f"{size} ranks on one GPU, each its own NCCL host (NCCL_HOSTID; socket transport over loopback)"
           if emulated_hosts() else f"{size} rank(s), one per GPU")
    print(f"\nnccl backend: {how}; {bench['device']}, cupy {bench['cupy']}, NCCL {bench['nccl']}, seed {seed}")
    if peer:
        print(f"peer: torch {peer['torch']} torch.distributed NCCL {peer['nccl']}, same ranks")
    print("\n| check | result |")
    print("|---|---|")
    print(f"| allreduce: 5 ops x 9 dtypes (44 pairs) x 2 shapes x {size} rank(s) vs numpy | {passed}/{cases} "
          f"{'PASS' if passed == cases else 'FAIL'} |")
    print(f"| broadcast, allgather (uneven), reduce_scatter, grouped, barrier, stream order, DLPack, host refusal, "
          f"cupy bfloat16 | {movement} |")
    print(f"| TensorFlow imported by the nccl path | {'yes (FAIL)' if tf_loaded else 'no'} |")
    print("\n| all-reduce float32 | tfcs time (median) | algbw GB/s | busbw GB/s | tfcs, no signature check | "
          "torch time (median) | tfcs / torch |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for nbytes in sizes:
        t = bench[nbytes]
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (size - 1) / size if size > 1 else algbw
        tp = peer.get(nbytes) if peer else None
        tu = unchecked[nbytes] if unchecked else None
        rows[nbytes] = {"time_s": t, "algbw_GBps": algbw, "busbw_GBps": busbw, "torch_time_s": tp,
                        "unchecked_time_s": tu}
        vs = f"{tp * 1e3:.3f} ms | {t / tp:.2f}" if tp else "n/a | n/a"
        nc = f"{tu * 1e3:.3f} ms" if tu else "n/a (one rank)"
        print(f"| {human(nbytes)} | {t * 1e3:.3f} ms | {algbw:.2f} | {busbw:.2f} | {nc} | {vs} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": size, "emulated_hosts": emulated_hosts(), "device": bench["device"],
                       "cupy": bench["cupy"], "nccl": bench["nccl"], "peer": peer and {
                           k: v for k, v in peer.items() if isinstance(k, str)},
                       "seed": seed, "cases": cases, "passed": passed, "movement": movement,
                       "tf_loaded": tf_loaded, "allreduce": {str(k): v for k, v in rows.items()},
                       "date": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
