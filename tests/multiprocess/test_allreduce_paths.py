"""Which path of the host backend runs each all-reduce, read from its typed statistics
(``HostStats.allreduces_by_path``), and the results against numpy on every path."""

import numpy as np
import pytest

from tests.helpers import cross_memory_max_ranks, run_workers

SIZES = (2, 1 << 18, 4 << 20)  # float32 elements: 8 B, 1 MiB, 16 MiB


def _sums(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init()
    b = default_group().backend("grpc")
    out = {"paths": [], "wrong": []}
    for n in SIZES:
        before = dict(b.stats().allreduces_by_path)
        got = tfcs.allreduce(np.full(n, rank + 1.0, np.float32))
        after = b.stats().allreduces_by_path
        out["paths"].append(sorted(k for k in after if after[k] != before.get(k, 0)))
        if not np.array_equal(got, np.full(n, size * (size + 1) / 2, np.float32)):
            out["wrong"].append(n)
    out["transport"] = b.stats().transport
    tfcs.shutdown()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size,env", [(2, {}), (3, {}), (2, {"TFCS_TRANSPORT": "unix"}),
                                      (2, {"TFCS_SHM_CMA": "0"})])
def test_each_allreduce_takes_the_path_the_job_wide_facts_choose(size, env):
    cma = env.get("TFCS_SHM_CMA") != "0" and env.get("TFCS_TRANSPORT") is None and cross_memory_max_ranks() >= size
    if env.get("TFCS_TRANSPORT") == "unix":  # the ring over Unix sockets: no shared memory at all
        expected = [["ring"]] * 3
    elif size == 2:  # small ones through the buffers' one-round path, larger ones on the ring (or read directly)
        expected = [["shm-buffers"], ["ring"], ["direct"] if cma else ["ring"]]
    else:  # 3 ranks on one host: the shared buffers at every size (or read directly when large)
        expected = [["shm-buffers"], ["shm-buffers"], ["direct"] if cma else ["shm-buffers"]]
    for r, res in enumerate(run_workers(_sums, size, timeout=180, env=env)):
        assert res["wrong"] == [], (r, res)
        assert res["paths"] == expected, (r, res, cma)
        assert res["transport"] == ("unix" if env.get("TFCS_TRANSPORT") == "unix" else "shm"), res
