#!/usr/bin/env bash
# Where a decode step's host time goes on the GPU: test/benchmark/profile_engine_host.py on the real-width
# checkpoint (phase wall times with the forward's launch cost and its GPU tail split, plus the top host operators).
#
#   bash test/gpu/profile_host.sh [seconds per part, default 150]
set -uo pipefail
cd "$(dirname "$0")/../.."
source test/gpu/python_env.sh || exit 1
limit=${1:-150}
prof="python test/benchmark/profile_engine_host.py --serving_model --device cuda --steps 20"
part() {
    echo "== $*"
    timeout "$limit" $prof "$@" 2>&1 | grep --line-buffered "^|"
}
part --mode native --batch 256 --top_ops 25
part --mode replay --batch 256
part --mode replay --batch 256 --mtp_step 2 --top_ops 25
part --mode native --batch 1
