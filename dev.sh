#!/usr/bin/env bash
# Set-up and entry points on a fresh machine: ./dev.sh demo | ./dev.sh test [pytest args]
# Creates .venv on first use (VENV=DIR PYTHON=INTERPRETER: another, made with that interpreter,
# as .ci/run's Python 3.12 leg does). PyTorch 2.13.0 (unless the venv has a torch already): the
# CPU build from PyTorch's CPU index where `nvidia-smi -L` lists no GPU, the default build (with CUDA)
# otherwise. Each step says what it does on stderr (pip draws its bars on a terminal).
set -euo pipefail
cd "$(dirname "$0")"
venv=${VENV:-.venv}
py=$venv/bin/python
TORCH=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
say() { echo "dev.sh: $*" >&2; }
if ! "$py" -c "import fastelbo, pytest, xdist, hypothesis, triton, mlxtend, safetensors, tqdm, ruff, mcp, dask, distributed" \
    2>/dev/null; then
  if [ ! -x "$py" ]; then
    say "creating $venv with $("${PYTHON:-python3}" --version) ..."
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  say "upgrading pip in $venv ..."
  "$py" -m pip install -q --upgrade pip
  gpus=$(nvidia-smi -L 2>/dev/null || true)
  if "$py" -c "import torch" 2>/dev/null; then
    say "keeping torch $("$py" -c 'import torch; print(torch.__version__)') (already in $venv)"
  elif [[ $gpus == *GPU* ]]; then
    say "installing torch $TORCH (default build, with CUDA: nvidia-smi lists a GPU; a few GB," \
        "minutes) ..."
    "$py" -m pip install "torch==$TORCH"
  else
    # An extra index, not the only one: pip's own configured sources still count (a local
    # wheel where there is one). From the CPU index pip prefers $TORCH+cpu: a local version
    # label sorts after the plain release. One retry: an index out of reach costs seconds.
    say "installing torch $TORCH (CPU build, from $CPU_INDEX: no NVIDIA GPU here; a minute" \
        "or two) ..."
    "$py" -m pip install --retries 1 --extra-index-url "$CPU_INDEX" "torch==$TORCH"
  fi
  say "installing fastelbo (editable) with its extras triton, train, dev (a minute or two) ..."
  "$py" -m pip install -e ".[triton,train,dev]"
  say "set-up done: $("$py" -c 'import torch
print(f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda
      else "CPU build"))')"
fi
cmd=${1:-demo}; shift || true
case "$cmd" in
  demo) exec "$py" -m fastelbo.cli demo "$@" ;;
  test) say "ruff ..."
        "$py" -m ruff check src tests benchmarks
        # pytest-xdist: a worker per core (at most 4), each test file on one worker (its
        # module fixtures run once), files in collection order, those with a slow test first
        # (conftest.py); still a line per file: which one is running. `-n 0` after `test` runs
        # them in this process instead.
        exec "$py" -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder \
          "$@" ;;
  *) echo "usage: ./dev.sh demo|test [args]" >&2; exit 2 ;;
esac
