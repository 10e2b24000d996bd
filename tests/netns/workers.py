"""Worker programs for the network-namespace tests, run as fresh processes inside a namespace:

    python tests/netns/workers.py fit --out DIR          # tf_keras model.fit under CommStrategy
    python tests/netns/workers.py reference --out DIR    # the same training in one process, no tfcs
    python tests/netns/workers.py collectives --out DIR  # direct-API collectives, results saved for numpy
    python tests/netns/workers.py loop --out DIR         # all-reduces until an error (link-down test)

Rank, world size and coordinator come from the ``TFCS_*`` environment set by the test. Each worker
writes ``<kind>-<rank>.json`` (and ``.npz`` arrays) to ``--out``; the test asserts in the parent.
``collective_inputs`` / ``expected_collectives`` are imported by the parent too (numpy only).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FIT_KIND, FIT_OPT, SEED = "mlp", "adam", 100
LOOP_ELEMS = 1024  # float32: 4 KiB per all-reduce


def _log_to_stderr():
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    lg = logging.getLogger("tf_commstrategy")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)


def _group_info(tfcs):
    import tf_commstrategy.process as proc
    g = proc.default_group()
    return {"rank": tfcs.rank(), "size": tfcs.size(), "local_rank": tfcs.local_rank(),
            "local_size": tfcs.local_size(), "hostname": socket.gethostname(),
            "transport": g.backend("grpc").transport, "advertise_host": g.advertise_host,
            "bind_host": g.bind_host, "hierarchical": g.backend("grpc").hierarchical}


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


# -- training ------------------------------------------------------------------------------------------
def fit(out: str) -> None:
    from tests.multiprocess import tf_workloads as W
    W.setup_tf(1)
    _log_to_stderr()
    import tensorflow as tf
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy()
    info = _group_info(tfcs)
    rank = info["rank"]
    x, y = W.data(FIT_KIND)
    with strategy.scope():
        # a different seed on every rank: the strategy must start all of them from rank 0's values
        m = W.build(FIT_KIND, FIT_OPT, SEED + rank)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(W.GLOBAL_BATCH)  # the GLOBAL batch
    hist = m.fit(ds, epochs=W.EPOCHS, verbose=0)
    np.savez(os.path.join(out, f"fit-{rank}.npz"), *m.get_weights())
    info["loss"] = [float(v) for v in hist.history["loss"]]
    _write_json(os.path.join(out, f"fit-{rank}.json"), info)


def reference(out: str) -> None:
    """One process, the default strategy, rank 0's seed, the global batch; tf_commstrategy is not imported."""
    from tests.multiprocess import tf_workloads as W
    tf = W.setup_tf(1)
    x, y = W.data(FIT_KIND)
    m = W.build(FIT_KIND, FIT_OPT, SEED)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(W.GLOBAL_BATCH)
    hist = m.fit(ds, epochs=W.EPOCHS, verbose=0)
    np.savez(os.path.join(out, "reference.npz"), *m.get_weights())
    _write_json(os.path.join(out, "reference.json"), {"loss": [float(v) for v in hist.history["loss"]],
                                                      "tfcs_imported": "tf_commstrategy" in sys.modules})


# -- direct API collectives --------------------------------------------------------------------------------
def collective_inputs(rank: int) -> dict:
    rng = np.random.default_rng(1000 + rank)
    return {
        "sum_f32": rng.standard_normal(1000).astype(np.float32),
        "sum_f32_big": rng.standard_normal(3 << 18).astype(np.float32),  # 3 MiB: several ring chunks
        "mean_f64": rng.standard_normal((7, 5)),
        "max_i32": rng.integers(-1000, 1000, 333).astype(np.int32),
        "min_i64": rng.integers(-10 ** 12, 10 ** 12, 64).astype(np.int64),
        "sum_f16": rng.standard_normal(100).astype(np.float16),
        "bcast": np.arange(17, dtype=np.float64) * (rank + 1),
        "gather": np.full((rank + 1, 3), rank, dtype=np.int32),  # uneven first dimensions
        "rs_sum": rng.standard_normal((10, 2)).astype(np.float32),
    }


def bcast_root(size: int) -> int:
    return size - 1  # the last rank: on another host than rank 0 in every layout used


