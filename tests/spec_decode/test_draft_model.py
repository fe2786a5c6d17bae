"""Speculative decoding with a draft model (vLLM's "draft_model" method): a draft that is
the target itself accepts every greedy draft; a perturbed copy of the target accepts some,
and greedy outputs equal those without drafts, under preemption too; seeded sampling
repeats; a draft of another vocabulary or tokenizer is refused before anything loads.
Under async scheduling (the default) the drafts stay on the device: outputs are those of
the synchronous engine, a stop among accepted drafts ends the output there, and a
structured output (no drafts) runs beside requests that draft."""

from __future__ import annotations

import numpy as np
import pytest

from jaxvllm import LLM, SamplingParams, StructuredOutputsParams
from jaxvllm.utils.compilation_cache import count_compilations
from tests.spec_decode.common import (ENGINE, GREEDY, PROMPTS, TO_THE_END, check_same_under_pressure, perturbed_copy,
                                      token_ids)
from weights.make_tiny import make_tiny


def draft_config(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def perturbed(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with noise on every weight: a draft that mostly agrees with it."""
    target = tiny_checkpoint("llama")
    folder = perturbed_copy(target, tmp_path_factory.mktemp("draft") / "llama-perturbed")
    return target, folder


@pytest.fixture(scope="module")
def engines(perturbed):
    """Without drafts; with drafts under async scheduling (on the device); with drafts, synchronous.
    (K = 4: the last drafts of a request at max_model_len would write past it; 3 would not.)"""
    target, draft = perturbed
    llms = (LLM(str(target), **ENGINE), LLM(str(target), speculative_config=draft_config(draft, 4), **ENGINE),
            LLM(str(target), speculative_config=draft_config(draft, 4), async_scheduling=False, **ENGINE))
    for llm in llms:
        llm.llm_engine.finish_warmup()  # (the tests count compiles)
    yield llms
    for llm in llms:
        llm.shutdown()


def test_the_target_as_its_own_draft_accepts_everything(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(str(path), speculative_config=draft_config(path), **ENGINE) as llm:
        assert llm.llm_engine.runner.device_drafts  # (async scheduling: the drafts stay on the device)
        full = token_ids(llm, prompts=PROMPTS[:1])[0]
        stats = llm.stats()
        # A stop id first met at an output past 8 that a draft gives (each verify emits outputs
        # 4j + 1 .. 4j + 3 as drafts and 4j + 4 as its bonus): the output ends there.
        at = next(i for i, t in enumerate(full) if i > 8 and i % 4 and t not in full[:i])
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full[at]])
        stopped = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_mean_accepted_length"] == 4.0
    assert list(stopped.token_ids) == full[: at + 1] and stopped.finish_reason == "stop"


def test_the_real_model_as_its_own_draft_accepts_everything(smollm2_path):
    # one token bucket (each is a compile of the 30-layer target and of its K-step draft): the
    # prompt is prefilled in chunks of 16
    engine = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16], dtype="float32")
    with LLM(str(smollm2_path), speculative_config=draft_config(smollm2_path, 4), **engine) as llm:
        outputs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                           SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        stats = llm.stats()
    assert "Paris" in outputs[0].outputs[0].text
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafts_stop_at_the_speculative_max_model_len(tiny_checkpoint, async_scheduling):
    """vLLM's speculative max_model_len (below the engine's): the drafter drafts only where
    its K positions lie below it, and the outputs are the same."""
    path, params = tiny_checkpoint("llama"), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    drafted = {}
    for limit in (None, 40):
        spec = {**draft_config(path), **({"max_model_len": limit} if limit else {})}
        with LLM(str(path), speculative_config=spec, async_scheduling=async_scheduling, **ENGINE) as llm:
            drafted[limit] = (token_ids(llm, params, PROMPTS[:1]), llm.stats()["spec_decode_num_draft_tokens"])
    (full, unlimited), (same, limited) = drafted[None], drafted[40]
    assert same == full and len(full[0]) == 60
    # (prompt 5, K = 3: drafts while the sequence is at most 37 tokens, about 9 verifies of 4)
    assert 0 < limited < unlimited and limited <= 3 * (40 - 5) // 4 + 3


def test_a_perturbed_draft_keeps_greedy_outputs(engines):
    plain, spec, sync = engines
    assert spec.llm_engine.runner.device_drafts and not sync.llm_engine.runner.device_drafts
    with count_compilations() as counts:  # (the engines' first steps: the warm-up compiled them all)
        assert token_ids(spec) == token_ids(plain) == token_ids(sync)
    assert counts.compilations == 0
    for llm in (spec, sync):
        stats = llm.stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    prompts, params = TO_THE_END
    want = token_ids(plain, params, prompts)
    assert len(want[0]) == 12 and token_ids(spec, params, prompts) == want == token_ids(sync, params, prompts)


def test_max_model_len_left_to_the_checkpoint(perturbed):
    """A synchronous drafter with max_model_len unset (the checkpoint's 1024): it drafts (the
    guard on its K slots once read the unset argument: a TypeError after the first step)."""
    target, draft = perturbed
    with LLM(str(target), speculative_config=draft_config(draft, 4), async_scheduling=False, max_num_seqs=4,
             max_num_batched_tokens=64, token_buckets=[16, 64], num_gpu_blocks_override=32, dtype="float32",
             enforce_eager=True) as llm:
        assert llm.llm_engine.runner.max_model_len == 1024
        token_ids(llm, prompts=PROMPTS[:2])
        assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_seeded_sampling_repeats_and_nothing_compiles(engines):
    """Seeded outputs repeat, and are those of the synchronous engine and of the engine
    without drafts: each verified position draws what sampling without drafts would."""
    plain, spec, sync = engines
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=21, seed=3, ignore_eos=True)
    with count_compilations() as counts:
        first = token_ids(spec, params)
        assert token_ids(spec, params) == first
        token_ids(spec)
    assert counts.compilations == 0
    assert token_ids(sync, params) == first == token_ids(plain, params)


def test_a_structured_output_beside_requests_that_draft(engines):
    """A structured output takes no drafts (its masks need them on the host); the requests
    beside it draft on the device, and every output is the engine's without drafts."""
    plain, spec, _ = engines
    choice = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex=r"(yes|no|maybe) [0-9]{1,3}"))
    params = [GREEDY, choice] * 2
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    want = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [list(o.outputs[0].token_ids) for o in spec.generate(PROMPTS, params, use_tqdm=False)] == want
    assert spec.stats()["spec_decode_num_accepted_tokens"] > before


