"""Fixtures of the engine tests: a one-node Slurm cluster, an environment with this project's Python first."""

import os
import sys

import pytest

from tests.engines import slurm_cluster as SC

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_env(**extra):
    """A worker environment as a user's shell gives it: this venv's bin first on PATH, nothing of the test
    run's own rank or coordinator settings, TF quiet and on the CPU."""
    drop = ("TFCS_", "TF_CONFIG", "SLURM_", "OMPI_", "PMIX_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "HOROVOD_", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and "proxy" not in k.lower()}
    env.update({"PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT})
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def slurm():
    reason = SC.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SC.SlurmCluster(SC.short_directory())
    try:
        yield cluster
    finally:
        cluster.close()
