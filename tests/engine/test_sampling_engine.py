"""Sampling and outputs through the engine: logprobs vs HF, seeds, stops, min_tokens, n, chat."""

import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams
from tests.conftest import ARCHS

ENGINE = dict(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=64, token_buckets=[64])


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen3"), **ENGINE)


def hf_logprobs(model, tokens):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_prompt_logprobs_match_hf(arch, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(arch)
    llm = LLM(path, **ENGINE)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 384, size=n)] for n in (90, 7)]  # 90 > budget: chunked prefill
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=4, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        want = hf_logprobs(hf_model(path), prompt + completion.token_ids)
        # Prompt: position p holds log P(prompt[p] | prompt[:p]); the first token has none.
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert abs(entry[prompt[p]].logprob - want[p - 1, prompt[p]]) <= 1e-4
            top = list(entry)[1:] if len(entry) > 3 else list(entry)
            assert set(np.argsort(-want[p - 1])[:3]) <= set(entry), (p, entry)
            assert entry[prompt[p]].rank == 1 + int((want[p - 1] > want[p - 1, prompt[p]] + 1e-6).sum())
            del top
        # Outputs: the sampled token's logprob under the raw logits, plus the top 4.
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = want[len(prompt) - 1 + i]
            assert abs(entry[token].logprob - row[token]) <= 1e-4
            assert list(entry)[0] == token and len(entry) in (4, 5)
            for t in np.argsort(-row)[:4]:
                assert abs(entry[int(t)].logprob - row[t]) <= 1e-4
            assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)
    assert llm.stats()["prefix_cache_hits"] == 0  # prompt_logprobs requests skip the prefix cache


def test_seed_is_batch_and_preemption_independent(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12)
    prompt = {"prompt_token_ids": list(range(40, 70))}
    alone = LLM(path, **ENGINE).generate(prompt, target, use_tqdm=False)[0].outputs[0].token_ids
    rng = np.random.default_rng(0)
    others = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 384, size=int(n))]} for n in rng.integers(5, 60, 49)]
    batch = others[:20] + [prompt] + others[20:]
    params = [SamplingParams(temperature=0.9, max_tokens=12, seed=i) for i in range(49)]
    params = params[:20] + [target] + params[20:]
    small = LLM(path, **ENGINE, num_gpu_blocks_override=12)  # forces preemptions
    for engine in (LLM(path, **ENGINE), small):
        outs = engine.generate(batch, params, use_tqdm=False)
        assert outs[20].outputs[0].token_ids == alone
    assert small.stats()["num_preemptions"] > 0


def test_stop_strings_across_tokens(llm):
    tokenizer = llm.get_tokenizer()
    [ref] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids = ref.outputs[0].token_ids
    text = ref.outputs[0].text
    assert text == tokenizer.decode(ids).rstrip("\ufffd")
    # A stop string that ends inside the 4th token's text and starts in an earlier one.
    prefix3, prefix4 = tokenizer.decode(ids[:3]), tokenizer.decode(ids[:4])
    assert len(prefix4) > len(prefix3) >= 1
    stop = text[len(prefix3) - 1 : len(prefix4)]
    start = text.index(stop)
    [cut] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)
    out = cut.outputs[0]
    assert out.text == text[:start] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) <= 4
    [kept] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
                                                  include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[: start + len(stop)]


def test_min_tokens_masks_stop_ids_and_eos(llm):
    [ref] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ids = ref.outputs[0].token_ids
    stop_id = ids[1]
    [early] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                           use_tqdm=False)
    assert early.outputs[0].token_ids[-1] == stop_id and len(early.outputs[0].token_ids) <= 2
    [held] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id], min_tokens=5),
                          use_tqdm=False)
    tokens = held.outputs[0].token_ids
    assert stop_id not in tokens[:5] and len(tokens) >= 5
    eos = llm.get_tokenizer().eos_token_id
    [no_eos] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                    logit_bias={eos: 100.0}), use_tqdm=False)
    assert eos not in no_eos.outputs[0].token_ids and len(no_eos.outputs[0].token_ids) == 8
    [forced] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}),
                            use_tqdm=False)
    assert forced.outputs[0].token_ids == [eos] and forced.outputs[0].finish_reason == "stop"
    [ignored] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                     logit_bias={eos: 100.0}), use_tqdm=False)
    assert ignored.outputs[0].token_ids == [eos] * 5 and ignored.outputs[0].finish_reason == "length"
    # Any finite bias, as vLLM's LLM takes it: -1e9 bans a token, 1e9 forces one.
    first = ids[0]
    [banned] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -1e9}),
                            use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first
    [sampled] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True,
                                                     logit_bias={7: 1e9}, logprobs=1), use_tqdm=False)
    assert sampled.outputs[0].token_ids == [7] * 4


