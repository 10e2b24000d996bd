"""CommStrategy sizes TensorFlow's thread pools to each local worker's share of the cores."""

import os

from tests.helpers import kept_log_messages, run_workers


def _pools(rank, size, early_op):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    records = kept_log_messages()
    if early_op:
        tf.constant(1.0) + 1.0  # starts TF's runtime: the pools can no longer be sized
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy()
    return {"intra": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter": tf.config.threading.get_inter_op_parallelism_threads(),
            "plan": strategy._thread_plan.threads, "warnings": [m for m in records if "thread pools" in m],
            "local_size": tfcs.local_size()}


def _expected(local_size):
    return max(1, len(os.sched_getaffinity(0)) // local_size)


def test_auto_gives_each_local_worker_its_share_of_the_cores():
    res = run_workers(_pools, 2, False, timeout=120)
    for r in res:
        assert r["local_size"] == 2
        assert r["intra"] == r["inter"] == r["plan"] == _expected(2), r


def test_off_and_tf_variables_leave_tensorflows_defaults():
    for env in ({"TFCS_TF_THREADS": "off"}, {"TF_NUM_INTRAOP_THREADS": "2"}):
        res = run_workers(_pools, 2, False, timeout=120, env=env)
        for r in res:
            assert r["plan"] is None and r["intra"] == 0 and r["inter"] == 0, (env, r)


def test_an_explicit_count_is_applied():
    res = run_workers(_pools, 2, False, timeout=120, env={"TFCS_TF_THREADS": "3"})
    assert all(r["intra"] == r["inter"] == 3 for r in res), res


def test_too_late_warns_with_the_fix_and_changes_nothing():
    res = run_workers(_pools, 2, True, timeout=120)
    for r in res:
        assert r["plan"] is None and r["intra"] == 0, r
        assert len(r["warnings"]) == 1, r
        assert "TF_NUM_INTRAOP_THREADS" in r["warnings"][0] and "before running any op" in r["warnings"][0]