@pytest.mark.slow
def test_preemption_and_prefix_caching(perturbed):
    """Few KV blocks (preemption: the draft's cache is recomputed with the target's) and
    shared prefixes (cache hits: the draft's K/V of a shared block was written with it)."""
    target, draft = perturbed
    prompts = [{"prompt_token_ids": [3, 4, 5, 6] * 6 + [i]} for i in range(6)]
    check_same_under_pressure(target, draft_config(draft), dict(ENGINE, num_gpu_blocks_override=14), prompts)


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    target = tiny_checkpoint("llama")
    other_vocab = make_tiny("llama", tmp_path / "vocab", vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary of 640 tokens, the target's has 512"):
        LLM(str(target), speculative_config=draft_config(other_vocab), **ENGINE)
    other_tokens = make_tiny("llama", tmp_path / "tokens", extra_tokens=3)
    with pytest.raises(ValueError, match="tokenizer of its own that differs"):
        LLM(str(target), speculative_config=draft_config(other_tokens), **ENGINE)
    with pytest.raises(ValueError, match="needs the draft's folder as model"):
        LLM(str(target), speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **ENGINE)


def test_device_draft_executables_do_not_branch(engines):
    """The async engine's step, its sampler and the draft model's proposer after it, as a
    GPU compiles them (no CPU loops): no conditional, no loop of unknown trip count."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxvllm.sampler import COMMON_FEATURES
    from jaxvllm.spec_decode.draft_model import jit_propose_rows
    from tests.engine.test_async_scheduling import assert_no_host_sync

    runner = engines[1].llm_engine.runner
    b, features = runner.builder, COMMON_FEATURES[-1]
    batch = b.padding_batch(b.buckets[-1], b.widths[-1], features, spec=True)
    layout = dataclasses.replace(batch.layout, dynamic_loops=False)
    assert layout.device_drafts and layout.spec_tokens == 4
    packed, rows = jnp.asarray(batch.packed), runner.draft_rows
    forward = runner._forward.lower(runner.params, runner.kv_caches, packed, runner.last_sampled, None, rows,
                                    layout=layout)
    assert_no_host_sync(forward.compile().as_text(), "forward")
    logits = jax.ShapeDtypeStruct((layout.num_logits, runner.cfg.vocab_size), jnp.float32)
    sampler = runner._sampler.lower(packed[: layout.sampling_size], logits, runner.last_sampled, None, None, rows,
                                    num_rows=layout.num_rows, features=features, spec_tokens=4, device_drafts=True)
    assert_no_host_sync(sampler.compile().as_text(), "sampler")
    draft, n = runner.draft, layout.num_rows
    proposer = jit_propose_rows(draft.cfg, runner.backend, None, 4, b.block_size)  # (no CPU loops)
    propose = proposer.lower(draft.params, draft.kv_caches, np.zeros(n, np.int32), np.ones(n, bool),
                             np.zeros((n, layout.width), np.int32), runner.last_sampled, rows)
    assert_no_host_sync(propose.compile().as_text(), "draft proposer")
