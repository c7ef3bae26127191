#!/usr/bin/env bash
# Trains the learned artifacts of a target on one CUDA GPU, all from one shard of target-written
# conversations: the data (`train data`, transformers' batched generate), then the dLLM delta,
# deer, EAGLE-3 and Hydra side by side (each its own process: they are launch-bound, so they
# share the GPU well). This is how the shipped SmolLM2 artifacts were trained (SOURCES.md).
#
#   scripts/gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]
#
# Environment: DATA_MINUTES (default 1.2) and DATA_BATCH (384) shape the data; PACK (default 1)
# is eagle's and hydra's `--pack` (conversations a training step: 16-32 should fill a GPU that one
# conversation a step leaves launch-bound; not yet measured on one); SPECDECODE (default
# `specdecode`) runs the CLI. Each trainer's log is OUT_DIR/train.log's section; its artifact
# OUT_DIR/NAME.
set -u
model=${1:?usage: gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]}
out=${2:?usage: gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]}
minutes=${3:-4}
spec=${SPECDECODE:-specdecode}
work=$(mktemp -d)
shard=$work/shard.jsonl
mkdir -p "$out"
stamp() { echo "[$(date +%T)] $*"; }

stamp "data for ${DATA_MINUTES:-1.2} min"
$spec train data --model "$model" --runner auto --count 50000 --batch "${DATA_BATCH:-384}" \
    --prompt-tokens 64 --answer-tokens 160 --max-minutes "${DATA_MINUTES:-1.2}" \
    --out "$shard" 2>&1 | tail -3
stamp "$(wc -l < "$shard") conversations"

eagle_init=src/specdecode/data/adapters/smollm2-eagle-heads.safetensors
common=(--model "$model" --no-progress)
$spec train dllm "${common[@]}" --data "$shard" --rank "${DLLM_RANK:-8}" --batch 48 \
    --minutes "$minutes" --checkpoint-every 200 --workdir "$work/dllm" \
    --out "$out/smollm2-dllm-delta.safetensors" > "$work/dllm.log" 2>&1 &
$spec train heads --kind deer "${common[@]}" --shard "$shard" --anchors 192 \
    --max-minutes "$minutes" --workdir "$work/deer" \
    --out "$out/smollm2-deer-heads.safetensors" > "$work/deer.log" 2>&1 &
$spec train heads --kind eagle "${common[@]}" --shard "$shard" --init "$eagle_init" \
    --pack "${PACK:-1}" --max-minutes "$minutes" --workdir "$work/eagle" \
    --out "$out/smollm2-eagle-heads.safetensors" > "$work/eagle.log" 2>&1 &
$spec train heads --kind hydra "${common[@]}" --shard "$shard" --pack "${PACK:-1}" \
    --max-minutes "$minutes" --workdir "$work/hydra" \
    --out "$out/smollm2-hydra-heads.safetensors" > "$work/hydra.log" 2>&1 &
stamp "four trainers for $minutes min"
wait
stamp "trained"
for name in dllm deer eagle hydra; do
    echo "== $name"; tail -c 3000 "$work/$name.log"
done | tee "$out/train.log"
gzip -c "$shard" > "$out/shard.jsonl.gz"
ls -la "$out"
