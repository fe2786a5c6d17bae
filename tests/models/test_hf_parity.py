"""Parity with HF transformers (float32, CPU) of every tiny architecture (weights/make_tiny.py):
the model through the paged KV cache (a prompt's logits, greedy decoding, batched, chunked and
mixed steps) and, for Gemma 3 and the mixtures of experts, the engine (greedy tokens with
prefix caching, preemption and the Pallas kernels).

What differs between the architectures is data: `ARCHS` (one entry per architecture) and the
checkpoint variants `PROMPTS` and `WINDOWS`; each check is written once. Errors are
max |logit difference| / max |HF logit| (`rel_err`); the bound is 1e-4 in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from tests.models.paged import (Chunk, build_inputs, greedy_decode, hf_greedy, hf_logits, jit_forward, mixed_errors,
                                mixed_steps, random_tokens, rel_err)
from weights.make_tiny import ARCHITECTURES

TOL = 1e-4
BLOCK = 4
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def engine_prompts(seed: int, layout) -> list[list[int]]:
    """Random prompts drawn from `seed` in the order of `layout`: an int n is a prompt of n
    tokens, a pair (p, lengths) a p-token prefix shared by prompts of p + each length tokens."""
    rng, prompts = np.random.default_rng(seed), []
    for item in layout:
        if isinstance(item, int):
            prompts.append(random_tokens(rng, item))
        else:
            prefix = random_tokens(rng, item[0])
            prompts += [prefix + random_tokens(rng, n) for n in item[1]]
    return prompts


@dataclass(frozen=True)
class Engine:
    """The engine checks of one architecture."""

    prompts: list[list[int]]  # greedy parity with prefix caching and with preemption
    reverse_rerun: bool = False  # the prefix-cached second run takes the prompts in reverse
    pallas_prompts: list[list[int]] | None = None  # a short run on both backends (None: none)
    pallas_args: dict = field(default_factory=dict)  # engine arguments of the Pallas run


@dataclass(frozen=True)
class Arch:
    """What one architecture's checks need besides the defaults."""

    num_blocks: int = 32  # of the paged cache (the decode check shuffles them)
    bf16: bool = False  # also checked in bfloat16 against HF's float32
    # two sequences in one padded batch = each alone (3 more compiled shapes: a few seconds of
    # CI time an architecture; the mixed-batch check covers the others' padded batches)
    batched: bool = True
    engine: Engine | None = None


# Mixed lengths (1 to 100 tokens; above the 64-token budget: chunked prefill) and four prompts
# sharing a 40-token prefix (prefix-cache hits within the first run).
GEMMA3_PROMPTS = engine_prompts(0, [1, 2, 5, 9, 16, 17, 30, 70, 100, (40, [3, 11, 24, 50])])
# A shared prefix of 2 full blocks of 16 for the prefix cache, then prompts alone.
MOE_PROMPTS = engine_prompts(7, [(40, [3, 9, 20]), 1, 17, 100])

ARCHS: dict[str, Arch] = {
    "llama": Arch(bf16=True),
    "mistral": Arch(),
    "qwen2": Arch(),
    "qwen3": Arch(bf16=True),
    # prompts run past its sliding window (8)
    "gemma3": Arch(num_blocks=48, bf16=True, batched=False, engine=Engine(
        GEMMA3_PROMPTS, reverse_rerun=True,
        # 1, 9, 70 tokens (chunked), and one past the shared prefix
        pallas_prompts=[GEMMA3_PROMPTS[i] for i in (0, 3, 7, 10)])),
    "qwen3_moe": Arch(batched=False, engine=Engine(
        MOE_PROMPTS, pallas_prompts=[list(range(5, 5 + n)) for n in (3, 21)], pallas_args=dict(enforce_eager=True))),
    "mixtral": Arch(batched=False, engine=Engine(MOE_PROMPTS)),
}
ENGINE_ARCHS = [a for a, arch in ARCHS.items() if arch.engine]


