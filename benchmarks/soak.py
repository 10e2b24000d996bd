"""Soak test: mixed collectives checked against numpy, interleaved with short model.fit epochs, for a while.

    python benchmarks/soak.py --duration 60 -np 2 [--json summary.json] [--report-dir DIR]

The parent starts the workers the way a user would, ``tfcs-run -np N python benchmarks/soak.py --worker``,
then reads one JSON report per worker, prints a summary table and exits non-zero when

* a worker failed or a tf_commstrategy error occurred (``errors`` must be 0),
* any collective result differed from the value numpy computes for it,
* RSS grew by more than ``--max-rss-growth-mb`` (default 200) after the warm-up
  (``--warmup-fraction`` of the duration, default 0.2), or
* the thread count (``threading.active_count()`` or the process's OS threads) grew by more than
  ``--max-thread-growth`` (default 4) after the warm-up.

Each iteration runs, on every rank: rank 0's control broadcast (continue / fit now), all-reduces over
several sizes x dtypes x ops (numpy arrays, and a tf.Tensor), a grouped all-reduce, a broadcast from a
rotating root, an all-gather with first dimensions that differ per rank, a reduce-scatter with an uneven
split, and a barrier. Inputs are integer-valued, so every expected result is exact and compared bit for
bit. About every ``--fit-every`` seconds all ranks run one ``model.fit`` epoch of a tiny tf_keras model
under ``CommStrategy`` and check that the weights are identical on every rank afterwards. Every
``--sample-every`` seconds (default 5) each worker samples VmRSS and Threads from /proc/self/status and
``threading.active_count()``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ALLREDUCE_SIZES = (1, 7, 1000, 65_537, 1 << 20)  # elements; the largest is 4 MiB of float32
ALLREDUCE_DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16", "int8", "uint8")
OPS = ("sum", "mean", "min", "max", "prod")


# ----------------------------------------------------------------------------------------------------
# worker
# ----------------------------------------------------------------------------------------------------
def proc_status():
    """(VmRSS in MiB, OS threads) of this process from /proc/self/status."""
    rss_kb, threads = None, None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss_kb / 1024.0, threads


class Checker:
    def __init__(self):
        self.mismatches = 0
        self.checks = 0
        self.first_mismatches = []

    def equal(self, what, got, want):
        import numpy as np
        self.checks += 1
        got = np.asarray(got)
        ok = got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        if not ok:
            self.mismatches += 1
            if len(self.first_mismatches) < 10:
                detail = f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
                if got.shape == want.shape:
                    bad = np.flatnonzero(got.ravel() != want.ravel())
                    if bad.size:
                        i = int(bad[0])
                        detail += (f"; {bad.size} of {want.size} elements differ, indices {i}..{int(bad[-1])}, "
                                   f"first: got {got.ravel()[i]!r} want {want.ravel()[i]!r}")
                self.first_mismatches.append(f"{what}: {detail}")


def _dtype(name):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _values(rng_seed, n, dtype, op):
    """Integer-valued inputs: every sum / mean / product below is exact in every dtype used."""
    import numpy as np
    rng = np.random.default_rng(rng_seed)
    if op == "prod":
        v = rng.integers(1, 3, n)          # 1 or 2: 2**size stays small
    elif dtype.kind == "u":
        v = rng.integers(0, 32, n)
    elif dtype.itemsize <= 2 or dtype.kind == "i" and dtype.itemsize == 1:
        v = rng.integers(-30, 31, n)       # int8 / float16 / bfloat16: small sums stay exact
    else:
        v = rng.integers(-1000, 1001, n)
    return v.astype(dtype)


def _expected_reduce(stack, op, dtype, size):
    """What the ring's contract says (docs/usage.md): low-precision sums/means in float32, rounded once;
    integer means by floor division."""
    import numpy as np
    low = dtype.itemsize == 2 and dtype.kind != "i" and dtype.kind != "u"
    if op in ("sum", "mean", "prod"):
        acc = stack.astype(np.float32) if low else stack
        r = acc.sum(0) if op != "prod" else acc.prod(0)
        if op == "mean":
            if dtype.kind in "iu":
                r = np.floor_divide(r, size)
            else:
                r = r / (np.float32(size) if low else dtype.type(size))
        return r.astype(dtype)
    return (stack.min(0) if op == "min" else stack.max(0)).astype(dtype)


def _run_collectives(tfcs, tf, it, rank, size, chk, counts):
    import numpy as np

    def count(kind):
        counts[kind] = counts.get(kind, 0) + 1

    # all-reduces: a few (size, dtype, op) combinations per iteration, cycling through all of them
    combos = [(n, d, op) for n in ALLREDUCE_SIZES for d in ALLREDUCE_DTYPES for op in OPS]
    for j in range(4):
        n, dname, op = combos[(it * 4 + j) % len(combos)]
        dtype = _dtype(dname)
        ins = [_values((it, j, r), n, dtype, op) for r in range(size)]
        got = tfcs.allreduce(ins[rank], op=op)
        count("allreduce")
        chk.equal(f"it {it} allreduce {op} {dname} x{n}", got, _expected_reduce(np.stack(ins), op, dtype, size))
    # bool min / max (logical and / or)
    b = [np.random.default_rng((it, 99, r)).integers(0, 2, 33).astype(bool) for r in range(size)]
    chk.equal(f"it {it} allreduce max bool", tfcs.allreduce(b[rank], op="max"), np.stack(b).max(0))
    count("allreduce")
    # a tf.Tensor through the same path
    tv = [_values((it, 7, r), 257, np.dtype(np.float32), "sum") for r in range(size)]
    got = tfcs.allreduce(tf.constant(tv[rank]), op="sum")
    chk.equal(f"it {it} allreduce tf.Tensor", got.numpy(), np.stack(tv).sum(0))
    count("allreduce")
    # grouped all-reduce of mixed dtypes
    g = [[_values((it, 11, k, r), 5 + 3 * k, _dtype(dn), "sum") for k, dn in enumerate(("float32", "int64",
                                                                                          "float64"))]
         for r in range(size)]
    out = tfcs.grouped_allreduce(g[rank], op="sum")
    for k in range(3):
        chk.equal(f"it {it} grouped_allreduce[{k}]", out[k], np.stack([g[r][k] for r in range(size)]).sum(0))
    count("grouped_allreduce")
    # broadcast from a rotating root
    root = it % size
    bv = [_values((it, 21, r), 1 + (it * 37) % 5000, np.dtype(np.float64), "sum") for r in range(size)]
    chk.equal(f"it {it} broadcast root {root}", tfcs.broadcast(bv[rank], root_rank=root), bv[root])
    count("broadcast")
    # all-gather: first dimensions differ per rank (and one rank may contribute nothing)
    rows = [(r + it) % 3 for r in range(size)]
    gv = [_values((it, 31, r), rows[r] * 4, np.dtype(np.int32), "sum").reshape(rows[r], 4) for r in range(size)]
    chk.equal(f"it {it} allgather rows {rows}", tfcs.allgather(gv[rank]), np.concatenate(gv))
    count("allgather")
    # reduce-scatter with an uneven split (rank r gets np.array_split(result, size)[r])
    nrows = 2 * size + 1 + it % 3
    rv = [_values((it, 41, r), nrows * 3, np.dtype(np.float32), "sum").reshape(nrows, 3) for r in range(size)]
    want = np.array_split(np.stack(rv).sum(0), size)[rank]
    chk.equal(f"it {it} reduce_scatter rows {nrows}", tfcs.reduce_scatter(rv[rank], op="sum"), want)
    count("reduce_scatter")
    tfcs.barrier()
    count("barrier")


def _tiny_model(strategy, keras):
    with strategy.scope():
        keras.utils.set_random_seed(7)
        L = keras.layers
        m = keras.Sequential([L.Dense(8, activation="relu", input_shape=(6,)), L.Dense(3)])
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def worker(args) -> int:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    t_start = time.monotonic()
    samples = []

    def sample(phase):
        rss, os_threads = proc_status()
        samples.append({"t": round(time.monotonic() - t_start, 2), "phase": phase, "rss_mb": round(rss, 2),
                        "threads_py": threading.active_count(), "threads_os": os_threads})

    sample("start")
    import tensorflow as tf
    import tf_keras as keras
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_commstrategy as tfcs
    from tf_commstrategy.errors import TfcsError
    strategy = tfcs.CommStrategy()
    rank, size = tfcs.rank(), tfcs.size()
    model = _tiny_model(strategy, keras)
    rng = np.random.default_rng(5)
    fx = rng.standard_normal((16 * size * 4, 6)).astype(np.float32)
    fy = (fx[:, 0] > 0).astype(np.int64) + (fx[:, 1] > 0)
    sample("initialized")
    chk = Checker()
    counts = {}
    errors = []
    it = fits = 0
    losses = []
    t0 = time.monotonic()  # the soak clock; rank 0's decides when to stop and when to fit
    next_sample = t0
    last_fit = t0
    warm_at = args.duration * args.warmup_fraction
    warm_sampled = False
    try:
        while True:
            now = time.monotonic()
            if rank == 0:
                go = now - t0 < args.duration
                do_fit = go and (it == 0 or now - last_fit >= args.fit_every)
                ctrl = np.array([go, do_fit], dtype=np.int32)
            else:
                ctrl = np.zeros(2, dtype=np.int32)
            ctrl = tfcs.broadcast(ctrl, root_rank=0)
            counts["broadcast"] = counts.get("broadcast", 0) + 1
            if not ctrl[0]:
                break
            _run_collectives(tfcs, tf, it, rank, size, chk, counts)
            if ctrl[1]:
                ds = tf.data.Dataset.from_tensor_slices((fx, fy)).batch(16 * size)  # the global batch
                h = model.fit(ds, epochs=1, verbose=0)
                losses.append(float(h.history["loss"][-1]))
                fits += 1
                last_fit = time.monotonic()
                flat = np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float32)
                every = tfcs.allgather(flat[None, :])
                counts["allgather"] = counts.get("allgather", 0) + 1
                chk.checks += 1
                if not all(np.array_equal(every[0], every[r]) for r in range(size)):
                    chk.mismatches += 1
                    chk.first_mismatches.append(f"fit {fits}: weights differ between ranks")
                if not np.isfinite(losses[-1]):
                    chk.mismatches += 1
                    chk.first_mismatches.append(f"fit {fits}: loss {losses[-1]}")
            it += 1
            now = time.monotonic()
            if not warm_sampled and now - t0 >= warm_at:
                sample("after_warmup")
                warm_sampled = True
                next_sample = now + args.sample_every
            elif now >= next_sample:
                sample("run")
                next_sample = now + args.sample_every
    except TfcsError as e:
        errors.append(f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - reported, and makes the run fail
        errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    sample("end")
    if not warm_sampled:
        errors.append("the run ended before the warm-up sample was taken")
    report = summarize(rank, size, it, fits, counts, chk, errors, samples, losses, time.monotonic() - t0)
    path = os.path.join(args.report_dir, f"soak-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"rank {rank}: {it} iterations, {report['collectives']} collectives, {fits} fits, "
          f"{len(errors)} errors, {chk.mismatches} mismatches; report {path}", flush=True)
    if errors:
        print("\n".join(errors), file=sys.stderr, flush=True)
        os._exit(3)  # a broken group: do not wait on peers at exit
    return 0


def summarize(rank, size, it, fits, counts, chk, errors, samples, losses, seconds):
    warm = next((s for s in samples if s["phase"] == "after_warmup"), samples[-1])
    after = [s for s in samples if s["t"] >= warm["t"]]
    col = lambda key, ss: [s[key] for s in ss]  # noqa: E731
    return {
        "rank": rank, "size": size, "seconds": round(seconds, 2), "iterations": it, "fits": fits,
        "collectives": sum(counts.values()), "collectives_by_kind": counts,
        "checks": chk.checks, "mismatches": chk.mismatches, "first_mismatches": chk.first_mismatches,
        "errors": len(errors), "error_messages": errors, "fit_losses": [round(v, 5) for v in losses[:3] + losses[-3:]],
        "rss_mb": {"first": samples[0]["rss_mb"], "after_warmup": warm["rss_mb"], "last": samples[-1]["rss_mb"],
                   "max": max(col("rss_mb", samples)),
                   "growth_after_warmup": round(max(col("rss_mb", after)) - warm["rss_mb"], 2)},
        "threads_py": {"first": samples[0]["threads_py"], "after_warmup": warm["threads_py"],
                       "max": max(col("threads_py", samples)), "last": samples[-1]["threads_py"],
                       "growth_after_warmup": max(col("threads_py", after)) - warm["threads_py"]},
        "threads_os": {"first": samples[0]["threads_os"], "after_warmup": warm["threads_os"],
                       "max": max(col("threads_os", samples)), "last": samples[-1]["threads_os"],
                       "growth_after_warmup": max(col("threads_os", after)) - warm["threads_os"]},
        "samples": samples,
    }


# ----------------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------------
def _launcher():
    exe = os.path.join(os.path.dirname(sys.executable), "tfcs-run")
    if os.path.exists(exe):
        return [exe]
    found = shutil.which("tfcs-run")
    return [found] if found else [sys.executable, "-m", "tf_commstrategy.run"]


def check(reports, np_, args):
    problems = []
    for r in range(np_):
        rep = reports.get(r)
        if rep is None:
            problems.append(f"rank {r}: no report")
            continue
        if rep["errors"]:
            problems.append(f"rank {r}: {rep['errors']} errors: {rep['error_messages'][0][:500]}")
        if rep["mismatches"]:
            problems.append(f"rank {r}: {rep['mismatches']} results differ from numpy: {rep['first_mismatches'][:3]}")
        if rep["iterations"] < 1 or rep["fits"] < 1:
            problems.append(f"rank {r}: nothing ran ({rep['iterations']} iterations, {rep['fits']} fits)")
        g = rep["rss_mb"]["growth_after_warmup"]
        if g > args.max_rss_growth_mb:
            problems.append(f"rank {r}: RSS grew by {g:.1f} MiB after the warm-up (bound {args.max_rss_growth_mb})")
        for kind in ("threads_py", "threads_os"):
            tg = rep[kind]["growth_after_warmup"]
            if tg > args.max_thread_growth:
                problems.append(f"rank {r}: {kind} grew by {tg} after the warm-up (bound {args.max_thread_growth})")
    its = {rep["iterations"] for rep in reports.values()}
    if len(its) > 1:
        problems.append(f"ranks ran different numbers of iterations: {sorted(its)}")
    return problems


def table(reports):
    head = (f"{'rank':>4} {'iters':>6} {'colls':>7} {'fits':>5} {'err':>4} {'diff':>5} | "
            f"{'RSS MiB first':>13} {'warm':>7} {'last':>7} {'max':>7} {'grow':>6} | "
            f"{'py thr f/w/max/last':>19} | {'OS thr f/w/max/last':>19}")
    lines = [head, "-" * len(head)]
    for r in sorted(reports):
        p = reports[r]
        m, tp, to = p["rss_mb"], p["threads_py"], p["threads_os"]
        lines.append(
            f"{r:>4} {p['iterations']:>6} {p['collectives']:>7} {p['fits']:>5} {p['errors']:>4} {p['mismatches']:>5} | "
            f"{m['first']:>13.1f} {m['after_warmup']:>7.1f} {m['last']:>7.1f} {m['max']:>7.1f} "
            f"{m['growth_after_warmup']:>+6.1f} | "
            f"{tp['first']:>4}/{tp['after_warmup']}/{tp['max']}/{tp['last']:<6} | "
            f"{to['first']:>4}/{to['after_warmup']}/{to['max']}/{to['last']}")
    return "\n".join(lines)


def parent(args) -> int:
    report_dir = args.report_dir or tempfile.mkdtemp(prefix="tfcs-soak-")
    os.makedirs(report_dir, exist_ok=True)
    for name in os.listdir(report_dir):
        if name.startswith("soak-rank") and name.endswith(".json"):
            os.remove(os.path.join(report_dir, name))
    cmd = _launcher() + ["-np", str(args.np), "--timeout", str(args.timeout)]
    if args.transport:
        cmd += ["--transport", args.transport]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", "--duration", str(args.duration),
            "--warmup-fraction", str(args.warmup_fraction), "--sample-every", str(args.sample_every),
            "--fit-every", str(args.fit_every), "--report-dir", report_dir]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    limit = args.duration + args.startup_limit
    print(f"soak: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"soak: the job ran past {limit:.0f} s; stopping it", file=sys.stderr, flush=True)
        os.killpg(p.pid, signal.SIGTERM)  # tfcs-run forwards it to the workers
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        rc = None
    wall = time.monotonic() - t0
    reports = {}
    for r in range(args.np):
        path = os.path.join(report_dir, f"soak-rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[r] = json.load(f)
    problems = [] if rc == 0 else [f"tfcs-run exited with {rc}" if rc is not None else "the job timed out"]
    problems += check(reports, args.np, args)
    if reports:
        print(table(reports))
    print(f"soak: {args.np} workers, {args.duration:g} s soak, {wall:.1f} s wall; reports in {report_dir}")
    summary = {"ok": not problems, "problems": problems, "returncode": rc, "wall_s": round(wall, 2),
               "duration_s": args.duration, "np": args.np, "bounds": {"max_rss_growth_mb": args.max_rss_growth_mb,
                                                                     "max_thread_growth": args.max_thread_growth,
                                                                     "warmup_fraction": args.warmup_fraction},
               "ranks": {str(r): {k: v for k, v in rep.items() if k != "samples"} for r, rep in reports.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if problems:
        print("soak: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("soak: OK")
    return 0


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of soak after init (default 60)")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0,
                   help="allowed RSS growth after the warm-up, MiB (default 200)")
    p.add_argument("--max-thread-growth", type=int, default=4,
                   help="allowed thread-count growth after the warm-up (default 4)")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="share of the duration before the baseline sample (default 0.2)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS / thread samples")
    p.add_argument("--fit-every", type=float, default=3.0, help="seconds between model.fit epochs")
    p.add_argument("--timeout", type=float, default=60.0, help="collective deadline (TFCS_TIMEOUT), seconds")
    p.add_argument("--transport", choices=["auto", "shm", "unix", "tcp", "grpc"], help="ring data path (tfcs-run)")
    p.add_argument("--startup-limit", type=float, default=240.0,
                   help="seconds allowed beyond --duration for startup and shutdown before the job is stopped")
    p.add_argument("--report-dir", help="where workers write soak-rank<N>.json (default: a new temp dir)")
    p.add_argument("--json", help="write the summary (checks and per-rank figures) to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
