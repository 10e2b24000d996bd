"""In-job A/B: CommStrategy training with the nineteenth session's per-step Python trims (new) and without
(old: TensorFlow's own type-spec properties and DataHandler.__init__), and the ceiling, taking turns in
blocks in the same 2 processes (order rotated), as keras_throughput's paired job.

    tfcs-run -np 2 python benchmarks/results/cpu-2026-12-06/s19_ab_step_python.py   # BLOCKS=15 AB_OUT=out.json
"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import keras_throughput as kt
np, tf, keras, rank = kt._tf_setup()
import tf_commstrategy as tfcs
from tensorflow.python.distribute import input_lib
from tf_keras.src.engine import data_adapter
strategy = kt._comm_strategy()
from tf_commstrategy.tf import input_path; input_path.install()
n = tfcs.size()
with strategy.scope():
    model_t = kt._model(keras)
model_c = kt._model(keras)
ds_t = kt._dataset(np, tf, rank, 64 * n)
ds_c = kt._dataset(np, tf, rank, 64)
props = [(input_lib.DistributedIterator, "_type_spec"), (input_lib.DistributedIteratorSpec, "_component_specs"),
         (input_lib._SingleWorkerOwnedDatasetIterator, "_type_spec")]
new = {(c, a): c.__dict__[a] for c, a in props}
new_init = data_adapter.DataHandler.__dict__["__init__"]
def use(which):
    for (c, a), p in new.items():
        setattr(c, a, p if which == "new" else property(p.fget.__wrapped__))
    data_adapter.DataHandler.__init__ = new_init if which == "new" else new_init.__wrapped__
for job in ("new", "old"):
    use(job); model_t.fit(ds_t, epochs=1, steps_per_epoch=20, verbose=0)
model_c.fit(ds_c, epochs=1, steps_per_epoch=20, verbose=0)
STEPS, BLOCKS = int(os.environ.get("STEPS", 300)), int(os.environ.get("BLOCKS", 10))
JOBS = ("new", "old", "ceiling")
rows = []
for i in range(BLOCKS):
    order = JOBS[i % 3:] + JOBS[:i % 3]
    row = {}
    for job in order:
        tfcs.barrier()
        if job == "ceiling":
            row[job] = kt._timed_fit(keras, model_c, ds_c, STEPS)["wall_s"]
        else:
            use(job)
            row[job] = kt._timed_fit(keras, model_t, ds_t, STEPS)["wall_s"]
    rows.append(row)
walls = tfcs.allgather(np.array([[r[j] for r in rows for j in JOBS]], dtype=np.float64))
if rank == 0:
    out = []
    for i, r in enumerate(rows):
        w = {j: walls[:, i * 3 + k] for k, j in enumerate(JOBS)}
        sps = {"new": 64 * n * STEPS / w["new"][0], "old": 64 * n * STEPS / w["old"][0],
               "ceiling": sum(64 * STEPS / x for x in w["ceiling"])}
        out.append(sps)
        print("block %d new/old %.3f new/ceiling %.3f old/ceiling %.3f" % (i, sps["new"] / sps["old"], sps["new"] / sps["ceiling"], sps["old"] / sps["ceiling"]), flush=True)
    import statistics as st
    print("median new/old %.3f new/ceiling %.3f old/ceiling %.3f" % tuple(st.median(o[a] / o[b] for o in out) for a, b in (("new", "old"), ("new", "ceiling"), ("old", "ceiling"))))
    json.dump(out, open(os.environ.get("AB_OUT", "ab_step_python.json"), "w"))