@dataclass(frozen=True)
class Prompt:
    """A prompt's logits, all positions in one step: `n` random tokens from `seed` in cache
    blocks 0 .. `blocks` - 1, of `arch`'s tiny checkpoint made with `overrides`."""

    arch: str
    overrides: dict = field(default_factory=dict)  # make_tiny's (config overrides, save format)
    seed: int = 0
    n: int = 27
    blocks: int = 8
    expect: dict = field(default_factory=dict)  # ModelConfig fields the checkpoint gives
    logit_bound: float | None = None  # every |logit| is below it
    softcapped_hf: bool = False  # HF's reference is eager attention with the soft-cap (see `softcap_attention`)


PROMPTS: dict[str, Prompt] = {
    # 27 tokens: over three of Gemma 3's windows, and each architecture's defaults
    **{a: Prompt(a) for a in ARCHS},
    "gemma3-final-softcap": Prompt("gemma3", dict(final_logit_softcapping=3.0), seed=7, n=20, blocks=5,
                                   expect=dict(final_logit_softcapping=3.0), logit_bound=3.0),
    "gemma3-attn-softcap": Prompt("gemma3", dict(attn_logit_softcapping=0.5), seed=8, n=20, blocks=5,
                                  expect=dict(attn_logit_softcapping=0.5), softcapped_hf=True),
    # norm_topk_prob=True (Qwen3-30B-A3B's setting) and a dense layer from decoder_sparse_step
    "qwen3_moe-renormalized": Prompt("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=None,
                                                       decoder_sparse_step=2), seed=4, n=19, blocks=5,
                                     expect=dict(norm_topk_prob=True, moe_layers=(False, True))),
    # transformers 5's own layout: experts fused into [E, ...] tensors (tests/models/test_moe.py: the same params)
    **{f"{a}-fused": Prompt(a, dict(save_original_format=False), seed=8, n=11, blocks=3)
       for a in ("qwen3_moe", "mixtral")},
}

# (architecture, sliding_window override): a prompt, then decode steps past the window
WINDOWS = [("mistral", 5), ("mistral", 8)]


