#!/usr/bin/env bash
# Everything one GPU session needs, in one call on the device machine (H200):
#   bash benchmarks/device_run.sh STAGE...   stages: env build gpu-tests sanitize check bench crossover train
# Logs and results go under $OUT (or ./device_out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
fe() { python3 -m fastelbo.cli "$@"; }
status=0
run() { local name=$1; shift; local t0=$SECONDS
  echo "=== $name: $*"; "$@" 2>&1 | tee "$OUT/$name.log"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"; [ "$rc" = 0 ] || status=1; }

for stage in "$@"; do case $stage in
  env) run env bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
        python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())";
        git rev-parse --short HEAD 2>/dev/null || true' ;;
  build) run build python3 -c "from fastelbo.backends import cuda; import torch; print(cuda.unavailable_reason(torch.device('cuda')))" ;;
  gpu-tests) run gpu_tests python3 -m pytest -q -m gpu -x --timeout=500 -p no:cacheprovider tests ;;
  sanitize) run memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_sanitize.py
            run racecheck compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/cuda_sanitize.py ;;
  check) for c in fastelbo:cuda fastelbo:triton fastelbo:auto; do
           run "check_${c#fastelbo:}" fe check vae_elbo "$c" --device cuda --batch-sizes 1,7,128,1000,65536 --trials 3
         done
         fe export --kernelbench "$OUT/solution.py" && run check_export fe check vae_elbo "$OUT/solution.py" --device cuda ;;
  bench) run bench fe bench vae_elbo --device cuda --batch-sizes 128,4096,65536 --out "$OUT/bench.jsonl" ;;
  crossover) run crossover python3 benchmarks/triton_crossover.py ;;
  *) echo "unknown stage $stage"; status=1 ;;
esac; done
exit $status
