"""Speculative decoding with a draft model (vLLM's "draft_model" method): a draft that is
the target itself accepts every greedy draft; a perturbed copy of the target accepts some,
and greedy outputs equal those without drafts, under preemption too; seeded sampling
repeats; a draft of another vocabulary or tokenizer is refused before anything loads."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxvllm import LLM, SamplingParams
from jaxvllm.utils.compilation_cache import count_compilations
from tests.spec_decode.common import ENGINE, check_same_under_pressure, token_ids
from weights.make_tiny import make_tiny


def draft_config(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def perturbed(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with noise on every weight: a draft that mostly agrees with it."""
    target = tiny_checkpoint("llama")
    folder = tmp_path_factory.mktemp("draft") / "llama-perturbed"
    shutil.copytree(target, folder)
    rng = np.random.default_rng(0)
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: (w + rng.normal(0, 0.3 * w.std() + 1e-6, w.shape)).astype(w.dtype)
                   for name, w in tensors.items()}, file, metadata={"format": "pt"})
    return target, folder


@pytest.fixture(scope="module")
def engines(perturbed):
    target, draft = perturbed
    plain, spec = LLM(str(target), **ENGINE), LLM(str(target), speculative_config=draft_config(draft), **ENGINE)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def test_the_target_as_its_own_draft_accepts_everything(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(str(path), speculative_config=draft_config(path), **ENGINE) as llm:
        token_ids(llm)
        stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_mean_accepted_length"] == 4.0


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


def test_a_perturbed_draft_keeps_greedy_outputs(engines):
    plain, spec = engines
    assert token_ids(spec) == token_ids(plain)
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_seeded_sampling_repeats_and_nothing_compiles(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    with count_compilations() as counts:
        first = token_ids(spec, params)
        assert token_ids(spec, params) == first
        token_ids(spec)
    assert counts.compilations == 0


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
