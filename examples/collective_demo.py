"""Collective demo: every worker contributes its rank; all-reduce, broadcast and all-gather the values.

    tfcs-run -np 2 python examples/collective_demo.py
"""

import numpy as np

import tf_commstrategy as tfcs


def main():
    tfcs.init()
    r, n = tfcs.rank(), tfcs.size()
    x = np.full(4, r + 1, dtype=np.float32)
    total = tfcs.allreduce(x, op="sum")
    mean = tfcs.allreduce(x, op="mean")
    root = tfcs.broadcast(np.arange(3) * (r + 10), root_rank=0)
    gathered = tfcs.allgather(np.full(r + 1, r, dtype=np.int32))
    expected = n * (n + 1) / 2
    assert np.all(total == expected), total
    print(f"rank {r}/{n}: sum={total.tolist()} mean={mean.tolist()} broadcast={root.tolist()} "
          f"allgather={gathered.tolist()}")
    tfcs.barrier()
    tfcs.shutdown()


if __name__ == "__main__":
    main()
