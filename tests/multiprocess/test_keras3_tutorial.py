"""TensorFlow's "Multi-worker training with Keras" tutorial flow with tfcs.CommStrategy: two workers started
by hand, each with its TF_CONFIG, ``tf.keras`` as Keras 3 (see keras3_tutorial_job.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "multiprocess", "keras3_tutorial_job.py")


@pytest.mark.timeout(400)
def test_tutorial_flow_trains_identically_on_both_workers_and_saves_on_the_chief(tmp_path):
    workers = [f"localhost:{free_port()}", f"localhost:{free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TFCS_", "TF_USE_LEGACY_KERAS"))}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", TFCS_TIMEOUT="120")
    procs = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        procs.append(subprocess.Popen([sys.executable, JOB, str(tmp_path)], cwd=str(tmp_path),
                                      env=dict(env, TF_CONFIG=json.dumps(tf_config)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=360)[0])
    finally:
        for p in procs:
            p.kill()
    for index, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"worker {index}:\n{out[-4000:]}"
    chief, other = outputs
    assert chief.count("Epoch 1/3") == 2 and "Epoch 3/3" in chief  # two fits, each with its progress bar
    assert "Epoch" not in other  # only the chief prints the progress bar
    w0, w1 = (np.load(tmp_path / f"weights{i}.npz") for i in range(2))
    assert str(w0["keras"]).startswith("keras.") and "tf_keras" not in str(w0["keras"])  # tf.keras is Keras 3
    names = [k for k in w0.files if k != "keras"]
    assert len(names) == 12  # two fits x (conv, dense, dense: kernel and bias)
    for name in names:
        np.testing.assert_array_equal(w0[name], w1[name])
    assert (tmp_path / "keras-model.keras").is_file()  # the chief's file; the other's temporary dir is gone
    assert not (tmp_path / "workertemp_1").exists()
    assert not (tmp_path / "backup").exists()  # BackupAndRestore deletes its backup after a finished fit
