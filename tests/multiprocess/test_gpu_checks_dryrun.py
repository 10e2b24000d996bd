"""The GPU checks (tests/gpu, gpu_report.py) run on the fake GPU of tests/fakegpu, so that the script a
GPU host runs unattended is itself tested here: a broken check is found before a GPU is lent."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, TFCS_GPU_DRYRUN="1", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


@pytest.mark.timeout(300)
def test_gpu_tests_pass_on_the_fake_gpu():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0 and "3 passed, 1 skipped" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.timeout(300)
def test_gpu_report_prints_its_table_on_the_fake_gpu(tmp_path):
    r = subprocess.run([sys.executable, "tests/gpu/gpu_report.py", "--sizes", str(1 << 20), "--json",
                        str(tmp_path / "r.json")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert "| 168/168 PASS |" in r.stdout  # 44 op x dtype pairs x 2 shapes x 2 ranks
    assert lines[-1].startswith("| 1 MiB |")  # the table comes last
    import json
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] == rep["cases"] == 168 and rep["movement"] == "PASS" and not rep["tf_loaded"]


def test_the_summary_reads_the_reports_of_a_real_gpu_run_and_names_what_is_missing(tmp_path):
    from tests.gpu.gpu_summary import summary
    lines = summary(os.path.join(ROOT, "benchmarks", "results", "h200"))  # the H200 run, as it came back
    text = "\n".join(lines)
    assert "| every op x dtype vs numpy | 84/84 PASS | 168/168 PASS |" in text
    assert "| tests/gpu | 3 passed, 1 skipped | 3 passed, 1 skipped |" in text
    assert [ln.split(" |")[0] for ln in lines[-4:]] == ["| 4 KiB", "| 4 MiB", "| 64 MiB", "| 1 GiB"]
    assert summary(str(tmp_path))[-1] == "| missing | | | | |"
    assert "| tests/gpu | missing |" in "\n".join(summary(str(tmp_path)))
