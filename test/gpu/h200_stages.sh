#!/usr/bin/env bash
# The GPU checks and measurements of this repository in stages, each sized for one 10-minute device command.
#
#   bash test/gpu/h200_stages.sh kernels    # GPU suites: state kernels vs torch twins, CUDA graphs, races; paged attention
#   bash test/gpu/h200_stages.sh sweep      # launch-config sweep at the three benchmark shapes -> tuned tables
#   bash test/gpu/h200_stages.sh bench      # the full benchmark grid (N 1..512, W 1/2/4, fp32 + bf16 state)
#   bash test/gpu/h200_stages.sh models     # model parity vs transformers: Kimi-Linear fp32, every arch bf16
#   bash test/gpu/h200_stages.sh serving    # serving smoke: Kimi-Linear (tiny), a random-weight Qwen3-Next-width model
#   bash test/gpu/h200_stages.sh profile    # Nsight Compute on each decode / verify kernel (test/benchmark/profile_replay_ncu.py)
#   bash test/gpu/h200_stages.sh memcheck   # compute-sanitizer memcheck over every Triton kernel (test/gpu/memcheck_kernels.py)
#   bash test/gpu/h200_stages.sh startup    # the real server started 5x per state mode + once at 256 requests (startup_check.py)
#   bash test/gpu/h200_stages.sh pd         # PD over CUDA IPC vs the monolithic engine, then transfer GB/s per transport
#   bash test/gpu/h200_stages.sh prefix     # prefix cache: TTFT of an 8k shared prefix, cold vs hit, per state mode
#   bash test/gpu/h200_stages.sh compiles   # rounds of changing batch sizes: TTFT and kernels compiled while serving
#   bash test/gpu/h200_stages.sh dp         # two replicas on the GPU, multi-turn: cache_aware vs round_robin routing
#   bash test/gpu/h200_stages.sh STAGE 420  # stop the stage's programs after 420 s (default 540), then save the cache
#   bash test/gpu/h200_stages.sh bench 540 --state-dtypes bf16   # sweep / bench: later arguments go to the script
#   bash test/gpu/h200_stages.sh serving 300 --skip-tiny --real-width   # models / serving: one run with these
#   bash test/gpu/h200_stages.sh memcheck 540 --cases replay,state       # memcheck / startup: arguments to the script
#   bash test/gpu/h200_stages.sh startup 540 --starts 2 --modes native,compact+mtp
#   bash test/gpu/h200_stages.sh kernels 300 test/gpu/test_linear_att_gpu.py::test_cuda_graph_replay_equals_eager_over_fold_cycles
#
# Extra packages come as wheels in .whl (see README.md here); outputs and tables are copied to $OUT when it is set,
# so a stage's files come back even when it is cut short. Every stage prints as it goes.
#
# Compiled kernels and autotuning results (ours and fla-core's, which autotunes its chunk kernels for minutes on a
# fresh machine) are kept in a Triton cache under .cache/gpu (ignored by git). A stage starts from
# .cache/gpu/triton.tgz (or its parts triton.tgz.part-NN) when there and ends by writing the cache back to $OUT the
# same way (parts of 15 MiB, the most a returned file may have); bring those files back into .cache/gpu/ and carry
# ".cache/gpu" with the next command to skip the compiles and the autotuning.
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
kernels | sweep | bench | models | serving | profile | memcheck | startup | pd | prefix | compiles | dp) ;;
*)
    sed -n '2,/^set -uo/p' "$0" | grep '^#'
    exit 2
    ;;
esac
source test/gpu/python_env.sh || exit 1
DEADLINE=$((SECONDS + ${2:-540}))
# a stage's programs run through `py`, which stops them at the deadline so the cache is still written back
py() { timeout $((DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1)) python "$@"; }
OUT_DIR="${OUT:-/tmp/lightllm_gpu_out}"
mkdir -p "$OUT_DIR"
# the Triton cache goes back to $OUT at the end (python_env.sh seeded it from a carried .cache/gpu/triton.tgz*)
save_cache() {
    [ -n "${SKIP_CACHE_SAVE:-}" ] && return  # h200_parallel.sh saves the shared cache once, after all stages
    save_triton_cache "$OUT_DIR" 3
}
trap save_cache EXIT

tables_out() {
    mkdir -p "$OUT_DIR/gdn" "$OUT_DIR/kda"
    cp lightllm/linear_att/gdn/tuned/h200.json "$OUT_DIR/gdn/"
    cp lightllm/linear_att/kda/tuned/h200.json "$OUT_DIR/kda/"
}

case "${1:-}" in
kernels)  # later arguments: the tests to run instead of both suites (pytest node ids)
    tests=("${@:3}")
    [ ${#tests[@]} -eq 0 ] && tests=(test/gpu/test_linear_att_gpu.py test/gpu/test_paged_attention_gpu.py)
    py -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 |
        grep --line-buffered -v "Warning\|warn(" | tee "$OUT_DIR/kernels.log"
    ;;
sweep)
    py test/benchmark/sweep_linear_att.py --families replay,serial,compact --cells 1x256,4x128 \
        --shapes qwen3-next-tp1,qwen3.5-tp1,kimi-linear-tp1 --out-dir lightllm/linear_att "${@:3}" 2>&1 |
        grep --line-buffered -v "Warning\|warn(" | tee "$OUT_DIR/sweep.log"
    tables_out
    ;;
bench)
    py test/benchmark/bench_linear_att.py --budget-s 480 "${@:3}" 2>&1 | grep --line-buffered -v "Warning\|warn(" | tee "$OUT_DIR/bench.log"
    py test/benchmark/replay_phases.py --ns 128 --ws 1,4 2>&1 | tee "$OUT_DIR/phases.log"
    ;;
