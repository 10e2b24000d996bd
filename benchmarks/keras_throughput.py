"""Training throughput of the reference CNN: CommStrategy vs MultiWorkerMirroredStrategy vs the ceiling.

    python benchmarks/keras_throughput.py [--keras 3|2] [--workers 2] [--steps 300] [--rounds 3] [--json out.json]

``--keras 3`` (the default) trains the tfcs and ceiling jobs with Keras 3 (``import keras``), ``--keras 2``
with tf_keras. The MultiWorkerMirroredStrategy jobs always use tf_keras: MWMS cannot train a Keras 3
model across workers (keras-team/keras#20585), so with ``--keras 3`` they are the best that MWMS offers.

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
* ``mwms-pools``: the same with the process settings CommStrategy would choose: its thread pools
  (``cores // N`` per pool) and its heap thresholds (``tf_commstrategy/heap.py``, as the ``MALLOC_*_``
  variables), so that the comparison does not rest on those settings;
* ``ceiling`` and ``ceiling-pools``: N independent single-process trainings at the same time (no
  communication at all), with TF's defaults and with CommStrategy's process settings (as
  ``mwms-pools``); the better of the two is the compute ceiling of this machine;
* ``paired`` (not in the default set): tfcs and the ceiling in the SAME N processes under ``tfcs-run``,
  taking turns in blocks of ``--steps`` steps (``--blocks`` rounds of three blocks, the order rotated
  from one to the next): a block of CommStrategy training; a block in which each process trains a
  model of its own without a strategy (no collective: the ceiling); and a *lockstep* block, the
  ceiling's model with the processes waiting for each other in every step where CommStrategy
  all-reduces the gradients (a barrier on shared-memory words, no data exchanged): what synchronous
  training costs before any gradient moves. Both ranks start each block together. The VM's speed
  drifts over seconds (see docs/benchmarks.md), so jobs run one after the other can land in different
  phases; blocks taken moments apart are compared. Reported per round of blocks.

Each worker trains a warm-up epoch, then ``--steps`` steps in one ``fit`` call. Samples/s are global and
steady-state: from the start of step 20 of that call to the end of its last step (a callback notes the
times), so the one-off work of starting ``fit`` is not counted; the whole call's time is reported too.
For tfcs the time spent inside collectives (rank 0) gives the step-time split.
"""

import argparse
import json
import os
import resource
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


def _tf_setup(mode=""):
    """TensorFlow, as every job's worker imports it (the Keras of ``TFCS_BENCH_KERAS``, tf_keras for the
    MWMS jobs; the "-pools" jobs' pool size; pinning)."""
    import importlib
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    flavour = "2" if mode.startswith("mwms") else os.environ.get("TFCS_BENCH_KERAS", "3")
    keras = importlib.import_module("keras" if flavour == "3" else "tf_keras")
    threads = os.environ.get("TFCS_BENCH_TF_THREADS")  # a pool size for this job (the "-pools" jobs)
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(int(threads))
        tf.config.threading.set_inter_op_parallelism_threads(int(threads))
    rank = int(os.environ.get("TFCS_RANK", "0"))
    if os.environ.get("TFCS_BENCH_PIN") == "1":  # every job alike: worker r on core r (mod the cores)
        cores = sorted(os.sched_getaffinity(0))
        slot = int(os.environ.get("TFCS_BENCH_SLOT", rank))
        os.sched_setaffinity(0, {cores[slot % len(cores)]})
    return np, tf, keras, rank


def _comm_strategy():
    """The tfcs jobs' strategy: ``CommStrategy()`` as a user makes it (``TFCS_BENCH_SYNC_METRICS=0``: local
    metrics)."""
    import tf_commstrategy as tfcs
    return tfcs.CommStrategy(sync_metrics=os.environ.get("TFCS_BENCH_SYNC_METRICS", "1") == "1")


