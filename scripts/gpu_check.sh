#!/usr/bin/env bash
# GPU check of the Pallas kernels: the kernel tests compiled (not interpreted), the engine
# parity test, the kernel benchmark, then the engine step benchmark; at most 9 minutes on one
# H200 (214 s in its last run, before engine_step timed 3 more variants). Results go to $OUT
# (default $TMPDIR/jaxvllm-gpu-check): a NAME.log per step (env, kernels, engine, bench,
# engine_step), bench.json, engine_step.json, summary.txt.
#
#   scripts/gpu_check.sh            on the GPU machine (the project copied in, not installed)
#   scripts/gpu_check.sh --small    anywhere: interpret-mode tests, benchmarks --small (a CPU rehearsal)
#   scripts/gpu_check.sh --dry-run  print what would run
#   scripts/gpu_check.sh --b1       then B1 (the nano-vllm workload), the fp8 KV cache against the
#                                   model's dtype, with the host's time per step in parts
#                                   (b1.log, b1.json; up to 5 more minutes)
#   scripts/gpu_check.sh --quant    then batch-1 decode with quantized weights against the same
#                                   model unquantized, fp8 then 4-bit (gptq-dummy): quant_fp8.json,
#                                   quant_int4.json (up to 8 more minutes)
#   scripts/gpu_check.sh --live     then multi-LoRA throughput (4 adapters against the base model:
#                                   lora.json) and update_weights on dummy:llama3-8b from device
#                                   arrays (weight_update.json; up to 8 more minutes)
#   scripts/gpu_check.sh --spec     then n-gram drafts (K = 4) on the repeat dataset against no drafts,
#                                   batch 1 and 16 on dummy:llama3-8b: inter-token latency and
#                                   acceptance (spec_b1.json, spec_b16.json; up to 8 more minutes)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-${TMPDIR:-/tmp}/jaxvllm-gpu-check}"
PYTHON="${PYTHON:-python}"
MODE=gpu
DRY=0
B1=0
QUANT=0
LIVE=0
SPEC=0
for arg in "$@"; do
    case "$arg" in
        --small) MODE=small ;;
        --dry-run) DRY=1 ;;
        --b1) B1=1 ;;
        --quant) QUANT=1 ;;
        --live) LIVE=1 ;;
        --spec) SPEC=1 ;;
        -h | --help) sed -n 2,22p "$0"; exit 0 ;;
        *) echo "unknown option: $arg (see --help)" >&2; exit 2 ;;
    esac
done

if [ "$MODE" = gpu ]; then
    export JAXVLLM_PALLAS_INTERPRET=0          # compiled Triton kernels in the tests too
    export JAX_DEFAULT_MATMUL_PRECISION=highest # float32 parity tests: no TF32 in the XLA reference
    BENCH_ARGS=()
    LIMITS=(30 120 90 180 120 300)              # env, kernel tests, engine test, bench, engine step: <= 9 min; B1
    B1_ARGS=(--model dummy:qwen3-0.6b --dataset nanovllm)
    QUANT_ARGS=(--model dummy:llama3-8b --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
    LORA_ARGS=(--model dummy:qwen3-0.6b --dataset random --num-prompts 256 --input-len 128 --output-len 128)
    WEIGHTS_MODELS=(dummy:qwen3-0.6b dummy:llama3-8b)
    SPEC_ARGS=(--model dummy:llama3-8b --output-len 128 --num-iters 3)
else
    BENCH_ARGS=(--small)
    LIMITS=(60 300 300 300 300 300)
    B1_ARGS=(--model dummy:tiny --dataset random --num-prompts 16 --input-len 32 --output-len 16)
    QUANT_ARGS=(--model dummy:tiny --batch-size 1 --input-len 16 --output-len 8 --num-iters 1)
    LORA_ARGS=(--model dummy:tiny --dataset random --num-prompts 16 --input-len 32 --output-len 16)
    WEIGHTS_MODELS=(dummy:tiny)
    SPEC_ARGS=(--model dummy:tiny --max-model-len 512 --output-len 16 --num-iters 1)
fi

[ "$DRY" = 1 ] || mkdir -p "$OUT"
FAILED=0

# run NAME LIMIT_SECONDS COMMAND...: log to $OUT/NAME.log, one line per step in summary.txt.
run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    [ "$DRY" = 1 ] && return 0
    local start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    echo "$name exit=$rc seconds=$((SECONDS - start))" >>"$OUT/summary.txt"
    [ "$rc" = 0 ] || FAILED=1
}

[ "$DRY" = 1 ] || : >"$OUT/summary.txt"
run env "${LIMITS[0]}" "$PYTHON" -c "import sys, jax; print(sys.version); print('jax', jax.__version__, jax.default_backend(), jax.devices())"

if "$PYTHON" -c "import pytest" 2>/dev/null || [ "$DRY" = 1 ]; then
    run kernels "${LIMITS[1]}" "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_fp8_attention.py tests/kernels/test_grouped_matmul.py \
        tests/kernels/test_int4_matmul.py
    run engine "${LIMITS[2]}" "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_pallas_engine.py
else
    echo "pytest is not installed: skipping the tests (the benchmark still checks the kernels against references)"
    echo "tests skipped=no-pytest" >>"$OUT/summary.txt"
fi

run bench "${LIMITS[3]}" "$PYTHON" -m pallas_kernels.bench ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --json "$OUT/bench.json"
run engine_step "${LIMITS[4]}" "$PYTHON" -m jaxvllm.benchmarks.engine_step ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
    --json "$OUT/engine_step.json"
if [ "$B1" = 1 ]; then
    run b1 "${LIMITS[5]}" "$PYTHON" -m jaxvllm bench throughput "${B1_ARGS[@]}" --compare-kv-cache-dtype \
        --disable-tqdm --output-json "$OUT/b1.json"
fi

if [ "$QUANT" = 1 ]; then  # the issue's goals: fp8 at least 1.7x bf16's speed, 4-bit 2.5x; weight bytes in each JSON
    run quant_fp8 240 "$PYTHON" -m jaxvllm bench latency "${QUANT_ARGS[@]}" --quantization fp8 \
        --compare-quantization --output-json "$OUT/quant_fp8.json"
    run quant_int4 240 "$PYTHON" -m jaxvllm bench latency "${QUANT_ARGS[@]}" --quantization gptq-dummy \
        --compare-quantization --output-json "$OUT/quant_int4.json"
fi

if [ "$LIVE" = 1 ]; then  # issue 30: LoRA's cost against the base; issue 31: an 8B update under 100 ms
    run lora 240 "$PYTHON" -m jaxvllm bench throughput "${LORA_ARGS[@]}" --num-loras 4 --max-lora-rank 16 \
        --disable-tqdm --output-json "$OUT/lora.json"
    run weight_update 240 "$PYTHON" -m jaxvllm.benchmarks.weight_update --model "${WEIGHTS_MODELS[@]}" \
        --json "$OUT/weight_update.json"
fi

if [ "$SPEC" = 1 ]; then  # issue 28: n-gram inter-token latency at batch 1 and 16, with and without drafts
    NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    for batch in 1 16; do
        run "spec_b$batch" 240 "$PYTHON" -m jaxvllm bench latency "${SPEC_ARGS[@]}" --dataset repeat \
            --batch-size "$batch" --speculative-config "$NGRAM" --compare-speculative --output-json "$OUT/spec_b$batch.json"
    done
fi

[ "$DRY" = 1 ] || cat "$OUT/summary.txt"
exit "$FAILED"
