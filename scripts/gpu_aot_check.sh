#!/usr/bin/env bash
# Compile the Pallas kernels and the engine step for an H200 (sm_90a) on a machine with
# no GPU: Triton compile errors, shared memory, register spills (pallas_kernels/aot_check.py);
# KV cache copies, in-place updates, conditionals (jaxvllm/benchmarks/aot_engine.py).
# Measures no speed (scripts/gpu_check.sh does, on a GPU).
#
#   scripts/gpu_aot_check.sh [--quick] [--json PATH]   (the engine's results: PATH less .json + _engine.json)
#
# The CUDA PJRT plugin matching the installed jaxlib, and ptxas, go into $AOT_DIR
# (default .aot/, git-ignored) with `pip install --target`, and are put on PYTHONPATH for
# this one command only: a plugin with no GPU prints errors in every process that
# imports jax, so it must not live in the project's environment.
# Exit: 0 all clean, 1 a case of either check failed, 2 the plugin could not be installed or loaded.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PYTHON="${PYTHON:-python}"
AOT_DIR="${AOT_DIR:-$ROOT/.aot}"

JAXLIB="$("$PYTHON" -c 'import jaxlib; print(jaxlib.__version__)')" || exit 2
CUDA="${AOT_CUDA_MAJOR:-12}"
installed() {  # the plugin in $AOT_DIR matches jaxlib
    PYTHONPATH="$AOT_DIR" "$PYTHON" -c "import sys
from importlib.metadata import version
sys.exit(version('jax-cuda${CUDA}-plugin') != '$JAXLIB')" 2>/dev/null
}
if ! installed; then
    echo "installing jax-cuda${CUDA}-plugin==$JAXLIB and ptxas into $AOT_DIR"
    rm -rf "$AOT_DIR"
    "$PYTHON" -m pip install -q --no-deps --target "$AOT_DIR" \
        "jax-cuda${CUDA}-plugin==$JAXLIB" "jax-cuda${CUDA}-pjrt==$JAXLIB" "nvidia-cuda-nvcc-cu${CUDA}" \
        || { echo "could not install the CUDA plugin for jaxlib $JAXLIB" >&2; exit 2; }
fi

# The plugin finds no GPU and logs so in each process; keep the checks' own output readable.
check() {
    PYTHONPATH="$AOT_DIR:$ROOT${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=2 \
        "$PYTHON" -m "$@"
}
engine_args=() prev=
for arg in "$@"; do  # the same arguments, but a JSON file of its own
    case "$prev:$arg" in --json:* | *:--json=*) arg="${arg%.json}_engine.json" ;; esac
    engine_args+=("$arg")
    prev=$arg
done

check pallas_kernels.aot_check "$@"
kernels=$?
[ "$kernels" = 2 ] && exit 2  # no plugin: the engine's check would not load it either
check jaxvllm.benchmarks.aot_engine ${engine_args[@]+"${engine_args[@]}"}
engine=$?
[ "$engine" = 2 ] && exit 2
[ "$kernels" = 0 ] && [ "$engine" = 0 ] || exit 1
