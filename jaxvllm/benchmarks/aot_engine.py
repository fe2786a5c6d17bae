"""Compile the engine's per-step executables (forward, sampler) for an H100/H200 on a machine without a GPU (deviceless AOT).

    scripts/gpu_aot_check.sh                      # the kernels' check, then this one
    JAX_PLATFORMS=cpu python -m jaxvllm.benchmarks.aot_engine [--quick] [--json PATH]

The same compile-only sm_90a device and CUDA PJRT plugin as `pallas_kernels.aot_check`
(its docstring says what to install). A step fails when its compiled HLO
- copies a donated KV cache or sampler state: the copy costs the buffer's full size in
  memory traffic on every step;
- copies, transposes or converts a whole weight or cache (`parameter_rewrites`): the same
  cost, for a layout or dtype XLA wanted otherwise;
- updates fewer donated buffers in place (input_output_alias) than it was given;
- holds a `conditional`: XLA's GPU runtime copies each predicate to the host and waits
  for it, a device-to-host sync in the middle of every step;
- holds a `while` loop whose trip count XLA does not know (a sync per iteration);
- holds instructions XLA's rematerialization pass recomputed (named `*.remat*`): over a
  cache that fills the device, the pass judged the step over its memory limit;
- on the pallas backend, runs any thunk outside XLA's command buffers (CUDA graphs): the
  host then launches it, or each iteration of a loop, on every step, where a graph is one
  launch for the whole step (the reference backend's loops are left so).
The step's kernels are the kernel check's own cases, so there is no second ptxas pass.
"""

from __future__ import annotations

import math
import re
import sys
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from jaxvllm.model_config import ModelConfig
from jaxvllm.dummy import get_dummy
from jaxvllm.loader import dummy_params
from pallas_kernels.aot_check import Case, check, problems as compile_problems, spec
from pallas_kernels.hlo import count_cache_copies, parameter_rewrites

STATE_ARRAYS = 4  # SamplerState's donated [max_num_seqs, vocab] arrays