def _model(keras, cls=None, optimizer="adam"):
    L = keras.layers
    layers = [keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(),
              L.Dense(128, activation="relu"), L.Dense(10)]
    model = (cls or keras.Sequential)(layers)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _dataset(np, tf, rank, global_batch):
    rng = np.random.default_rng(rank)
    x = rng.random((global_batch * 8, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, global_batch * 8)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()


def _machine_idle_s():
    """Seconds all CPUs together have been idle since boot (``/proc/stat``; 0 where there is none): an idle
    CPU in a block means a process waited with nothing else to run."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait ...
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _timed_fit(keras, model, ds, steps, counters=lambda: {}):
    """One ``fit`` call of ``steps + SKIP`` steps: the steady-state time from the start of step SKIP to
    the end of the last step, what ``counters`` (seconds by name) grew by in that window, and the whole
    call's time."""
    marks = {}

    def usage():  # this process's page faults and CPU seconds (user, kernel) so far; the machine's idle CPU time
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"minflt": r.ru_minflt, "user_s": r.ru_utime, "sys_s": r.ru_stime, "idle_s": _machine_idle_s()}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == SKIP:
                marks["begin"] = time.perf_counter()
                marks["counters"] = dict(counters(), **usage())

        def on_train_batch_end(self, batch, logs=None):
            marks["end"] = time.perf_counter()
            marks["usage"] = usage()
            if batch == steps + SKIP - 1:  # the last step: before fit's own epoch-end work
                marks["usage"].update(counters())

    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps + SKIP, verbose=0, callbacks=[Clock()])
    grown = {k: v - marks["counters"][k] for k, v in marks["usage"].items()}
    # the window in CLOCK_MONOTONIC seconds (perf_counter's clock on Linux), to line up with a profiler's
    # samples (``perf record -k CLOCK_MONOTONIC``)
    return dict(grown, wall_s=marks["end"] - marks["begin"], fit_call_s=time.perf_counter() - t0,
                fit_call_steps=steps + SKIP, steps=steps, window_s=[marks["begin"], marks["end"]])


def worker(mode, steps, out):
    np, tf, keras, rank = _tf_setup(mode)
    n = int(os.environ.get("TFCS_WORLD_SIZE", "1"))
    if mode.startswith("tfcs"):
        strategy = _comm_strategy()
        global_batch = PER_WORKER_BATCH * n
    elif mode.startswith("mwms"):
        opts = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)
        global_batch = PER_WORKER_BATCH * n
    else:
        strategy = tf.distribute.get_strategy()
        global_batch = PER_WORKER_BATCH
    ds = _dataset(np, tf, rank, global_batch)
    with strategy.scope():
        model = _model(keras)
    model.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up: tracing, first collectives
    timed = _timed_fit(keras, model, ds, steps, lambda: _comm_counters(mode))
    if rank == 0 or mode.startswith("ceiling"):
        with open(out, "w") as f:
            json.dump(dict(timed, mode=mode, global_batch=global_batch, params=model.count_params(),
                           keras=keras.__name__ + " " + keras.__version__,
                           intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads(),
                           inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads()), f)


class StepBarrier:
    """The lockstep blocks' barrier: every rank writes how many barriers it has reached into its own word of
    a shared-memory page and waits until every word has reached that count, yielding the CPU in a loop
    (never sleeping: a barrier that sleeps wakes a poll late, and that delay would count as lockstep's
    cost). No data moves, so its cost is what lockstep itself
    costs. Rank 0 makes the page (a random name, broadcast) and removes its name as
    soon as every rank has mapped it, so a killed job leaves nothing in /dev/shm."""

    DEADLINE_S = 120.0

    def __init__(self, tfcs, np, rank, n):
        import mmap
        import secrets
        name = np.zeros(48, np.uint8)
        if rank == 0:
            text = f"/dev/shm/tfcs-bench-lockstep-{secrets.token_hex(8)}".encode()
            name[:len(text)] = np.frombuffer(text, np.uint8)
            fd = os.open(text.decode(), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
        name = tfcs.broadcast(name, root_rank=0)
        self.path = bytes(name[name > 0]).decode()
        fd = os.open(self.path, os.O_RDWR)
        self._mm = mmap.mmap(fd, 4096)
        os.close(fd)
        self._words = np.frombuffer(self._mm, dtype=np.uint64, count=n)
        self.rank, self.count, self.wait_s, self._np = rank, 0, 0.0, np
        tfcs.barrier()  # every rank has the page mapped: its name can go
        if rank == 0:
            os.unlink(self.path)

    def wait(self):
        self.count += 1
        self._words[self.rank] = self.count
        start = time.perf_counter()
        while self._words.min() < self.count:
            if time.perf_counter() - start < self.DEADLINE_S:
                os.sched_yield()
            else:
                raise RuntimeError(f"rank {self.rank}: lockstep barrier {self.count} not reached by every rank "
                                   f"within {self.DEADLINE_S:g} s (words {self._words.tolist()})")
        self.wait_s += time.perf_counter() - start

    def passed(self):
        """``wait``, as a ``tf.numpy_function`` calls it: returns how many barriers this rank has passed."""
        self.wait()
        return self._np.int64(self.count)

    def close(self):
        del self._words
        self._mm.close()


PAIRED_JOBS = ("tfcs", "ceiling", "lockstep")
OPTIONAL_PAIRED_JOBS = ("hvd",)


def _paired_jobs():
    """The paired job's blocks: ``--paired-jobs`` (passed to the workers as TFCS_BENCH_PAIRED_JOBS)."""
    return tuple(os.environ.get("TFCS_BENCH_PAIRED_JOBS", ",".join(PAIRED_JOBS)).split(","))


def _hvd_model(keras):
    """The ``hvd`` blocks: the model as a Horovod script builds it with ``tf_commstrategy.horovod``: no
    strategy, the optimizer wrapped in ``hvd.DistributedOptimizer`` (one fused all-reduce of the step's
    gradients), each worker training on its own batch of PER_WORKER_BATCH samples."""
    import tf_commstrategy.horovod as hvd
    hvd.init()
    return _model(keras, optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam()))


