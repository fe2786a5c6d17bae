"""Prompt logprobs from a position on (`extra_args["prompt_logprobs_start"]`): the scores of
loglikelihood evaluation (the continuation's logprobs and whether each token is the greedy
one) equal those of vLLM's whole-prompt `prompt_logprobs=0` and HF's, for every
architecture, while the contexts come from the prefix cache and only the continuation's
rows meet the lm_head. Also with the prefix cache off, under preemption, with contexts
longer than a step's token budget (chunked), and with no compilation after warm-up."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxvllm import LLM, SamplingParams
from jaxvllm.utils.compilation_cache import count_compilations

ALL_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"]
BUDGET = 32  # max_num_batched_tokens: the 45-token context takes two steps
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=BUDGET, dtype="float32")


def hf_logprobs(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's float32 log-softmax [len(ids), vocab] rows of one sequence, and its argmax per row."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy(), logits.argmax(-1).numpy()


def requests_for(path, hf_model, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Three contexts (5, 20 and 45 tokens), each with three continuations: HF's greedy
    two tokens, and random ones of 1 and 4 tokens."""
    model, rng = hf_model(path), random.Random(seed)
    vocab = model.config.vocab_size
    requests = []
    for length in (5, 20, 45):
        context = [rng.randrange(3, vocab) for _ in range(length)]
        greedy = []
        for _ in range(2):
            greedy.append(int(hf_logprobs(model, context + greedy)[1][-1]))
        requests += [(context, greedy), (context, [rng.randrange(3, vocab)]),
                     (context, [rng.randrange(3, vocab) for _ in range(4)])]
    return requests


def score(llm: LLM, requests, start: bool = True, max_tokens: int = 1):
    """Per request: the continuation tokens' (logprob, is greedy), and the output."""
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=0, detokenize=False,
                             extra_args={"prompt_logprobs_start": len(c)} if start else None) for c, _ in requests]
    outputs = llm.generate([{"prompt_token_ids": c + t} for c, t in requests], params, use_tqdm=False)
    scores = []
    for (context, continuation), out in zip(requests, outputs):
        ids = context + continuation
        scores.append([(out.prompt_logprobs[p][ids[p]].logprob, out.prompt_logprobs[p][ids[p]].rank == 1)
                       for p in range(len(context), len(ids))])
    return scores, outputs


def check_against(scores, reference, atol: float) -> None:
    for got, want in zip(scores, reference):
        assert [g for _, g in got] == [g for _, g in want]
        np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in want], atol=atol, rtol=0)


def hf_scores(path, hf_model, requests):
    scores = []
    for context, continuation in requests:
        ids = context + continuation
        logprobs, argmax = hf_logprobs(hf_model(path), ids)
        scores.append([(float(logprobs[p - 1, ids[p]]), bool(argmax[p - 1] == ids[p]))
                       for p in range(len(context), len(ids))])
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_scores_equal_the_full_prompt_path_and_hf(arch, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(arch)
    requests = requests_for(path, hf_model)
    llm = LLM(str(path), **ENGINE)
    try:
        scores, outputs = score(llm, requests)
        full, full_outputs = score(llm, requests, start=False)
    finally:
        llm.shutdown()
    check_against(scores, full, atol=1e-5)
    check_against(scores, hf_scores(path, hf_model, requests), atol=1e-4)
    assert any(g for s in scores for _, g in s)  # the greedy continuations are seen as greedy
    for (context, _), out, whole in zip(requests, outputs, full_outputs):
        # Positions before the start are not computed; the others hold the token alone (no top-k).
        assert all(lp is None for lp in out.prompt_logprobs[: len(context)])
        assert all(len(lp) == 1 for lp in out.prompt_logprobs[len(context):])
        assert whole.num_cached_tokens == 0 and all(lp is not None for lp in whole.prompt_logprobs[1:])
    # The second and third continuation of a context read its full blocks (16 tokens each),
    # computed once, in the same step as the first's.
    cached = [out.num_cached_tokens for out in outputs]
    assert cached == [0, 0, 0, 0, 16, 16, 0, 32, 32]


@pytest.mark.slow
def test_prefix_cache_off_and_preemption(tiny_checkpoint, hf_model):
    """Without the prefix cache every context is computed (same scores). With a KV cache of
    4 blocks, requests that go on generating are preempted and recomputed (same scores)."""
    path = tiny_checkpoint("llama")
    requests = requests_for(path, hf_model, seed=1)
    reference = hf_scores(path, hf_model, requests)
    for engine, max_tokens in ((dict(enable_prefix_caching=False), 1),
                               (dict(max_model_len=64, num_gpu_blocks_override=4), 8)):
        llm = LLM(str(path), **{**ENGINE, **engine})
        try:
            scores, outputs = score(llm, requests, max_tokens=max_tokens)
            preemptions = llm.stats()["num_preemptions"]
        finally:
            llm.shutdown()
        check_against(scores, reference, atol=1e-4)
        if max_tokens == 1:
            assert all(out.num_cached_tokens == 0 for out in outputs)
        else:
            assert preemptions > 0


def test_no_compilation_after_warmup(tiny_checkpoint):
    """The prompt-logprob executable of every token bucket is compiled by the warm-up
    (width 0, what scoring reads): a scoring run compiles nothing."""
    llm = LLM(str(tiny_checkpoint("qwen3")), **ENGINE)
    llm.llm_engine.finish_warmup()
    rng = random.Random(3)
    requests = [([rng.randrange(3, 200) for _ in range(n)], [rng.randrange(3, 200) for _ in range(k)])
                for n, k in ((3, 1), (17, 5), (40, 2), (90, 20), (30, 1))]
    try:
        with count_compilations() as counts:
            scores, _ = score(llm, requests)
    finally:
        llm.shutdown()
    assert counts.compilations == 0
    assert [len(s) for s in scores] == [1, 5, 2, 20, 1]


def test_prompt_logprobs_start_is_checked(tiny_checkpoint):
    with pytest.raises(ValueError, match="needs prompt_logprobs"):
        SamplingParams(extra_args={"prompt_logprobs_start": 3})
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            SamplingParams(prompt_logprobs=0, extra_args={"prompt_logprobs_start": bad})
    llm = LLM(str(tiny_checkpoint("qwen3")), **ENGINE)
    try:
        params = SamplingParams(prompt_logprobs=0, max_tokens=1)
        params.extra_args = {"prompt_logprobs_start": 5}  # set after construction: checked when added
        with pytest.raises(ValueError, match="past the prompt's last position"):
            llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)
        out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs[:5] == [None] * 5 and list(out.prompt_logprobs[5]) == [10]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]  # nothing leaked by the refusal
    finally:
        llm.shutdown()
