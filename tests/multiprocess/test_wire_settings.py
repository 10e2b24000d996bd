"""Transport settings checked on the real sockets, not assumed: TCP_NODELAY and message size limits."""

import os
import socket

import numpy as np
import pytest

from tests.helpers import run_workers
from tf_commstrategy.core.cpus import usable_cores


def _nodelay(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init()
    tfcs.allreduce(np.ones(1000))  # streams are open and used
    flags = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                try:
                    s.getpeername()
                except OSError:
                    continue  # a listening socket
                flags.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        finally:
            s.close()
    return flags


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_every_connected_tcp_socket_has_nodelay(transport):
    for flags in run_workers(_nodelay, 2, timeout=60, env={"TFCS_TRANSPORT": transport}):
        assert flags, "no connected TCP sockets found"
        assert all(f != 0 for f in flags), flags


def _large(rank, size):
    import tf_commstrategy as tfcs
    tfcs.init(chunk_bytes=64 << 20)  # one message per segment: 96 MiB buffer -> 48 MiB messages
    x = np.full(24 << 20, rank + 1, dtype=np.float32)
    return float(tfcs.allreduce(x)[-1])


def test_messages_far_above_grpc_default_4mib_limit_pass():
    assert run_workers(_large, 2, timeout=120) == [3.0, 3.0]


def _socket_chunk(rank, size, transport, crowded_rank):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    if rank == crowded_rank:  # this rank's host now has fewer cores than ranks
        from tf_commstrategy.core import cpus
        cpus.usable_cores = lambda: 1
    tfcs.init(transport=transport)
    x = np.arange(3 << 20, dtype=np.float32) + rank  # 12 MiB: several chunks of either size per segment
    got = tfcs.allreduce(x)
    want = 2 * np.arange(3 << 20, dtype=np.float64) + 1
    return default_group().backend("grpc").chunk_bytes, bool(np.array_equal(got, want))


@pytest.mark.skipif(usable_cores() < 2, reason="needs a core per rank for the uncrowded case")
@pytest.mark.parametrize("transport,crowded_rank", [("tcp", None), ("unix", None), ("tcp", 1), ("unix", 0)])
def test_socket_rings_pick_one_chunk_size_on_every_rank_from_every_hosts_crowding(transport, crowded_rank):
    # 2 ranks on this host's cores: 1 MiB chunks; one rank seeing fewer cores than ranks moves every rank to 4 MiB
    res = run_workers(_socket_chunk, 2, transport, crowded_rank, timeout=120)
    want = (4 << 20) if crowded_rank is not None else (1 << 20)
    assert res == [(want, True)] * 2, res
