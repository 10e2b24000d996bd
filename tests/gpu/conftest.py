"""tests/gpu: the nccl backend on real GPUs. Every test here is marked ``gpu`` and skipped without one.

They need no TensorFlow: the backend runs on cupy arrays. On a host with one GPU the job has one
rank (NCCL refuses two ranks on one GPU); with several GPUs, one rank per GPU (at most 8).

``TFCS_GPU_DRYRUN=1`` runs the same checks on the fake GPU of tests/fakegpu (2 ranks), so the
checks themselves are exercised on machines without a GPU (tests/multiprocess/test_gpu_checks_dryrun.py).
"""

import os

import pytest


DRYRUN = os.environ.get("TFCS_GPU_DRYRUN") == "1"  # run these checks on tests/fakegpu (CI, no GPU)


def gpu_world() -> int:
    """Ranks for the GPU jobs: one per visible GPU (at most 8), or 0 when nccl cannot run here
    (2 in a dry run on the fake GPU)."""
    if DRYRUN:
        return 2
    from tf_commstrategy.backends.nccl import availability
    if availability() is not None:
        return 0
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
