#!/usr/bin/env bash
# Stages of h200_stages.sh side by side on a machine with several GPUs: one list of stages per GPU (stages of a
# list run one after the other, separated by ';'), each list on its own GPU, each stage with its own output folder.
#
#   bash test/gpu/h200_parallel.sh "kernels 300; serving 250" "sweep 300 --state-dtype bf16; bench 250"
#
# Afterwards $OUT holds what a single stage would return, once for all of them: logs.tgz (every stage's logs,
# named gpuI-J-STAGE/...), the tuned tables of the last sweep (gdn/h200.json, kda/h200.json) and the Triton cache
# that all stages shared (parts triton.tgz.part-NN, when under 60 MiB; the stages themselves skip saving it).
# Stages on different GPUs time independent devices; they share the host's CPU cores, which the benchmarks barely
# use (their steps replay CUDA graphs).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ]; then
    sed -n '2,/^set -uo/p' "$0" | grep '^#'
    exit 2
fi
GPUS=$(nvidia-smi -L | wc -l)
if [ $# -gt "$GPUS" ]; then
    echo "$# stage lists for $GPUS GPUs"
    exit 2
fi
OUT_DIR="${OUT:-/tmp/lightllm_gpu_out}"
# the wheels installed and the Triton cache seeded once, before the stages (concurrent installs would collide)
source test/gpu/python_env.sh || exit 1
WORK=/tmp/h200_parallel
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT_DIR"

run_list() {  # GPU index, "stage args; stage args; ..."
    local gpu=$1 j=0 stage
    IFS=';' read -ra stages <<<"$2"
    for stage in "${stages[@]}"; do
        read -ra words <<<"$stage"
        local dir="$WORK/gpu$gpu-$j-${words[0]}"
        mkdir -p "$dir"
        CUDA_VISIBLE_DEVICES=$gpu OUT="$dir" SKIP_CACHE_SAVE=1 bash test/gpu/h200_stages.sh "${words[@]}" 2>&1 |
            sed -u "s/^/[gpu$gpu ${words[0]}] /"
        j=$((j + 1))
    done
}

i=0
for list in "$@"; do
    run_list "$i" "$list" &
    i=$((i + 1))
done
wait

# one copy of what the stages returned: the last tables, the cache (shared by all stages), every log
for algo in gdn kda; do
    table=$(ls -t "$WORK"/*/"$algo"/h200.json 2>/dev/null | head -1)
    if [ -n "$table" ]; then
        mkdir -p "$OUT_DIR/$algo" && cp "$table" "$OUT_DIR/$algo/"
    fi
done
# the cache in up to four parts (what may come back beside the logs and tables)
find "$WORK" -name 'triton.tgz*' -delete
save_triton_cache "$OUT_DIR" 4
tar -czf "$OUT_DIR/logs.tgz" -C "$WORK" .
