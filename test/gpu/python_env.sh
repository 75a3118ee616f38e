# Sourced from the repository root by the GPU drivers (h200_stages.sh, serving_speed.sh, profile_host.sh): installs the carried
# wheels once (see README.md here) and puts them and the repository on PYTHONPATH.
if [ -d .whl ]; then
    bash test/gpu/install_wheels.sh || return 1
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
# compiled kernels and autotune results (ours and fla-core's, which autotunes its prefill kernels for minutes on a
# fresh machine) live in a Triton cache under .cache/gpu; a carried .cache/gpu/triton.tgz (or its parts) seeds it
export TRITON_CACHE_DIR="$PWD/.cache/gpu/triton" TRITON_CACHE_AUTOTUNING=1
if [ ! -d "$TRITON_CACHE_DIR" ] && ls .cache/gpu/triton.tgz* >/dev/null 2>&1; then
    mkdir -p "$TRITON_CACHE_DIR"
    cat $(ls .cache/gpu/triton.tgz* | sort) | tar -xzf - -C "$TRITON_CACHE_DIR"
fi
mkdir -p "$TRITON_CACHE_DIR"
# save_triton_cache DIR PARTS: the cache back into DIR as triton.tgz.part-NN of 15 MiB (the most a returned file may
# have), when it fits in PARTS parts (a device command returns eight files at most, logs and tables included)
save_triton_cache() {
    local dir=$1 parts=$2
    rm -f "$dir"/triton.tgz*
    tar -czf /tmp/triton.tgz -C "$TRITON_CACHE_DIR" . || return
    if [ "$(stat -c %s /tmp/triton.tgz)" -le $((parts * 15 * 1024 * 1024)) ]; then
        split -b 15M -d /tmp/triton.tgz "$dir/triton.tgz.part-"
    else
        echo "Triton cache $(du -h /tmp/triton.tgz | cut -f1) is over $((parts * 15)) MiB: not returned"
    fi
}
