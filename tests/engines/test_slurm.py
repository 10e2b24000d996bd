"""A real Slurm cluster (slurmctld + slurmd + munged, started by the tests): on one node the recipe and srun
train examples/keras_mnist.py to the end with ranks from Slurm's own variables, and a rank killed during
the job ends it with a non-zero code and the survivors' PeerLostError; on two nodes (one slurmd per
network-namespace host) the recipe runs unchanged, two tasks on each node."""

from __future__ import annotations

import pytest

from tests.engines import slurm_cluster as SC
from tests.engines.conftest import engine_env
from tests.engines.jobs import LOOP_WORKER, Command, check_batch_job, final_lines, kill_rank_and_check

pytestmark = pytest.mark.engines

MNIST = ["python", "examples/keras_mnist.py", "--epochs", "1", "--train-samples", "2000"]


@pytest.mark.timeout(240)
def test_sbatch_recipe_trains_to_the_end(slurm, tmp_path):
    # one node here: the recipe's two nodes are overridden on the command line, its script runs unchanged
    out = str(tmp_path / "slurm-%j.out")
    job = Command(["sbatch", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={out}",
                   "examples/launch/slurm.sbatch", "--epochs", "1", "--train-samples", "2000"],
                  slurm.env(engine_env()))
    check_batch_job(job.wait(200), job, tmp_path, 2, slurm.log("slurmctld.log"))


@pytest.mark.timeout(240)
def test_srun_trains_keras_mnist(slurm):
    job = Command(["srun", "-n", "2", *MNIST], slurm.env(engine_env(TFCS_TIMEOUT="120")))
    code = job.wait(200)
    assert code == 0, job.output()[-5000:]
    finals = final_lines(job.lines)
    assert len(finals) == 1 and "on 2 workers" in finals[0], job.output()[-3000:]
    assert "2 workers, 2 replicas" in job.output()


@pytest.mark.timeout(180)
def test_srun_rank_killed_ends_the_job_with_peer_lost(slurm, tmp_path):
    # as the recipe runs it: the survivor reports the lost rank itself, then the step ends
    job = Command(["srun", "-n", "2", "--kill-on-bad-exit=0", "python", LOOP_WORKER, "loop", "--out",
                   str(tmp_path), "--max-seconds", "120"], slurm.env(engine_env(TFCS_TIMEOUT="30")))
    kill_rank_and_check(job, str(tmp_path), "SLURM_PROCID", "Slurm", "srun")


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_sbatch_recipe_unchanged_on_two_namespace_nodes(tmp_path):
    from tests.netns import hosts as H
    reason = SC.unavailable_reason() or H.unavailable_reason()
    if reason:
        pytest.skip(reason)
    H.cleanup_stale()
    with H.NetnsHosts(2) as hosts:
        cluster = SC.SlurmCluster(SC.short_directory(), hosts)
        try:
            out = str(tmp_path / "slurm-%j.out")
            job = Command(cluster.client_argv(["sbatch", "--wait", f"--output={out}", "examples/launch/slurm.sbatch",
                                               "--epochs", "1", "--train-samples", "2000"]),
                          cluster.env(engine_env()))
            code = job.wait(240)
        finally:
            cluster.close()
        check_batch_job(code, job, tmp_path, 4, cluster.log("slurmctld.log"))
        for name in hosts.hostnames:  # the step's tasks ran on both nodes
            assert "launch task StepId" in cluster.log(f"slurmd-{name}.log"), name
