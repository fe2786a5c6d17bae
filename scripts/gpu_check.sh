#!/usr/bin/env bash
# GPU check: the Pallas kernel tests compiled (not interpreted) and the engine parity test, side
# by side, then the kernel benchmark and the engine step benchmark (277 s on one H100 in their
# last run, the tests one after the other), then the open issues' GPU figures, those not
# yet measured on a GPU first, as long as the time budget lasts: a step runs at most until
# the budget is spent (default 480 s from the start, which leaves a session's 15 device
# minutes room for the machine's start and a rerun of the base steps),
# and a step that would get less than 20 s is skipped (a line in summary.txt says so).
# Results go to $OUT (default $TMPDIR/jaxvllm-gpu-check): a NAME.log per step, the JSON
# files below, summary.txt.
#
#   scripts/gpu_check.sh            on the GPU machine (the project copied in, not installed):
#                                   the base steps, then every extra below, in the order
#                                   spec, quant, b1, live, startup
#   scripts/gpu_check.sh --small    anywhere: interpret-mode tests, benchmarks --small, tiny
#                                   models (a CPU rehearsal; no budget unless --budget)
#   scripts/gpu_check.sh --dry-run  print what would run
#   scripts/gpu_check.sh --base     the base steps only
#   --budget SECONDS                the time budget (0: none)
# Extras (naming any runs the base steps and only the extras named, in the order named):
#   --startup   issue 26: `LLM(...)` ready time, dummy:qwen3-0.6b cold and warm, dummy:llama3-8b
#               cold (startup_qwen3-0.6b.json, startup_llama3-8b.json)
#   --b1        issue 26: B1 (the nano-vllm workload), the fp8 KV cache against the model's dtype,
#               with the host's time per step in parts (b1.json)
#   --spec      issue 28: n-gram drafts (K = 4) on the repeat dataset against no drafts, batch 1
#               and 16 on dummy:llama3-8b: inter-token latency and acceptance (spec_b1.json,
#               spec_b16.json)
#   --quant     issue 29: batch-1 decode with quantized weights against the same model
#               unquantized, fp8 then 4-bit (gptq-dummy): quant_fp8.json, quant_int4.json
#   --live      issues 30/31: multi-LoRA throughput (4 adapters against the base model: lora.json)
#               and update_weights on dummy:llama3-8b from device arrays (weight_update.json)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step stopped at its limit keeps what it printed in its log
OUT="${OUT:-${TMPDIR:-/tmp}/jaxvllm-gpu-check}"
PYTHON="${PYTHON:-python}"
MODE=gpu
DRY=0
BASE_ONLY=0
BUDGET=
EXTRAS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --small) MODE=small ;;
        --dry-run) DRY=1 ;;
        --base) BASE_ONLY=1 ;;
        --budget) BUDGET=${2:?--budget needs SECONDS}; shift ;;
        --startup | --b1 | --spec | --quant | --live) EXTRAS+=("${1#--}") ;;
        -h | --help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$BASE_ONLY" = 1 ]; then
    EXTRAS=()
