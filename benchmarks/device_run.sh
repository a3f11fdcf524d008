#!/usr/bin/env bash
# Everything one GPU session needs, in one call on the device machine (H200), from the repo root:
#   bash benchmarks/device_run.sh STAGE...
# Stages: build env tests cuda-tests cuda-noise cuda-validation compile-host other-gpu triton-tests triton-iwae host-triton host-cuda profile-triton ncu-triton probe-saturated memcheck racecheck check check-cuda check-cuda-all export-test check-auto bench cuda-plans cuda-paths
#         trace tma-ingest mma-l4 repro profile threads512 pdl triton-ws triton-sweep cuda-iwae iwae iwae-variants iwae-sweep train train-epochs
#         multi crossover. Each stage's log lands in $LOGS; at the end everything is packed into
#         $OUT/results.tgz (the device tool brings back at most 8 files) beside summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}; LOGS=/tmp/fastelbo_logs; mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
FE="python3 -m fastelbo.cli"
run() {  # run NAME TIMEOUT CMD...: log to $LOGS/NAME.log, one summary line, never abort the rest
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  tail -n 15 "$LOGS/$name.log"
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
  cp "$LOGS/summary.txt" "$OUT/"; tar -czf "$OUT/results.tgz" -C "$LOGS" .  # survives a kill
}
pytest_gpu() { run "$1" "$2" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "${@:3}"; }