models)
    if [ $# -gt 2 ]; then  # later arguments: one check_models_gpu.py run with them instead of the two below
        py test/gpu/check_models_gpu.py "${@:3}" 2>&1 | tee "$OUT_DIR/models.log" |
            grep --line-buffered -E "True|False|ok,|failed|Error|=="
        exit
    fi
    py test/gpu/check_models_gpu.py --skip-real-width --archs kimi_linear --dtypes float32 2>&1 |
        tee "$OUT_DIR/models_kimi.log" | grep --line-buffered -E "True|False|ok,|failed|Error"
    py test/gpu/check_models_gpu.py --dtypes bfloat16 2>&1 |
        tee "$OUT_DIR/models_bf16.log" | grep --line-buffered -E "True|False|ok,|failed|Error|=="
    ;;
serving)
    if [ $# -gt 2 ]; then  # later arguments: one smoke_serving_gpu.py run with them instead of the two below
        py test/gpu/smoke_serving_gpu.py "${@:3}" 2>&1 | tee "$OUT_DIR/serving.log" |
            grep --line-buffered -E "^\||HTTP|failures|Error"
        exit
    fi
    py test/gpu/smoke_serving_gpu.py --archs kimi_linear --skip-http 2>&1 |
        tee "$OUT_DIR/serving_kimi.log" | grep --line-buffered -E "^\||failures|Error"
    py test/gpu/smoke_serving_gpu.py --skip-tiny --real-width 2>&1 |
        tee "$OUT_DIR/serving_real_width.log" | grep --line-buffered -E "^\||HTTP|failures|Error"
    ;;
memcheck)  # later arguments go to memcheck_kernels.py (--cases SUBSTR,..., --tiny-only)
    SANITIZER="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -1)"
    # every torch allocation its own cudaMalloc: a read just past a tensor is past an allocation, which memcheck sees
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $((DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1)) "$SANITIZER" \
        --tool memcheck --error-exitcode 1 python test/gpu/memcheck_kernels.py "${@:3}" 2>&1 | tee "$OUT_DIR/memcheck.log"
    echo "memcheck exit status ${PIPESTATUS[0]}"
    ;;
startup)  # later arguments go to startup_check.py (--starts N, --modes ..., --model_dir DIR)
    logs="$(mktemp -d /tmp/lightllm_startup_logs.XXXXXX)"  # one per stage: h200_parallel.sh may run two
    py test/gpu/startup_check.py --log_dir "$logs" "${@:3}" 2>&1 | tee "$OUT_DIR/startup.log" |
        grep --line-buffered -E "^\||^checkpoint|failures|Error|Traceback"
    echo "startup exit status ${PIPESTATUS[0]}"
    tar -czf "$OUT_DIR/startup_logs.tgz" -C "$logs" .  # one server log per start
    ;;
pd)  # later arguments go to pd_bench.py (default: its transfer part)
    py -m pytest -q -p no:cacheprovider test/gpu/test_pd_cuda_ipc_gpu.py 2>&1 | tail -15 | tee "$OUT_DIR/pd_tests.log"
    args=("${@:3}")
    [ ${#args[@]} -eq 0 ] && args=(--parts transfer)
    py test/gpu/pd_bench.py --out "$OUT_DIR" "${args[@]}" 2>&1 | tee "$OUT_DIR/pd_bench.log" |
        grep --line-buffered -E "^\||Error|Traceback"
    ;;
prefix)  # later arguments go to prefix_cache_ttft.py (default: its TTFT part)
    args=("${@:3}")
    [ ${#args[@]} -eq 0 ] && args=(--parts ttft)
    py test/gpu/prefix_cache_ttft.py --result_file "$OUT_DIR/prefix_cache.json" "${args[@]}" 2>&1 |
        tee -a "$OUT_DIR/prefix_cache.log" | grep --line-buffered -E "^\||Error|Traceback"
    ;;
dp)  # later arguments go to dp_multiturn_bench.py (--balancers, --conversations, --server_flags, ...)
    py test/gpu/dp_multiturn_bench.py --result_file "$OUT_DIR/dp_multiturn.json" --log_dir "$OUT_DIR/dp_logs" \
        "${@:3}" 2>&1 | tee "$OUT_DIR/dp_multiturn.log" | grep --line-buffered -E "^\||^cache_aware|Error|Traceback"
    ;;
compiles)  # later arguments go to serving_compiles.py (--mode, --mtp_step)
    py test/gpu/serving_compiles.py --log "$OUT_DIR/serving_compiles_server.log" "${@:3}" 2>&1 |
        tee "$OUT_DIR/serving_compiles.log" | grep --line-buffered -E "^\||Error|Traceback"
    echo "serving_compiles exit status ${PIPESTATUS[0]}"
    ;;
profile)
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
    timeout $((DEADLINE - SECONDS)) "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis -k 'regex:replay|native|compact' \
        python test/benchmark/profile_replay_ncu.py >"$OUT_DIR/ncu.txt" 2>&1
    grep --line-buffered -E "^  [a-z_]+kernel|^[a-z0-9.-]+ [a-z-]+ W=|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit (Reg|Shared)|Warp Cycles Per Issued|Dynamic Shared|Static Shared|Local Memory|Mem Busy|Max Bandwidth|L2 Hit" \
        "$OUT_DIR/ncu.txt" | sed 's/  */ /g'
    ;;
esac