def _lockstep_model(keras, tf, barrier):
    """The ceiling's model, but its train step waits for every rank's (``barrier``) where CommStrategy
    all-reduces the gradients: between the backward pass and the update (as ``optimizer.minimize`` does
    it, the gradients only wait for the barrier). No data moves between the processes."""

    class LockstepSequential(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x, y, y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            passed = tf.numpy_function(barrier.passed, [], tf.int64, stateful=True)
            with tf.control_dependencies([passed]):
                grads = [tf.identity(g) for g in grads]
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return self.compute_metrics(x, y, y_pred, None)

    return _model(keras, LockstepSequential)


def paired_worker(steps, blocks, out):
    """The ``paired`` job: in the same N processes (under ``tfcs-run``), blocks of CommStrategy training,
    blocks of the ceiling (each process trains a model of its own, no strategy, no communication: N
    independent trainings at the same time) and lockstep blocks (the ceiling's model, every process
    waiting for the others in each step: ``_lockstep_model``) take turns, the order rotated from
    one round of blocks to the next. Both ranks start every block together (a barrier, outside the timed
    window)."""
    np, tf, keras, rank = _tf_setup("paired")
    import tf_commstrategy as tfcs
    strategy = _comm_strategy()
    n = tfcs.size()
    with strategy.scope():
        model_t = _model(keras)
    model_c = _model(keras)  # outside the scope: TensorFlow's default strategy, this process alone
    barrier = StepBarrier(tfcs, np, rank, n)
    ds_c = _dataset(np, tf, rank, PER_WORKER_BATCH)
    jobs = {"tfcs": (model_t, _dataset(np, tf, rank, PER_WORKER_BATCH * n)), "ceiling": (model_c, ds_c),
            "lockstep": (_lockstep_model(keras, tf, barrier), ds_c)}
    paired = _paired_jobs()
    if "hvd" in paired:
        jobs["hvd"] = (_hvd_model(keras), ds_c)
    for model, ds in jobs.values():
        model.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up: tracing, first collectives
    rows = []
    for i in range(blocks):
        k = i % len(paired)
        order = paired[k:] + paired[:k]
        row = {"order": list(order)}
        for job in order:
            tfcs.barrier()
            model, ds = jobs[job]
            # the collectives' time counted in every job: only the strategy's blocks may show any (and
            # only the lockstep blocks barrier waits)
            row[job] = _timed_fit(keras, model, ds, steps,
                                  lambda: dict(_comm_counters("tfcs"), barrier_wait_s=barrier.wait_s))
        rows.append(row)
    barrier.close()
    # every rank's walls: the ceiling's (and lockstep's) samples/s is the sum over the N trainings
    for job in [j for j in ("ceiling", "lockstep") if j in paired]:
        walls = tfcs.allgather(np.array([[r[job]["wall_s"] for r in rows]], dtype=np.float64))
        for i, r in enumerate(rows):
            r[job]["rank_wall_s"] = [float(w) for w in walls[:, i]]
            r[job]["samples_per_s"] = sum(PER_WORKER_BATCH * steps / w for w in walls[:, i])
    # every rank's waits inside the tfcs blocks' all-reduce: a rank that always waits less is the slower one
    waits = tfcs.allgather(np.array([[r["tfcs"].get("wait_s", 0.0) for r in rows]], dtype=np.float64))
    for i, r in enumerate(rows):
        r["tfcs"]["rank_wait_s"] = [float(w) for w in waits[:, i]]
        r["tfcs"]["samples_per_s"] = PER_WORKER_BATCH * n * steps / r["tfcs"]["wall_s"]
        if "hvd" in r:  # in lockstep like tfcs: every rank's PER_WORKER_BATCH samples per step
            r["hvd"]["samples_per_s"] = PER_WORKER_BATCH * n * steps / r["hvd"]["wall_s"]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": "paired", "blocks": rows, "global_batch": PER_WORKER_BATCH * n,
                       "lockstep_barriers": barrier.count,  # every lockstep step passed one, warm-up included
                       "params": model_t.count_params(), "steps": steps,
                       "keras": keras.__name__ + " " + keras.__version__,
                       "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                       "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}, f)


