"""Benchmark workers: one process per rank, for tfcs itself and for each peer it is compared with.

    python -m tf_commstrategy.bench.workers --impl tfcs|tf-ring|gloo --op allreduce --sizes ... --out F
    python -m tf_commstrategy.bench.workers --impl tfcs,gloo --rounds 6 ... --out F

Every implementation runs the same schedule: for each size, warm-up calls, then ``iters`` timed
calls, back to back or ``--gap-ms`` apart (each rank busy in between, as a training step computes
between its all-reduces; only the calls are timed). All-reduces run in place on the host (gloo's
way; tfcs with ``out=``), the input restored before each call outside the timing. Each rank writes
its per-call times (seconds) to ``--out.rank<r>``, rank 0 also ``--out`` (JSON); the CLI reports
each call's slowest rank.

With several implementations (``--impl tfcs,gloo``), the same processes join every one of them and
take turns, size by size, in ``--rounds`` rounds (``run_interleaved``): each implementation's files
are ``--out.<impl>`` and ``--out.<impl>.rank<r>``. The peers:

* ``tf-ring``: TensorFlow's MultiWorkerMirroredStrategy with
  ``CommunicationOptions(implementation=RING)``, the all-reduce inside ``strategy.run`` (a
  ``tf.function``), TF_CONFIG built from ``TFCS_BENCH_PORTS`` (its first N ports);
* ``gloo``: ``torch.distributed`` with the gloo backend, ``torch.set_num_threads(1)``, its rendezvous
  on the last port of ``TFCS_BENCH_PORTS``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Optional

import numpy as np

from .. import config

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


class Session:
    """One implementation's collectives in this process: ``calls(nbytes, n)`` gives the timed call of
    one size and the untimed ``prepare`` before each call (or None); ``close()`` leaves the group and
    returns what the table header reports (transport, versions)."""

    def calls(self, nbytes: int, n: int):
        raise NotImplementedError

    def close(self) -> dict:
        raise NotImplementedError


class TfcsSession(Session):
    def __init__(self, args, rank, size):
        import tf_commstrategy as tfcs
        self.tfcs, self.args, self.rank, self.size = tfcs, args, rank, size
        tfcs.init(backend=args.backend)
        self.on_gpu = args.backend == "nccl"

    def calls(self, nbytes, n):
        tfcs, args, rank, size = self.tfcs, self.args, self.rank, self.size
        x = _device_ones(n, rank + 1, tfcs.local_rank()) if self.on_gpu else np.ones(n, np.float32) * (rank + 1)
        if args.op == "allreduce":
            check = tfcs.allreduce(x, op="sum")
            host = check.get() if self.on_gpu else check  # the nccl backend returns once the GPU is done
            assert np.all(host == size * (size + 1) / 2), "wrong allreduce result"
            if self.on_gpu:  # the nccl backend has no out=
                return (lambda: tfcs.allreduce(x, op="sum")), None
            # in place, as gloo's all_reduce: the input restored before each call, untimed. With
            # --buffers shared the array lives in shared memory (tfcs.shared_empty, a collective: every
            # rank makes it at the same size)
            if getattr(args, "buffers", "private") == "shared":
                y = tfcs.shared_empty(n, np.float32)
                y[:] = x
            else:
                y = x.copy()
            return (lambda: tfcs.allreduce(y, op="sum", out=y)), (lambda: np.copyto(y, x))
        if args.op == "broadcast":
            return (lambda: tfcs.broadcast(x, root_rank=0)), None
        xs = x[: max(1, n // size)]
        return (lambda: tfcs.allgather(xs)), None

    def close(self):
        self.tfcs.barrier()
        from tf_commstrategy.process import default_group
        if self.on_gpu:
            info = {"transport": "nccl", "allreduce": "nccl", "buffers": "private", "direct_allreduces": 0,
                    "cross_memory_bytes": 0, "cma_allreduces": 0}
        else:
            stats = default_group().backend("grpc").stats()
            info = {"transport": stats.transport, "allreduce": stats.allreduce_path,
                    # "shared": all-reduces above DIRECT_ABOVE_BYTES read the peers' shared arrays
                    "buffers": "shared" if stats.direct_allreduces else "private",
                    "direct_allreduces": stats.direct_allreduces,
                    # all-reduces of at least cross_memory_bytes read the peers' private arrays (process_vm_readv)
                    "cross_memory_bytes": stats.cross_memory_bytes, "cma_allreduces": stats.cma_allreduces}
        self.tfcs.shutdown()
        return info


class TfRingSession(Session):
    def __init__(self, args, rank, size):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        ports = config.bench_ports_from_env()[:size]
        hosts = config.bench_hosts_from_env(size)
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]},
                                              "task": {"type": "worker", "index": rank}})
        import tensorflow as tf
        self.tf, self.args, self.rank, self.size = tf, args, rank, size
        opts = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)

    def calls(self, nbytes, n):
        tf, strategy, size = self.tf, self.strategy, self.size
        with strategy.scope():
            v = tf.Variable(tf.ones([n], tf.float32) * (self.rank + 1))
        if self.args.op == "allreduce":
            @tf.function
            def step():
                return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, v.read_value()))
        elif self.args.op == "allgather":
            m = max(1, n // size)

            @tf.function
            def step():
                return strategy.run(lambda: tf.distribute.get_replica_context().all_gather(
                    v.read_value()[:m], axis=0))
        else:
            raise SystemExit("tf-ring has no broadcast primitive to compare with")
        out = step()
        if self.args.op == "allreduce":
            # MWMS gives every worker rank 0's initial value, so the sum is size * that value
            first = float(strategy.experimental_local_results(v)[0].numpy()[0])
            assert np.all(strategy.experimental_local_results(out)[0].numpy() == size * first)
        return (lambda: strategy.experimental_local_results(step())[0].numpy()), None

    def close(self):
        return {"tensorflow": self.tf.__version__}


class GlooSession(Session):
    def __init__(self, args, rank, size):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.args, self.size = torch, dist, args, size
        torch.set_num_threads(1)
        port = config.bench_ports_from_env()[-1]  # the one that tf-ring's servers leave free
        host = config.bench_hosts_from_env(size)[0]  # rank 0 runs gloo's store
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size)
        self.rank = rank

    def calls(self, nbytes, n):
        torch, dist, size = self.torch, self.dist, self.size
        x = torch.ones(n, dtype=torch.float32) * (self.rank + 1)
        y = x.clone()
        if self.args.op == "allreduce":
            y.copy_(x)
            dist.all_reduce(y)
            assert bool((y == size * (size + 1) / 2).all()), "wrong allreduce result"
            return (lambda: dist.all_reduce(y)), (lambda: y.copy_(x))  # gloo works in place
        if self.args.op == "broadcast":
            return (lambda: dist.broadcast(y, src=0)), (lambda: y.copy_(x))
        m = max(1, n // size)
        outs = [torch.empty(m) for _ in range(size)]
        return (lambda: dist.all_gather(outs, x[:m])), None

    def close(self):
        self.dist.barrier()
        self.dist.destroy_process_group()
        return {"torch": self.torch.__version__}


SESSIONS = {"tfcs": TfcsSession, "tf-ring": TfRingSession, "gloo": GlooSession}


def run_one(impl, args, rank, size):
    """Every size of one implementation, one after the other: {size: [per-call seconds]}, info."""
    session = SESSIONS[impl](args, rank, size)
    results = {}
    for nbytes, n, iters in _schedule(args.sizes, args.budget, args.gap_s):
        call, prepare = session.calls(nbytes, n)
        results[nbytes] = timed(call, iters, gap_s=args.gap_s, prepare=prepare)
    return results, session.close()


def per_round_calls(iters: int, rounds: int) -> int:
    """Timed calls of one implementation in each round of an interleaved run: its share of the budget
    (``iters`` over ``rounds``), at least 3 so every round has a median."""
    return max(3, -(-iters // rounds))


def run_interleaved(sessions, args):
    """For each size, ``args.rounds`` rounds in which every implementation makes its calls in turn (the
    order reversed every other round), so that each round's ratio compares calls made within moments
    of each other, on the same machine state. Each block starts with one untimed call (the first
    round with the warm-up of a job of its own): the other implementation's calls have just evicted
    its buffers. Every round has at least 3 calls, so the largest sizes may take more than the budget.

    Returns:
      {impl: {size: [per-call seconds, round after round]}}; each round holds ``per_round_calls``.
    """
    names = list(sessions)
    results = {name: {} for name in names}
    for nbytes, n, iters in _schedule(args.sizes, args.budget, args.gap_s):
        k = per_round_calls(iters, args.rounds)
        made = {name: sessions[name].calls(nbytes, n) for name in names}
        for name in names:
            results[name][nbytes] = []
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                call, prepare = made[name]
                # the first round warms up as a job of its own would (a tenth of all its calls)
                results[name][nbytes] += timed(call, k, warmup=max(3, iters // 10) if r == 0 else 1,
                                               gap_s=args.gap_s, prepare=prepare)
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", required=True,
                   help=f"one of {sorted(SESSIONS)}, or several comma-separated to interleave them in rounds")
    p.add_argument("--op", default="allreduce")
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--budget", type=float, default=1.0, help="approximate seconds per size (and impl)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="busy time before each timed call")
    p.add_argument("--rounds", type=int, default=1, help="rounds of an interleaved run")
    p.add_argument("--backend", default=None)
    p.add_argument("--buffers", choices=["private", "shared"], default="private",
                   help="tfcs's all-reduce arrays: np arrays, or tfcs.shared_empty arrays")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    impls = args.impl.split(",")
    unknown = [i for i in impls if i not in SESSIONS]
    if unknown or len(set(impls)) != len(impls):
        p.error(f"--impl: each of {sorted(SESSIONS)} at most once, got {args.impl!r}")
    args.gap_s = args.gap_ms / 1e3
    args.sizes = [int(s) for s in args.sizes.split(",")]
    rank, size, _ = config.tfcs_cluster_from_env()
    if len(impls) == 1:
        results, info = run_one(impls[0], args, rank, size)
        _write(args.out, impls[0], args, rank, size, results, info, None)
        return
    sessions = {i: SESSIONS[i](args, rank, size) for i in impls}
    results = run_interleaved(sessions, args)
    for i in impls:  # every round of a size holds the same number of calls: the CLI splits them by count
        _write(f"{args.out}.{i}", i, args, rank, size, results[i], sessions[i].close(), {"rounds": args.rounds})


def _write(out, impl, args, rank, size, results, info, rounds):
    # every rank's own times: the CLI reports each call's slowest rank (a root that returns once it has
    # sent would otherwise make a broadcast look faster than it is)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({str(k): v for k, v in results.items()}, f)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"impl": impl, "op": args.op, "world_size": size, "info": info, "gap_ms": args.gap_ms,
                       "interleaved": rounds, "times": {str(k): v for k, v in results.items()}}, f)


if __name__ == "__main__":
    main()
