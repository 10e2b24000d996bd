"""Open MPI's real mpirun (openmpi-bin): examples/launch/mpirun.sh trains examples/keras_mnist.py to the end
with ranks from OMPI_COMM_WORLD_*, and a rank killed during the job ends it with a non-zero code and the
survivors' PeerLostError."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.engines.conftest import engine_env
from tests.engines.jobs import LOOP_WORKER, Command, final_lines, kill_rank_and_check

pytestmark = pytest.mark.engines


@pytest.fixture
def mpi_env():
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (`make engines` installs openmpi-bin)")
    extra = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none"}  # no ptrace rights needed in containers
    if os.geteuid() == 0:  # mpirun refuses root unless told twice
        extra.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return engine_env(**extra)


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_mpirun_recipe_trains_to_the_end(mpi_env):
    env = dict(mpi_env, HOSTS="localhost:2", NP="2", PORT=_port())
    job = Command(["bash", "examples/launch/mpirun.sh", "--epochs", "1", "--train-samples", "2000"], env)
    code = job.wait(200)
    assert code == 0, job.output()[-5000:]
    finals = final_lines(job.lines)
    assert len(finals) == 1 and "on 2 workers" in finals[0], job.output()[-3000:]
    assert job.output().count("val_accuracy") == 1, "one progress bar (rank 0's) expected"


@pytest.mark.timeout(180)
def test_mpirun_rank_killed_ends_the_job_with_peer_lost(mpi_env, tmp_path):
    env = dict(mpi_env, TFCS_TIMEOUT="30", TFCS_COORDINATOR=f"127.0.0.1:{_port()}")
    job = Command(["mpirun", "-np", "2", "-H", "localhost:2", "-x", "TFCS_COORDINATOR", "-x", "TFCS_TIMEOUT",
                   "-x", "PATH", "-x", "PYTHONPATH", "python", LOOP_WORKER, "loop", "--out", str(tmp_path),
                   "--max-seconds", "120"], env)
    kill_rank_and_check(job, str(tmp_path), "OMPI_COMM_WORLD_RANK", "Open MPI", "mpirun")
