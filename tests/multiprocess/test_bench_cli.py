"""tfcs-bench end to end in a fresh process: table, JSON and bus-bandwidth convention."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, cross_memory_max_ranks
from tf_commstrategy.bench.cli import bus_factor
from tf_commstrategy.bench.workers import iterations

pytestmark = pytest.mark.bench


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert bus_factor("allreduce", 2) == 1.0
    assert bus_factor("allreduce", 4) == 1.5
    assert bus_factor("allgather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0


def _bench(tmp_path, *extra, env=None):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "tf_commstrategy.bench.cli", "-np", "2", "--sizes", "8,64K",
                        "--budget", "0.05", "--json", str(out), *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=280, env=None if env is None else dict(os.environ, **env))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "allgather"])
def test_bench_tfcs_only(tmp_path, op):
    stdout, data = _bench(tmp_path, "--op", op)
    rows = data["results"]["tfcs"]
    assert set(rows) == {"8", "65536"}
    for nbytes, row in rows.items():
        assert row["median_s"] > 0 and row["iters"] >= 5
        assert row["algbw_GBps"] == pytest.approx(int(nbytes) / row["median_s"] / 1e9)
    assert "| 64 KiB |" in stdout
    assert "calls back to back" in stdout and data["gap_ms"] == 0.0


def test_bench_gap_between_calls(tmp_path):
    stdout, data = _bench(tmp_path, "--gap-ms", "40")
    assert data["gap_ms"] == 40.0
    assert "calls 40 ms apart (ranks busy in between)" in stdout
    rows = data["results"]["tfcs"]
    assert set(rows) == {"8", "65536"}
    # the workers got the gap: their loop is sized for it (that only the calls are timed is
    # tests/unit/test_bench_timing.py's, on a fake clock)
    for nbytes, row in rows.items():
        assert row["iters"] == iterations(int(nbytes), 0.05, 0.04) < iterations(int(nbytes), 0.05)


def test_bench_rejects_a_negative_gap(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tf_commstrategy.bench.cli", "--gap-ms", "-1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--gap-ms must be 0 or more, got -1.0" in r.stderr


@pytest.mark.slow
def test_bench_compares_with_tf_ring(tmp_path):
    stdout, data = _bench(tmp_path, "--compare", "tf-ring")
    assert set(data["results"]) == {"tfcs", "tf-ring"}
    assert "tfcs/tf-ring" in stdout


def test_bench_interleaved_with_tf_ring_in_the_same_processes(tmp_path):
    """--interleave: tfcs and TF's RING all-reduce in the same two processes, taking turns in rounds; each
    peer row carries one ratio per round and the table their median and range."""
    stdout, data = _bench(tmp_path, "--compare", "tf-ring", "--interleave", "--rounds", "3")
    assert data["interleaved_rounds"] == 3 and set(data["results"]) == {"tfcs", "tf-ring"}
    for nbytes, row in data["results"]["tf-ring"].items():
        ratios = row["round_ratios"]
        assert len(ratios) == 3 and all(r > 0 for r in ratios)
        assert row["ratio"] == sorted(ratios)[1]
        assert data["results"]["tfcs"][nbytes]["iters"] == row["iters"] >= 9  # 3 rounds of at least 3 calls
    assert "the peers in the same processes, 3 rounds in turn" in stdout
    assert "| size | tfcs time | algbw GB/s | busbw GB/s | tf-ring time | tfcs/tf-ring | tfcs/tf-ring per round |" \
        in stdout


def test_bench_interleaved_with_gloo(tmp_path):
    pytest.importorskip("torch")
    stdout, data = _bench(tmp_path, "--compare", "gloo", "--interleave", "--rounds", "2", "--transport", "tcp")
    assert set(data["results"]) == {"tfcs", "gloo"}
    assert all(len(row["round_ratios"]) == 2 for row in data["results"]["gloo"].values())
    assert "transport tcp" in stdout


def test_bench_shared_buffers_reduce_through_the_peers_arrays(tmp_path):
    stdout, data = _bench(tmp_path, "--buffers", "shared", "--transport", "shm", "--sizes", "8,1M")
    info = data["tfcs_info"]
    # the 1 MiB calls (warm-up, check and timed ones) read the peers' shared arrays; 8 B took the small path
    assert info["buffers"] == "shared" and info["direct_allreduces"] >= data["results"]["tfcs"]["1048576"]["iters"]
    assert "transport shm" in stdout and "shared buffers" in stdout
    stdout, data = _bench(tmp_path, "--transport", "shm", "--sizes", "1M")
    assert data["tfcs_info"]["buffers"] == "private" and "private buffers" in stdout


@pytest.mark.skipif(cross_memory_max_ranks() < 2, reason="process_vm_readv between sibling processes refused here")
def test_bench_private_arrays_of_4_mib_read_the_peers_memory_unless_turned_off(tmp_path):
    stdout, data = _bench(tmp_path, "--transport", "shm", "--sizes", "8,4M")
    info = data["tfcs_info"]
    # the 4 MiB calls (warm-up, check and timed ones) read the peers' arrays; 8 B took the small path
    assert info["cross_memory_bytes"] == 4 << 20, info
    assert info["cma_allreduces"] >= data["results"]["tfcs"][str(4 << 20)]["iters"], info
    assert "private buffers, cross-memory reads from 4 MiB" in stdout
    stdout, data = _bench(tmp_path, "--transport", "shm", "--sizes", "4M", env={"TFCS_SHM_CMA": "0"})
    assert data["tfcs_info"]["cma_allreduces"] == 0 and data["tfcs_info"]["cross_memory_bytes"] == 0
    assert "cross-memory" not in stdout


def test_bench_nccl_runs_without_tensorflow_on_the_fake_gpu(tmp_path):
    """`tfcs-bench --backend nccl` as a GPU host without TensorFlow runs it: every worker gets the fake
    GPU of tests/fakegpu (through sitecustomize) and an import of tensorflow fails."""
    site = tmp_path / "site"
    (site / "tensorflow").mkdir(parents=True)
    (site / "tensorflow" / "__init__.py").write_text("raise ImportError('no TensorFlow on this GPU host')\n")
    (site / "sitecustomize.py").write_text("from tests import fakegpu\nfakegpu.install()\n")
    import os
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "tf_commstrategy.bench.cli", "-np", "2", "--backend", "nccl",
                        "--sizes", "4K,256K", "--budget", "0.05", "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "backend nccl, transport nccl" in r.stdout and "| 256 KiB |" in r.stdout, r.stdout
    rows = json.loads(out.read_text())["results"]["tfcs"]
    assert set(rows) == {"4096", "262144"} and all(row["median_s"] > 0 for row in rows.values())
