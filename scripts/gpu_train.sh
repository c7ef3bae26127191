#!/usr/bin/env bash
# Trains the learned artifacts of a target on one CUDA GPU, all from one shard of target-written
# conversations: the data (`train data`, transformers' batched generate), then the dLLM delta,
# deer, EAGLE-3 and Hydra side by side (each its own process: they are launch-bound, so they
# share the GPU well). This is how the shipped SmolLM2 artifacts were trained (SOURCES.md).
#
#   scripts/gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]
#
# Environment:
#   SHARD          an existing `train data` shard to train on (e.g. one the CPU wrote while the
#                  GPU was away); unset: DATA_MINUTES (default 1.2) and DATA_BATCH (384) of
#                  `train data --runner hf` write one
#   TRAINERS       which run (default "dllm deer eagle hydra"; also "deer2": deer of 2 layers)
#   PACK           eagle's and hydra's `--pack` (default 1): conversations a training step
#   DEER_PACK      deer's `--pack` (default PACK): its attention spans the whole pack, so its
#                  memory grows with the pack's square
#   ANCHORS        deer's `--anchors` (default 192)
#   NAME           the artifacts' name prefix (default: MODEL's file name without .gguf, so
#                  `smollm2` for the default model and `qwen2.5-coder-1.5b` for that one)
#   INIT           kinds that start from the shipped artifact NAME-KIND-heads of their kind,
#                  where one ships (default "eagle")
#   SPECDECODE     the CLI (default `specdecode`)
# Each trainer's log is OUT_DIR/train.log's section; its artifact OUT_DIR/NAME.
set -u
model=${1:?usage: gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]}
out=${2:?usage: gpu_train.sh MODEL.gguf OUT_DIR [TRAIN_MINUTES]}
minutes=${3:-4}
spec=${SPECDECODE:-specdecode}
prefix=${NAME:-$(basename "$model" .gguf)}
trainers=${TRAINERS:-dllm deer eagle hydra}
work=$(mktemp -d)
mkdir -p "$out"
stamp() { echo "[$(date +%T)] $*"; }

if [ -n "${SHARD:-}" ]; then
    shard=$SHARD
else
    shard=$work/shard.jsonl
    stamp "data for ${DATA_MINUTES:-1.2} min"
    $spec train data --model "$model" --runner auto --count 50000 --batch "${DATA_BATCH:-384}" \
        --prompt-tokens 64 --answer-tokens 160 --max-minutes "${DATA_MINUTES:-1.2}" \
        --out "$shard" 2>&1 | tail -3
fi
stamp "$(wc -l < "$shard") conversations"

adapters=src/specdecode/data/adapters
init() {  # the shipped artifact of kind $1 where INIT names it and one ships for NAME
    local shipped=${ADAPTERS:-$adapters}/$prefix-$1-heads.safetensors
    case " ${INIT:-eagle} " in
        *" $1 "*) [ ! -f "$shipped" ] || echo --init "$shipped" ;;
    esac
}
common=(--model "$model" --no-progress)
# trainers started together each see the whole GPU free: a third of it shared between them
# for their feature caches (a quarter each, the default, took 142.5 of an H200's 143.8 GB)
free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -1)
cache=()
[ -z "$free_mib" ] || cache=(--feature-cache $(( free_mib / 1024 / (3 * $(echo $trainers | wc -w)) )))
heads() {  # NAME KIND [FLAGS...]: one heads trainer in the background
    local name=$1 kind=$2
    shift 2
    $spec train heads --kind "$kind" "${common[@]}" --shard "$shard" --max-minutes "$minutes" \
        --workdir "$work/$name" --out "$out/$prefix-$name-heads.safetensors" \
        "${cache[@]}" "$@" \
        > "$work/$name.log" 2>&1 &
}
for name in $trainers; do
    case $name in
        dllm) $spec train dllm "${common[@]}" --data "$shard" --rank "${DLLM_RANK:-8}" \
                  --batch 48 --minutes "$minutes" --checkpoint-every 200 \
                  --workdir "$work/dllm" --out "$out/$prefix-dllm-delta.safetensors" \
                  > "$work/dllm.log" 2>&1 & ;;
        deer) heads deer deer --anchors "${ANCHORS:-192}" --pack "${DEER_PACK:-${PACK:-1}}" \
                  $(init deer) ;;
        deer2) heads deer2 deer --layers 2 --anchors "${ANCHORS:-192}" \
                   --pack "${DEER_PACK:-${PACK:-1}}" ;;
        eagle|hydra) heads "$name" "$name" --pack "${PACK:-1}" $(init "$name") ;;
        *) echo "unknown trainer $name" >&2; exit 2 ;;
    esac
done
stamp "$trainers for $minutes min"
wait
stamp "trained"
for name in $trainers; do
    echo "== $name"; tail -c 3000 "$work/$name.log"
done | tee "$out/train.log"
[ -n "${SHARD:-}" ] || gzip -c "$shard" > "$out/shard.jsonl.gz"
ls -la "$out"
