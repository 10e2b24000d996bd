"""A real Slurm cluster (slurmctld + slurmd + munged, started by the tests): on one node the recipe and srun
train examples/keras_mnist.py to the end with ranks from Slurm's own variables, and a rank killed during
the job ends it with a non-zero code and the survivors' PeerLostError; on two nodes (one slurmd per
network-namespace host) the recipe runs unchanged, two tasks on each node."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from tests.engines import slurm_cluster as SC
from tests.engines.conftest import engine_env
from tests.engines.jobs import LOOP_WORKER, Command, final_lines, find_worker

pytestmark = pytest.mark.engines

MNIST = ["python", "examples/keras_mnist.py", "--epochs", "1", "--train-samples", "2000"]


@pytest.mark.timeout(240)
def test_sbatch_recipe_trains_to_the_end(slurm, tmp_path):
    # one node here: the recipe's two nodes are overridden on the command line, its script runs unchanged
    out = str(tmp_path / "slurm-%j.out")
    job = Command(["sbatch", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={out}",
                   "examples/launch/slurm.sbatch", "--epochs", "1", "--train-samples", "2000"],
                  slurm.env(engine_env()))
    code = job.wait(200)
    logs = glob.glob(str(tmp_path / "slurm-*.out"))
    text = open(logs[0]).read() if logs else "(no job output)"
    assert code == 0, f"sbatch rc={code}: {job.output()}\n{text[-5000:]}\n{slurm.log('slurmctld.log')}"
    finals = final_lines(text.splitlines())
    assert len(finals) == 1 and "on 2 workers" in finals[0], text[-3000:]
    assert text.count("val_accuracy") == 1, "one progress bar (rank 0's) expected"


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
    job.wait_for_progress(2, 10, 120)
    victim = find_worker(str(tmp_path), "SLURM_PROCID", 1)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = job.wait(60)
    took = time.monotonic() - t0
    out = job.output()
    assert code not in (0, None), out[-4000:]
    assert out.count("joined via Slurm") == 2, "ranks must come from the engine's own variables"
    assert "error PeerLostError" in out, out[-4000:]
    assert took < 30, f"srun took {took:.1f} s to end after rank 1 was killed"


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
        logs = glob.glob(str(tmp_path / "slurm-*.out"))
        text = open(logs[0]).read() if logs else "(no job output)"
        assert code == 0, f"sbatch rc={code}: {job.output()}\n{text[-5000:]}\n{cluster.log('slurmctld.log')}"
        finals = final_lines(text.splitlines())
        assert len(finals) == 1 and "on 4 workers" in finals[0], text[-3000:]
        assert text.count("val_accuracy") == 1, "one progress bar (rank 0's) expected"
        for name in hosts.hostnames:  # the step's tasks ran on both nodes
            assert "launch task StepId" in cluster.log(f"slurmd-{name}.log"), name
