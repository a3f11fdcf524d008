#!/usr/bin/env bash
# The benchmarks of record and the GPU checks, on the device machine (H200), from the repo root:
#   bash benchmarks/device_run.sh STAGE...        (benchmarks/README.md says what each stage runs)
# Stages: build env tests memcheck racecheck check bench profile train iwae crossover multi jobs
# harness kbtiming honest deferred latent pingpong traintc iwaewgmma.
# Each stage's log lands in $LOGS; $OUT gets summary.txt (one line per run: rc and seconds) and
# results.tgz (every log and .jsonl), refreshed after every run so that a kill loses nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=" build env tests memcheck racecheck check bench profile train iwae crossover multi jobs harness kbtiming honest deferred latent pingpong traintc iwaewgmma "
for stage in "$@"; do  # refuse a typo before any stage spends device time
  [[ $STAGES == *" $stage "* ]] || { echo "device_run.sh: unknown stage '$stage' (stages:$STAGES)" >&2; exit 2; }
done
[ $# -gt 0 ] || { echo "usage: bash benchmarks/device_run.sh STAGE... (stages:$STAGES)" >&2; exit 2; }
# Rows are tagged with FASTELBO_COMMIT: the copy of the tree on a device machine may carry a .git
# of another commit (2026-12-05: rows read 52da252-dirty for a tree at c14135e), so git there
# is not asked.
[ -n "${FASTELBO_COMMIT:-}" ] || { echo "device_run.sh: set FASTELBO_COMMIT=\$(git rev-parse --short HEAD) where the tree was committed: git on the device may read another commit" >&2; exit 2; }
export FASTELBO_COMMIT

OUT=${OUT:-device_out}; LOGS=${LOGS:-/tmp/fastelbo_logs}; mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FASTELBO_REQUIRE_GPU=1  # a GPU test that would skip fails instead: a skip proves nothing
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried in (mlxtend): the device has no index
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
FE="python3 -m fastelbo.cli"
CHECK_BATCHES=1,7,128,1000,4096,65536 CHECK_TRIALS=${CHECK_TRIALS:-3} TRAIN_BATCHES=${TRAIN_BATCHES:-128}

run() {  # run NAME TIMEOUT CMD...: log to $LOGS/NAME.log (its first line `# CMD`, quoted), one
  # summary line, never abort the rest
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  echo "=== $name: $*"
  { printf '# '; printf '%q ' "$@"; echo; timeout "$limit" "$@"; } > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$LOGS/$name.log"
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
  cp "$LOGS/summary.txt" "$OUT/"; tar -czf "$OUT/results.tgz" -C "$LOGS" .
}

gpu_test_files() {  # every test file with a gpu-marked test, or $TESTS
  if [ -n "${TESTS:-}" ]; then echo "$TESTS"; else
    grep -rlE --include='test_*.py' 'mark\.gpu' tests | sort; fi
}

sanitize() {  # sanitize TOOL TIMEOUT
  run "$1" "$2" compute-sanitizer --tool "$1" --error-exitcode 9 python3 benchmarks/cuda_sanitize.py --quick
}

for stage in "$@"; do case $stage in
  build) run build "${T_BUILD:-300}" python3 -c "from fastelbo.backends.cuda import extension; extension()" ;;
  env) run env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton; print(torch.__version__,
        triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())"' ;;
  tests)  # one process per file: a device assert in one file cannot poison the others
    for f in $(gpu_test_files); do  # the exploit corpus's 13 GPU tests took 301+ s on an H100
      limit=${T_TEST:-300}; [[ $f == *test_harness_exploits.py ]] && limit=${T_EXPLOITS:-480}
      run "$(basename "$f" .py)" "$limit" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs "$f"
    done
    # every test that wants the device's toolkit and no GPU (the nvcc fixture, test_cuda_compile's
    # own, marked needs_nvcc by conftest.py: the kernels' sm_90 builds without spills, the
    # binding, the exported file, the tools, the noise against curand and Triton); HOST_TESTS=0
    # leaves them out when no CUDA source has changed. One file: the device lacks the dev extra
    # (mcp, jsonschema), which other test files import.
    [ "${HOST_TESTS:-1}" = 0 ] || run test_needs_nvcc "${T_NVCC:-420}" python3 -m pytest -q -p no:cacheprovider -rfEs \
      -m needs_nvcc tests/test_cuda_compile.py ;;
  memcheck) sanitize memcheck "${T_MEMCHECK:-120}" ;;
  racecheck) sanitize racecheck "${T_RACE:-300}" ;;
  check)  # the harness's verdict on fastelbo itself: every regime, odd dims, the exported file
    for c in auto cuda; do
      run "check_$c" 300 $FE check vae_elbo "fastelbo:$c" --device cuda --batch-sizes "$CHECK_BATCHES" --trials "$CHECK_TRIALS"
      run "check_odd_$c" 200 $FE check benchmarks/problems/vae_elbo_odd.py "fastelbo:$c" --device cuda --batch-sizes 1,7,1000
    done
    rm -f "$LOGS/solution.py"; run export 120 $FE export --kernelbench "$LOGS/solution.py"
    [ -s "$LOGS/solution.py" ] && run check_export 400 $FE check vae_elbo "$LOGS/solution.py" --device cuda ;;
  bench) run bench "${T_BENCH:-300}" $FE bench vae_elbo fastelbo:auto fastelbo:cuda fastelbo:triton --device cuda \
           --batch-sizes "${BENCH_BATCHES:-128,4096,65536}" --out "$LOGS/bench.jsonl" ;;
  profile) run profile 200 python3 benchmarks/kernel_profile.py --out "$LOGS/kernel_profile.jsonl" ;;
  train)  # speed of a training step at each of TRAIN_BATCHES, then 10 epochs against the
    # reference (3 seeds; TRAIN_EPOCHS=0 leaves them out)
    for b in ${TRAIN_BATCHES//,/ }; do
      run "train_$b" 150 python3 benchmarks/train_bench.py --skip-compile --batch "$b" --out "$LOGS/train.jsonl"
    done
    [ "${TRAIN_EPOCHS:-1}" = 0 ] ||
    run train_epochs 200 python3 benchmarks/train_bench.py --epochs 10 --out "$LOGS/train.jsonl" ;;
  iwae) run iwae "${T_IWAE:-200}" python3 benchmarks/iwae_bench.py --out "$LOGS/iwae.jsonl" ;;
  crossover) run crossover 300 python3 benchmarks/crossover.py  # rewrites backends/crossover.json
             cp src/fastelbo/backends/crossover.json "$LOGS/" ;;
  multi) run test_multi_gpu 300 python3 -m pytest -q -m multi_gpu -p no:cacheprovider -rfEs tests/test_dist.py
         run multi "${T_MULTI:-300}" env OUT="$LOGS/multi" bash benchmarks/multi_gpu.sh "${GPUS:-2}" ;;
  jobs) run jobs "${T_JOBS:-450}" python3 benchmarks/jobs.py --device cuda --out "$LOGS/jobs.jsonl" ;;
  harness) run harness "${T_HARNESS:-300}" python3 benchmarks/harness_timing.py --device cuda \
             --out "$LOGS/harness_timing.jsonl" ;;
  kbtiming)  # bench's cold column against KernelBench's own timing (its timing.py in $KB_TIMING),
    # over KB_RUNS bench runs of the exported solution, eager and a torch.compile candidate
    run kbtiming "${T_KB:-540}" python3 benchmarks/kernelbench_timing.py --kb "${KB_TIMING:-.kb/timing.py}" \
      --runs "${KB_RUNS:-3}" --out "$LOGS/kernelbench_timing.jsonl" ;;
  honest)  # every honest candidate under bench: no flag, exit 0 (vae_elbo at B = 1 to 65,536)
    run honest "${T_HONEST:-480}" python3 benchmarks/honest_bench.py --out "$LOGS/honest_bench.jsonl" \
      ${HONEST_SIZES:+--sizes "$HONEST_SIZES"} ;;
  deferred)  # issue #56 item 1's acceptance, one call (~6 min on an H100): the deferred value
    # check (FASTELBO_DEFERRED_CHECK=1): the build, its GPU tests, check of fastelbo:cuda with it
    # on, memcheck of its every path, and the exported file's per-call rows without and with it
    run deferred_build "${T_BUILD:-300}" python3 -c "from fastelbo.backends.cuda import extension; extension()"
    run test_cuda_deferred "${T_TEST:-300}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_deferred.py
    run check_deferred_cuda 300 env FASTELBO_DEFERRED_CHECK=1 $FE check vae_elbo fastelbo:cuda --device cuda --batch-sizes "$CHECK_BATCHES" --trials "$CHECK_TRIALS"
    run memcheck_deferred "${T_MEMCHECK:-180}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/deferred_check.py --sanitize
    run deferred_timing "${T_KB:-300}" python3 benchmarks/deferred_check.py --timing --out "$LOGS/deferred_check.jsonl" ;;
  latent)  # issue #56 item 2's acceptance, one call (~5 min): the latent block fused
    # (latent.cu, FASTELBO_FUSED_LATENT=1): the build, its GPU tests, check of fastelbo:cuda
    # with it on, memcheck of its paths, and its rows against the cuBLAS block
    run latent_build "${T_BUILD:-300}" python3 -c "from fastelbo.backends.cuda import extension; extension()"
    run test_cuda_latent "${T_TEST:-300}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_latent.py
    run check_latent_cuda 300 env FASTELBO_FUSED_LATENT=1 $FE check vae_elbo fastelbo:cuda --device cuda --batch-sizes "$CHECK_BATCHES" --trials "$CHECK_TRIALS"
    run check_latent_odd_cuda 200 env FASTELBO_FUSED_LATENT=1 $FE check benchmarks/problems/vae_elbo_odd.py fastelbo:cuda --device cuda --batch-sizes 1,7,1000
    run memcheck_latent "${T_MEMCHECK:-180}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/latent_block.py --sanitize
    run latent_timing 200 python3 benchmarks/latent_block.py --timing --out "$LOGS/latent_block.jsonl" ;;
  pingpong)  # issue #56 item 3's acceptance, one call (~5 min expected; the limits sum to 9):
    # the output layer as one persistent ping-pong kernel (pingpong.cu, FASTELBO_PINGPONG=1): the
    # build, its GPU tests, check of fastelbo:cuda with it on (the candidate builds the extension
    # in its own cache), memcheck of small and odd cases, and its rows against tc_gemm.cu's
    # output layer (graph replays at B = 4096 and 65536, the same process)
    run pingpong_build "${T_BUILD:-120}" python3 -c "from fastelbo.backends.cuda import extension; extension()"
    run test_cuda_pingpong "${T_TEST:-110}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_pingpong.py
    run check_pingpong_cuda 170 env FASTELBO_PINGPONG=1 $FE check vae_elbo fastelbo:cuda --device cuda --batch-sizes "$CHECK_BATCHES" --trials "$CHECK_TRIALS"
    run memcheck_pingpong "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/pingpong_block.py --sanitize
    run pingpong_timing 50 python3 benchmarks/pingpong_block.py --timing --out "$LOGS/pingpong_block.jsonl" ;;
  traintc)  # issue #56 item 4's acceptance, one call (<= 8 min; the limits sum to 8): the
    # backward's fused engine (backward_fused.cu, FASTELBO_TC_TRAIN=1): the build, its GPU tests
    # and the backward's, memcheck of cuda_sanitize.py --quick (its fused cases), then the
    # training step at B = 128, 1024, 4096 with the flag off and on (the same process each)
    run traintc_build "${T_BUILD:-120}" python3 -c "from fastelbo.backends.cuda import extension; extension()"
    run test_cuda_fused_backward "${T_TEST:-120}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_fused_backward.py
    run test_cuda_backward "${T_TEST:-60}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_backward.py
    run memcheck_traintc "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_sanitize.py --quick
    for b in 128 1024 4096; do
      run "traintc_$b" 30 python3 benchmarks/train_bench.py --skip-compile --tc-train --batch "$b" \
        --steps 100 --out "$LOGS/train.jsonl"
    done ;;
  iwaewgmma)  # issue #56 item 5's acceptance, one call (<= 8 min on an H100; the limits sum to 8):
    # the IWAE kernel on wgmma (iwae_wgmma.cu, FASTELBO_IWAE_WGMMA=1): the build, its GPU tests,
    # memcheck of small and odd cases, and 10,000 images x K = 5000 on iwae_wgmma.cu and iwae.cu
    # in the same process (the verdict: wgmma's against 0.25 s)
    run iwaewgmma_build "${T_BUILD:-120}" python3 -c "from fastelbo.backends.cuda import extension; extension()"
    run test_cuda_iwae_wgmma "${T_TEST:-150}" python3 -m pytest -q -m "gpu and not multi_gpu" -p no:cacheprovider -rfEs tests/test_cuda_iwae_wgmma.py
    run memcheck_iwae_wgmma "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/iwae_wgmma_check.py
    run iwae_wgmma_timing "${T_IWAE:-120}" python3 benchmarks/iwae_bench.py --backend cuda:wgmma,cuda:mma --target 0.25 --out "$LOGS/iwae.jsonl" ;;
esac; done
# The correctness record: a gpu_tests.jsonl row per test file, sanitizer run and check logged so
# far (benchmarks/gpu_rows.py), into $LOGS and so into results.tgz.
if [[ " $* " =~ \ (tests|memcheck|racecheck|check|multi|deferred|latent|pingpong|traintc|iwaewgmma)\  ]]; then
  python3 benchmarks/gpu_rows.py "$LOGS" || echo "gpu_rows.py failed: no gpu_tests.jsonl rows"
  tar -czf "$OUT/results.tgz" -C "$LOGS" .
fi
