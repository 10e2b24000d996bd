"""Training throughput of the reference CNN: CommStrategy vs MultiWorkerMirroredStrategy vs the ceiling.

    python benchmarks/keras_throughput.py [--workers 2] [--steps 150] [--json out.json]

Model: Conv2D(32,3)-MaxPool-Flatten-Dense(128)-Dense(10) (~0.69 M parameters), MNIST-shaped synthetic
data, 64 samples per worker per step. Three jobs run one after the other in this invocation:

* tfcs: N workers under ``tfcs-run`` with ``CommStrategy`` (grpc backend);
* mwms: N workers with TF_CONFIG and ``MultiWorkerMirroredStrategy(RING)``;
* ceiling: N independent single-process trainings at the same time (no communication at all), the
  compute ceiling of this machine.

Each worker times ``--steps`` training steps after a warm-up epoch; samples/s are global (summed over
workers). For tfcs, the time spent inside collectives is reported as the communication share.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PER_WORKER_BATCH = 64


def worker(mode, steps, out):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras
    threads = os.environ.get("TFCS_BENCH_TF_THREADS")  # e.g. "1": intra/inter-op threads for every job
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(int(threads))
        tf.config.threading.set_inter_op_parallelism_threads(int(threads))
    n = int(os.environ.get("TFCS_WORLD_SIZE", "1"))
    rank = int(os.environ.get("TFCS_RANK", "0"))
    if os.environ.get("TFCS_BENCH_PIN") == "1":  # every job alike: worker r on core r (mod the cores)
        cores = sorted(os.sched_getaffinity(0))
        slot = int(os.environ.get("TFCS_BENCH_SLOT", rank))
        os.sched_setaffinity(0, {cores[slot % len(cores)]})
    if mode.startswith("tfcs"):
        import tf_commstrategy as tfcs
        strategy = tfcs.CommStrategy(sync_metrics=os.environ.get("TFCS_BENCH_SYNC_METRICS", "1") == "1")
        global_batch = PER_WORKER_BATCH * n
    elif mode == "mwms":
        opts = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)
        global_batch = PER_WORKER_BATCH * n
    else:
        strategy = tf.distribute.get_strategy()
        global_batch = PER_WORKER_BATCH
    rng = np.random.default_rng(rank)
    x = rng.random((global_batch * 8, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, global_batch * 8)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
    with strategy.scope():
        L = keras.layers
        model = keras.Sequential([L.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), L.MaxPooling2D(),
                                  L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up: tracing, first collectives
    comm0 = _comm_seconds(mode)
    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    wall = time.perf_counter() - t0
    comm = _comm_seconds(mode) - comm0
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "wall_s": wall, "steps": steps, "global_batch": global_batch,
                       "params": model.count_params(), "comm_s": comm}, f)


def _comm_seconds(mode):
    if not mode.startswith("tfcs"):
        return 0.0
    from tf_commstrategy.process import default_group
    return default_group().backend("grpc").stats()["busy_s"]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_mode(mode, n, steps):
    d = tempfile.mkdtemp()
    outs = [os.path.join(d, f"r{i}.json") for i in range(n)]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(steps)]
    if mode.startswith("tfcs"):
        transport = ["--transport", "grpc"] if mode == "tfcs-grpc" else []
        subprocess.run([sys.executable, "-m", "tf_commstrategy.run", "-np", str(n)] + transport + cmd +
                       ["--out", outs[0]], check=True)
        results = [json.load(open(outs[0]))]
    else:
        ports = _free_ports(n)
        procs = []
        for r in range(n):
            env = dict(os.environ, TFCS_RANK=str(r), TFCS_WORLD_SIZE=str(n) if mode == "mwms" else "1",
                       TFCS_BENCH_SLOT=str(r))
            if mode == "mwms":
                env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                               "task": {"type": "worker", "index": r}})
            else:
                env["TFCS_RANK"] = "0"
            procs.append(subprocess.Popen(cmd + ["--out", outs[r]], env=env))
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"{mode} worker failed")
        results = [json.load(open(o)) for o in (outs if mode == "ceiling" else outs[:1])]
    sps = sum(r["global_batch"] * r["steps"] / r["wall_s"] for r in results)
    res = dict(results[0], samples_per_s=sps, step_ms=1e3 * results[0]["wall_s"] / steps)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--json")
    p.add_argument("--modes", default="tfcs,tfcs-grpc,mwms,ceiling")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.steps, a.out)
    modes = a.modes.split(",")
    res = {m: run_mode(m, a.workers, a.steps) for m in modes}
    if not {"tfcs", "mwms", "ceiling"} <= set(modes):
        print(json.dumps(res, indent=1))
        return
    t, m, c = res["tfcs"], res["mwms"], res["ceiling"]
    print(f"\nreference CNN ({t['params']:,} parameters), {a.workers} workers x {PER_WORKER_BATCH} samples, "
          f"{a.steps} timed steps\n")
    print("| job | samples/s (global) | step time | vs MWMS | fraction of ceiling |")
    print("|---|---|---|---|---|")
    rows = [("tfcs CommStrategy (default transport: shared memory)", t)]
    if "tfcs-grpc" in res:
        rows.append(("tfcs CommStrategy (gRPC ring)", res["tfcs-grpc"]))
    rows += [("TF MultiWorkerMirroredStrategy (RING)", m), ("ceiling: independent processes", c)]
    for name, r in rows:
        print(f"| {name} | {r['samples_per_s']:,.0f} | {r['step_ms']:.1f} ms | "
              f"{r['samples_per_s'] / m['samples_per_s']:.2f}x | {r['samples_per_s'] / c['samples_per_s']:.2f} |")
    share = t["comm_s"] / t["wall_s"]
    print(f"\ntfcs step-time split (rank 0): {t['step_ms'] * (1 - share):.1f} ms compute and framework, "
          f"{t['step_ms'] * share:.1f} ms inside collectives ({100 * share:.0f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