def paired_ratios(result, num="tfcs", den="ceiling"):
    """Each round of blocks' ``num`` / ``den`` samples/s (default tfcs / ceiling), in block order; empty
    where the result has no ``num`` or ``den`` blocks (the lockstep job is newer than some saved runs)."""
    return [b[num]["samples_per_s"] / b[den]["samples_per_s"] for b in result["blocks"] if num in b and den in b]


def _comm_counters(mode):
    """Seconds this rank has spent inside collectives (``comm_s``), and of those, inside the compiled
    all-reduce waiting for the other ranks (``wait_s``; 0 where the op is not used)."""
    if not mode.startswith("tfcs"):
        return {"comm_s": 0.0, "wait_s": 0.0, "collectives": 0}
    from tf_commstrategy.process import default_group
    from tf_commstrategy.tf.native_path import NativeAllReduce
    group = default_group()
    native = NativeAllReduce.for_group(group)  # set up already by the strategy: only looked up here
    stats = group.backend("grpc").stats()
    if native is None:
        return {"comm_s": stats.busy_s, "wait_s": 0.0, "collectives": stats.collectives}
    return {"comm_s": stats.busy_s + native.busy_seconds(), "wait_s": native.wait_seconds(),
            "collectives": stats.collectives + native.calls()}


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_mode(mode, n, steps, blocks=6):
    d = tempfile.mkdtemp()
    outs = [os.path.join(d, f"r{i}.json") for i in range(n)]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(steps)]
    env = dict(os.environ)
    if mode == "paired":
        subprocess.run([sys.executable, "-m", "tf_commstrategy.run", "-np", str(n)] + cmd +
                       ["--blocks", str(blocks), "--out", outs[0]], check=True, env=env)
        result = json.load(open(outs[0]))
        # as a job of the round: tfcs's median block (the ratios themselves are per block pair)
        tfcs = statistics.median(b["tfcs"]["samples_per_s"] for b in result["blocks"])
        return dict(result, samples_per_s=tfcs, step_ms=1e3 * PER_WORKER_BATCH * n / tfcs,
                    comm_s=sum(b["tfcs"]["comm_s"] for b in result["blocks"]),
                    wait_s=sum(b["tfcs"].get("wait_s", 0.0) for b in result["blocks"]),
                    wall_s=sum(b["tfcs"]["wall_s"] for b in result["blocks"]),
                    fit_call_samples_per_s=statistics.median(
                        result["global_batch"] * b["tfcs"]["fit_call_steps"] / b["tfcs"]["fit_call_s"]
                        for b in result["blocks"]))
    if mode.endswith("-pools"):  # CommStrategy's process settings: its pool sizes and heap thresholds
        from tf_commstrategy import heap
        env["TFCS_BENCH_TF_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
        if heap.plan("auto").apply:
            env.update(MALLOC_MMAP_THRESHOLD_=str(heap.MMAP_BYTES), MALLOC_TRIM_THRESHOLD_=str(heap.TRIM_BYTES))
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
    kerases = sorted({f"{j}: {rounds[0][j]['keras']}" for j in jobs if "keras" in rounds[0][j]})
    lines = [f"reference CNN ({rounds[0][jobs[0]]['params']:,} parameters), {workers} workers x "
             f"{PER_WORKER_BATCH} samples, {steps} timed steps, {len(rounds)} rounds" +
             (f"; Keras per job: {', '.join(kerases)}" if kerases else "") + "\n",
             "| job | pools (intra/inter) | samples/s, median of rounds | step time | each round |",
             "|---|---|---|---|---|"]
    for j in jobs:
        r0 = rounds[0][j]
        pools = f"{r0['intra_op_threads'] or 'TF default'}/{r0['inter_op_threads'] or 'TF default'}"
        each = ", ".join(f"{r[j]['samples_per_s']:,.0f}" for r in rounds)
        lines.append(f"| {j} | {pools} | {med[j]:,.0f} | {1e3 * PER_WORKER_BATCH * workers / med[j]:.1f} ms "
                     f"| {each} |")
    if "paired" in jobs:
        lock = all("lockstep" in b for r in rounds for b in r["paired"]["blocks"])
        paired_jobs = PAIRED_JOBS if lock else PAIRED_JOBS[:2]
        lines += ["", "paired job: CommStrategy, the ceiling" + (" and the lockstep ceiling" if lock else "") +
                  f" in the same processes, taking turns in blocks of {steps} steps (ratios within each round of "
                  "blocks)", "",
                  "| round | tfcs samples/s (blocks) | ceiling samples/s (blocks) | tfcs / ceiling | median |" +
                  (" lockstep / ceiling | tfcs / lockstep | median |" if lock else ""),
                  "|---|---|---|---|---|" + ("---|---|---|" if lock else "")]
        for i, r in enumerate(rounds, 1):
            blocks, ratios = r["paired"]["blocks"], paired_ratios(r["paired"])
            row = (f"| {i} | " + ", ".join(f"{b['tfcs']['samples_per_s']:,.0f}" for b in blocks) + " | " +
                   ", ".join(f"{b['ceiling']['samples_per_s']:,.0f}" for b in blocks) + " | " +
                   ", ".join(f"{x:.2f}" for x in ratios) + f" | {statistics.median(ratios):.2f} |")
            if lock:
                sync = paired_ratios(r["paired"], "lockstep", "ceiling")
                own = paired_ratios(r["paired"], "tfcs", "lockstep")
                row += (" " + ", ".join(f"{x:.2f}" for x in sync) + " | " + ", ".join(f"{x:.2f}" for x in own) +
                        f" | {statistics.median(own):.2f} |")
            lines.append(row)
        blocks = [b for r in rounds for b in r["paired"]["blocks"]]
        per_step = lambda key, job="tfcs": statistics.median(  # noqa: E731
            1e3 * b[job].get(key, 0.0) / b[job]["steps"] for b in blocks)
        lines.append(f"\nper step (rank 0, median over blocks): tfcs {per_step('wall_s'):.2f} ms, ceiling "
                     f"{per_step('wall_s', 'ceiling'):.2f} ms" +
                     (f", lockstep {per_step('wall_s', 'lockstep'):.2f} ms (of which waiting at its barrier "
                      f"{per_step('barrier_wait_s', 'lockstep'):.2f} ms)" if lock else "") +
                     f"; tfcs inside collectives {per_step('comm_s'):.2f} "
                     f"ms, of which waiting for the other ranks {per_step('wait_s'):.2f} ms" +
                     (f"; collectives per tfcs step {per_step('collectives') / 1e3:.2f}"
                      if all("collectives" in b["tfcs"] for b in blocks) else ""))
        if all("minflt" in b[job] for b in blocks for job in paired_jobs):  # absent from older saved runs
            lines.append("page faults per step (rank 0, median over blocks): " + ", ".join(
                f"{job} {per_step('minflt', job) / 1e3:.1f} ({per_step('sys_s', job):.2f} ms in the kernel)"
                for job in paired_jobs))
        if all("idle_s" in b[job] for b in blocks for job in paired_jobs):  # absent from older saved runs
            lines.append("idle CPU time per step, all CPUs together (median over blocks): " + ", ".join(
                f"{job} {per_step('idle_s', job):.2f} ms" for job in paired_jobs))
        if all("rank_wait_s" in b["tfcs"] for b in blocks):
            rank_wait = lambda k: statistics.median(  # noqa: E731
                1e3 * b["tfcs"]["rank_wait_s"][k] / b["tfcs"]["steps"] for b in blocks)
            lines.append("tfcs waiting for the other ranks per step, each rank (median over blocks): " + ", ".join(
                f"rank {k} {rank_wait(k):.2f} ms" for k in range(len(blocks[0]["tfcs"]["rank_wait_s"]))))
        hvd = all("hvd" in b for b in blocks)
        if hvd:
            lines.append(f"hvd per step (rank 0, median over blocks): {per_step('wall_s', 'hvd'):.2f} ms, inside "
                         f"collectives {per_step('comm_s', 'hvd'):.2f} ms; collectives per hvd step "
                         f"{per_step('collectives', 'hvd') / 1e3:.2f}")
        for num, den in ((("tfcs", "ceiling"),) + ((("lockstep", "ceiling"), ("tfcs", "lockstep")) if lock else ())
                         + ((("hvd", "ceiling"), ("hvd", "tfcs")) if hvd else ())):
            every = [x for r in rounds for x in paired_ratios(r["paired"], num, den)]
            lines.append(f"{num} / {den}, all {len(every)} rounds of blocks: median {statistics.median(every):.2f}, "
                         f"{min(every):.2f}-{max(every):.2f}, at least 0.9 in {sum(x >= 0.9 for x in every)}")
        if "mwms" in jobs:
            lines.append("paired tfcs (median block) / mwms per round: " + ", ".join(
                f"{r['paired']['samples_per_s'] / r['mwms']['samples_per_s']:.2f}x" for r in rounds))
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
        wait = statistics.median(r["tfcs"].get("wait_s", 0.0) / r["tfcs"]["wall_s"] for r in rounds)
        lines.append(f"\ntfcs step-time split (rank 0, median share): {step * (1 - share):.1f} ms compute and "
                     f"framework, {step * share:.1f} ms inside collectives ({100 * share:.0f}%), of which "
                     f"{step * wait:.2f} ms waiting for the other ranks")
        if "collectives" in rounds[0]["tfcs"]:
            lines.append("collectives per tfcs step (rank 0, round 1): "
                         f"{rounds[0]['tfcs']['collectives'] / rounds[0]['tfcs']['steps']:.2f}")
        lines.append("whole fit() call incl. its start (samples/s, round 1): " + ", ".join(
            f"{j} {rounds[0][j]['fit_call_samples_per_s']:,.0f}" for j in jobs))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--keras", choices=["3", "2"], default=os.environ.get("TFCS_BENCH_KERAS", "3"),
                   help="the Keras of the tfcs and ceiling jobs: 3 (import keras) or 2 (tf_keras)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--modes", default=",".join(JOBS),
                   help="jobs of a round, from: " + ", ".join(JOBS + ("tfcs-python", "tfcs-grpc", "paired")))
    p.add_argument("--blocks", type=int, default=6, help="block pairs of the paired job (each --steps steps)")
    p.add_argument("--paired-jobs", default=os.environ.get("TFCS_BENCH_PAIRED_JOBS", ",".join(PAIRED_JOBS)),
                   help="the paired job's blocks, from " + ", ".join(PAIRED_JOBS + OPTIONAL_PAIRED_JOBS) +
                        "; hvd (a Horovod-style script on tf_commstrategy.horovod) needs --keras 2")
    p.add_argument("--plot", help="write a PNG bar chart of the jobs here (needs matplotlib)")
    p.add_argument("--from-json", help="summarize / plot an earlier --json file instead of running")
    a = p.parse_args()
    os.environ["TFCS_BENCH_KERAS"] = a.keras  # the workers' flavour (they inherit the environment)
    os.environ["TFCS_BENCH_PAIRED_JOBS"] = a.paired_jobs
    unknown = set(a.paired_jobs.split(",")) - set(PAIRED_JOBS + OPTIONAL_PAIRED_JOBS)
    if unknown or not {"tfcs", "ceiling"} <= set(a.paired_jobs.split(",")):
        p.error(f"--paired-jobs {a.paired_jobs}: needs tfcs and ceiling, knows {PAIRED_JOBS + OPTIONAL_PAIRED_JOBS}")
    if "hvd" in a.paired_jobs.split(",") and a.keras != "2":
        p.error("--paired-jobs hvd: DistributedOptimizer wraps tf_keras optimizers; add --keras 2")
    if a.worker == "paired":
        return paired_worker(a.steps, a.blocks, a.out)
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
        rounds.append({m: run_mode(m, a.workers, a.steps, a.blocks) for m in modes})
        print(f"round {i + 1}: " + ", ".join(f"{m} {r['samples_per_s']:,.0f}" for m, r in rounds[-1].items()),
              flush=True)
    print("\n" + summarize(rounds, a.workers, a.steps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workers": a.workers, "steps": a.steps, "keras": a.keras, "rounds": rounds, "machine": {
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
    colors = ["tab:green" if j.startswith("tfcs") or j == "paired" else "tab:red" if j.startswith("mwms") else "tab:gray"
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