def expected_collectives(rank: int, size: int) -> dict:
    ins = [collective_inputs(r) for r in range(size)]
    st = lambda k: np.stack([i[k] for i in ins])  # noqa: E731
    return {
        "sum_f32": st("sum_f32").sum(0),
        "sum_f32_big": st("sum_f32_big").sum(0),
        "mean_f64": st("mean_f64").mean(0),
        "max_i32": st("max_i32").max(0),
        "min_i64": st("min_i64").min(0),
        "sum_f16": st("sum_f16").astype(np.float32).sum(0).astype(np.float16),
        "bcast": ins[bcast_root(size)]["bcast"],
        "gather": np.concatenate([i["gather"] for i in ins]),
        "rs_sum": np.array_split(st("rs_sum").sum(0), size)[rank],
    }


def _environ_facts() -> dict:
    """What a launcher passed on: the job token (as a digest), the TFCS_TEST_* variables, this directory
    and whether a shell-specific variable (OLDPWD) came along."""
    import hashlib
    token = os.environ.get("TFCS_TOKEN", "")
    return {"token_sha": hashlib.sha256(token.encode()).hexdigest() if token else None,
            "test_vars": {k: v for k, v in os.environ.items() if k.startswith("TFCS_TEST_")},
            "cwd": os.getcwd(), "oldpwd": os.environ.get("OLDPWD"),
            "local_rank_var": os.environ.get("TFCS_LOCAL_RANK")}


def collectives(out: str) -> None:
    _log_to_stderr()
    import tf_commstrategy as tfcs
    tfcs.init()
    info = _group_info(tfcs)
    rank = info["rank"]
    x = collective_inputs(rank)
    res = {}
    for rep in range(3):  # a few rounds: the ring must stay in step across hosts
        res["sum_f32"] = tfcs.allreduce(x["sum_f32"], op="sum")
        res["sum_f32_big"] = tfcs.allreduce(x["sum_f32_big"], op="sum")
        res["mean_f64"] = tfcs.allreduce(x["mean_f64"], op="mean")
        res["max_i32"] = tfcs.allreduce(x["max_i32"], op="max")
        res["min_i64"] = tfcs.allreduce(x["min_i64"], op="min")
        res["sum_f16"] = tfcs.allreduce(x["sum_f16"], op="sum")
        res["bcast"] = tfcs.broadcast(x["bcast"], root_rank=bcast_root(info["size"]))
        res["gather"] = tfcs.allgather(x["gather"])
        res["rs_sum"] = tfcs.reduce_scatter(x["rs_sum"], op="sum")
        tfcs.barrier()
    np.savez(os.path.join(out, f"coll-{rank}.npz"), **{k: np.asarray(v) for k, v in res.items()})
    info["environ"] = _environ_facts()
    _write_json(os.path.join(out, f"coll-{rank}.json"), info)
    tfcs.shutdown()


# -- link-down loop ----------------------------------------------------------------------------------------
def loop(out: str, max_seconds: float, idle_after: int = 0, idle_sleep: float = 0.0, idle_ranks=None) -> None:
    """All-reduces of 4 KiB, 10 ms apart; after ``idle_after`` of them (if set) the ranks in ``idle_ranks``
    (default all) pause ``idle_sleep`` s before each further one (the others wait for them inside it)."""
    _log_to_stderr()
    import tf_commstrategy as tfcs
    from tf_commstrategy.errors import TfcsError
    tfcs.init()
    info = _group_info(tfcs)
    rank, size = info["rank"], info["size"]
    print(f"ready {json.dumps(info)}", flush=True)
    x = np.full(LOOP_ELEMS, rank + 1, dtype=np.float32)
    want = size * (size + 1) / 2
    n = 0
    end = time.monotonic() + max_seconds
    report = dict(info, collectives=0, error_class=None, message=None, t_error=None)
    try:
        while time.monotonic() < end:
            r = tfcs.allreduce(x, op="sum")
            if not np.all(r == want):
                raise AssertionError(f"allreduce #{n} gave {r[:4]}..., expected {want}")
            n += 1
            if n % 5 == 0:
                print(f"progress {n}", flush=True)
            if idle_after and n >= idle_after and (idle_ranks is None or rank in idle_ranks):
                print(f"idle {n}", flush=True)
                time.sleep(idle_sleep)
            else:
                time.sleep(0.01)
        report["collectives"] = n
        _write_json(os.path.join(out, f"loop-{rank}.json"), report)
        print("loop ended without an error", flush=True)
        sys.exit(2)
    except TfcsError as e:
        report.update(t_error=time.time(), collectives=n, error_class=type(e).__name__,
                      error_mro=[c.__name__ for c in type(e).__mro__], message=str(e))
        _write_json(os.path.join(out, f"loop-{rank}.json"), report)
        print(f"error {type(e).__name__} after {n} collectives", flush=True)
        os._exit(3)  # do not wait on the dead peer at exit


