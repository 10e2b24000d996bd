"""A worker script for the fault-tolerance tests, run through ``tfcs-run`` as a user would run training.

    tfcs-run -np 3 python tests/multiprocess/fault_job.py --out DIR --fault kill --victim 2 --at 5

``--fault kill``: the victim SIGKILLs itself after batch ``--at`` of ``model.fit``; ``stop``: it SIGSTOPs
itself (the test or tfcs-run ends it). The survivors write what ``model.fit`` raised (class, message,
lost rank, detection time after the victim's fault) to ``DIR/rank<r>.json`` and exit 1.
``--fault none`` trains to the end and writes the weights (the reference for restarts).
With ``--backup DIR`` training uses BackupAndRestore, and ``--kill-epoch E`` kills the victim after
epoch E on the first attempt only (``TFCS_RESTART_COUNT`` = 0), to test ``tfcs-run --max-restarts``.
``--keras 3|2``: Keras 3 (``import keras``) or tf_keras.
"""

import argparse
import importlib
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fault", choices=["kill", "stop", "none"], default="none")
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--backup", default="")
    p.add_argument("--kill-epoch", type=int, default=-1)
    p.add_argument("--keras", choices=["3", "2"], default="2")
    a = p.parse_args()

    import tensorflow as tf
    keras = importlib.import_module("keras" if a.keras == "3" else "tf_keras")
    import tf_commstrategy as tfcs

    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tfcs.CommStrategy()
    rank, n = tfcs.rank(), tfcs.size()
    restart = int(os.environ.get("TFCS_RESTART_COUNT", "0"))
    gb = 8 * n
    rng = np.random.default_rng(0)
    x = rng.standard_normal((gb * a.steps, 16)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) > 0).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(gb)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fault_file = os.path.join(a.out, "fault_time")

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if a.fault != "none" and rank == a.victim and batch == a.at:
                with open(fault_file + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.replace(fault_file + ".tmp", fault_file)
                os.kill(os.getpid(), signal.SIGKILL if a.fault == "kill" else signal.SIGSTOP)

        def on_epoch_end(self, epoch, logs=None):
            if rank == a.victim and epoch == a.kill_epoch and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [Fault()]
    if a.backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(a.backup))
    try:
        model.fit(ds, epochs=a.epochs, verbose=0, callbacks=callbacks)
    except Exception as e:  # what a user's script sees
        t = time.time()
        fault_t = None
        for _ in range(50):
            if os.path.exists(fault_file):
                fault_t = float(open(fault_file).read())
                break
            time.sleep(0.1)
        info = {"cls": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer_rank", None),
                "waiting_for": getattr(e, "waiting_for", None),
                "chained_from_tf": isinstance(e.__cause__, tf.errors.OpError),
                "tfcs_error": isinstance(e, tfcs.TfcsError),
                "detect_s": (t - fault_t) if fault_t is not None else None}
        with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
            json.dump(info, f)
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    weights = model.get_weights()
    np.savez(os.path.join(a.out, f"weights{rank}_r{restart}.npz"), *weights)
    with open(os.path.join(a.out, f"done{rank}"), "w") as f:
        f.write(str(restart))


if __name__ == "__main__":
    main()
