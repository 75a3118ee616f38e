#!/usr/bin/env bash
# Prefill, start-up and HTTP serving of the serving checkpoint on one GPU, in one device command:
#
#   bash test/gpu/prefill_startup.sh [parts, default "tune startup prefill http"]
#
# Parts:
#   tune     fla-core's prefill kernel table for this GPU kind (lightllm.tools.tune_fla_configs --serving_model),
#            written into lightllm/linear_att/fla_tuned/ here and copied to $OUT
#   startup  time to ready with an empty Triton cache (fresh GPU) and again with the cache it left (warm)
#   profile  the offline engine's build under cProfile (test/gpu/startup_profile.py), warm cache; the decode-kernel
#            autotune cache of start-up (for the shipped tables) copied to $OUT
#   prefill  LLM.generate(max_tokens=1) against a transformers forward (test/benchmark/bench_prefill_vs_transformers.py)
#   http     a server on the serving checkpoint (a tokenizer over all its rows) driven by lightllm.tools.bench_serving: 512 requests, 1024 in / 256 out,
#            concurrency 256, replay
# Rows print as they finish; logs and JSON go to $OUT (or /tmp/lightllm_gpu_out).
set -uo pipefail
cd "$(dirname "$0")/../.."
source test/gpu/python_env.sh || exit 1
OUT_DIR="${OUT:-/tmp/lightllm_gpu_out}"
mkdir -p "$OUT_DIR"
parts=${1:-"tune startup prefill http"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stage() { echo "== $1 ($(date +%T))"; }
for part in $parts; do
    case $part in
        tune)
            stage tune
            timeout 240 python -m lightllm.tools.tune_fla_configs --serving_model > "$OUT_DIR/tune.log" 2>&1 \
                || { echo "tune failed:"; tail -20 "$OUT_DIR/tune.log"; }
            tail -3 "$OUT_DIR/tune.log"
            cp lightllm/linear_att/fla_tuned/*.json "$OUT_DIR/" 2>/dev/null
            ;;
        startup)
            stage "startup (empty Triton cache, then warm)"
            fresh=$(mktemp -d)
            TRITON_CACHE_DIR=$fresh timeout 200 python test/gpu/startup_check.py --starts 2 --modes replay \
                --big_max_running_requests 0 --log_dir "$OUT_DIR/startup" 2>&1 | grep -E "^\||ready|fail|Error"
            ;;
        profile)
            stage profile
            timeout 200 python test/gpu/startup_profile.py --out "$OUT_DIR/startup.prof" 2>&1 | grep -v Warning | cut -c1-220
            cp ~/.cache/lightllm/linear_att_tuned/*.json "$OUT_DIR/" 2>/dev/null
            ;;
        prefill)
            stage prefill
            timeout 300 python test/benchmark/bench_prefill_vs_transformers.py --modes replay,native \
                --result_file "$OUT_DIR/prefill.json" > "$OUT_DIR/prefill.log" 2>&1 \
                || { echo "prefill failed:"; tail -20 "$OUT_DIR/prefill.log"; }
            grep -E "^\|" "$OUT_DIR/prefill.log"
            ;;
        http)
            stage http
            model=$(python -c "from lightllm.tools.bench_throughput import serving_text_model_dir as d; print(d())")
            python -m lightllm.server.api_server --model_dir "$model" --ssm_state_mode replay --port 8011 \
                > "$OUT_DIR/http_server.log" 2>&1 &
            server=$!
            for _ in $(seq 240); do
                curl -sf http://127.0.0.1:8011/health > /dev/null && break
                sleep 1
            done
            timeout 240 python -m lightllm.tools.bench_serving --base_url http://127.0.0.1:8011 --num_prompts 512 \
                --input_len 1024 --output_len 256 --max_concurrency 256 --result_file "$OUT_DIR/http.json" \
                2>&1 | tail -25
            kill $server
            wait $server
            ;;
        *) echo "unknown part $part" ;;
    esac
done
stage done
