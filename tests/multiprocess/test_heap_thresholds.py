"""CommStrategy keeps glibc's freed memory for the next step: a step that frees tens of MB at once does
not fault them back in (``heap.py``)."""

import os

from tests.helpers import kept_log_messages, run_workers

STEPS = 20


def _faults_per_step(rank, size):
    """Build the strategy, then repeat a step-like pattern (four 5.6 MB buffers made and freed together,
    as a training step's tensors are) and count this process's page faults per repetition."""
    import logging
    import resource

    import numpy as np
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    records = kept_log_messages(logging.INFO)
    import tf_commstrategy as tfcs
    strategy = tfcs.CommStrategy()

    def step():
        bufs = [np.ones(700_000) for _ in range(4)]
        del bufs
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(STEPS):
        step()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / STEPS
    return {"faults": faults, "apply": strategy._heap_plan.apply, "reason": strategy._heap_plan.reason,
            "logged": [m for m in records if "heap:" in m]}


def test_auto_keeps_freed_memory_and_off_leaves_glibc_faulting_it_back():
    tuned = run_workers(_faults_per_step, 2, timeout=120)
    plain = run_workers(_faults_per_step, 2, timeout=120, env={"TFCS_HEAP": "off"})
    for r in plain:
        assert not r["apply"] and "off" in r["reason"], r
        # glibc's own thresholds: most of the 22 MB freed each time goes back to the kernel
        assert r["faults"] > 1000, r
    for r in tuned:
        assert r["apply"], r
        assert r["faults"] < 20, r
        assert len(r["logged"]) == 1 and "mmap threshold 32 MiB" in r["logged"][0], r


def test_a_users_malloc_variable_is_left_alone():
    res = run_workers(_faults_per_step, 2, timeout=120, env={"MALLOC_TRIM_THRESHOLD_": "131072"})
    for r in res:
        assert not r["apply"] and "MALLOC_TRIM_THRESHOLD_" in r["reason"], r
