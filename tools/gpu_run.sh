#!/usr/bin/env bash
# Everything one GPU machine should run, in one command (xffl_like/bench/gpu_run.py; docs/running.md, "On GPUs"):
#   tools/gpu_run.sh --prepare   on a CPU machine with pip: the wheelhouse .gpu/wheels (+ .gpu/data); carry .gpu
#   tools/gpu_run.sh             on the GPU machine: installs it offline, runs the steps, logs to $OUT
#   tools/gpu_run.sh --cpu       the same script end to end on this CPU (llama_tiny, gloo, a few steps)
# It runs as a file, not `python -m`: the package's own imports need the wheels it installs first.
# PYTHONSAFEPATH: the script's folder (xffl_like/bench) is not put on sys.path.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONSAFEPATH=1 exec "${PYTHON:-python3}" xffl_like/bench/gpu_run.py "$@"