# -- fit until a fault ----------------------------------------------------------------------------------------
def fitloop(out: str, max_seconds: float) -> None:
    """tf_keras ``model.fit`` under CommStrategy on an endless dataset, ``progress N`` every 5 steps, until a
    tf_commstrategy error (written to ``fitloop-<rank>.json`` as ``loop`` does) or ``max_seconds``."""
    from tests.multiprocess import tf_workloads as W
    tf = W.setup_tf(1)
    import tf_commstrategy as tfcs
    from tf_commstrategy.errors import TfcsError
    keras = W.keras_module(2)
    strategy = tfcs.CommStrategy()
    info = _group_info(tfcs)
    rank = info["rank"]
    x, y = W.data(FIT_KIND)
    with strategy.scope():
        m = W.build(FIT_KIND, FIT_OPT, SEED)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(W.GLOBAL_BATCH)
    end = time.monotonic() + max_seconds
    steps = [0]

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps[0] += 1
            if steps[0] % 5 == 0:
                print(f"progress {steps[0]}", flush=True)
            time.sleep(0.01)  # a step of a few ms plus a pause: faults land both in and between collectives
            if time.monotonic() > end:
                self.model.stop_training = True

    report = dict(info, collectives=0, error_class=None, message=None, t_error=None)
    print(f"ready {json.dumps(info)}", flush=True)
    try:
        m.fit(ds, epochs=1, steps_per_epoch=10 ** 7, verbose=0, callbacks=[Progress()])
    except TfcsError as e:
        report.update(t_error=time.time(), collectives=steps[0], error_class=type(e).__name__,
                      error_mro=[c.__name__ for c in type(e).__mro__], message=str(e))
        _write_json(os.path.join(out, f"fitloop-{rank}.json"), report)
        print(f"error {type(e).__name__} after {steps[0]} steps", flush=True)
        os._exit(3)  # do not wait on the dead peer at exit
    report["collectives"] = steps[0]
    _write_json(os.path.join(out, f"fitloop-{rank}.json"), report)
    print("fit ended without an error", flush=True)
    sys.exit(2)


def _refuse_raw_tcp() -> None:
    """This process's raw TCP data connections are refused at connect, as a firewall that opens only the
    gRPC port would refuse them (gRPC and the coordinator connect through grpcio, untouched)."""
    from tf_commstrategy.backends.host import socket_transport

    def refused(address, timeout):
        raise ConnectionRefusedError(111, f"Connection refused (a firewall in front of {address})")
    socket_transport._connect = refused


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["fit", "reference", "collectives", "loop", "fitloop"])
    p.add_argument("--out", required=True)
    p.add_argument("--max-seconds", type=float, default=90.0)
    p.add_argument("--idle-after", type=int, default=0)
    p.add_argument("--idle-sleep", type=float, default=0.0)
    p.add_argument("--idle-ranks", default="", help="comma-separated ranks (default: all)")
    p.add_argument("--refuse-raw-tcp", default="", help="comma-separated ranks whose raw TCP connects are "
                                                        "refused, as by a firewall's REJECT")
    a = p.parse_args(argv)
    if a.refuse_raw_tcp and os.environ.get("TFCS_RANK") in a.refuse_raw_tcp.split(","):
        _refuse_raw_tcp()
    if a.kind == "loop":
        idle_ranks = {int(r) for r in a.idle_ranks.split(",")} if a.idle_ranks else None
        loop(a.out, a.max_seconds, a.idle_after, a.idle_sleep, idle_ranks)
    elif a.kind == "fitloop":
        fitloop(a.out, a.max_seconds)
    else:
        {"fit": fit, "reference": reference, "collectives": collectives}[a.kind](a.out)


if __name__ == "__main__":
    main()