def test_every_tiny_architecture_is_checked():
    assert sorted(ARCHS) == sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, hf_model):
    """loaded(arch, dtype="auto", **overrides) -> (path, cfg, params, HF model); loaded once per module."""
    models: dict = {}

    def get(arch: str, dtype: str = "auto", **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in models:
            path = tiny_checkpoint(arch, **overrides)
            models[key] = (path, *load_model(path, dtype=dtype), hf_model(path))
        return models[key]

    return get


def fresh_caches(cfg, arch: str, dtype=jnp.float32):
    return allocate_kv_caches(cfg, ARCHS[arch].num_blocks, BLOCK, dtype)


# -- The model through the paged cache -------------------------------------------------------


@pytest.fixture(scope="module")
def softcap_attention():
    """An HF attention implementation that soft-caps the scores with `attn_logit_softcapping`:
    transformers' Gemma3Attention keeps the value but never passes it to its attention
    function (eager or sdpa), so HF's Gemma 3 ignores it; this is the reference for the cap."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gemma3 import modeling_gemma3

    def eager_softcap(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("sliding_window", None)  # already in the mask
        return modeling_gemma3.eager_attention_forward(
            module, query, key, value, attention_mask, softcap=module.attn_logit_softcapping, **kwargs
        )

    AttentionInterface.register("jaxvllm_eager_softcap", eager_softcap)
    AttentionMaskInterface.register("jaxvllm_eager_softcap", eager_mask)
    return "jaxvllm_eager_softcap"


@pytest.mark.parametrize("case", PROMPTS.values(), ids=PROMPTS)
def test_full_prompt_logits(case, loaded, request):
    path, cfg, params, hf = loaded(case.arch, **case.overrides)
    assert {k: getattr(cfg, k) for k in case.expect} == case.expect
    tokens = random_tokens(np.random.default_rng(case.seed), case.n)
    inputs = build_inputs([Chunk(tokens, 0, list(range(case.blocks)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg, case.arch), inputs, cfg, "reference")
    want = hf_logits(hf, tokens)
    if case.softcapped_hf:
        from transformers import AutoModelForCausalLM

        capped = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                      attn_implementation=request.getfixturevalue("softcap_attention"))
        want, uncapped = hf_logits(capped.eval(), tokens), want
        assert rel_err(want, uncapped) > 0.01  # the cap matters
    if case.logit_bound is not None:
        assert np.abs(np.asarray(logits)).max() < case.logit_bound
    err = rel_err(logits, want)
    print(f"{request.node.callspec.id} full-prompt rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_shuffled_blocks(arch, loaded):
    """Prompt, then one greedy token at a time (past Gemma 3's window), with physical blocks in random order."""
    _, cfg, params, hf = loaded(arch)
    rng = np.random.default_rng(1)
    prompt, steps = random_tokens(rng, 13), 14
    blocks = [int(b) for b in rng.permutation(ARCHS[arch].num_blocks)[:8]]
    assert blocks != sorted(blocks)

    tokens, got = greedy_decode(params, cfg, fresh_caches(cfg, arch), prompt, steps, blocks, BLOCK)
    want = hf_logits(hf, tokens)[len(prompt) - 1 :]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    print(f"{arch} decode max rel err {max(errs):.2e} over {len(errs)} steps")
    assert max(errs) <= TOL


@pytest.mark.parametrize("arch", [a for a, arch in ARCHS.items() if arch.batched])
def test_batched_sequences_match_each_alone(arch, loaded):
    """Two sequences of different lengths in one padded flat batch = each one alone."""
    _, cfg, params, hf = loaded(arch)
    rng = np.random.default_rng(2)
    a, b = random_tokens(rng, 7), random_tokens(rng, 18)
    chunk_a, chunk_b = Chunk(a, 0, [9, 3]), Chunk(b, 0, [0, 17, 5, 30, 12])

    batched = build_inputs([chunk_a, chunk_b], BLOCK, pad_tokens_to=32, pad_seqs_to=4)
    logits, _ = jit_forward(params, fresh_caches(cfg, arch), batched, cfg, "reference")
    alone_a, _ = jit_forward(params, fresh_caches(cfg, arch), build_inputs([chunk_a], BLOCK), cfg, "reference")
    alone_b, _ = jit_forward(params, fresh_caches(cfg, arch), build_inputs([chunk_b], BLOCK), cfg, "reference")
    np.testing.assert_allclose(logits[0], alone_a[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits[1], alone_b[0], rtol=0, atol=1e-5)
    assert rel_err(logits[0], hf_logits(hf, a)[-1]) <= TOL
    assert rel_err(logits[1], hf_logits(hf, b)[-1]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_mixed_batch(arch, loaded):
    """A prompt in two chunks (the first ends mid-block), the second sharing a padded step with
    another sequence's decode."""
    _, cfg, params, hf = loaded(arch)
    a, b, next_a, logits1, logits2, _ = mixed_steps(params, cfg, fresh_caches(cfg, arch), np.random.default_rng(3),
                                                    BLOCK)
    errs = mixed_errors(hf, a, b, next_a, logits1, logits2)
    print(f"{arch} chunked/mixed max rel err {max(errs):.2e}")
    assert max(errs) <= TOL


@pytest.mark.parametrize("arch, window", WINDOWS, ids=[f"{a}-window={w}" for a, w in WINDOWS])
def test_sliding_window_prefill_then_decode(arch, window, loaded):
    """The prompt's logits in one step, then decode steps past the window, in shuffled blocks."""
    _, cfg, params, hf = loaded(arch, sliding_window=window)
    assert cfg.sliding_windows == (window,) * cfg.num_layers
    tokens = random_tokens(np.random.default_rng(4), 22)
    blocks = [int(b) for b in np.random.default_rng(5).permutation(ARCHS[arch].num_blocks)[:8]]
    want = hf_logits(hf, tokens)
    caches = fresh_caches(cfg, arch)
    prefill = build_inputs([Chunk(tokens[:-3], 0, blocks)], BLOCK, all_logits=True)
    logits, caches = jit_forward(params, caches, prefill, cfg, "reference")
    assert rel_err(logits, want[:-3]) <= TOL
    for i in range(len(tokens) - 3, len(tokens)):
        logits, caches = jit_forward(params, caches, build_inputs([Chunk([tokens[i]], i, blocks)], BLOCK), cfg,
                                     "reference")
        assert rel_err(logits[0], want[i]) <= TOL


@pytest.mark.parametrize("arch", [a for a, arch in ARCHS.items() if arch.bf16])
def test_bfloat16_close_to_float32_reference(arch, loaded):
    _, cfg, params, hf = loaded(arch, dtype="bfloat16")
    tokens = random_tokens(np.random.default_rng(6), 16)
    inputs = build_inputs([Chunk(tokens, 0, list(range(4)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg, arch, jnp.bfloat16), inputs, cfg, "reference")
    want = hf_logits(hf, tokens)
    assert logits.dtype == jnp.float32
    # bf16 keeps 8 bits of mantissa: a few percent of the logit scale, and mostly the same argmax.
    assert rel_err(logits, want) < 0.05
    assert np.mean(np.argmax(logits, -1) == np.argmax(want, -1)) >= 0.8


# -- The engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_case(loaded):
    """engine_case(arch) -> (path, its Engine, HF's greedy completions of its prompts); once per arch."""
    cases: dict = {}

    def get(arch: str):
        if arch not in cases:
            path, _, _, hf = loaded(arch)
            engine = ARCHS[arch].engine
            cases[arch] = str(path), engine, hf_greedy(hf, engine.prompts, MAX_TOKENS)
        return cases[arch]

    return get


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_greedy_matches_hf_with_prefix_caching(arch, engine_case):
    """Chunked prefill (a 100-token prompt over 64-token steps), then the same prompts again:
    every prompt's full blocks are prefix-cache hits now."""
    path, engine, want = engine_case(arch)
    order = slice(None, None, -1 if engine.reverse_rerun else 1)
    with LLM(path, **ENGINE) as llm:
        assert completions(generate(llm, engine.prompts)) == want
        hits = llm.stats()["prefix_cache_hits"]
        again = generate(llm, engine.prompts[order])
        assert completions(again) == want[order]
        assert llm.stats()["prefix_cache_hits"] > hits
        assert sum(o.num_cached_tokens for o in again) >= 100
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_greedy_matches_hf_with_preemption(arch, engine_case):
    path, engine, want = engine_case(arch)
    # 10 blocks x 16 = 160 tokens of KV for 8 running sequences of up to 108 tokens.
    with LLM(path, **ENGINE, num_gpu_blocks_override=10, enable_prefix_caching=False) as llm:
        assert completions(generate(llm, engine.prompts)) == want
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", [a for a in ENGINE_ARCHS if ARCHS[a].engine.pallas_prompts])
def test_engine_pallas_equals_reference(arch, loaded):
    """A short run on the Pallas kernels (interpret mode on CPU): HF's tokens, and the
    reference backend's tokens and logprobs."""
    path, _, _, hf = loaded(arch)
    engine = ARCHS[arch].engine
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    got = {}
    for backend, args in (("reference", {}), ("pallas", engine.pallas_args)):
        with LLM(str(path), **ENGINE, attention_backend=backend, **args) as llm:
            assert llm.llm_engine.runner.backend == backend
            got[backend] = generate(llm, engine.pallas_prompts, params)
    assert completions(got["pallas"]) == hf_greedy(hf, engine.pallas_prompts, 4) == completions(got["reference"])
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in got["pallas"]],
                               [o.outputs[0].cumulative_logprob for o in got["reference"]], rtol=1e-4, atol=1e-4)
