"""benchmarks/keras_throughput.py's paired job: CommStrategy blocks and ceiling blocks (each process alone,
no communication) taking turns in the same two workers under tfcs-run."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "keras_throughput.py")
STEPS, BLOCKS = 5, 2


@pytest.mark.timeout(300)
def test_paired_job_alternates_strategy_and_ceiling_blocks(tmp_path):
    out = tmp_path / "paired.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFCS_")}
    p = subprocess.run([sys.executable, SCRIPT, "--rounds", "1", "--steps", str(STEPS), "--blocks", str(BLOCKS),
                        "--modes", "paired", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tfcs / ceiling per pair" in p.stdout
    job = json.loads(out.read_text())["rounds"][0]["paired"]
    blocks = job["blocks"]
    assert [b["order"] for b in blocks] == [["tfcs", "ceiling"], ["ceiling", "tfcs"]]
    for b in blocks:
        t, c = b["tfcs"], b["ceiling"]
        assert t["steps"] == c["steps"] == STEPS
        assert t["comm_s"] > 0  # the strategy's blocks all-reduce every step
        assert 0 <= t["wait_s"] <= t["comm_s"]  # waits for the other rank: part of the time in collectives
        assert c["comm_s"] == c["wait_s"] == 0  # the ceiling's blocks never enter a collective
        # each rank's waits, gathered: rank 0's entry is its own counter
        assert len(t["rank_wait_s"]) == 2 and t["rank_wait_s"][0] == pytest.approx(t["wait_s"])
        assert all(w >= 0 for w in t["rank_wait_s"])
        assert len(c["rank_wall_s"]) == 2 and c["rank_wall_s"][0] == pytest.approx(c["wall_s"])
        # global samples/s: the strategy trains 2 x 64 samples per step in lockstep; the ceiling is the
        # sum of two independent trainings of 64 samples per step
        assert t["samples_per_s"] == pytest.approx(2 * 64 * STEPS / t["wall_s"])
        assert c["samples_per_s"] == pytest.approx(sum(64 * STEPS / w for w in c["rank_wall_s"]))
    ratios = [b["tfcs"]["samples_per_s"] / b["ceiling"]["samples_per_s"] for b in blocks]
    assert "tfcs / ceiling per pair" in p.stdout and f"{ratios[0]:.2f}, {ratios[1]:.2f}" in p.stdout
    assert "of which waiting for the other ranks" in p.stdout
    assert "each rank (median over blocks): rank 0 " in p.stdout and ", rank 1 " in p.stdout
