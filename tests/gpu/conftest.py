"""tests/gpu: the nccl backend on real GPUs. Every test here is marked ``gpu`` and skipped without one.

They need no TensorFlow: the backend runs on cupy arrays. With several GPUs the job has one rank
per GPU (at most 8); on a host with one GPU, one rank, since NCCL refuses two ranks of one host on
one GPU ("Duplicate GPU detected"). ``TFCS_GPU_EMULATE_HOSTS=N`` runs N ranks on one GPU anyway,
each told by ``NCCL_HOSTID`` that it is a host of its own: NCCL then joins them as it joins ranks on
different machines (its socket transport over loopback), so a one-GPU host still checks real
multi-rank reductions. Their bandwidth is the socket path's, not the GPU's.

``TFCS_GPU_DRYRUN=1`` runs the same checks on the fake GPU of tests/fakegpu (2 ranks), so the
checks themselves are exercised on machines without a GPU (tests/multiprocess/test_gpu_checks_dryrun.py).
"""

import os

import pytest


DRYRUN = os.environ.get("TFCS_GPU_DRYRUN") == "1"  # run these checks on tests/fakegpu (CI, no GPU)


def emulated_hosts() -> int:
    """N of ``TFCS_GPU_EMULATE_HOSTS=N`` (0 when unset): ranks that share GPUs, each its own NCCL host."""
    return int(os.environ.get("TFCS_GPU_EMULATE_HOSTS") or 0)


def emulate_host(rank: int) -> None:
    """In a worker, before its first NCCL call: make this rank an NCCL host of its own (see above)."""
    if emulated_hosts():
        os.environ["NCCL_HOSTID"] = f"tfcs-emulated-host-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # the only network these ranks share
        os.environ.setdefault("NCCL_IB_DISABLE", "1")


def gpu_world() -> int:
    """Ranks for the GPU jobs: one per visible GPU (at most 8), or 0 when nccl cannot run here
    (2 in a dry run on the fake GPU; N with ``TFCS_GPU_EMULATE_HOSTS=N``)."""
    if DRYRUN:
        return 2
    from tf_commstrategy.backends.nccl import availability
    if availability() is not None:
        return 0
    if emulated_hosts():
        return emulated_hosts()
    import cupy
    return min(8, cupy.cuda.runtime.getDeviceCount())


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    world = gpu_world()
    why = None
    if DRYRUN:
        return  # not marked gpu: a dry run is an ordinary test of the checks themselves
    if world == 0:
        from tf_commstrategy.backends.nccl import availability
        why = f"nccl cannot run here: {availability()}"
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
