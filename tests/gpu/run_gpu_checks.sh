#!/usr/bin/env bash
# The GPU check, in one unattended call on a GPU host with no network: it installs nothing.
#
#   bash tests/gpu/run_gpu_checks.sh            # from the repository root (or anywhere)
#
# Needs python3 with cupy (any CUDA build), NCCL, numpy, grpcio, ml_dtypes, pytest and pytest-timeout;
# no TensorFlow (PyTorch, where installed, is the timing peer). Steps, each with a timeout:
#   1. tests/gpu with one rank per GPU (one rank on a one-GPU host);
#   2. the report: every op x dtype against numpy with fresh random inputs, the data movement, and
#      all-reduce times at 4 KiB .. 1 GiB beside torch.distributed's on the same ranks; a table last;
#   3. on a one-GPU host, tests/gpu and the report again with 2 ranks on that GPU, each its own NCCL
#      host (TFCS_GPU_EMULATE_HOSTS=2: NCCL joins them over its socket transport, as on two machines);
#      only there do the mismatch and missing-rank checks run (they need 2 ranks);
#   4. tfcs-bench --backend nccl (the project's benchmark tool, TF-free on this path), its table;
#   5. one summary table of all of it (tests/gpu/gpu_summary.py), the exit codes on the line after.
# About 100 s on one H200 (measured); each step has a timeout, about 14 minutes in all at worst.
# Writes logs and JSON to $OUT (default /tmp). Exit 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
start=$(date +%s)
nccl_ok() { timeout 120 "$PY" -c 'import sys; from tf_commstrategy.backends.nccl import availability as a; r = a(); print(r or "nccl: usable"); sys.exit(r is not None)'; }
echo "== host"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
if ! nccl_ok; then  # cupy may not find the NCCL of the nvidia-nccl wheel by itself
    lib=$("$PY" -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null)
    [ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && echo "retry with $lib" && nccl_ok
fi
timeout 120 "$PY" - <<'PY'
import sys
import numpy
try:
    import cupy
    from cupy.cuda import nccl
    print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__,
          "NCCL", nccl.get_version(), "GPUs", cupy.cuda.runtime.getDeviceCount())
except Exception as e:  # noqa: BLE001 - a report, not a check
    print("cupy / NCCL not usable:", e)
try:
    import torch
    print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version(), "cuda", torch.cuda.is_available())
except Exception as e:  # noqa: BLE001
    print("torch not usable:", e)
PY
gpus=$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)
echo "== tests/gpu, one rank per GPU ($gpus GPU(s))"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --timeout 140 2>&1 | tee "$OUT/gpu_pytest.log"
tests=${PIPESTATUS[0]}
echo "== report, one rank per GPU"
timeout 180 "$PY" tests/gpu/gpu_report.py --json "$OUT/gpu_report.json" 2>&1 | tee "$OUT/gpu_report.log"
report=${PIPESTATUS[0]}
report2=0
tests2=0
if [ "$gpus" = 1 ]; then
    # the same checks with 2 ranks on the one GPU, each its own NCCL host; the two ranks' kernels
    # take turns on the GPU and the data goes through sockets, so only small sizes are timed
    echo "== tests/gpu, 2 ranks on the one GPU, each its own NCCL host"
    TFCS_GPU_EMULATE_HOSTS=2 timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --timeout 140 2>&1 \
        | tee "$OUT/gpu_pytest_2hosts.log"
    tests2=${PIPESTATUS[0]}
    echo "== report, 2 ranks on the one GPU, each its own NCCL host"
    TFCS_GPU_EMULATE_HOSTS=2 timeout 200 "$PY" tests/gpu/gpu_report.py --sizes 4096,1048576,16777216 \
        --json "$OUT/gpu_report_2hosts.json" 2>&1 | tee "$OUT/gpu_report_2hosts.log"
    report2=${PIPESTATUS[0]}
fi
echo "== tfcs-bench --backend nccl, one rank per GPU"
timeout 120 "$PY" -m tf_commstrategy.bench.cli -np "$(( gpus > 0 ? gpus : 1 ))" --backend nccl --sizes 4K,4M,64M \
    --budget 1 --json "$OUT/bench_nccl.json" 2>&1 | tail -8
bench=${PIPESTATUS[0]}
timeout 60 "$PY" tests/gpu/gpu_summary.py "$OUT"
echo
echo "pytest exit $tests (2 hosts: $tests2), report exit $report (2 hosts: $report2), tfcs-bench exit $bench," \
     "$(( $(date +%s) - start )) s"
[ "$tests" = 0 ] && [ "$tests2" = 0 ] && [ "$report" = 0 ] && [ "$report2" = 0 ] && [ "$bench" = 0 ]
