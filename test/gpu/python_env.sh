# Sourced from the repository root by the GPU drivers (h200_stages.sh, serving_speed.sh): installs the carried
# wheels once (see README.md here) and puts them and the repository on PYTHONPATH.
if [ -d .whl ]; then
    bash test/gpu/install_wheels.sh || return 1
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
