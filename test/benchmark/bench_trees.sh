#!/usr/bin/env bash
# The kernel benchmark of several source trees in one device session, the trees alternating, so a before/after
# comparison shares the GPU's clocks and temperature and a drift shows as a difference between passes:
#
#   git archive fe09397 lightllm test/benchmark | (mkdir -p .trees/fe09397 && tar -x -C .trees/fe09397)
#   bash test/benchmark/bench_trees.sh 2 . .trees/fe09397 -- --state-dtypes fp32 --ns 256 --ws 2,4 --budget-s 60
#
# PASSES: how many times every tree runs; TREE: "." for this checkout, or a folder holding another revision's
# `lightllm/` and `test/benchmark/`; after "--": arguments of `bench_linear_att.py`, whose `--budget-s` also bounds
# each run (plus 60 s for the compiles of a cold pass). Prints each run's table rows under a header naming the pass
# and the tree, and appends the full output to $OUT/trees.log when $OUT is set.
set -uo pipefail
passes=${1:?usage: bench_trees.sh PASSES TREE... -- BENCH_ARGS}
shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    trees+=("$1")
    shift
done
[ "${1:-}" = "--" ] && shift
[ ${#trees[@]} -gt 0 ] || { echo "no trees given" >&2; exit 2; }
budget=420
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = "--budget-s" ] && budget=${args[$((i + 1))]%.*}
done
log="${OUT:-/tmp}/trees.log"
here="$(pwd)"
for pass in $(seq "$passes"); do
    for tree in "${trees[@]}"; do
        echo "=== pass $pass tree $tree" | tee -a "$log"
        # each tree imports its own lightllm: its folder goes first on the path
        (cd "$tree" && PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" timeout $((budget + 60)) \
            python test/benchmark/bench_linear_att.py "${args[@]}" 2>&1) |
            grep -v "Warning\|warn(" | tee -a "$log" | grep --line-buffered -E "^\| [0-9]|^## [a-z]|rror"
        cd "$here" || exit 1
    done
done
