#!/usr/bin/env bash
# Measurements of the open serving targets on one GPU, one bounded part after another, in one device command:
#
#   bash test/gpu/open_targets.sh [parts, default "structured host_tier dp_multiturn"]
#
# Parts (each prints its table as it finishes; full logs and JSON go to $OUT/logs.tar, or /tmp/lightllm_gpu_out, and
# the Triton cache to $OUT/triton.tgz.part-*):
#   structured    free vs JSON-schema-constrained decode at batch 64, one engine (bench_structured_output.py), and
#                 constrained at Python's GIL switch interval against the engine's; then the schema's strings unbounded
#   grammar_gpu   the constrained step's deferred masks on CUDA: the device wait's memcheck, the grammar and host-sync
#                 GPU tests (overlap == sync through graphs, no host sync)
#   grammar_masks the host side of those masks without a model: llguidance's pool per thread count, the engine's
#                 mask step on CUDA and the torch work around it (bench_grammar_masks.py)
#   host_tier     two replicas on one GPU sharing the host tier: TTFT of a request forced to the other replica
#                 against a same-replica device hit and a cold prefill; host-tier copy bandwidth (host_tier_ttft.py)
#   dp_multiturn  --dp 2 on one GPU, 64 conversations x 4 turns, cache_aware vs round_robin (dp_multiturn_bench.py)
#   spec          the serving checkpoint's decode step in replay, plain and MTP 2 (every draft rejected)
#   checks        compute-sanitizer memcheck of the fused MoE, FP8 and conv decode kernels; the GPU tests of the
#                 host tier's writer and of overlapped MTP steps in graphs
#   glue_tests    the GPU tests of the decode step's fused glue kernels (q/k norm + RoPE, output gate, SwiGLU, GDN's
#                 in_proj split), of the MoE routers against torch, and of the fused MoE
#   spec_graph    overlapped MTP steps as one graph each: graph == synchronous tokens (test_spec_overlap_gpu.py), then
#                 replay and native decode at 1 / 64 / 256 plain, MTP 3 at simulated acceptance 0.7 and MTP 2 with
#                 every draft rejected, one command
#   spec_kernels  the kernels of a replay MTP 3 step at simulated acceptance 0.7 and 256 rows (what its GPU time is)
#   spec_host     what an overlapped MTP 3 step at simulated acceptance 0.7 spends on the host at batch 1 and 64:
#                 host operators (launches, copies) and the callers of its eager torch calls (profile_engine_host.py)
#   prefill_host  the 64 x 1024 prefill, GPU kernels and the host's Python functions (bench_prefill_vs_transformers.py)
#   prefill       prefill against a transformers forward at the four shapes of the prefill target
#   prefill_syncs where the host waits for the GPU during prefill-heavy steps (prefill_syncs.py)
#   attn_sweep    launch shapes of the paged-attention kernel on a long prefill chunk (bench_paged_attention.py --sweep)
#   http          the serving checkpoint (with a tokenizer over all its rows) over HTTP, 512 requests 1024 in / 256
#                 out at concurrency 256, replay, four client processes: the server's defaults, then without the host
#                 tier (--host_tier_gb 0), then with four HTTP processes (--http_workers 4)
#   http_workers  the same, at the defaults and with four HTTP processes only
#   http_mixed    the same at the defaults (a step decoding for streaming requests takes at most a quarter of the
#                 budget in prompt tokens), with the cap off (--max_mixed_prefill_tokens 8192) and at 1024
#   closed_loop   the same workload on the engine alone (test/gpu/closed_loop.py)
#   mixed_profile the engine alone, profiled over ten steps that prefill beside decode rows: with two 1024-token
#                 prompts a step (--max_mixed_prefill_tokens 2048, steady state) and with eight (the default, the
#                 first wave): what a mixed step spends its ~30 ms beyond its tokens on (GPU kernels, host operators)
#   http_spy      the http parts' workload at the defaults with py-spy on the server's processes for 7 s (250 Hz;
#                 py-spy carried as a wheel in .whl): each process's and thread's busy share and where it goes
#   http_spy_idle the same with the threads' waits sampled too (py-spy --idle): where each thread waits
#   imports       the start-up's imports, each timed in a fresh interpreter (torch, CUDA, Triton's driver, fla's
#                 prefill modules, the API server's and the engine's trees; test/gpu/import_times.py)
#   moe_full      Qwen3.5-35B-A3B at full size (random weights): replay and native decode at 1 / 64 / 256, with the
#                 kernels of a replay step at 256
#   moe_full_variants  the same model's decode at 256, replay and native, with the recurrent state stored in bf16
#                 (--linear_att_ssm_data_type bfloat16, vLLM's default: half the replay kernel's reads), then with the
#                 experts quantized to FP8 at load (fp32 state); the kernels of each replay step
#   kimi_full     Kimi-Linear-48B-A3B at full size (random weights, bf16: ~96 GB, an H200): replay and native decode at
#                 1 / 64 / 256
#   kimi_ctx      the same model: replay decode of 64 requests at 8k and 32k context with its kernels (the MLA latent
#                 kernel against its read floor)
#   kimi_fp8, kimi_ctx_fp8  the two above with the weights quantized to FP8 at load (~47 GiB; fits an H100 at
#                 --mem_fraction 0.92, 32k contexts at 16 requests)
#   kimi_mixed_fp8 Kimi-Linear-48B-A3B in FP8, 64 requests of 8k tokens on the engine alone (closed_loop.py): five of
#                 the steps that prefill a 2048-token chunk beside the decoding rows profiled (GPU kernels, host
#                 operators): what such a step spends its ~150 ms on
#   moe_mixed     Qwen3.5-35B-A3B in FP8 on the engine alone (closed_loop.py, 256 requests of 1024 tokens out 128 at
#                 concurrency 128): mixed steps with prefill graphs (each prompt chunk a whole-model replay of its own,
#                 beside the decode graph: every replay reads the experts again) against eager packed steps
#                 (--prefill_graph_max_tokens 0: one forward a step)
#   kimi_mixed_base  kimi_mixed_fp8 for the tree in /tmp/base (another revision), after this tree's
#   q3n_fp8       Qwen3-Next-80B-A3B at full size quantized to FP8 at load: the server's memory plan and 64 requests
#                 over HTTP (q3n_serve alone), then replay and native decode at 1 / 64 / 256
#   structured_q35 free vs constrained decode at batch 64 on Qwen3.5-35B-A3B at full size (random weights) with a
#                 generated vocabulary of the released size (248k): the structured target on a served model's step
#   structured_q35_fp8  the same with the weights quantized to FP8 at load (fits an H100)
#   moe_prefill   one layer's fused MoE at prefill token counts (1024 / 4096 / 16384) at the three served expert shapes:
#                 the configuration used (the heuristic above the tuned buckets) against the tuned table's largest
#                 bucket's (bench_fused_moe.py --largest_tuned), TFLOP/s
#   mla_tiles     the MLA latent kernel's launch tiles at Kimi-Linear's TP1 shape (decode, 64 rows at 8k and 32k),
#                 the 64-row padded tiles (warpgroup MMA) beside the 32-row ones (kernel_speed.py --parts mla; the
#                 table comes back in the logs, not written into the package)
#   conv          the causal conv's decode / verify kernel against its bytes floor (bench_conv_decode.py) at 64 / 256
#                 rows and windows 1-4, then the same for the tree in /tmp/base when there is one (another revision,
#                 e.g. `git archive HEAD~1 lightllm | tar -x -C /tmp/base`), then its memcheck cases
#   fla_tune_kimi fla's autotuned KDA prefill kernels tuned at Kimi-Linear-48B-A3B's shapes and merged into this GPU
#                 kind's pinning table (tune_fla_configs.py; the table comes back beside the logs: commit it when the
#                 GPU is the kind it names), so a fresh Kimi start no longer autotunes them for minutes
#   moe_prefill_trees  the fused MoE (bf16, bench_fused_moe.py) and FP8 against bf16 experts (bench_fp8_moe.py) at
#                 prefill token counts, this tree then the one in /tmp/base (another revision), in one command
#   moe_prefill_tune  the fused MoE tuned at prefill token counts (1024 / 4096 / 16384) over tall blocks and wide
#                 tiles (tune_fused_moe.py --grid prefill) for Qwen3.5-35B-A3B and Kimi-Linear-48B-A3B; the entries
#                 come back as moe_prefill_tuned.json beside the logs (not merged into the package's tables)
#   fp8_moe       the fused MoE step with FP8 against bf16 experts (bench_fp8_moe.py)
#   warm_start    three starts of the server on the serving checkpoint with this machine's Triton cache (the first,
#                 compiling what the cache lacks, left out of the summary): time to ready and the start-up's phases
#   compile_ahead the serving checkpoint's start-up compiles (replay and native, 64 requests) recorded into this GPU
#                 kind's compile list (returned beside the logs: commit it), then a fresh start (empty Triton cache)
#                 without the list and one with it
#   record_presets the compile list's groups of Qwen3.5-35B-A3B, Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B (FP8),
#                 recorded from 4-layer random-weight copies (the list comes back beside the logs)
#   tune_cap8     the replay kernels' table at the default replay capacity (8), fp32 state, 256 rows: plain decode at
#                 the shipped shapes, the MTP 2 / 3 windows at the serving checkpoint's; the entries a fresh start
#                 would otherwise tune, timed as the shipped ones were (sweep_linear_att.py) and merged into copies
#                 of the shipped tables that come back beside the logs
set -uo pipefail
cd "$(dirname "$0")/../.."
source test/gpu/python_env.sh || exit 1
# logs and JSON results go to LOG_DIR, packed after every part into $OUT/logs.tar (a device command brings back at most
# eight files); what must come back as it is (tuned tables) is copied to OUT_DIR
OUT_DIR="${OUT:-/tmp/lightllm_gpu_out}"
LOG_DIR=/tmp/lightllm_gpu_logs
rm -rf "$LOG_DIR"; mkdir -p "$OUT_DIR" "$LOG_DIR"
pack() { tar -cf "$OUT_DIR/logs.tar" -C "$LOG_DIR" .; }
# the Triton cache comes back too (carry it as .cache/gpu/triton.tgz.part-* to skip the next machine's compiles)
trap 'save_triton_cache "$OUT_DIR" 4' EXIT
parts=${1:-"structured host_tier dp_multiturn"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T)): $*"
    timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
    local rc=$?
    # tables and summary lines, without progress bars
    grep -v -E "it/s\]|s/it\]|shape/s|kernel/s|req/s\]|^\s*$|Warning|warn\(" "$LOG_DIR/$name.log" | grep -E "^\||tok/s|ratio|TTFT|ITL gaps|skipped|GB/s|hit" | tail -40
    [ "$rc" = 0 ] || { echo "== $name: exit $rc"; tail -12 "$LOG_DIR/$name.log"; }
    pack
}
# the serving checkpoint over HTTP with the server flags $1 (the http parts' workload)
http_run() {
    local flags=$1 model server
    model=$(python -c "from lightllm.tools.bench_throughput import serving_text_model_dir as d; print(d())")
    python -m lightllm.server.api_server --model_dir "$model" --ssm_state_mode replay --port 8011 $flags \
        > "$LOG_DIR/http_server${flags// /_}.log" 2>&1 &
    server=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
    grep -E "start-up of rank|ready" "$LOG_DIR/http_server${flags// /_}.log" | cut -c1-300 | tail -2
    run "http${flags// /_}" 120 python -m lightllm.tools.bench_serving --base_url http://127.0.0.1:8011 \
        --num_prompts 512 --input_len 1024 --output_len 256 --max_concurrency 256 --num_workers 4 \
        --result_file "$LOG_DIR/http${flags// /_}.json"
    kill $server; wait $server
}
# the http parts' workload at the defaults with py-spy on the server's processes for 7 s; $1: "--idle" to sample
# the threads' waits too
http_spy() {
    local idle=$1 model server bench
    model=$(python -c "from lightllm.tools.bench_throughput import serving_text_model_dir as d; print(d())")
    python -m lightllm.server.api_server --model_dir "$model" --ssm_state_mode replay --port 8011 \
        > "$LOG_DIR/http_spy_server.log" 2>&1 &
    server=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
    grep -E "start-up of rank" "$LOG_DIR/http_spy_server.log" | cut -c1-300
    python -m lightllm.tools.bench_serving --base_url http://127.0.0.1:8011 --num_prompts 512 \
        --input_len 1024 --output_len 256 --max_concurrency 256 --num_workers 4 \
        --result_file "$LOG_DIR/http_spy.json" > "$LOG_DIR/http_spy.log" 2>&1 &
    bench=$!
    sleep 1.5
    /tmp/site/bin/py-spy record -r 250 -d 7 --subprocesses --threads --nonblocking $idle -f raw \
        -o "$LOG_DIR/http_spy.txt" -p $server > "$LOG_DIR/http_spy_record.log" 2>&1
    wait $bench
    grep -E "throughput|TTFT|TPOT|ITL" "$LOG_DIR/http_spy.log" | cut -c1-160
    kill $server; wait $server
    python test/gpu/spy_summary.py "$LOG_DIR/http_spy.txt" --rate 250 --seconds 7 $idle
    pack
}
for part in $parts; do
    case $part in
        structured) run structured 280 python test/benchmark/bench_structured_output.py --batch 64 --synthetic_vocab 31000 \
                        --phases --compare_switch_interval 0.005
                    run structured_unbounded 200 python test/benchmark/bench_structured_output.py --batch 64 \
                        --synthetic_vocab 31000 --schema records_unbounded --phases ;;
        grammar_gpu) run grammar_memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
                         --error-exitcode 1 python test/gpu/memcheck_kernels.py --cases host_flag,token_bitmask
                     tail -5 "$LOG_DIR/grammar_memcheck.log"
                     run grammar_tests 300 python -m pytest -q test/gpu/test_grammar_gpu.py test/gpu/test_host_syncs_gpu.py
                     tail -3 "$LOG_DIR/grammar_tests.log" ;;
        grammar_masks) run grammar_masks 300 python test/benchmark/bench_grammar_masks.py --device cuda \
                           --threads 1,2,4,8,12
                       tail -40 "$LOG_DIR/grammar_masks.log" ;;
        host_tier) run host_tier 200 python test/gpu/host_tier_ttft.py --parts ttft,bandwidth --modes replay \
                       --result_file "$LOG_DIR/host_tier.json" ;;
        dp_multiturn) run dp_multiturn 200 python test/gpu/dp_multiturn_bench.py --result_file "$LOG_DIR/dp_multiturn.json" ;;
        spec) for mtp in 0 2; do
                  run "spec-mtp$mtp" 120 python -m lightllm.tools.bench_throughput --serving_model --input_len 256 \
                      --output_len 128 --modes replay --batch_sizes 1,64,256 --mtp_step $mtp \
                      --result_file "$LOG_DIR/spec-mtp$mtp.json"
              done ;;
        checks) run memcheck 400 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
                    --error-exitcode 1 python test/gpu/memcheck_kernels.py --cases fused_moe,fp8,conv_decode
                tail -5 "$LOG_DIR/memcheck.log"
                run gpu_tests 300 python -m pytest -q test/gpu/test_section_writer_gpu.py test/gpu/test_spec_overlap_gpu.py
                tail -3 "$LOG_DIR/gpu_tests.log" ;;
        glue_tests) run glue_tests 240 python -m pytest -q test/gpu/test_attention_io_gpu.py test/gpu/test_glue_kernels_gpu.py \
                        test/gpu/test_moe_routing_gpu.py \
                        test/gpu/test_fused_moe_gpu.py
                    tail -3 "$LOG_DIR/glue_tests.log" ;;
        spec_graph) run spec_graph_test 300 python -m pytest -q -x test/gpu/test_spec_overlap_gpu.py
                    for flags in "--mtp_step 0" "--mtp_step 3 --simulate_acceptance 0.7" \
                                 "--mtp_step 2 --simulate_acceptance 0"; do
                        run "spec_graph${flags// /_}" 200 python -m lightllm.tools.bench_throughput --serving_model \
                            --input_len 256 --output_len 128 --modes replay,native --batch_sizes 1,64,256 $flags
                    done ;;
        spec_kernels) run spec_kernels 150 python -m lightllm.tools.bench_throughput --serving_model --input_len 256 \
                          --output_len 128 --modes replay --batch_sizes 256 --mtp_step 3 --simulate_acceptance 0.7 \
                          --top_kernels 24
                      grep -E "kernel " "$LOG_DIR/spec_kernels.log" | head -24 ;;
        spec_host) for b in 1 64; do
                       run "spec_host-b$b" 120 python test/benchmark/profile_engine_host.py --serving_model --device cuda \
                           --mode replay --batch $b --mtp_step 3 --simulate_acceptance 0.7 --top_ops 18 --by_caller 20
                   done ;;
        prefill_host) run prefill_host 120 python test/benchmark/bench_prefill_vs_transformers.py --modes replay \
                          --shapes 64x1024 --top_kernels 20 ;;
        prefill) run prefill 300 python test/benchmark/bench_prefill_vs_transformers.py --modes replay \
                     --shapes 64x1024,16x4096,256x256,4x16384 ;;
        prefill_syncs) run prefill_syncs 150 python test/gpu/prefill_syncs.py
                       tail -22 "$LOG_DIR/prefill_syncs.log" ;;
        attn_sweep) run attn_sweep 200 python test/benchmark/bench_paged_attention.py --sweep ;;
        http) for flags in "" "--host_tier_gb 0" "--http_workers 4"; do http_run "$flags"; done ;;
        http_workers) for flags in "" "--http_workers 4"; do http_run "$flags"; done ;;
        http_mixed) for flags in "" "--max_mixed_prefill_tokens 8192" "--max_mixed_prefill_tokens 1024"; do
                        http_run "$flags"
                    done ;;
        closed_loop) run closed_loop 150 python test/gpu/closed_loop.py
                     grep -E "^\|" "$LOG_DIR/closed_loop.log" | tail -14 ;;
        mixed_profile) for v in "cap2048 --max_mixed_prefill_tokens 2048 --profile 280,10" "default --profile 5,10"; do
                           run "mixed_profile_${v%% *}" 150 python test/gpu/closed_loop.py ${v#* }
                           grep -E "requests in|TTFT|profiled" "$LOG_DIR/mixed_profile_${v%% *}.log" | cut -c1-300
                           grep -A10 "top by" "$LOG_DIR/mixed_profile_${v%% *}.log" | cut -c1-130
                       done ;;
        http_spy|http_spy_idle) http_spy "$([ "$part" = http_spy_idle ] && echo --idle)" ;;
        imports) run imports 200 python test/gpu/import_times.py --log_dir "$LOG_DIR/imports"
                 grep -E "^\|" "$LOG_DIR/imports.log" ;;
        moe_full) python -m lightllm.tools.dummy_model_dir --preset qwen3.5-35b-a3b --out /tmp/q35 > /dev/null
                  # one model load: every cell's kernels are logged, the replay step's at 256 printed
                  run moe_full 420 python -m lightllm.tools.bench_throughput --model_dir /tmp/q35 --load_format dummy \
                      --modes replay,native --batch_sizes 1,64,256 --input_len 128 --output_len 48 --top_kernels 28
                  awk '/ kernel /{buf = buf $0 "\n"} /^\| (replay|native) /{if ($0 ~ /^\| replay .*\| 256 \|/) printf "%s", buf; buf = ""}' \
                      "$LOG_DIR/moe_full.log" ;;
        moe_full_variants) python -m lightllm.tools.dummy_model_dir --preset qwen3.5-35b-a3b --out /tmp/q35 > /dev/null
                  for variant in "--linear_att_ssm_data_type bfloat16" "--quantization fp8"; do
                      name="moe_full_${variant##* }"
                      run "$name" 270 python -m lightllm.tools.bench_throughput --model_dir /tmp/q35 --load_format dummy \
                          $variant --modes replay,native --batch_sizes 256 --input_len 128 --output_len 48 --top_kernels 16
                      grep -E " kernel " "$LOG_DIR/$name.log" | head -16
                  done ;;
        kimi_full|kimi_fp8|kimi_ctx|kimi_ctx_fp8)
                   python -m lightllm.tools.dummy_model_dir --preset kimi-linear-48b-a3b --out /tmp/kimi > /dev/null
                   # FP8 (an H100): weights ~47 GiB, the state of 256 requests ~20 GiB; 32k contexts at 16 requests
                   quant="" ctx_batches="8192:64 32768:64"
                   [ "${part%_fp8}" != "$part" ] && quant="--quantization fp8 --mem_fraction 0.92" \
                       ctx_batches="8192:64 32768:16"
                   if [ "${part#kimi_ctx}" = "$part" ]; then
                       run "$part" 300 python -m lightllm.tools.bench_throughput --model_dir /tmp/kimi --load_format dummy \
                           $quant --modes replay,native --batch_sizes 1,64,256 --input_len 128 --output_len 48
                   else
                       # a step prefills 2048 prompt tokens beside the decoding rows: 256 such steps for 64 x 8k
                       # (16 x 32k), so 300 tokens each keep every request decoding once the last prompt is in
                       for cb in $ctx_batches; do
                           run "${part}_${cb%:*}" 270 python -m lightllm.tools.bench_throughput --model_dir /tmp/kimi \
                               --load_format dummy $quant --modes replay --batch_sizes "${cb#*:}" --input_len "${cb%:*}" \
                               --output_len 300 --top_kernels 16
                           grep -E "kernel " "$LOG_DIR/${part}_${cb%:*}.log" | head -16
                       done
                   fi ;;
        kimi_mixed_fp8|kimi_mixed_base)
                        python -m lightllm.tools.dummy_model_dir --preset kimi-linear-48b-a3b --out /tmp/kimi > /dev/null
                        tree=.
                        [ $part = kimi_mixed_base ] && tree=/tmp/base
                        run $part 280 env PYTHONPATH="$tree:$PYTHONPATH" python $tree/test/gpu/closed_loop.py \
                            --model_dir /tmp/kimi --load_format dummy --quantization fp8 --mem_fraction 0.92 \
                            --requests 64 --concurrency 64 --input_len 8192 --output_len 32 --profile 20,5
                        grep -E "requests in|TTFT|profiled" "$LOG_DIR/$part.log" | cut -c1-300
                        grep -A25 "top by" "$LOG_DIR/$part.log" | cut -c1-150 ;;
        moe_mixed) python -m lightllm.tools.dummy_model_dir --preset qwen3.5-35b-a3b --out /tmp/q35 > /dev/null
                   for graphs in 1024 0; do
                       run "moe_mixed_graphs$graphs" 250 python test/gpu/closed_loop.py --model_dir /tmp/q35 \
                           --load_format dummy --quantization fp8 --requests 256 --concurrency 128 --input_len 1024 \
                           --output_len 128 --prefill_graph_max_tokens $graphs
                       grep -E "requests in|TTFT" "$LOG_DIR/moe_mixed_graphs$graphs.log" | cut -c1-300
                   done ;;
        q3n_serve|q3n_fp8)
                 python -m lightllm.tools.dummy_model_dir --preset qwen3-next-80b-a3b --out /tmp/q3n > /dev/null
                 # the server at its defaults: the memory plan's line (the concurrency it affords), then it serves
                 python -m lightllm.server.api_server --model_dir /tmp/q3n --load_format dummy --quantization fp8 \
                     --ssm_state_mode replay --port 8012 > "$LOG_DIR/q3n_server.log" 2>&1 &
                 server=$!
                 for _ in $(seq 300); do curl -sf http://127.0.0.1:8012/health > /dev/null && break; sleep 1; done
                 grep -E "memory plan|engine ready|start-up of rank" "$LOG_DIR/q3n_server.log" | cut -c1-400
                 run q3n_serve 120 python -m lightllm.tools.bench_serving --base_url http://127.0.0.1:8012 \
                     --num_prompts 64 --input_len 1024 --output_len 64 --max_concurrency 64
                 kill $server; wait $server
                 [ "$part" = q3n_fp8 ] && run q3n_fp8 330 python -m lightllm.tools.bench_throughput --model_dir /tmp/q3n \
                     --load_format dummy --quantization fp8 --modes replay,native --batch_sizes 1,64,256 --input_len 128 \
                     --output_len 48 ;;
        structured_q35|structured_q35_fp8)
                        python -m lightllm.tools.dummy_model_dir --preset qwen3.5-35b-a3b --out /tmp/q35 > /dev/null
                        run "$part" 540 python test/benchmark/bench_structured_output.py --batch 64 \
                            --model_dir /tmp/q35 --load_format dummy --synthetic_vocab 248000 --phases \
                            $([ "$part" = structured_q35_fp8 ] && echo "--quantization fp8") ;;
        moe_prefill) run moe_prefill 240 python test/benchmark/bench_fused_moe.py --batches 1024,4096,16384 --largest_tuned \
                         --iters 20
                     grep -E "^\|" "$LOG_DIR/moe_prefill.log" ;;
        mla_tiles) run mla_tiles 280 python test/gpu/kernel_speed.py --parts mla --mla_budget_s 240 --no_repo_tables \
                       --out "$LOG_DIR/kernel_speed"
                   grep -E "best tile|64 \||min rows" "$LOG_DIR/mla_tiles.log" | head -40 ;;
        conv) run conv_decode 150 python test/benchmark/bench_conv_decode.py
              [ -d /tmp/base/lightllm ] && run conv_decode_base 150 env PYTHONPATH="/tmp/base:$PYTHONPATH" \
                  python test/benchmark/bench_conv_decode.py
              run conv_memcheck 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
                  --error-exitcode 1 python test/gpu/memcheck_kernels.py --cases conv_decode
              tail -3 "$LOG_DIR/conv_memcheck.log" ;;
        moe_prefill_trees)
                  for tree in . /tmp/base; do
                      [ -d $tree/lightllm ] || continue
                      tag=${tree//\//_}
                      run "moe_prefill$tag" 150 env PYTHONPATH="$tree:$PYTHONPATH" python test/benchmark/bench_fused_moe.py \
                          --batches 1024,4096,16384 --iters 20
                      grep -E "^\|" "$LOG_DIR/moe_prefill$tag.log" | head -12
                      run "fp8_moe$tag" 120 env PYTHONPATH="$tree:$PYTHONPATH" python test/benchmark/bench_fp8_moe.py \
                          --batches 1024,4096,16384 --iters 20
                      tail -4 "$LOG_DIR/fp8_moe$tag.log"
                  done ;;
        fla_tune_kimi) python -m lightllm.tools.dummy_model_dir --preset kimi-linear-48b-a3b --out /tmp/kimi > /dev/null
                       run fla_tune_kimi 500 python -m lightllm.tools.tune_fla_configs --model_dir /tmp/kimi
                       tail -5 "$LOG_DIR/fla_tune_kimi.log"
                       cp lightllm/linear_att/fla_tuned/*.json "$OUT_DIR/" ;;
        moe_prefill_tune) run moe_prefill_tune 280 python -m lightllm.tools.tune_fused_moe --grid prefill \
                              --shapes qwen3.5-35b-a3b,kimi-linear-48b-a3b --batches 4096,16384,1024 \
                              --output "$OUT_DIR/moe_prefill_tuned.json"
                          grep -E "tokens" "$LOG_DIR/moe_prefill_tune.log" ;;
        fp8_moe) run fp8_moe 200 python test/benchmark/bench_fp8_moe.py
                 grep -E "^\|" "$LOG_DIR/fp8_moe.log" | tail -20 ;;
        tune_cap8) run tune_cap8 240 python test/benchmark/sweep_linear_att.py --families replay --cells 1x256 \
                       --replay_capacity 8 --shapes qwen3-next-tp1,kimi-linear-tp1,qwen3.5-tp1 --out-dir lightllm/linear_att
                   run tune_cap8_mtp 200 python test/benchmark/sweep_linear_att.py --families replay \
                       --cells 3x256,4x256 --projections inline --replay_capacity 8 --shapes qwen3-next-tp1 \
                       --out-dir lightllm/linear_att
                   # the merged tables come back beside the logs (merge them into the repository's if the GPU is
                   # the H200 the tables are for)
                   cp lightllm/linear_att/gdn/tuned/h200.json "$OUT_DIR/gdn_h200.json"
                   cp lightllm/linear_att/kda/tuned/h200.json "$OUT_DIR/kda_h200.json"
                   grep -h -E "^family=replay" "$LOG_DIR"/tune_cap8*.log | grep "replay_capacity=8" \
                       | sed -E 's/gpu=[^|]*.triton=[^|]*.//' ;;
        warm_start) run warm_start 400 python test/gpu/startup_check.py --starts 3 --modes replay \
                        --big_max_running_requests 0 --log_dir "$LOG_DIR/warm_start"
                    grep -h -o -E "start-up of rank 0: .*|engine ready: .*" "$LOG_DIR/warm_start"/* | cut -c1-400 ;;
        compile_ahead) # the serving checkpoint's start-up compiles recorded into this GPU kind's list (replay and native,
                       # 64 requests), then fresh starts (empty Triton caches) without and with it
                       lists=lightllm/kernels/compile_ahead/lists
                       run record_compiles 240 python -m lightllm.tools.record_compiles --serving_model \
                           --modes replay,native --max_running_requests 64
                       grep -h -E "kernel variants|not recordable|has [0-9]+ entries" "$LOG_DIR/record_compiles.log"
                       cp $lists/*.json "$OUT_DIR/"
                       for list in without with; do
                           [ $list = without ] && mkdir -p /tmp/lists_aside && mv $lists/*.json /tmp/lists_aside/
                           run "fresh_start_$list" 300 env TRITON_CACHE_DIR="$(mktemp -d)" python test/gpu/startup_check.py \
                               --starts 1 --modes replay --big_max_running_requests 0 --log_dir "$LOG_DIR/start_$list"
                           [ $list = without ] && mv /tmp/lists_aside/*.json $lists/
                           grep -h -o -E "start-up of rank 0: .*|[0-9]+ of [0-9]+ kernels compiled ahead.*|beyond the compile list.*|engine ready: .*" \
                               "$LOG_DIR/start_$list"/* | cut -c1-400
                       done ;;
        record_presets) # the released models' groups of the list, from 4-layer random-weight copies (the key ignores depth)
                        for preset in qwen3.5-35b-a3b kimi-linear-48b-a3b "qwen3-next-80b-a3b --quantization fp8"; do
                            read -r name flags <<<"$preset"
                            python -m lightllm.tools.dummy_model_dir --preset "$name" --num_layers 4 --out "/tmp/rec_$name" > /dev/null
                            run "record_$name" 240 python -m lightllm.tools.record_compiles --model_dir "/tmp/rec_$name" \
                                --load_format dummy --modes replay $flags
                            grep -h -E "kernel variants|not recordable|has [0-9]+ entries" "$LOG_DIR/record_$name.log"
                        done
                        cp lightllm/kernels/compile_ahead/lists/*.json "$OUT_DIR/" ;;
        *) echo "unknown part $part" ;;
    esac
    pack
done
echo "== done ($(date +%T))"