def engine_step_cases(backend: str, model: str = "qwen3-0.6b", num_tokens: int = 256, max_num_seqs: int = 256,
                      context: int = 1024, block_size: int = 16, dtype=jnp.bfloat16,
                      sampler: tuple[str, ...] = ("greedy", "all"), kv_cache_dtype=None,
                      decode_only: bool = False, spec_tokens: int = 0, device_drafts: bool = False,
                      quantization: str | None = None, lora_slots: int = 0, lora_rank: int = 16,
                      num_layers: int | None = None) -> list[Case]:
    """The model runner's per-step executables for a bucket of `num_tokens` tokens, one
    sequence each at `context` tokens: the forward (KV caches donated) and the sampler
    (last sampled ids and sampler state donated) with no feature, or every one, on.
    `kv_cache_dtype`: the cache's dtype when not the model's (fp8: each layer's cache
    carries its KV heads' float32 (k_scale, v_scale), donated with it). `decode_only`: the
    forward the pallas backend runs for a step of one token per sequence. `spec_tokens` K: a
    speculative step's (drafts verified in the sampler), and the draft model's proposer of K
    tokens (the model drafting for itself); with `device_drafts`, as under async scheduling:
    the drafts and position corrections read from the device (`BatchLayout.device_drafts`)
    and the draft model's proposer after the step (`_propose_rows`). `quantization` "fp8": the forward over online
    fp8 weights (`jaxvllm.quantization`), per channel; "fp8-block": over a block-fp8
    checkpoint's (scales per 128 x 128 block); "gptq-dummy": over 4-bit weights (W4A16,
    scales per 128 inputs). `lora_slots` S: a step with LoRA adapters, S slots of rank
    `lora_rank` on every linear layer weight (`jaxvllm.lora`). `num_layers`: the model cut to
    its first layers.

    The only code here that knows the runner's API (imported here, so that the rest of
    the module does not depend on it): params name the donated buffers (`copy_shapes`,
    `donated`) for `inspect` and `problems`."""
    from jaxvllm.input_batch import BatchLayout
    from jaxvllm.batch_builder import sequence_rows
    from jaxvllm.model_runner import jit_forward, jit_sampler
    from jaxvllm.sampler import SamplerFeatures, init_state
    from jaxvllm.structured_output import bitmask_words

    hf_config = get_dummy(model).make_config()
    if num_layers is not None:
        hf_config.num_hidden_layers = num_layers
        if getattr(hf_config, "layer_types", None):
            hf_config.layer_types = hf_config.layer_types[:num_layers]
    cfg = ModelConfig.from_hf(hf_config)
    rows = sequence_rows(max_num_seqs, num_tokens)
    layout = BatchLayout(num_tokens, rows, context // block_size, decode_only, spec_tokens=spec_tokens,
                         lora=lora_slots > 0, lora_kernel=lora_slots > 0 and backend == "pallas",
                         device_drafts=device_drafts, block_size=block_size if device_drafts else 0)
    def caches(num_layers: int) -> tuple:  # every layer's, as `allocate_kv_caches` lays them out
        cache = spec((cfg.num_kv_heads, num_layers, rows * layout.width, block_size, cfg.head_dim),
                     kv_cache_dtype or dtype)
        scales = spec((cfg.num_kv_heads, num_layers, 2), jnp.float32)  # an fp8 cache's, per KV head
        return (cache, cache) if kv_cache_dtype is None else (cache, cache, scales)

    kv_caches = caches(cfg.num_layers)
    packed, last_sampled = spec((layout.size,)), spec((max_num_seqs,))
    common = dict(backend=backend, model=model, dtype=jnp.dtype(dtype).name, num_tokens=num_tokens, context=context)
    if decode_only:
        common["decode_only"] = True
    if kv_cache_dtype is not None:
        common["kv_cache"] = jnp.dtype(kv_cache_dtype).name
    if spec_tokens:
        common["spec_tokens"] = spec_tokens
    draft_rows = spec((max_num_seqs, 2 + spec_tokens)) if device_drafts else None
    if device_drafts:
        common["device_drafts"] = True
    params = jax.eval_shape(lambda: dummy_params(cfg, dtype))
    if quantization is not None:
        from jaxvllm.models import MODELS
        from jaxvllm.quantization import (EXPERT_STACK, FP8, ONLINE, QuantizedWeight, quantize_online,
                                          quantize_params, single_device_kernels)

        def blocks(w, num_in: int) -> QuantizedWeight:  # a block-fp8 checkpoint's weight, as loaded
            if num_in == EXPERT_STACK:  # [E, in, out]: scales [E, in blocks, out] (each block's, per column)
                e, inputs, out = w.shape
                return QuantizedWeight(w.astype(FP8), jnp.ones((e, -(-inputs // 128), out), jnp.float32), 128)
            out, inputs = w.shape[: w.ndim - num_in], math.prod(w.shape[w.ndim - num_in:])
            return QuantizedWeight(w.astype(FP8), jnp.ones((*out, -(-inputs // 128)), jnp.float32), 128)

        common["quantization"] = quantization
        quantize = partial(quantize_online, method=quantization) if quantization in ONLINE else blocks
        params = jax.eval_shape(lambda: single_device_kernels(quantize_params(
            dummy_params(cfg, dtype), MODELS[cfg.architecture].param_specs(cfg), quantize)))
    lora = None
    if lora_slots:
        from jaxvllm.lora.adapter import lora_targets
        from jaxvllm.models import MODELS

        common.update(lora_slots=lora_slots, lora_rank=lora_rank)
        def stack(shape: tuple[int, ...]):  # [rows, slots, ...]
            return spec((shape[0], lora_slots, *shape[1:]), dtype)

        lora = {}
        for t in lora_targets(MODELS[cfg.architecture].param_specs(cfg)):
            a, bs = t.slot_shapes(lora_rank)
            lora[t.name] = (stack(a), tuple(map(stack, bs)))
    forward = jit_forward(cfg, backend)
    cases = [Case("engine_forward", dict(common, num_layers=cfg.num_layers, copy_shapes=[list(kv_caches[0].shape)],
                                         donated=len(kv_caches)),
                  SimpleNamespace(trace=partial(forward.trace, layout=layout)),
                  [params, kv_caches, packed, last_sampled, lora, draft_rows])]
    everything = SamplerFeatures(random=True, min_p=True, top_k=True, top_p=True, state=True, bad_words=True, logprobs=20,
                                 grammar=True)
    for name in sampler:
        features = everything if name == "all" else SamplerFeatures()
        state = jax.eval_shape(lambda: init_state(max_num_seqs, cfg.vocab_size)) if features.state else None
        cases.append(Case("engine_sampler", dict(common, features=features.name,
                                                 copy_shapes=[[max_num_seqs, cfg.vocab_size]] if state else [],
                                                 donated=1 + (STATE_ARRAYS if state else 0) + device_drafts),
                          SimpleNamespace(trace=partial(jit_sampler().trace, num_rows=rows, features=features,
                                                        spec_tokens=spec_tokens, device_drafts=device_drafts)),
                          [spec((layout.sampling_size,)), spec((layout.num_logits, cfg.vocab_size), jnp.float32),
                           last_sampled, state,
                           spec((layout.num_logits, bitmask_words(cfg.vocab_size))) if features.grammar else None,
                           draft_rows]))
    if device_drafts:
        from jaxvllm.spec_decode.draft_model import jit_propose_rows

        propose_rows = jit_propose_rows(cfg, backend, None, spec_tokens, block_size)
        cases.append(Case("draft_propose_rows", dict(common, num_layers=cfg.num_layers,
                                                     copy_shapes=[list(kv_caches[0].shape)],
                                                     donated=len(kv_caches) + 1),
                          SimpleNamespace(trace=propose_rows.trace),
                          [jax.eval_shape(lambda: dummy_params(cfg, dtype)), kv_caches, spec((max_num_seqs,)),
                           spec((max_num_seqs,), jnp.bool_), spec((max_num_seqs, layout.width)), last_sampled,
                           draft_rows]))
        cases += eagle_cases(cfg, backend, layout, block_size, dtype, caches(1), [packed, last_sampled], common,
                             max_num_seqs, draft_rows)
    elif spec_tokens:
        from jaxvllm.spec_decode.draft_model import jit_propose

        propose = jit_propose(cfg, backend, None, spec_tokens, block_size)
        cases.append(Case("draft_propose", dict(common, num_layers=cfg.num_layers,
                                                copy_shapes=[list(kv_caches[0].shape)], donated=len(kv_caches)),
                          SimpleNamespace(trace=propose.trace),
                          [jax.eval_shape(lambda: dummy_params(cfg, dtype)), kv_caches,
                           spec((max_num_seqs,)), spec((max_num_seqs,)), spec((max_num_seqs,), jnp.bool_),
                           spec((max_num_seqs, layout.width))]))
        cases += eagle_cases(cfg, backend, layout, block_size, dtype, caches(1), [packed, last_sampled], common,
                             max_num_seqs)
    return cases


def eagle_cases(cfg: ModelConfig, backend: str, layout, block_size: int, dtype, head_caches, step: list,
                common: dict, max_num_seqs: int, draft_rows=None) -> list[Case]:
    """An EAGLE-3 head of one layer (a draft vocabulary of a quarter of the target's) after a
    target step of `layout`: its prefill over the step's tokens, and K drafts for every row
    (with `draft_rows`: the device-drafts forms, after the step's sampler)."""
    import dataclasses

    from jaxvllm.spec_decode.eagle import EagleConfig, default_aux_layers, jit_eagle, param_specs

    head = dataclasses.replace(cfg, num_layers=1)
    e = EagleConfig("eagle3", head, cfg.vocab_size // 4, cfg.hidden_size, default_aux_layers(cfg.num_layers))
    prefill, decode = jit_eagle(e, head, cfg, backend, None, layout.spec_tokens, block_size,
                                device_drafts=draft_rows is not None)
    t, s = layout.num_tokens, max_num_seqs
    params = jax.eval_shape(lambda: dummy_params(head, dtype, specs=param_specs(e, set())))
    target = jax.eval_shape(lambda: dummy_params(cfg, dtype))
    one_layer = dict(common, num_layers=1, copy_shapes=[list(head_caches[0].shape)], donated=len(head_caches))
    states = spec((s, cfg.hidden_size), dtype)
    if draft_rows is not None:
        rows = spec((layout.num_rows,))
        return [Case("eagle_prefill_rows", one_layer, SimpleNamespace(trace=partial(prefill.trace, layout=layout)),
                     [params, target, head_caches, spec((t, 3 * cfg.hidden_size), dtype), *step, draft_rows, rows,
                      rows, rows, spec((s,))]),
                Case("eagle_decode_rows", dict(one_layer, donated=len(head_caches) + 1),
                     SimpleNamespace(trace=decode.trace),
                     [params, target, head_caches, states, states, spec((s,)), spec((s,), jnp.bool_),
                      spec((s, layout.width)), draft_rows])]
    return [Case("eagle_prefill", one_layer, SimpleNamespace(trace=partial(prefill.trace, layout=layout)),
                 [params, target, head_caches, spec((t, 3 * cfg.hidden_size), dtype), *step, spec((t,)),
                  spec((t,), jnp.bool_), spec((s,))]),
            Case("eagle_decode", one_layer, SimpleNamespace(trace=decode.trace),
                 [params, target, head_caches, states, states, spec((s,)), spec((s,), jnp.bool_),
                  spec((s, layout.width))])]


def engine_cases(quick: bool = False) -> list[Case]:
    """A small and the full decode bucket, a prefill bucket; the reference path once; and
    the tiny float32 model that scripts/gpu_check.sh's engine parity test runs. `quick`
    (CI's run) compiles every case with each model cut to 2 layers: what `problems` judges
    (copies, in-place updates, conditionals, loops, CUDA graphs) is the same at any depth,
    while the launch counts, temporaries and compile times to report come from a full run."""
    step_cases = partial(engine_step_cases, num_layers=2 if quick else None)
    cases = [c for t in (16, 256, 2048) for c in step_cases("pallas", num_tokens=t, sampler=("all",))]
    cases += step_cases("reference", sampler=("greedy",))
    # A cache of 56 GiB, as the runner sizes one to fill an H200 (the 28-layer model's at
    # 2048 tokens a sequence): its size must not set off XLA's rematerialization.
    cases += step_cases("pallas", sampler=(), context=2048 * 28 // (2 if quick else 28))
    cases += step_cases("pallas", sampler=(), kv_cache_dtype=jnp.float8_e4m3fn)  # fp8 KV cache, decode
    for kv_cache_dtype in (None, jnp.float8_e4m3fn):  # the decode-only forward of a step of 256 decode rows
        cases += step_cases("pallas", sampler=(), kv_cache_dtype=kv_cache_dtype, decode_only=True)
    # fp8 weights, online (per channel) and a block-fp8 checkpoint's, and 4-bit weights: a decode-only step
    # and a prefill bucket.
    for quantization in ("fp8", "fp8-block", "gptq-dummy"):
        cases += step_cases("pallas", sampler=(), decode_only=True, quantization=quantization)
        cases += step_cases("pallas", num_tokens=2048, sampler=(), quantization=quantization)
    # 4-bit experts (Qwen3-30B-A3B, gptq-dummy): the grouped W4A16 kernel on the int4 stacks, a decode-only step.
    cases += step_cases("pallas", model="qwen3-30b-a3b", sampler=(), decode_only=True, quantization="gptq-dummy")
    # block-fp8 experts (Qwen3-30B-A3B-FP8): each projection one grouped kernel call over its 128-input blocks.
    cases += step_cases("pallas", model="qwen3-30b-a3b", sampler=(), decode_only=True, quantization="fp8-block")
    # LoRA: 4 adapter slots of rank 16 on every linear layer weight, decode-only and a prefill bucket.
    cases += step_cases("pallas", sampler=(), decode_only=True, lora_slots=4)
    cases += step_cases("pallas", num_tokens=2048, sampler=(), lora_slots=4)
    cases += step_cases("pallas", model="tiny", num_tokens=64, max_num_seqs=8, context=256, dtype=jnp.float32,
                        sampler=())
    # Speculative decoding: a step verifying 4 drafts a row, the draft model's proposer and an EAGLE-3 head's;
    # and with the drafts on the device (async scheduling), the step and the proposer after it.
    cases += step_cases("pallas", num_tokens=256, max_num_seqs=64, sampler=("greedy", "all"), spec_tokens=4)
    cases += step_cases("pallas", num_tokens=256, max_num_seqs=64, sampler=("all",), spec_tokens=4,
                        device_drafts=True)
    return cases


def aliased_outputs(hlo: str) -> int:
    """How many outputs reuse a donated input's buffer (`input_output_alias` entries)."""
    header = hlo.split("\n", 1)[0]
    return len(re.findall(r"\{[\d,\s]*\}: \(\d+, \{[\d,\s]*\}, (?:may|must)-alias\)", header))


def conditionals(hlo_text: str) -> int:
    """`conditional` ops anywhere in an optimized HLO module (each one a host sync on a GPU)."""
    return hlo_text.count(" conditional(")


def unbounded_loops(hlo_text: str) -> int:
    """`while` ops whose trip count XLA does not know: the GPU runtime then copies the loop
    condition to the host on every iteration."""
    return sum(1 for line in hlo_text.splitlines() if " while(" in line and "known_trip_count" not in line)


def rematerialized(hlo_text: str) -> int:
    """Instructions the rematerialization pass added (copies of others, named `*.remat*`)."""
    return len(re.findall(r"^\s+(?:ROOT )?%?[\w.\-]*\.remat[\w.\-]* = ", hlo_text, re.M))


# Ops of an entry computation that launch nothing on a GPU.
_NO_LAUNCH = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant"}


def launches(hlo_text: str) -> int:
    """Kernels (fusions, custom calls, other ops) the compiled step's entry computation
    runs: each one a launch per step, on the device and, outside a CUDA graph, the host."""
    entry = hlo_text[hlo_text.index("\nENTRY"):].split("\n}", 1)[0]
    ops = re.findall(r"^\s+(?:ROOT )?\S+ = (?:\([^=]*?\)|\S+) ([\w-]+)\(", entry, re.M)  # a shape, or a tuple's
    return sum(op not in _NO_LAUNCH for op in ops)


# A rewrite of a parameter this large costs memory traffic worth a failure: a weight or a cache.
MIN_REWRITE = 1 << 16


def inspect(case: Case, hlo: str) -> dict:
    """The compiled step's figures that `problems` judges, and its kernel count."""
    return {"cache_copies": sum(count_cache_copies(hlo, tuple(s)) for s in case.params["copy_shapes"]),
            # (a batch's small integer inputs, such as block tables, may be offset in a fusion of their own)
            "parameter_rewrites": sum(n >= MIN_REWRITE for n in parameter_rewrites(hlo).values()),
            "aliased_outputs": aliased_outputs(hlo), "conditionals": conditionals(hlo),
            "unbounded_loops": unbounded_loops(hlo), "rematerialized": rematerialized(hlo),
            "launches": launches(hlo)}


def problems(case: Case) -> list[str]:
    """The kernel check's problems (compile errors, spills), then the step's own."""
    found = compile_problems(case)
    r = case.result
    if not r.get("ok"):
        return found
    if r["cache_copies"]:
        found.append(f"{r['cache_copies']} copies of a KV cache or sampler state in the compiled step")
    if r.get("parameter_rewrites"):
        found.append(f"{r['parameter_rewrites']} weights or caches copied or converted whole in the compiled step")
    if r["aliased_outputs"] < case.params["donated"]:
        found.append(f"only {r['aliased_outputs']} of {case.params['donated']} donated buffers are updated in place")
    if r["conditionals"]:
        found.append(f"{r['conditionals']} conditionals in the compiled step (a host sync each)")
    if r.get("unbounded_loops"):
        found.append(f"{r['unbounded_loops']} while loops without a known trip count (a host sync per iteration)")
    if r.get("rematerialized"):
        found.append(f"{r['rematerialized']} instructions recomputed by XLA's rematerialization pass")
    if r.get("ungraphed_thunks") and case.params.get("backend") == "pallas":
        found.append(f"{r['ungraphed_thunks']} thunks outside CUDA graphs (host launches on every step)")
    return found


def main(argv: list[str] | None = None) -> int:
    return check(argv, __doc__, "aot_engine", engine_cases, use_ptxas=False, inspect=inspect, judge=problems)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
