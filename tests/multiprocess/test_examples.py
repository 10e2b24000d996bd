"""Every example runs through tfcs-run in a fresh process (shortened by flags) and exits 0."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CASES = [
    (["examples/keras_mnist.py", "--epochs", "1", "--train-samples", "2048"], "final: test accuracy"),
    (["examples/keras_mnist.py", "--keras", "2", "--epochs", "1", "--train-samples", "2048"], "final: test accuracy"),
    (["examples/custom_training_loop.py", "--steps", "5"], "weights identical on 2 workers"),
    (["examples/custom_training_loop.py", "--keras", "2", "--steps", "5"], "weights identical on 2 workers"),
    (["examples/quickstart.py", "--keras", "2"], "rank 0 of 2: accuracy"),
    (["examples/keras_synthetic_benchmark.py", "--iters", "2", "--batches-per-iter", "3", "--warmup-batches", "2"],
     "total img/sec on 2 workers"),
    (["examples/per_call_backend.py", "--steps", "5"], "gradients via grpc, metrics via grpc"),
    (["examples/collective_demo.py"], "allgather=[0, 1, 1]"),
    # 2 workers on one host: every gradient all-reduce reads the peer's shared array in place
    (["examples/shared_arrays.py", "--steps", "12"],
     "weights identical on 2 workers: True; gradient all-reduces straight through the shared arrays on rank 0: "
     "12 of 12"),
]


@pytest.mark.parametrize("args,expect", CASES,
                         ids=[c[0][0].split("/")[1] + ("-keras2" if "--keras" in c[0] else "") for c in CASES])
def test_example_runs_on_two_workers(args, expect):
    r = subprocess.run([sys.executable, "-m", "tf_commstrategy.run", "-np", "2", sys.executable] + args,
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert expect in r.stdout


def test_any_engine_recipe_runs_a_single_worker_job():
    from tests.helpers import free_port
    env = dict(os.environ, TFCS_RANK="0", TFCS_WORLD_SIZE="1", TFCS_COORDINATOR=f"127.0.0.1:{free_port()}",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", os.path.join(os.path.join(ROOT, 'examples', 'launch'), "any_engine.sh"), "--epochs", "1", "--train-samples", "512"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "final: test accuracy" in r.stdout
