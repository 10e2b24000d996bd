"""The GPU check's last words: one table from what run_gpu_checks.sh left in its output folder.

    python3 tests/gpu/gpu_summary.py DIR

Reads ``gpu_pytest.log`` / ``gpu_report.json`` (one rank per GPU) and, where the host has one GPU,
``gpu_pytest_2hosts.log`` / ``gpu_report_2hosts.json`` (two ranks posing as two NCCL hosts), and
prints the correctness of each and the one-rank-per-GPU all-reduce algbw at every timed size (4 MiB,
64 MiB and 1 GiB among them). A step that left nothing is reported as missing. Host only: no cupy.
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tf_commstrategy.bench.cli import human  # noqa: E402


def _pytest_line(path):
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    except OSError:
        return "missing"
    return re.sub(r" in [\d.]+s.*$", "", lines[-1].strip("= ")) if lines else "no result"


def _report(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summary(folder):
    """The summary's lines.

    Args:
      folder: the script's output folder ($OUT).

    Returns:
      The lines to print, the all-reduce table last.
    """
    configs = [("one rank per GPU", "gpu_pytest.log", "gpu_report.json")]
    if os.path.exists(os.path.join(folder, "gpu_report_2hosts.json")) or \
            os.path.exists(os.path.join(folder, "gpu_pytest_2hosts.log")):
        configs.append(("2 ranks on one GPU as 2 NCCL hosts", "gpu_pytest_2hosts.log", "gpu_report_2hosts.json"))
    reports = [_report(os.path.join(folder, rep)) for _, _, rep in configs]
    first = next((r for r in reports if r), None)
    out = ["", "== summary"]
    if first:
        out.append(f"{first['device']}, cupy {first['cupy']}, NCCL {first['nccl']}")
    out += ["", "| check | " + " | ".join(name for name, _, _ in configs) + " |",
            "|---|" + "---|" * len(configs)]
    cells = {"tests/gpu": [], "every op x dtype vs numpy": [], "data movement, refusals": [],
             "TensorFlow imported": []}
    for (_, log, _), rep in zip(configs, reports):
        cells["tests/gpu"].append(_pytest_line(os.path.join(folder, log)))
        if rep is None:
            for key in list(cells)[1:]:
                cells[key].append("missing")
            continue
        cells["every op x dtype vs numpy"].append(
            f"{rep['passed']}/{rep['cases']} {'PASS' if rep['passed'] == rep['cases'] else 'FAIL'}")
        cells["data movement, refusals"].append(rep["movement"])
        cells["TensorFlow imported"].append("yes (FAIL)" if rep["tf_loaded"] else "no")
    for key, row in cells.items():
        out.append(f"| {key} | " + " | ".join(row) + " |")
    rep = reports[0]
    out += ["", f"| all-reduce float32, {configs[0][0]} ({rep['world'] if rep else '?'} rank(s)) | time (median) | "
                "algbw GB/s | torch time | tfcs / torch |", "|---|---|---|---|---|"]
    if rep is None:
        out.append("| missing | | | | |")
        return out
    for key, row in sorted(rep["allreduce"].items(), key=lambda kv: int(kv[0])):
        tp = row.get("torch_time_s")
        vs = f"{tp * 1e3:.3f} ms | {row['time_s'] / tp:.2f}" if tp else "n/a | n/a"
        out.append(f"| {human(int(key))} | {row['time_s'] * 1e3:.3f} ms | {row['algbw_GBps']:.1f} | {vs} |")
    return out


if __name__ == "__main__":
    print("\n".join(summary(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp"))))
