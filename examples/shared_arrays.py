"""Data-parallel least squares in numpy, gradients averaged in place in a shared array.

    tfcs-run -np 2 python examples/shared_arrays.py --steps 20

Every worker fits the same linear model on its own shard of the data. Its gradient is written into
an array from ``tfcs.shared_empty`` (allocated once, by every worker), and ``tfcs.allreduce(g, op="mean",
out=g)`` averages it across the workers: on one host the all-reduce reads the other workers' arrays
where they are (no copies through transfer buffers); across hosts the arrays are private and the
all-reduce takes its usual path.
"""

import argparse

import numpy as np

import tf_commstrategy as tfcs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--features", type=int, default=1 << 15)  # 128 KiB of float32 gradient
    p.add_argument("--samples", type=int, default=64, help="samples per worker")
    p.add_argument("--lr", type=float, default=0.5)
    args = p.parse_args()
    tfcs.init()
    r, n = tfcs.rank(), tfcs.size()
    truth = np.random.default_rng(0).standard_normal(args.features).astype(np.float32)
    rng = np.random.default_rng(100 + r)  # each worker's own shard
    x = rng.standard_normal((args.samples, args.features)).astype(np.float32) / np.sqrt(args.features)
    y = x @ truth
    w = np.zeros(args.features, np.float32)
    grad = tfcs.shared_empty(args.features, np.float32)  # a collective: every worker, same shape, once
    for step in range(args.steps):
        np.matmul(x.T, x @ w - y, out=grad)
        grad /= args.samples
        tfcs.allreduce(grad, op="mean", out=grad)  # in place: every worker now holds the mean gradient
        w -= args.lr * grad
        if step % 10 == 0 or step == args.steps - 1:
            loss = tfcs.allreduce(np.array([np.mean((x @ w - y) ** 2)]), op="mean")[0]
            if r == 0:
                print(f"step {step}: mean loss over {n} workers {loss:.5f}")
    first = tfcs.broadcast(w, root_rank=0)
    same = bool(tfcs.allreduce(np.array([np.array_equal(first, w)], np.int32), op="min")[0])
    from tf_commstrategy.process import default_group
    direct = default_group().backend("grpc").stats().direct_allreduces
    if r == 0:
        print(f"weights identical on {n} workers: {same}; gradient all-reduces straight through the shared "
              f"arrays on rank 0: {direct} of {args.steps}")
    assert same
    tfcs.shutdown()


if __name__ == "__main__":
    main()