def test_allowed_token_ids_and_penalties(llm):
    [out] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=1, max_tokens=10, allowed_token_ids=[50, 60, 70]),
                         use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= {50, 60, 70}
    [rep] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0,
                                                 presence_penalty=2.0, repetition_penalty=1.5), use_tqdm=False)
    [plain] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = rep.outputs[0].token_ids
    assert len(set(tokens)) > len(set(plain.outputs[0].token_ids)) or len(set(tokens)) == 10


def test_n_completions_share_the_prompt(llm):
    prompt = {"prompt_token_ids": list(range(100, 140))}  # 2 full blocks of 16 + 8
    [out] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    [greedy] = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=8), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    [single] = llm.generate(prompt, SamplingParams(temperature=1.0, seed=6, max_tokens=8), use_tqdm=False)
    assert single.outputs[0].token_ids == out.outputs[1].token_ids  # child i uses seed + i
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 2 * 32  # children 1 and 2 reuse the prompt's full blocks
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_chat(llm):
    tokenizer = llm.get_tokenizer()
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    conversation = [{"role": "user", "content": "Hello, how are you?"}]
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(conversation, use_tqdm=False)
    [out] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5), chat_template=template, use_tqdm=False)
    assert out.prompt == "<s>user: Hello, how are you?\nassistant:"
    assert out.prompt_token_ids == tokenizer(out.prompt, add_special_tokens=False).input_ids
    assert out.prompt_token_ids[0] == tokenizer.bos_token_id
    [direct] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)
    assert direct.outputs[0].token_ids == out.outputs[0].token_ids
    tokenizer.chat_template = template
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "fine"}]],
                   SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(two) == 2 and two[1].prompt.endswith("assistant: fine\nassistant:")


def test_detokenize_options(llm):
    [raw] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, detokenize=False), use_tqdm=False)
    assert raw.outputs[0].text == "" and len(raw.outputs[0].token_ids) == 6
    eos = llm.get_tokenizer().eos_token_id
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    [skip] = llm.generate("Hello", SamplingParams(**params), use_tqdm=False)
    [keep] = llm.generate("Hello", SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)
    assert skip.outputs[0].text == "" and keep.outputs[0].text == "</s></s></s>"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), r"n must be at least 1, got 0."),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0.$"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5.$"),
        (dict(top_k=-2), r"top_k must be 0 \(disable\), or at least 1, got -2."),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5."),
        (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\], got 3."),
        (dict(frequency_penalty=-2.5), r"frequency_penalty must be in \[-2, 2\], got -2.5."),
        (dict(repetition_penalty=0), r"repetition_penalty must be greater than zero, got 0."),
        (dict(logprobs=-2), r"^logprobs must be non-negative or -1, got -2.$"),
        (dict(prompt_logprobs=-3), r"^prompt_logprobs must be non-negative or -1, got -3.$"),
        (dict(min_tokens=5, max_tokens=4), r"^min_tokens must be less than or equal to max_tokens=4, got 5.$"),
        (dict(stop=[""]), "stop must be a non-empty string"),
        (dict(stop="x", detokenize=False), "stop strings are only supported when detokenize is True"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(temperature="hot"), "temperature must be a number"),
    ],
)
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocabulary_are_refused(llm):
    for params, match in ((SamplingParams(stop_token_ids=[512]), r"out of range \[0, 512\)"),
                          (SamplingParams(allowed_token_ids=[1, 600]), r"out of range \[0, 512\)"),
                          (SamplingParams(logit_bias={9999: 1.0}), r"\[9999\] .* Vocabulary size: 512")):
        with pytest.raises(ValueError, match=match):
            llm.generate("Hello", params, use_tqdm=False)


def test_top_k_and_min_tokens_beyond_every_limit(llm):
    """vLLM takes any top_k >= -1 (the vocabulary or more: off) and any min_tokens up to
    max_tokens; past the sampler's int32 columns they failed the step, and the request
    beside them with it."""
    prompt = {"prompt_token_ids": list(range(100, 110))}
    beside = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    huge = [SamplingParams(temperature=0.8, seed=1, top_k=2**31, max_tokens=4),
            SamplingParams(temperature=0, max_tokens=None, min_tokens=2**31),
            SamplingParams(temperature=0, max_tokens=4)]
    outs = llm.generate([prompt] * 3, huge, use_tqdm=False)
    off = llm.generate(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=4), use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == off.outputs[0].token_ids
    assert len(outs[1].outputs[0].token_ids) == 128 - 10 and outs[1].outputs[0].finish_reason == "length"
    assert outs[2].outputs[0].token_ids == beside.token_ids


def test_greedy_turns_the_filters_off():
    """As vLLM's SamplingParams: temperature 0 sets top_p 1, top_k 0 and min_p 0."""
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
