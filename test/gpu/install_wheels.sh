#!/usr/bin/env bash
# Installs the wheels in .whl (see README.md here) into /tmp/site once per machine; later calls return at once.
# Callers then put /tmp/site on PYTHONPATH.
cd "$(dirname "$0")/../.."
[ -d .whl ] || exit 0
[ -e /tmp/site/.lightllm_wheels ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>/dev/null || exit 1
# byte-compiled in parallel here, as a pip install would have done, so that no first start pays for it
python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
touch /tmp/site/.lightllm_wheels
