#!/usr/bin/env bash
# Everything GPU-specific, on one CUDA GPU, in about 8 minutes: first where a step's time goes
# (benchmarks/gpu_diagnose.py, 100 s: the attention kernel PyTorch and aiayn choose, ms per step on
# new and seen shapes, allocations per step, host enqueue against GPU busy time, decoding), then the
# CUDA-marked tests (sync-free steps, the kernel of each attention, the snapshots' pinned copies ...),
# bf16 training tokens/s and MFU through aiayn-train at model=base, model=big and base compiled, the
# residual chain eager vs compiled, and decoding speeds (ours, generate, CTranslate2 float16).
# The last line printed is one JSON object. Needs only the repository: it installs the project (and its
# dev extras) when it or transformers is missing; a torch with CUDA must be there or installable.
# CTranslate2 is optional here: without it (or without the CUDA libraries its build links), its test is
# skipped or failed and the decoding race runs without it, saying why.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import aiayn, transformers, pytest" 2>/dev/null; then
  python -m pip install -q -e ".[dev]"
fi
python benchmarks/gpu_diagnose.py --deadline 100 --skip-lightning
exec python benchmarks/gpu_bench.py "$@"