for stage in "$@"; do case $stage in
  build) run build "${T_BUILD:-300}" python3 -c "from fastelbo.backends.cuda import extension; extension()" ;;
  env) run env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton; print(torch.__version__,
        triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())"' ;;
  cuda-tests) pytest_gpu test_cuda_backend "${T_CUDA:-150}" tests/test_cuda_backend.py
              pytest_gpu test_cuda_backward "${T_CUDA_BWD:-90}" tests/test_cuda_backward.py ;;
  tests)  # one process per file: a device assert in one cannot poison the others
    pytest_gpu test_cuda_backend "${T_CUDA:-150}" tests/test_cuda_backend.py
    pytest_gpu test_cuda_backward "${T_CUDA_BWD:-90}" tests/test_cuda_backward.py
    pytest_gpu test_triton_gpu "${T_TRITON:-110}" tests/test_triton_gpu.py
    pytest_gpu test_triton_iwae "${T_IWAE:-90}" tests/test_triton_iwae.py
    pytest_gpu test_cuda_iwae "${T_CUDA_IWAE:-120}" tests/test_cuda_iwae.py
    pytest_gpu other_gpu "${T_OTHER:-150}" tests --ignore=tests/test_cuda_backend.py \
      --ignore=tests/test_cuda_backward.py --ignore=tests/test_cuda_iwae.py \
      --ignore=tests/test_triton_gpu.py --ignore=tests/test_triton_iwae.py ;;
  cuda-noise) pytest_gpu test_cuda_noise "${T_NOISE:-120}" tests/test_cuda_noise.py ;;
  cuda-validation) pytest_gpu test_cuda_validation 90 tests/test_cuda_validation.py ;;
  compile-host)  # the host-side CUDA tests that want a toolkit with curand (test_cuda_compile)
    run compile_host 180 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_compile.py \
      -k "known_answers or follow_curand or philox" ;;
  triton-tests) pytest_gpu test_triton_gpu "${T_TRITON:-110}" tests/test_triton_gpu.py ;;
  triton-iwae) pytest_gpu test_triton_iwae "${T_IWAE:-90}" tests/test_triton_iwae.py ;;
  other-gpu) pytest_gpu other_gpu "${T_OTHER:-150}" tests --ignore=tests/test_cuda_backend.py \
      --ignore=tests/test_cuda_backward.py --ignore=tests/test_cuda_iwae.py \
      --ignore=tests/test_triton_gpu.py --ignore=tests/test_triton_iwae.py ;;
  cuda-iwae) pytest_gpu test_cuda_iwae "${T_CUDA_IWAE:-120}" tests/test_cuda_iwae.py ;;
  memcheck) run memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_sanitize.py --quick ;;
  racecheck) run racecheck "${T_RACE:-300}" compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/cuda_sanitize.py --quick ;;
  check)
    for c in cuda triton auto; do
      run "check_$c" 300 $FE check vae_elbo "fastelbo:$c" --device cuda --batch-sizes 1,7,128,1000,65536 --trials 3
    done
    for c in cuda triton; do run "check_odd_$c" 300 $FE check benchmarks/problems/vae_elbo_odd.py "fastelbo:$c" --device cuda --batch-sizes 1,7,1000; done
    $FE export --kernelbench "$LOGS/solution.py" && run check_export 400 $FE check vae_elbo "$LOGS/solution.py" --device cuda ;;
  check-cuda-all)  # #3's acceptance: cuda in every regime, odd dims, the exported single file
    run check_cuda "${T_CHECK:-200}" $FE check vae_elbo fastelbo:cuda --device cuda --batch-sizes 1,7,128,1000,65536 --trials 3
    run check_odd_cuda 150 $FE check benchmarks/problems/vae_elbo_odd.py fastelbo:cuda --device cuda --batch-sizes 1,7,1000
    $FE export --kernelbench "$LOGS/solution.py" && run check_export "${T_EXPORT:-200}" $FE check vae_elbo "$LOGS/solution.py" --device cuda ;;
  check-cuda) run check_cuda "${T_CHECK:-200}" $FE check vae_elbo fastelbo:cuda --device cuda --batch-sizes 1,7,128,1000,65536 --trials 3 ;;
  export-test) pytest_gpu test_export "${T_EXPORT:-200}" tests/test_cuda_backend.py -k exported ;;
  check-auto) run check_auto "${T_CHECK:-100}" $FE check vae_elbo fastelbo:auto --device cuda --batch-sizes 1,7,128,1000,65536 --trials 2 ;;
  bench) run bench "${T_BENCH:-160}" $FE bench vae_elbo fastelbo:auto fastelbo:cuda fastelbo:triton --device cuda --batch-sizes "${BENCH_BATCHES:-128,4096,65536}" --out "$LOGS/bench.jsonl" ;;
  cuda-plans) run cuda_plans 240 python3 benchmarks/cuda_bench.py --plans ;;
  cuda-paths) run cuda_paths "${T_PATHS:-150}" python3 benchmarks/cuda_bench.py --paths
              cp benchmarks/results/cuda_bench.csv "$LOGS/" ;;
  trace)  # per-phase cycles of the cluster kernel (benchmarks/cuda_trace.cu), several plans
    nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda \
      -o /tmp/cuda_trace benchmarks/cuda_trace.cu > "$LOGS/trace_build.log" 2>&1
    run trace 120 bash -c 'for a in "cluster 128" "fast 128" "fast 64" "fast 16" "fast 140" \
      "fast 1000" "fast 128 0 8"; do /tmp/cuda_trace $a; echo; done' ;;
  mma-l4)  # the fast kernel's L4 on FP32 FMA vs tf32x3 mma.sync, cycles and error (benchmarks/mma_l4.cu)
    nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/mma_l4 benchmarks/mma_l4.cu \
      > "$LOGS/mma_l4_build.log" 2>&1
    run mma_l4 60 /tmp/mma_l4 ;;
  tma-ingest)  # how fast an SM's shared memory fills, by staging method (benchmarks/tma_ingest.cu)
    nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda \
      -o /tmp/tma_ingest benchmarks/tma_ingest.cu > "$LOGS/tma_ingest_build.log" 2>&1
    run tma_ingest 60 /tmp/tma_ingest ;;
  repro)  # does memcheck accept block-to-block bulk copies? (NOTES runs 24-25)
    nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o /tmp/repro benchmarks/dsmem_bulk_repro.cu \
      > "$LOGS/repro_build.log" 2>&1
    run repro 120 bash -c 'for m in 0 1 2 3 4 5 6; do /tmp/repro $m; compute-sanitizer --tool memcheck \
      --print-limit 2 /tmp/repro $m 2>&1 | grep -v "Host Frame"; done' ;;
  iwae-variants)  # A/B timing of iwae.cu's FE_IWAE_* switches (IWAE_VARIANTS: "A_B C", base = none)
    for v in ${IWAE_VARIANTS:-base}; do
      f=""; for w in ${v//+/ }; do [ "$w" != base ] && f="$f -DFE_IWAE_$w"; done
      nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda $f \
        -o "/tmp/iv_$v" benchmarks/iwae_variants.cu > "$LOGS/iv_build_$v.log" 2>&1 &
    done; wait
    run iwae_variants 200 bash -c 'for e in /tmp/iv_*; do echo "$e"; $e 1320 5000 "$e.bin"; done
      python3 -c "
import glob, numpy as np
base = np.fromfile(\"/tmp/iv_base.bin\", np.float32).astype(np.float64)
for f in sorted(glob.glob(\"/tmp/iv_*.bin\")):
    d = np.abs(np.fromfile(f, np.float32) - base)
    print(f, \"max |diff| vs base\", d.max(), \"mean\", d.mean())"'
    run rcp_check 60 bash -c "nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 \
      -I src/fastelbo/backends/cuda -o /tmp/rcp_check benchmarks/rcp_check.cu && /tmp/rcp_check"
    [ -n "${IWAE_NCU:-}" ] && run iwae_ncu 150 ncu --kernel-name regex:iwae_kernel --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section InstructionStats \
      "/tmp/iv_$IWAE_NCU" 264 5000
    for e in /tmp/iv_*; do [ -x "$e" ] || continue  # each variant's M = 128 kernel, for reading
      cuobjdump -sass "$e" | awk '/Function : .*iwae_kernelILi4/{f=1} /Function : .*iwae_kernelILi2/{f=0} f' \
        > "$LOGS/iv_sass_$(basename "$e").txt" 2>&1; done ;;
  profile) run profile "${T_PROFILE:-150}" python3 benchmarks/profile_kernels.py ;;
  ncu-triton)  # where the slab kernels' time goes: L2 / tensor / issue, one launch of each
    run ncu_triton 200 ncu --kernel-name regex:"_encode_kernel|_decode_bce_kernel" --launch-skip 2 \
      --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis python3 -c "
import torch; from fastelbo import ModelNew, VAEParams; from fastelbo.backends import triton as tb
m = ModelNew(784, 256, 32, backend='torch').cuda(); p = VAEParams(*(t.detach() for t in m.vae_params()))
x = torch.rand(65536, 784, device='cuda'); e = torch.randn(65536, 32, device='cuda')
for _ in range(2): tb.forward(x, p, e)
torch.cuda.synchronize()" ;;
  probe-saturated) run probe_saturated 60 python3 benchmarks/saturated_row_probe.py --binary \
                     --rows ${PROBE_ROWS:-} --save "$LOGS/saturated_781_x16_binary.pt" ;;
  profile-triton) run profile_triton 90 python3 benchmarks/profile_kernels.py --only triton_4096 \
                    triton_65536 ;;
  threads512)  # A/B of the cluster kernel at 512 threads per block, on a copy of the tree
    rm -rf /tmp/t512 && cp -r "$PWD" /tmp/t512 && sed -i \
      's/constexpr int kClusterThreads = 256;/constexpr int kClusterThreads = 512;/' \
      /tmp/t512/src/fastelbo/backends/cuda/elbo.cu
    run threads512_plans 200 env PYTHONPATH=/tmp/t512/src python3 /tmp/t512/benchmarks/cuda_bench.py --plans
    run threads512_tests 150 env PYTHONPATH=/tmp/t512/src python3 -m pytest -q -m gpu \
      -p no:cacheprovider -x /tmp/t512/tests/test_cuda_backend.py -k "every_launch_plan or cluster" ;;
  host-triton) run host_triton 120 python3 benchmarks/triton_host_profile.py ;;
  host-cuda) run host_cuda 120 python3 benchmarks/cuda_host_profile.py ;;
  pdl)  # programmatic dependent launch of the fast kernel, off and on (benchmarks/pdl_probe.py)
    run pdl_off 90 env FASTELBO_PDL=0 python3 benchmarks/pdl_probe.py
    run pdl_on 90 env FASTELBO_PDL=1 python3 benchmarks/pdl_probe.py ;;
  triton-ws) run triton_ws "${T_WS:-300}" python3 benchmarks/triton_ws_probe.py ;;
  triton-sweep) run triton_sweep 240 python3 benchmarks/triton_forward_sweep.py --batches 4096 65536 ;;
  iwae) run iwae "${T_IWAE_BENCH:-120}" python3 benchmarks/iwae_bench.py --out "$LOGS/iwae.jsonl" ;;
  iwae-sweep) run iwae_sweep 200 python3 benchmarks/iwae_bench.py --sweep --reps 2 --eager-images 5 --out "$LOGS/iwae_sweep.jsonl" ;;
  train) run train 100 python3 benchmarks/train_bench.py --skip-compile --out "$LOGS/train.jsonl" ;;
  train-epochs) run train_epochs 120 python3 benchmarks/train_bench.py --epochs 10 --out "$LOGS/train.jsonl" ;;
  multi) run multi "${T_MULTI:-240}" env OUT="$LOGS/multi" bash benchmarks/multi_gpu.sh 2 ;;
  crossover) run crossover 300 python3 benchmarks/crossover.py
             cp src/fastelbo/backends/crossover.json "$LOGS/" 2>/dev/null ;;
  *) echo "unknown stage $stage" ;;
esac; done
cp "$LOGS/summary.txt" "$OUT/" 2>/dev/null
tar -czf "$OUT/results.tgz" -C "$LOGS" .
