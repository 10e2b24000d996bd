"""Training throughput of the reference CNN: CommStrategy vs MultiWorkerMirroredStrategy vs the ceiling.

    python benchmarks/keras_throughput.py [--workers 2] [--steps 300] [--rounds 3] [--json out.json]

Model: Conv2D(32,3)-MaxPool-Flatten-Dense(128)-Dense(10) (~0.69 M parameters), MNIST-shaped synthetic
data, 64 samples per worker per step. Each round runs these jobs one after the other; rounds repeat
the sequence, so every job sees the machine in several states and each round's ratios come from one
run of each job:

* ``tfcs``: N workers under ``tfcs-run`` with ``CommStrategy`` as a user runs it (its defaults: on one
  host the compiled all-reduce op through shared memory, thread pools sized to each worker's share of
  the cores);
* ``tfcs-python`` (not in the default set): the same with ``TFCS_NATIVE=0``, the gradients through the
  ``tf.numpy_function`` path (concat, the ring over shared memory, split);
* ``mwms``: N workers with TF_CONFIG and ``MultiWorkerMirroredStrategy(RING)``, TensorFlow's defaults;
* ``mwms-pools``: the same with the thread pools CommStrategy would choose (``cores // N`` per pool),
  so that the comparison does not rest on the thread setting alone;
* ``ceiling`` and ``ceiling-pools``: N independent single-process trainings at the same time (no
  communication at all), with TF's default pools and with ``cores // N``; the better of the two is
  the compute ceiling of this machine.

Each worker trains a warm-up epoch, then ``--steps`` steps in one ``fit`` call. Samples/s are global and
steady-state: from the start of step 20 of that call to the end of its last step (a callback notes the
times), so the one-off work of starting ``fit`` is not counted; the whole call's time is reported too.
For tfcs the time spent inside collectives (rank 0) gives the step-time split.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PER_WORKER_BATCH = 64
SKIP = 20  # steps of the timed fit call not counted (first-step effects of the call itself)
JOBS = ("tfcs", "mwms", "mwms-pools", "ceiling", "ceiling-pools")


def worker(mode, steps, out):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras
    threads = os.environ.get("TFCS_BENCH_TF_THREADS")  # a pool size for this job (the "-pools" jobs)
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
    elif mode.startswith("mwms"):
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
    marks = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == SKIP:
                marks["begin"] = time.perf_counter()
                marks["comm0"] = _comm_seconds(mode)

        def on_train_batch_end(self, batch, logs=None):
            marks["end"] = time.perf_counter()

    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps + SKIP, verbose=0, callbacks=[Clock()])
    call_s = time.perf_counter() - t0
    comm = _comm_seconds(mode) - marks["comm0"]
    if rank == 0 or mode.startswith("ceiling"):
        with open(out, "w") as f:
            json.dump({"mode": mode, "wall_s": marks["end"] - marks["begin"], "steps": steps,
                       "global_batch": global_batch, "params": model.count_params(), "comm_s": comm,
                       "fit_call_s": call_s, "fit_call_steps": steps + SKIP,
                       "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                       "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}, f)


def _comm_seconds(mode):
    if not mode.startswith("tfcs"):
        return 0.0
    from tf_commstrategy.process import default_group
    from tf_commstrategy.tf.native_path import NativeAllReduce
    group = default_group()
    native = NativeAllReduce.for_group(group)  # set up already by the strategy: only looked up here
    return group.backend("grpc").stats()["busy_s"] + (native.busy_seconds() if native is not None else 0.0)


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
    env = dict(os.environ)
    if mode.endswith("-pools"):
        env["TFCS_BENCH_TF_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
    if mode.startswith("tfcs"):
        transport = ["--transport", "grpc"] if mode == "tfcs-grpc" else []
        if mode == "tfcs-python":
            env["TFCS_NATIVE"] = "0"
        subprocess.run([sys.executable, "-m", "tf_commstrategy.run", "-np", str(n)] + transport + cmd +
                       ["--out", outs[0]], check=True, env=env)
        results = [json.load(open(outs[0]))]
    else:
        ports = _free_ports(n)
        procs = []
        for r in range(n):
            wenv = dict(env, TFCS_RANK=str(r), TFCS_WORLD_SIZE=str(n) if mode.startswith("mwms") else "1",
                        TFCS_BENCH_SLOT=str(r))
            if mode.startswith("mwms"):
                wenv["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                                "task": {"type": "worker", "index": r}})
            else:
                wenv["TFCS_RANK"] = "0"
            procs.append(subprocess.Popen(cmd + ["--out", outs[r]], env=wenv))
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"{mode} worker failed")
        results = [json.load(open(o)) for o in (outs if mode.startswith("ceiling") else outs[:1])]
    sps = sum(r["global_batch"] * r["steps"] / r["wall_s"] for r in results)
    call_sps = sum(r["global_batch"] * r["fit_call_steps"] / r["fit_call_s"] for r in results)
    return dict(results[0], samples_per_s=sps, step_ms=1e3 * results[0]["wall_s"] / steps,
                fit_call_samples_per_s=call_sps)


def summarize(rounds, workers, steps):
    """Markdown: the median of each job over the rounds, and each round's ratios."""
    jobs = list(rounds[0])
    med = {j: statistics.median(r[j]["samples_per_s"] for r in rounds) for j in jobs}
    lines = [f"reference CNN ({rounds[0][jobs[0]]['params']:,} parameters), {workers} workers x "
             f"{PER_WORKER_BATCH} samples, {steps} timed steps, {len(rounds)} rounds\n",
             "| job | pools (intra/inter) | samples/s, median of rounds | step time | each round |",
             "|---|---|---|---|---|"]
    for j in jobs:
        r0 = rounds[0][j]
        pools = f"{r0['intra_op_threads'] or 'TF default'}/{r0['inter_op_threads'] or 'TF default'}"
        each = ", ".join(f"{r[j]['samples_per_s']:,.0f}" for r in rounds)
        lines.append(f"| {j} | {pools} | {med[j]:,.0f} | {1e3 * PER_WORKER_BATCH * workers / med[j]:.1f} ms "
                     f"| {each} |")
    if {"tfcs", "mwms"} <= set(jobs):
        lines += ["", "| round | tfcs / mwms | tfcs / best MWMS | tfcs / ceiling (best) | tfcs comm share |",
                  "|---|---|---|---|---|"]
        for i, r in enumerate(rounds, 1):
            t = r["tfcs"]["samples_per_s"]
            best_m = max(r[j]["samples_per_s"] for j in jobs if j.startswith("mwms"))
            ceil = [r[j]["samples_per_s"] for j in jobs if j.startswith("ceiling")]
            share = r["tfcs"]["comm_s"] / r["tfcs"]["wall_s"]
            lines.append(f"| {i} | {t / r['mwms']['samples_per_s']:.2f}x | {t / best_m:.2f}x | "
                         f"{t / max(ceil):.2f} | {100 * share:.0f}% |" if ceil else
                         f"| {i} | {t / r['mwms']['samples_per_s']:.2f}x | {t / best_m:.2f}x | - | "
                         f"{100 * share:.0f}% |")
        share = statistics.median(r["tfcs"]["comm_s"] / r["tfcs"]["wall_s"] for r in rounds)
        step = 1e3 * PER_WORKER_BATCH * workers / med["tfcs"]
        lines.append(f"\ntfcs step-time split (rank 0, median share): {step * (1 - share):.1f} ms compute and "
                     f"framework, {step * share:.1f} ms inside collectives ({100 * share:.0f}%)")
        lines.append("whole fit() call incl. its start (samples/s, round 1): " + ", ".join(
            f"{j} {rounds[0][j]['fit_call_samples_per_s']:,.0f}" for j in jobs))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--modes", default=",".join(JOBS))
    p.add_argument("--plot", help="write a PNG bar chart of the jobs here (needs matplotlib)")
    p.add_argument("--from-json", help="summarize / plot an earlier --json file instead of running")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.steps, a.out)
    if a.from_json:
        saved = json.load(open(a.from_json))
        print(summarize(saved["rounds"], saved["workers"], saved["steps"]))
        if a.plot:
            plot(saved["rounds"], saved["workers"], a.plot)
        return
    modes = a.modes.split(",")
    rounds = []
    for i in range(a.rounds):
        rounds.append({m: run_mode(m, a.workers, a.steps) for m in modes})
        print(f"round {i + 1}: " + ", ".join(f"{m} {r['samples_per_s']:,.0f}" for m, r in rounds[-1].items()),
              flush=True)
    print("\n" + summarize(rounds, a.workers, a.steps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workers": a.workers, "steps": a.steps, "rounds": rounds, "machine": {
                "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d")}}, f, indent=1)
    if a.plot:
        plot(rounds, a.workers, a.plot)


def plot(rounds, workers, path):
    """Bars: each job's median samples/s over the rounds; dots: the rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    jobs = list(rounds[0])
    med = [statistics.median(r[j]["samples_per_s"] for r in rounds) for j in jobs]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["tab:green" if j.startswith("tfcs") else "tab:red" if j.startswith("mwms") else "tab:gray"
              for j in jobs]
    ax.bar(range(len(jobs)), med, color=colors, alpha=0.8)
    for i, j in enumerate(jobs):
        ax.plot([i] * len(rounds), [r[j]["samples_per_s"] for r in rounds], "k.", ms=5)
        ax.text(i, med[i], f"{med[i]:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(jobs)))
    ax.set_xticklabels(jobs, fontsize=8)
    ax.set_ylabel("samples/s (global)")
    ax.set_title(f"reference CNN, {workers} workers x {PER_WORKER_BATCH} samples, {len(rounds)} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
