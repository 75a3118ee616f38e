#!/usr/bin/env bash
# Serving speed on one GPU, side by side in one run: the offline engine (lightllm.tools.bench_throughput) on the
# real-width random checkpoint (SERVING_BENCH_SIZES: Qwen3.5 layout, hidden 2048, 8 layers, bf16, fp32 state),
# 256-token prompts, 128 new tokens, greedy.
#
#   bash test/gpu/serving_speed.sh [seconds per mode, default 170] [parts, default "overlap sync mtp2"]
#
# Parts: overlap (graphs + overlap scheduling; compact needs drafts), sync (the same without overlap), eager (no graphs, no
# overlap), mtp2 (MTP 2, every mode), accept (MTP 3 at simulated acceptance 0 / 0.5 / 0.7 / 0.9, every mode:
# bench_throughput --simulate_acceptance; accept0.7 runs one acceptance, three modes: one 10-minute slot). Rows print as they finish; each part's JSON goes to $OUT (or
# /tmp/lightllm_gpu_out).
set -uo pipefail
cd "$(dirname "$0")/../.."
source test/gpu/python_env.sh || exit 1
OUT_DIR="${OUT:-/tmp/lightllm_gpu_out}"
mkdir -p "$OUT_DIR"
limit=${1:-170}
parts=${2:-"overlap sync mtp2"}
bench="python -m lightllm.tools.bench_throughput --serving_model --input_len 256 --output_len 128"
run() {
    local name=$1
    shift
    echo "== $name: $*"
    timeout "$limit" $bench --result_file "$OUT_DIR/$name.json" "$@" > "$OUT_DIR/$name.log" 2>&1 &
    local pid=$!
    tail -f --pid=$pid "$OUT_DIR/$name.log" | grep --line-buffered -E "^\||^  kernel"
    wait $pid || { echo "== $name failed (exit $?):"; tail -15 "$OUT_DIR/$name.log"; }
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# one process per mode: each sizes its KV cache from the device memory it finds free
for part in $parts; do
    case $part in
        overlap) for m in native replay; do run overlap-$m --modes $m --batch_sizes 1,64,256 --top_kernels 12; done ;;
        sync) for m in native replay; do run sync-$m --modes $m --batch_sizes 64,256 --disable_overlap_schedule; done ;;
        eager) for m in native replay; do
                   run eager-$m --modes $m --batch_sizes 1,64,256 --disable_cudagraph --disable_overlap_schedule
               done ;;
        mtp2) for m in native compact replay; do run mtp2-$m --modes $m --batch_sizes 1,64,256 --mtp_step 2; done ;;
        accept*) probs=${part#accept}
                 for p in ${probs:-0 0.5 0.7 0.9}; do for m in native compact replay; do
                     run accept$p-$m --modes $m --batch_sizes 1,64,256 --mtp_step 3 --simulate_acceptance $p
                 done; done ;;
        *) echo "unknown part $part" ;;
    esac
done
