"""Soak: 60 s of mixed collectives (checked against numpy) and model.fit epochs on 2 workers under tfcs-run,
with RSS and thread counts bounded after the warm-up (benchmarks/soak.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOAK = os.path.join(ROOT, "benchmarks", "soak.py")
DURATION = 60
NP = 2


@pytest.mark.slow
@pytest.mark.timeout(DURATION + 300)
def test_soak_60s_two_workers(tmp_path):
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFCS_")}
    p = subprocess.run([sys.executable, SOAK, "--duration", str(DURATION), "-np", str(NP),
                        "--report-dir", str(tmp_path / "reports"), "--json", str(summary_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=DURATION + 280)
    tail = (p.stdout[-4000:] + "\n" + p.stderr[-4000:])
    assert p.returncode == 0, tail
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and not summary["problems"], summary["problems"]
    assert sorted(summary["ranks"]) == [str(r) for r in range(NP)]
    ranks = [summary["ranks"][str(r)] for r in range(NP)]
    assert len({r["iterations"] for r in ranks}) == 1  # every rank ran the same collectives
    for rep in ranks:
        assert rep["errors"] == 0 and rep["mismatches"] == 0, rep
        assert rep["seconds"] >= DURATION * 0.95
        assert rep["iterations"] >= 50 and rep["fits"] >= 5, rep
        kinds = rep["collectives_by_kind"]
        for kind in ("allreduce", "grouped_allreduce", "broadcast", "allgather", "reduce_scatter", "barrier"):
            assert kinds.get(kind, 0) >= rep["iterations"], (kind, kinds)
        assert rep["checks"] > 5 * rep["iterations"]
        assert rep["rss_mb"]["growth_after_warmup"] <= 200, rep["rss_mb"]
        assert rep["threads_py"]["growth_after_warmup"] <= 4, rep["threads_py"]
        assert rep["threads_os"]["growth_after_warmup"] <= 4, rep["threads_os"]
        assert rep["rss_mb"]["first"] <= rep["rss_mb"]["after_warmup"] <= rep["rss_mb"]["max"]
