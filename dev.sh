#!/usr/bin/env bash
# Set-up and entry points on a fresh machine: ./dev.sh demo | ./dev.sh test [pytest args]
# Creates .venv on first use (CPU PyTorch unless one is already importable there).
set -euo pipefail
cd "$(dirname "$0")"
py=.venv/bin/python
if ! "$py" -c "import fastelbo, pytest, hypothesis, triton, mlxtend, safetensors, tqdm, ruff, mcp" 2>/dev/null; then
  python3 -m venv .venv
  "$py" -m pip install -q --upgrade pip
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "torch==2.13.0"
  "$py" -m pip install -q -e ".[triton,train,dev]"
fi
cmd=${1:-demo}; shift || true
case "$cmd" in
  demo) exec "$py" -m fastelbo.cli demo "$@" ;;
  test) "$py" -m ruff check src tests benchmarks
        exec "$py" -m pytest -q "$@" ;;
  *) echo "usage: ./dev.sh demo|test [args]" >&2; exit 2 ;;
esac
