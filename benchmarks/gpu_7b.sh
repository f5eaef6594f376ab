#!/usr/bin/env bash
# Issue 44: the seed's setting on an accelerator -- 7B-shaped models passing caches -- in one scripted run of about
# five minutes (a lent GPU's 15 minutes hold it and one rerun). Weights are made from the configs (random, seeded:
# benchmarks/configs/), so times, bytes and ratios are the real shapes'; replies are noise of fixed length.
#
# Prepare here, once, with no GPU: `make gpu-prep` copies the bundled tokenizer (no weights) into .device/tokenizer.
# On the device machine (the device tool's run, carry [".device"]):
#     bash benchmarks/gpu_7b.sh          # JSON and logs into benchmarks/results/gpu, and one gpu.tgz of them in $OUT
# Each step has its own time limit (590 s in all at worst: run it with timeout_s 600), and a failed step does not
# stop the others; the last line lists every step's exit status. Python: $PYTHON, else python3 (the device image's,
# with torch), kvwire from src/. That image lacks blake3 and redis: `make gpu-prep` also downloads their wheels into
# .device/wheels, and this script installs them into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
TOKENIZER=${TOKENIZER:-.device/tokenizer}
LLAMA=${LLAMA:-benchmarks/configs/llama-2-7b.json}
QWEN=${QWEN:-benchmarks/configs/qwen2.5-7b.json}
mkdir -p "$RESULTS"
if compgen -G ".device/wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/wheels/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status=()
step() {  # step NAME SECONDS COMMAND...: stdout (the JSON line) to NAME.json, stderr to NAME.log
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$RESULTS/$name.json" 2> "$RESULTS/$name.log"
    local rc=$?
    status+=("$name=$rc:$((SECONDS - start))s")
    echo "== $name: exit $rc in $((SECONDS - start)) s"; tail -n 12 "$RESULTS/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  date -u; } | tee "$RESULTS/device.txt"
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no tokenizer at $TOKENIZER: run make gpu-prep here first"; exit 2; }
M=(--model "$TOKENIZER" --device "${DEVICE:-cuda}")  # DEVICE=cpu LLAMA=QWEN=benchmarks/configs/tiny-llama.json: a dry run here
# 1. exactness in fp32 (7B in fp32: ~28 GB): text vs prefix, greedy, a short run
step exact-fp32 90 $PY benchmarks/pipeline.py --random-weights $LLAMA "${M[@]}" --dtype fp32 --only a \
    --repeats 1 --max-new-tokens 8 --stores memory:// --json
# 2. bf16: the document pipeline (5 agents, ~1,500 tokens), the support conversation (~3,000), and splice at
#    R = 0.15 with private prompts; 32 tokens an agent
step pipelines-bf16 180 $PY benchmarks/pipeline.py --random-weights $LLAMA "${M[@]}" --dtype bf16 --only b c d \
    --splice --repeats 3 --max-new-tokens 32 --stores memory:// --json
# 3. decode-heavy: 256 tokens an agent on the document pipeline
step decode256-bf16 100 $PY benchmarks/pipeline.py --random-weights $LLAMA "${M[@]}" --dtype bf16 --only b \
    --repeats 1 --max-new-tokens 256 --stores memory:// --json
# 4. fan-out of 4 and 8 rows over a 1,500-token context against one at a time
step fanout-bf16 80 $PY benchmarks/graph.py --random-weights $LLAMA "${M[@]}" --dtype bf16 --only decode --json
# 5. transfer rates and the seed's arithmetic (fp16, 2,048 tokens: 1.07 GB)
step transfer-fp16 60 $PY benchmarks/device_transfer.py --random-weights $LLAMA "${M[@]}" --dtype fp16 \
    --tokens 2048 --repeats 5 --json
# 6. grouped heads: Qwen2.5-7B, the document pipeline
step qwen-bf16 80 $PY benchmarks/pipeline.py --random-weights $QWEN "${M[@]}" --dtype bf16 --only b \
    --repeats 2 --max-new-tokens 32 --stores memory:// --json
echo "steps: ${status[*]}" | tee "$RESULTS/steps.txt"
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && tar czf "$OUT/gpu.tgz" -C "$RESULTS" .  # the device tool brings back at most 8 files
