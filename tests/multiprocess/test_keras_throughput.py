"""benchmarks/keras_throughput.py's paired job: CommStrategy blocks and ceiling blocks (each process alone,
no communication) taking turns in the same two workers under tfcs-run."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "keras_throughput.py")
STEPS, BLOCKS = 5, 2

pytestmark = pytest.mark.bench


@pytest.mark.timeout(300)
def test_paired_job_alternates_strategy_and_ceiling_blocks(tmp_path):
    out = tmp_path / "paired.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFCS_")}
    p = subprocess.run([sys.executable, SCRIPT, "--rounds", "1", "--steps", str(STEPS), "--blocks", str(BLOCKS),
                        "--modes", "paired", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| tfcs / ceiling | median | lockstep / ceiling | tfcs / lockstep | median |" in p.stdout
    job = json.loads(out.read_text())["rounds"][0]["paired"]
    blocks = job["blocks"]
    # one barrier per step of the lockstep model: its 20 warm-up steps, then each block's fit call
    assert job["lockstep_barriers"] == 20 + BLOCKS * (STEPS + 20)
    assert [b["order"] for b in blocks] == [["tfcs", "ceiling", "lockstep"], ["ceiling", "lockstep", "tfcs"]]
    for b in blocks:
        t, c, k = b["tfcs"], b["ceiling"], b["lockstep"]
        assert t["steps"] == c["steps"] == k["steps"] == STEPS
        assert t["comm_s"] > 0  # the strategy's blocks all-reduce every step
        assert t["collectives"] == STEPS and c["collectives"] == k["collectives"] == 0  # one per step, fused
        assert 0 <= t["wait_s"] <= t["comm_s"]  # waits for the other rank: part of the time in collectives
        assert c["comm_s"] == c["wait_s"] == 0  # the ceiling's blocks never enter a collective
        assert k["comm_s"] == k["wait_s"] == 0  # nor do the lockstep blocks: they only wait at their barrier
        assert t["barrier_wait_s"] == c["barrier_wait_s"] == 0 and 0 < k["barrier_wait_s"] < k["wall_s"]
        assert len(k["rank_wall_s"]) == 2 and k["rank_wall_s"][0] == pytest.approx(k["wall_s"])
        assert k["samples_per_s"] == pytest.approx(sum(64 * STEPS / w for w in k["rank_wall_s"]))
        # each rank's waits, gathered: rank 0's entry is its own counter
        assert len(t["rank_wait_s"]) == 2 and t["rank_wait_s"][0] == pytest.approx(t["wait_s"])
        assert all(w >= 0 for w in t["rank_wait_s"])
        assert len(c["rank_wall_s"]) == 2 and c["rank_wall_s"][0] == pytest.approx(c["wall_s"])
        # global samples/s: the strategy trains 2 x 64 samples per step in lockstep; the ceiling is the
        # sum of two independent trainings of 64 samples per step
        assert t["samples_per_s"] == pytest.approx(2 * 64 * STEPS / t["wall_s"])
        assert c["samples_per_s"] == pytest.approx(sum(64 * STEPS / w for w in c["rank_wall_s"]))
    for num, den in (("tfcs", "ceiling"), ("lockstep", "ceiling"), ("tfcs", "lockstep")):
        ratios = [b[num]["samples_per_s"] / b[den]["samples_per_s"] for b in blocks]
        assert f"{ratios[0]:.2f}, {ratios[1]:.2f}" in p.stdout, (num, den)
        assert f"{num} / {den}, all 2 rounds of blocks: median " in p.stdout
    assert "of which waiting for the other ranks" in p.stdout and "collectives per tfcs step 1.00" in p.stdout
    assert job["keras"].startswith("keras 3.")  # the default flavour: Keras 3
    # page faults and kernel time per step of each job (rank 0's counters, grown over the timed window)
    faults = {job: sorted(b[job]["minflt"] / STEPS for b in blocks) for job in ("tfcs", "ceiling", "lockstep")}
    kernel = {job: sorted(1e3 * b[job]["sys_s"] / STEPS for b in blocks) for job in faults}
    assert all(x >= 0 for v in list(faults.values()) + list(kernel.values()) for x in v)
    assert "page faults per step (rank 0, median over blocks): " + ", ".join(
        f"{job} {sum(faults[job]) / 2:.1f} ({sum(kernel[job]) / 2:.2f} ms in the kernel)" for job in faults) in p.stdout
    assert "each rank (median over blocks): rank 0 " in p.stdout and ", rank 1 " in p.stdout
    # the machine's idle CPU time in each window, and the windows themselves (monotonic clock, one after the
    # other in the order the blocks ran, each as long as its timed steps)
    idle = {job: sorted(1e3 * b[job]["idle_s"] / STEPS for b in blocks) for job in faults}
    assert all(x >= 0 for v in idle.values() for x in v)
    assert "idle CPU time per step, all CPUs together (median over blocks): " + ", ".join(
        f"{job} {sum(idle[job]) / 2:.2f} ms" for job in idle) in p.stdout
    windows = [b[job]["window_s"] for b in blocks for job in b["order"]]
    assert all(a < b <= c for (a, b), (c, _) in zip(windows, windows[1:] + [(float("inf"), 0)]))
    for b in blocks:
        for job in b["order"]:
            assert b[job]["window_s"][1] - b[job]["window_s"][0] == pytest.approx(b[job]["wall_s"])


def _barrier_worker(rank, size, late, deadline):
    import numpy as np

    import tf_commstrategy as tfcs
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import keras_throughput
    tfcs.init()
    barrier = keras_throughput.StepBarrier(tfcs, np, rank, size)
    barrier.DEADLINE_S = deadline
    tfcs.barrier()  # rank 0 has left the constructor too
    named = os.path.exists(barrier.path)  # the name is gone once every rank mapped the page
    waits = []
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                time.sleep(late)  # rank 1 comes late to the second barrier
                if late > deadline:
                    return waits, barrier.path, named
            t0 = time.perf_counter()
            barrier.wait()
            waits.append(time.perf_counter() - t0)
    finally:
        tfcs.barrier()
        barrier.close()
    return waits, barrier.path, named


@pytest.mark.timeout(120)
def test_the_lockstep_barrier_holds_every_rank_until_the_last_arrives():
    (w0, path, named0), (w1, path1, named1) = run_workers(_barrier_worker, 2, 0.6, 60.0, timeout=100)
    assert path == path1 and path.startswith("/dev/shm/tfcs-bench-lockstep-")
    assert not named0 and not named1 and not os.path.exists(path)  # no name left for a killed job to leak
    assert len(w0) == len(w1) == 3
    assert w0[1] >= 0.5  # rank 0 waited for the late rank 1
    assert w1[1] < 0.5  # rank 1, the last to arrive, passed at once


@pytest.mark.timeout(120)
def test_the_lockstep_barrier_gives_up_at_its_deadline():
    res = run_workers(_barrier_worker, 2, 3.0, 1.0, timeout=100, expect_failure=True)
    kind, err = res[0]
    assert kind == "error" and err[0] == "RuntimeError" and "not reached by every rank within 1 s" in err[1]
    assert res[1][0] == "ok"


@pytest.mark.timeout(300)
def test_paired_job_with_horovod_style_blocks(tmp_path):
    out = tmp_path / "paired_hvd.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFCS_")}
    base = [sys.executable, SCRIPT, "--rounds", "1", "--steps", str(STEPS), "--modes", "paired"]
    p = subprocess.run(base + ["--paired-jobs", "tfcs,ceiling,hvd"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "add --keras 2" in p.stderr
    p = subprocess.run(base + ["--keras", "2", "--blocks", "3", "--paired-jobs", "tfcs,ceiling,hvd", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = json.loads(out.read_text())["rounds"][0]["paired"]
    blocks = job["blocks"]
    assert [b["order"] for b in blocks] == [["tfcs", "ceiling", "hvd"], ["ceiling", "hvd", "tfcs"],
                                            ["hvd", "tfcs", "ceiling"]]
    assert job["keras"].startswith("tf_keras 2.")
    for b in blocks:
        h, c = b["hvd"], b["ceiling"]
        assert h["steps"] == STEPS and h["comm_s"] > 0
        assert h["collectives"] == STEPS  # DistributedOptimizer: the step's gradients in one fused all-reduce
        assert h["samples_per_s"] == pytest.approx(2 * 64 * STEPS / h["wall_s"])
        assert c["collectives"] == 0
    for num, den in (("hvd", "ceiling"), ("hvd", "tfcs")):
        ratios = [b[num]["samples_per_s"] / b[den]["samples_per_s"] for b in blocks]
        assert f"{num} / {den}, all 3 rounds of blocks: median {sorted(ratios)[1]:.2f}" in p.stdout, (num, den)
    assert "collectives per hvd step 1.00" in p.stdout
