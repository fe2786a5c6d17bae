"""Compile the engine step for an H100/H200 on a machine without a GPU (deviceless AOT).

    scripts/gpu_aot_check.sh                      # the kernels' check, then this one
    JAX_PLATFORMS=cpu python -m jaxvllm.benchmarks.aot_engine [--quick] [--json PATH]

The same compile-only sm_90a device and CUDA PJRT plugin as `pallas_kernels.aot_check`
(its docstring says what to install). A step fails when its compiled HLO
- copies a donated KV cache or sampler state: the copy costs the buffer's full size in
  memory traffic on every step;
- updates fewer donated buffers in place (input_output_alias) than it was given;
- holds a `conditional`: XLA's GPU runtime copies each predicate to the host and waits
  for it, a device-to-host sync in the middle of every step.
The step's kernels are the kernel check's own cases, so there is no second ptxas pass.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp

from jaxvllm.config import ModelConfig
from jaxvllm.dummy import get_dummy
from jaxvllm.loader import dummy_params
from pallas_kernels.aot_check import Case, check, problems as compile_problems, spec
from pallas_kernels.hlo import count_cache_copies

STATE_ARRAYS = 4  # SamplerState's donated [max_num_seqs, vocab] arrays


def engine_step_case(backend: str, model: str = "qwen3-0.6b", num_tokens: int = 256, max_num_seqs: int = 256,
                     context: int = 1024, block_size: int = 16, dtype=jnp.bfloat16) -> Case:
    """The model runner's jitted step (model + sampler, caches and sampler state donated)
    for a bucket of `num_tokens` tokens, one sequence each, at `context` tokens.

    The only code here that knows the runner's API (imported here, so that the rest of
    the module does not depend on it): params name the donated buffers (`cache_shape`,
    `state_shape`, `donated`) for `inspect` and `problems`."""
    from jaxvllm.batch import ModelInputs
    from jaxvllm.model_runner import jit_step, sampling_tensors, sequence_rows
    from jaxvllm.sampler import init_state

    cfg = ModelConfig.from_hf(get_dummy(model).make_config())
    rows = sequence_rows(max_num_seqs, num_tokens)
    max_blocks = context // block_size
    cache = spec((cfg.num_kv_heads, rows * max_blocks, block_size, cfg.head_dim), dtype)
    inputs = ModelInputs(spec((num_tokens,)), spec((num_tokens,)), spec((num_tokens,)), spec((rows + 1,)),
                         spec((rows,)), spec((rows, max_blocks)), spec((rows,)))
    args = [
        jax.eval_shape(lambda: dummy_params(cfg, dtype)),
        [(cache, cache)] * cfg.num_layers,
        jax.eval_shape(lambda: init_state(max_num_seqs, cfg.vocab_size)),
        inputs,
        jax.tree.map(lambda x: spec(x.shape, x.dtype), sampling_tensors([], rows, {})),
        spec((num_tokens,)),
    ]
    params = dict(backend=backend, model=model, dtype=jnp.dtype(dtype).name, num_tokens=num_tokens, context=context,
                  num_layers=cfg.num_layers, cache_shape=list(cache.shape),
                  state_shape=[max_num_seqs, cfg.vocab_size], donated=2 * cfg.num_layers + STATE_ARRAYS)
    return Case("engine_step", params, jit_step(cfg, backend), args)


def engine_cases(quick: bool = False) -> list[Case]:
    """A small and the full decode bucket, a prefill bucket; the reference path once; and
    the tiny float32 model that scripts/gpu_check.sh's engine parity test runs. Few
    enough that `quick` keeps them all."""
    return [engine_step_case("pallas", num_tokens=t) for t in (16, 256, 2048)] + [
        engine_step_case("reference"),
        engine_step_case("pallas", model="tiny", num_tokens=64, max_num_seqs=8, context=256, dtype=jnp.float32),
    ]


def aliased_outputs(hlo: str) -> int:
    """How many outputs reuse a donated input's buffer (`input_output_alias` entries)."""
    header = hlo.split("\n", 1)[0]
    return len(re.findall(r"\{[\d,\s]*\}: \(\d+, \{[\d,\s]*\}, (?:may|must)-alias\)", header))


def conditionals(hlo_text: str) -> int:
    """`conditional` ops anywhere in an optimized HLO module (each one a host sync on a GPU)."""
    return hlo_text.count(" conditional(")


def inspect(case: Case, hlo: str) -> dict:
    """The compiled step's figures that `problems` judges."""
    shapes = (case.params["cache_shape"], case.params["state_shape"])
    return {"cache_copies": sum(count_cache_copies(hlo, tuple(s)) for s in shapes),
            "aliased_outputs": aliased_outputs(hlo), "conditionals": conditionals(hlo)}


def problems(case: Case) -> list[str]:
    """The kernel check's problems (compile errors, spills), then the step's own."""
    found = compile_problems(case)
    r = case.result
    if not r.get("ok"):
        return found
    if r["cache_copies"]:
        found.append(f"{r['cache_copies']} copies of a KV cache or sampler state in the compiled step")
    if r["aliased_outputs"] < case.params["donated"]:
        found.append(f"only {r['aliased_outputs']} of {case.params['donated']} donated buffers are updated in place")
    if r["conditionals"]:
        found.append(f"{r['conditionals']} conditionals in the compiled step (a host sync each)")
    return found


def main(argv: list[str] | None = None) -> int:
    return check(argv, __doc__, "aot_engine", engine_cases, use_ptxas=False, inspect=inspect, judge=problems)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
