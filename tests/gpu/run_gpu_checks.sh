#!/usr/bin/env bash
# The GPU check, in one unattended call on a GPU host with no network: it installs nothing.
#
#   bash tests/gpu/run_gpu_checks.sh            # from the repository root (or anywhere)
#
# Needs python3 with cupy (any CUDA build), NCCL, numpy, grpcio, ml_dtypes, pytest and pytest-timeout;
# no TensorFlow. Runs tests/gpu (the nccl backend on cupy arrays), then prints a short table last:
# every op x dtype against numpy with fresh random inputs, and the all-reduce algbw at 4 MiB, 64 MiB
# and 1 GiB. Bounded: about 2-4 minutes, at most 8 (each step has a timeout). Writes its logs and
# JSON to $OUT (default /tmp). Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
start=$(date +%s)
echo "== host"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
timeout 60 "$PY" - <<'PY'
import sys
import numpy
try:
    import cupy
    from cupy.cuda import nccl
    print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__,
          "NCCL", nccl.get_version(), "GPUs", cupy.cuda.runtime.getDeviceCount())
except Exception as e:  # noqa: BLE001 - a report, not a check
    print("cupy / NCCL not usable:", e)
PY
echo "== tests/gpu"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --timeout 280 2>&1 | tee "$OUT/gpu_pytest.log"
tests=${PIPESTATUS[0]}
echo "== report"
timeout 240 "$PY" tests/gpu/gpu_report.py --json "$OUT/gpu_report.json" 2>&1 | tee "$OUT/gpu_report.log"
report=${PIPESTATUS[0]}
echo "pytest exit $tests, report exit $report, $(( $(date +%s) - start )) s"
[ "$tests" = 0 ] && [ "$report" = 0 ]