elif [ ${#EXTRAS[@]} = 0 ]; then
    # Not yet measured on a GPU first: an H100 measured start-up and B1's bf16 half (2026-12-05).
    EXTRAS=(spec quant b1 live startup)
fi

if [ "$MODE" = gpu ]; then
    export JAXVLLM_PALLAS_INTERPRET=0          # compiled Triton kernels in the tests too
    export JAX_DEFAULT_MATMUL_PRECISION=highest # float32 parity tests: no TF32 in the XLA reference
    BENCH_ARGS=()
    LIMITS=(30 150 150 180 120 300)             # env, kernel tests, engine test, bench, engine step; B1
    BUDGET=${BUDGET:-480}
    STARTUP_ARGS=(--max-model-len 2048)
    STARTUP_MODELS=("dummy:qwen3-0.6b cold warm" "dummy:llama3-8b cold")
    B1_ARGS=(--model dummy:qwen3-0.6b --dataset nanovllm)
    QUANT_ARGS=(--model dummy:llama3-8b --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
    LORA_ARGS=(--model dummy:qwen3-0.6b --dataset random --num-prompts 256 --input-len 128 --output-len 128)
    WEIGHTS_MODELS=(dummy:qwen3-0.6b dummy:llama3-8b)
    SPEC_ARGS=(--model dummy:llama3-8b --output-len 128 --num-iters 3)
else
    BENCH_ARGS=(--small)
    LIMITS=(60 300 300 300 300 300)
    BUDGET=${BUDGET:-0}
    STARTUP_ARGS=(--max-model-len 256)
    STARTUP_MODELS=("dummy:tiny cold warm")
    B1_ARGS=(--model dummy:tiny --dataset random --num-prompts 16 --input-len 32 --output-len 16)
    QUANT_ARGS=(--model dummy:tiny --batch-size 1 --input-len 16 --output-len 8 --num-iters 1)
    LORA_ARGS=(--model dummy:tiny --dataset random --num-prompts 16 --input-len 32 --output-len 16)
    WEIGHTS_MODELS=(dummy:tiny)
    SPEC_ARGS=(--model dummy:tiny --max-model-len 512 --output-len 16 --num-iters 1)
fi

[ "$DRY" = 1 ] || mkdir -p "$OUT"

# spent: under 20 s of the budget left (a step would get too little to finish).
spent() { [ "$BUDGET" -gt 0 ] && [ $((BUDGET - SECONDS)) -lt 20 ]; }

# run NAME LIMIT_SECONDS COMMAND...: log to $OUT/NAME.log, one line per step in summary.txt;
# the limit is cut to what is left of the budget, and the step skipped once it is spent.
run() {
    local name=$1 limit=$2
    shift 2
    if [ "$BUDGET" -gt 0 ] && [ "$DRY" = 0 ]; then
        if spent; then
            echo "== $name: skipped, $((BUDGET - SECONDS))s of the ${BUDGET}s budget left"
            echo "$name skipped=budget" >>"$OUT/summary.txt"
            return 0
        fi
        [ $((BUDGET - SECONDS)) -lt "$limit" ] && limit=$((BUDGET - SECONDS))
    fi
    echo "== $name (limit ${limit}s): $*"
    [ "$DRY" = 1 ] && return 0
    local start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    echo "$name exit=$rc seconds=$((SECONDS - start))" >>"$OUT/summary.txt"
}

# together NAME LIMIT COMMAND -- NAME LIMIT COMMAND: two steps at once (the tests: each mostly
# compiles, on the host's cores, and neither fills the GPU), each growing its GPU memory as
# it needs rather than taking 75% of it at start.
together() {
    local i
    for ((i = 1; i <= $#; i++)); do [ "${!i}" = -- ] && break; done
    local first=("${@:1:i-1}") second=("${@:i+1}")
    if [ "$DRY" = 1 ] || spent; then
        run "${first[@]}"  # (in order: a plan, or two skips)
        run "${second[@]}"
        return
    fi
    XLA_PYTHON_CLIENT_PREALLOCATE=false run "${first[@]}" &
    XLA_PYTHON_CLIENT_PREALLOCATE=false run "${second[@]}"
    wait
}

[ "$DRY" = 1 ] || : >"$OUT/summary.txt"
run env "${LIMITS[0]}" "$PYTHON" -c "import sys, jax; print(sys.version); print('jax', jax.__version__, jax.default_backend(), jax.devices())"

if "$PYTHON" -c "import pytest" 2>/dev/null || [ "$DRY" = 1 ]; then
    together kernels "${LIMITS[1]}" "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py \
        tests/kernels/test_fp8_attention.py tests/kernels/test_grouped_matmul.py tests/kernels/test_int4_matmul.py \
        -- engine "${LIMITS[2]}" "$PYTHON" -m pytest -v -p no:cacheprovider tests/kernels/test_pallas_engine.py
else
    echo "pytest is not installed: skipping the tests (the benchmark still checks the kernels against references)"
    echo "tests skipped=no-pytest" >>"$OUT/summary.txt"
fi

run bench "${LIMITS[3]}" "$PYTHON" -m pallas_kernels.bench ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --json "$OUT/bench.json"
run engine_step "${LIMITS[4]}" "$PYTHON" -m jaxvllm.benchmarks.engine_step ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
    --json "$OUT/engine_step.json"
# The extras, each a function, run in the order of EXTRAS.
extra_startup() {  # issue 26: ready in at most 60 s cold for the 8B
    local entry model runs name
    for entry in "${STARTUP_MODELS[@]}"; do
        read -r model runs <<<"$entry"
        name="startup_${model#dummy:}"
        run "$name" 240 "$PYTHON" -m jaxvllm.benchmarks.startup --model "$model" --runs $runs "${STARTUP_ARGS[@]}" \
            --json "$OUT/$name.json"
    done
}

extra_b1() {
    run b1 "${LIMITS[5]}" "$PYTHON" -m jaxvllm bench throughput "${B1_ARGS[@]}" --compare-kv-cache-dtype \
        --disable-tqdm --output-json "$OUT/b1.json"
}

extra_spec() {  # issue 28: n-gram inter-token latency at batch 1 and 16, with and without drafts
    local ngram='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    local batch
    for batch in 1 16; do
        run "spec_b$batch" 240 "$PYTHON" -m jaxvllm bench latency "${SPEC_ARGS[@]}" --dataset repeat \
            --batch-size "$batch" --speculative-config "$ngram" --compare-speculative --output-json "$OUT/spec_b$batch.json"
    done
}

extra_quant() {  # issue 29: fp8 at least 1.7x bf16's speed, 4-bit 2.5x; weight bytes in each JSON
    run quant_fp8 240 "$PYTHON" -m jaxvllm bench latency "${QUANT_ARGS[@]}" --quantization fp8 \
        --compare-quantization --output-json "$OUT/quant_fp8.json"
    run quant_int4 240 "$PYTHON" -m jaxvllm bench latency "${QUANT_ARGS[@]}" --quantization gptq-dummy \
        --compare-quantization --output-json "$OUT/quant_int4.json"
}

extra_live() {  # issue 30: LoRA's cost against the base; issue 31: an 8B update under 100 ms
    run lora 240 "$PYTHON" -m jaxvllm bench throughput "${LORA_ARGS[@]}" --num-loras 4 --max-lora-rank 16 \
        --disable-tqdm --output-json "$OUT/lora.json"
    run weight_update 240 "$PYTHON" -m jaxvllm.benchmarks.weight_update --model "${WEIGHTS_MODELS[@]}" \
        --json "$OUT/weight_update.json"
}

for extra in ${EXTRAS[@]+"${EXTRAS[@]}"}; do
    "extra_$extra"
done

[ "$DRY" = 1 ] && exit 0
cat "$OUT/summary.txt"
! grep -q "exit=[1-9]" "$OUT/summary.txt"  # the status: 1 when a step failed
