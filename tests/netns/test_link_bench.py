"""``benchmarks/link_allreduce.py`` end to end: two namespace hosts on a shaped link, one job per
configuration, the report and its JSON (the figures themselves belong to docs/benchmarks.md)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_the_link_benchmark_runs_every_configuration_across_hosts(tmp_path):
    out = tmp_path / "link.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFCS_")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "link_allreduce.py"), "--rate", "1gbit",
                        "--configs", "default,fp16", "--sizes", "4K,1M", "--budget", "0.3", "--rounds", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["rate"] == "1gbit" and list(got["configs"]) == ["default", "fp16"]
    # between hosts the default path is raw TCP; compression keeps it
    assert [c["transport"] for c in got["configs"].values()] == ["tcp", "tcp"]
    for name, c in got["configs"].items():
        assert sorted(c["rows"], key=int) == [str(4 << 10), str(1 << 20)], (name, c["rows"])
        for row in c["rows"].values():
            assert row["tfcs_s"] > 0 and row["tfcs_busbw_of_link"] > 0, (name, row)
            if "gloo" in got["impls"]:
                assert row["gloo_s"] > 0 and row["ratio"] > 0, (name, row)
    assert "| 1 MiB |" in p.stdout and "fp16: transport tcp" in p.stdout, p.stdout
