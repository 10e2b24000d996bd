"""Benchmark workers: one process per rank, for tfcs itself and for each peer it is compared with.

    python -m tf_commstrategy.bench.workers --impl tfcs|tf-ring|gloo --op allreduce --sizes ... --out F

Every implementation runs the same schedule: for each size, warm-up calls, then ``iters`` timed
calls, back to back or ``--gap-ms`` apart (each rank busy in between, as a training step computes
between its all-reduces; only the calls are timed). All-reduces run in place on the host (gloo's
way; tfcs with ``out=``), the input restored before each call outside the timing. Each rank writes
its per-call times (seconds) to ``--out.rank<r>``, rank 0 also ``--out`` (JSON); the CLI reports
each call's slowest rank. The peers:

* ``tf-ring``: TensorFlow's MultiWorkerMirroredStrategy with
  ``CommunicationOptions(implementation=RING)``, the all-reduce inside ``strategy.run`` (a
  ``tf.function``), TF_CONFIG built from ``TFCS_BENCH_PORTS``;
* ``gloo``: ``torch.distributed`` with the gloo backend, ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Optional

import numpy as np

DTYPE_BYTES = 4  # float32 everywhere
_SCRATCH = bytes(16 << 10)  # what busy() hashes


def iterations(nbytes: int, budget_s: float, gap_s: float = 0.0) -> int:
    """Same count on every rank and implementation: more calls for small sizes, at least 5."""
    est = 2e-4 + nbytes / 5e8 + gap_s  # a rough guess of one call's time, only to size the loop
    return int(max(5, min(2000, budget_s / est)))


def busy(seconds: float) -> None:
    """Keep this rank's CPU busy for ``seconds`` as a training step's kernels do: native work with the
    GIL released (hashing a 16 KiB buffer that stays in the L1 cache), never touching the collective's
    buffers. (Sleeping instead lets the CPU idle; a pure-Python spin holds the GIL, which starves the
    control plane's threads until the call, as TensorFlow's compute does not.)"""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(_SCRATCH).digest()


def timed(call, iters: int, warmup: Optional[int] = None, gap_s: float = 0.0, prepare=None):
    """Per-call wall times (seconds) of ``iters`` calls after ``warmup`` untimed ones (default: a tenth
    of ``iters``, at least 3: with more ranks than cores the first few hundred small calls of a size ran
    slower than the rest), back to back, or with ``busy(gap_s)`` before each (not timed).
    ``prepare()``, when given, runs before each call, untimed: it restores the input an in-place call
    overwrote."""
    for _ in range(max(3, iters // 10) if warmup is None else warmup):
        if prepare is not None:
            prepare()
        call()
    times = []
    for _ in range(iters):
        if gap_s > 0:
            busy(gap_s)
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _schedule(sizes, budget, gap_s=0.0):
    for nbytes in sizes:
        yield nbytes, max(1, nbytes // DTYPE_BYTES), iterations(nbytes, budget, gap_s)


def _device_ones(n, value, local_rank):
    """GPU buffers for the nccl backend: one GPU per rank of this host (local rank modulo the GPUs)."""
    import cupy
    cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy.full(n, value, dtype=cupy.float32)


def run_tfcs(args, rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(backend=args.backend)
    on_gpu = args.backend == "nccl"
    results = {}
    for nbytes, n, iters in _schedule(args.sizes, args.budget, args.gap_s):
        x = _device_ones(n, rank + 1, tfcs.local_rank()) if on_gpu else np.ones(n, np.float32) * (rank + 1)
        prepare = None
        if args.op == "allreduce":
            check = tfcs.allreduce(x, op="sum")
            host = check.get() if on_gpu else check  # the nccl backend returns once the GPU is done
            assert np.all(host == size * (size + 1) / 2), "wrong allreduce result"
            if on_gpu:  # the nccl backend has no out=
                call = lambda: tfcs.allreduce(x, op="sum")  # noqa: E731
            else:  # in place, as gloo's all_reduce: the input restored before each call, untimed
                y = x.copy()
                prepare = lambda: np.copyto(y, x)  # noqa: E731
                call = lambda: tfcs.allreduce(y, op="sum", out=y)  # noqa: E731
        elif args.op == "broadcast":
            call = lambda: tfcs.broadcast(x, root_rank=0)  # noqa: E731
        else:
            xs = x[: max(1, n // size)]
            call = lambda: tfcs.allgather(xs)  # noqa: E731
        results[nbytes] = timed(call, iters, gap_s=args.gap_s, prepare=prepare)
    tfcs.barrier()
    from tf_commstrategy.process import default_group
    stats = {} if on_gpu else default_group().backend("grpc").stats()
    info = {"transport": "nccl" if on_gpu else stats["transport"], "allreduce": stats.get("allreduce", "nccl")}
    tfcs.shutdown()
    return results, info


def run_tf_ring(args, rank, size):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ports = os.environ["TFCS_BENCH_PORTS"].split(",")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    import tensorflow as tf
    opts = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)
    results = {}
    for nbytes, n, iters in _schedule(args.sizes, args.budget, args.gap_s):
        with strategy.scope():
            v = tf.Variable(tf.ones([n], tf.float32) * (rank + 1))
        if args.op == "allreduce":
            @tf.function
            def step():
                return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, v.read_value()))
        elif args.op == "allgather":
            m = max(1, n // size)

            @tf.function
            def step():
                return strategy.run(lambda: tf.distribute.get_replica_context().all_gather(
                    v.read_value()[:m], axis=0))
        else:
            raise SystemExit("tf-ring has no broadcast primitive to compare with")
        out = step()
        if args.op == "allreduce":
            # MWMS gives every worker rank 0's initial value, so the sum is size * that value
            first = float(strategy.experimental_local_results(v)[0].numpy()[0])
            assert np.all(strategy.experimental_local_results(out)[0].numpy() == size * first)
        results[nbytes] = timed(lambda: strategy.experimental_local_results(step())[0].numpy(), iters,
                                gap_s=args.gap_s)
    return results, {}


def run_gloo(args, rank, size):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    port = os.environ["TFCS_BENCH_PORTS"].split(",")[0]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    results = {}
    for nbytes, n, iters in _schedule(args.sizes, args.budget, args.gap_s):
        x = torch.ones(n, dtype=torch.float32) * (rank + 1)
        y = x.clone()
        prepare = lambda: y.copy_(x)  # noqa: E731  (untimed: gloo works in place)
        if args.op == "allreduce":
            def call():
                dist.all_reduce(y)
                return y
        elif args.op == "broadcast":
            def call():
                dist.broadcast(y, src=0)
                return y
        else:
            prepare = None
            m = max(1, n // size)
            outs = [torch.empty(m) for _ in range(size)]

            def call():
                dist.all_gather(outs, x[:m])
                return outs
        if args.op == "allreduce":
            prepare()
            assert bool((call() == size * (size + 1) / 2).all())
        results[nbytes] = timed(call, iters, gap_s=args.gap_s, prepare=prepare)
    dist.barrier()
    dist.destroy_process_group()
    return results, {"torch": torch.__version__}


IMPLS = {"tfcs": run_tfcs, "tf-ring": run_tf_ring, "gloo": run_gloo}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=sorted(IMPLS), required=True)
    p.add_argument("--op", default="allreduce")
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--budget", type=float, default=1.0, help="approximate seconds per size")
    p.add_argument("--gap-ms", type=float, default=0.0, help="busy time before each timed call")
    p.add_argument("--backend", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.gap_s = args.gap_ms / 1e3
    args.sizes = [int(s) for s in args.sizes.split(",")]
    rank, size = int(os.environ["TFCS_RANK"]), int(os.environ["TFCS_WORLD_SIZE"])
    results, info = IMPLS[args.impl](args, rank, size)
    # every rank's own times: the CLI reports each call's slowest rank (a root that returns once it has
    # sent would otherwise make a broadcast look faster than it is)
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump({str(k): v for k, v in results.items()}, f)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"impl": args.impl, "op": args.op, "world_size": size, "info": info, "gap_ms": args.gap_ms,
                       "times": {str(k): v for k, v in results.items()}}, f)


if __name__ == "__main__":
    main()
