"""Speculative decoding with n-gram prompt lookup in the engine: greedy outputs equal
those without it, for every architecture and under preemption, chunked prefill, prefix
caching, n > 1 and stops that fall among accepted drafts; drafts are proposed and partly
accepted (else equality proves nothing); seeded sampling repeats; vLLM's metrics add up;
nothing compiles after warm-up; bad configs are refused by name. On every architecture
the draft-model and EAGLE methods are checked here too."""

from __future__ import annotations

import json
import re

import pytest

from jaxvllm import LLM, SamplingParams
from jaxvllm.metrics import Vector
from jaxvllm.utils.compilation_cache import count_compilations
from tests.spec_decode.common import perturbed_copy
from tests.spec_decode.eagle_heads import passing_head

ALL_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64], dtype="float32")
# Random weights loop readily, so a random model's greedy outputs repeat themselves: drafts match.
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7], [11, 12, 13, 14], [5] * 6, list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def token_ids(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(c.token_ids) for out in outputs for c in out.outputs]


def assert_partly_accepted(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    plain, spec = LLM(path, **ENGINE), LLM(path, speculative_config=SPEC, **ENGINE)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_outputs_unchanged_every_architecture(arch, tiny_checkpoint, tmp_path):
    """Each method on each architecture: n-gram (synchronous), and a draft model (a noisy
    copy of the target) and an EAGLE head (one that passes the target's state through)
    under async scheduling, their drafts on the device."""
    path = tiny_checkpoint(arch)
    with LLM(str(path), **ENGINE) as plain:
        expected = token_ids(plain, GREEDY)
    draft = perturbed_copy(path, tmp_path / "draft")
    head = passing_head(path, tmp_path / "head")
    for spec in (SPEC, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
                 {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}):
        with LLM(str(path), speculative_config=spec, **ENGINE) as llm:
            assert llm.llm_engine.runner.device_drafts == (spec["method"] != "ngram")
            assert token_ids(llm, GREEDY) == expected, spec["method"]
            assert_partly_accepted(llm)


def test_greedy_outputs_unchanged_and_synchronous(engines):
    plain, spec = engines
    assert token_ids(spec, GREEDY) == token_ids(plain, GREEDY)
    assert_partly_accepted(spec)
    assert spec.stats()["async_scheduling"] is False and plain.stats()["async_scheduling"] is True


def test_stops_among_accepted_drafts(engines):
    """A stop id or stop string that a verified step accepts ends the output at that token,
    as without drafts (the drafts after it are dropped)."""
    plain, spec = engines
    outputs = token_ids(plain, GREEDY)
    for out in outputs:
        if len(set(out[10:])) < len(out[10:]):  # a token that repeats late: accepted drafts come there
            stop_id = out[12]
            break
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
    assert token_ids(spec, params) == token_ids(plain, params)
    texts = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                       use_tqdm=False)]
    stop = next(t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].stop_reason) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].stop_reason) for o in want]
    assert any(o.outputs[0].stop_reason == stop for o in got)


@pytest.mark.slow
def test_preemption_chunked_prefill_prefix_caching_and_n(tiny_checkpoint):
    """A KV cache of few blocks (preemption), a 16-token budget (chunked prefills), shared
    prefixes (prefix cache hits) and n = 2: the same greedy outputs with drafts as without."""
    path = str(tiny_checkpoint("llama"))
    engine = dict(ENGINE, max_num_batched_tokens=16, token_buckets=[16], num_gpu_blocks_override=14)
    prompts = [[3, 4, 5, 6] * 6 + [i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    results = []
    for spec in (None, SPEC):
        llm = LLM(path, speculative_config=spec, **engine)
        try:
            results.append(token_ids(llm, params, prompts))
            stats = llm.stats()
        finally:
            llm.shutdown()
    assert results[0] == results[1]
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] + stats["prefix_cache_preempted_hits"] > 0  # (readmissions: apart)
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_repeats_and_equals_sampling_without_drafts(engines):
    """Each verified position draws what sampling without drafts would draw there, so a
    seeded output is the same with or without them, whatever was accepted."""
    plain, spec = engines
    params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=40, seed=7, ignore_eos=True),
              SamplingParams(temperature=1.2, top_p=0.9, min_p=0.02, frequency_penalty=0.4, repetition_penalty=1.2,
                             max_tokens=23, seed=8, n=2, ignore_eos=True)]
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    for sp in params:
        first = token_ids(spec, sp)
        assert token_ids(spec, sp) == first
        assert token_ids(plain, sp) == first
    assert spec.stats()["spec_decode_num_accepted_tokens"] > before


def test_metrics_are_consistent(engines):
    """vLLM's `test_engine_metrics` checks for n-gram speculative decoding."""
    _, spec = engines
    token_ids(spec, GREEDY)
    metrics = {m.name: m for m in spec.get_metrics() if "spec_decode" in m.name}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 3  # (vLLM's reader type)
    per_pos = per_pos.values
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    stats = spec.stats()
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_no_compilation_after_warmup(engines):
    _, spec = engines
    spec.llm_engine.finish_warmup()
    with count_compilations() as counts:
        token_ids(spec, GREEDY)
        token_ids(spec, SamplingParams(temperature=1.0, max_tokens=20, seed=1))
        token_ids(spec, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=20, seed=2))
    assert counts.compilations == 0


@pytest.mark.parametrize("config,message", [
    ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown speculative_config method 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be > 0"),
    ({"method": "mtp", "model": "x", "num_speculative_tokens": 2}, "'mtp' is not supported by jaxvllm yet"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "'deepseek_mtp' is not supported by jaxvllm yet"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method 'eagle3' needs the draft's folder as model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's folder as model"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size=2: the draft model is split as the target is"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown or unsupported key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len must be"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "quantization": "fp8"},
     "quantization='fp8': a quantized draft is not supported"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,)]"},
     "speculative_token_tree: tree drafts are not supported"),
])
def test_bad_configs_are_refused_before_loading(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LLM("/nonexistent/model", speculative_config=config)


def test_vllm_0_11s_other_fields_are_taken():
    """Fields of vLLM 0.11's SpeculativeConfig that change nothing here are accepted (a config
    copied from vLLM runs), and draft_tensor_parallel_size is not read for n-gram drafts."""
    from jaxvllm.config import SpeculativeConfig

    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "disable_logprobs": False,
                                   "enforce_eager": True, "disable_padded_drafter_batch": True, "revision": "main",
                                   "code_revision": None, "quantization": None, "speculative_token_tree": None,
                                   "draft_tensor_parallel_size": 4})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)


def test_the_method_is_inferred_as_vllm_infers_it():
    """Without a method: "[ngram]", an EAGLE head by its published names, else a draft model."""
    from jaxvllm.config import SpeculativeConfig

    for model, method in [("[ngram]", "ngram"), ("yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "eagle"),
                          ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"), ("AngelSlim/Qwen3-8B_eagle3", "eagle3"),
                          ("/models/Qwen3-0.6B", "draft_model")]:
        assert SpeculativeConfig(model=model, num_speculative_tokens=2).method == method, model


def test_an_id_aborted_and_added_again_drafts_from_its_own_tokens(engines):
    """The proposer keeps each request's tokens by id from step to step: an id aborted and
    added again before the next step once drafted from the aborted request's tokens."""
    import numpy as np

    plain, spec = engines
    engine, prompt = spec.llm_engine, list(range(200, 245))  # (nothing repeats)
    first = token_ids(plain, SamplingParams(temperature=0, max_tokens=1), [prompt])[0][0]
    # the aborted request's tokens: the new one's first output, then tokens it would draft
    engine.add_request("a", {"prompt_token_ids": [first, 400, 401, 402] * 10}, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    engine.add_request("a", {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(3):
        engine.step()
        request = engine.scheduler.requests["a"]
        assert request.spec_token_ids == engine.proposer.propose(np.array(request.token_ids)).tolist()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()


def test_speculative_max_model_len(tiny_checkpoint):
    """vLLM's speculative max_model_len: at most the engine's (vLLM's words), and ignored by
    the n-gram proposer, which has no model (a drafter's is tested with the draft model)."""
    path = str(tiny_checkpoint("llama"))
    with LLM(path, max_model_len=64, enforce_eager=True, speculative_config={**SPEC, "max_model_len": 32}) as llm:
        assert llm.llm_engine.config.speculative_config.max_model_len == 32
        assert llm.llm_engine.runner.draft_max_model_len == 64
    with pytest.raises(ValueError, match=r"speculative_max_model_len=65 cannot be larger than target_max_model_len=64"):
        LLM(path, max_model_len=64, enforce_eager=True, speculative_config={**SPEC, "max_model_len": 65})


def test_logprobs_of_every_emitted_token(engines):
    """Requests with logprobs are drafted for (raw modes): each emitted token, accepted draft or
    not, has the target's logprob and top logprobs, as without drafts."""
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    want = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert spec.stats()["spec_decode_num_accepted_tokens"] > before
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for token, wd, gd in zip(g.token_ids, w.logprobs, g.logprobs):
            assert list(gd) == list(wd) and gd[token].rank == wd[token].rank
            assert [e.logprob for e in gd.values()] == pytest.approx([e.logprob for e in wd.values()], abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_a_stop_string_among_drafts_drops_the_logprobs_after_it(engines):
    plain, spec = engines
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    texts = [o.outputs[0].text for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    stop = next(t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=1)
    for w, g in zip(plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        assert g.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(g.token_ids, g.logprobs)),
                                                     abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_disable_by_batch_size(tiny_checkpoint):
    """vLLM's `disable_by_batch_size`: no drafts while more requests than it run."""
    config = dict(SPEC, disable_by_batch_size=2)
    with LLM(str(tiny_checkpoint("llama")), speculative_config=config, **ENGINE) as llm:
        token_ids(llm, GREEDY, PROMPTS[:4])  # four run together to the end: never drafted for
        assert llm.stats()["spec_decode_num_drafts"] == 0
        token_ids(llm, GREEDY, PROMPTS[:2])
        assert llm.stats()["spec_decode_num_drafts"] > 0
    with pytest.raises(ValueError, match="disable_by_batch_size=1"):
        LLM("/nonexistent/model", speculative_config=dict(SPEC, disable_by_batch_size=1))


def drafted(llm: LLM, run) -> tuple[list, int, int]:
    """(run's result, draft tokens proposed during it, accepted during it)."""
    before = llm.stats()
    result = run()
    after = llm.stats()
    return result, *(after[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))


def test_requests_with_sampler_state_get_drafts(engines):
    """Penalties, logit bias, allowed ids, bad words and min_tokens judge every verified
    position with the drafts before it counted: greedy outputs equal the plain engine's."""
    plain, spec = engines
    looped = token_ids(plain, GREEDY)
    word = plain.get_tokenizer().decode([looped[1][4]])
    common = dict(temperature=0, max_tokens=40)
    cases = [
        SamplingParams(repetition_penalty=1.2, ignore_eos=True, **common),
        SamplingParams(frequency_penalty=0.2, presence_penalty=0.3, ignore_eos=True, **common),
        SamplingParams(logit_bias={looped[2][5]: 1.5}, allowed_token_ids=sorted(  # (ids the tokenizer has)
            {t for s in looped for t in s if t < len(plain.get_tokenizer())}), ignore_eos=True, **common),
        SamplingParams(bad_words=[word], ignore_eos=True, **common),
        SamplingParams(stop_token_ids=[looped[0][2], looped[1][2]], min_tokens=25, **common),
    ]
    accepted = []
    for params in cases:
        got, proposed, passed = drafted(spec, lambda: token_ids(spec, params))
        assert got == token_ids(plain, params), params
        assert proposed > 0
        accepted.append(passed)
    assert all(a > 0 for a in accepted[2:]) and sum(accepted) > 0, accepted
    seeded = SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5, bad_words=[word], max_tokens=30,
                            ignore_eos=True)
    assert token_ids(spec, seeded) == token_ids(spec, seeded)  # seeded sampling with state repeats


def test_structured_outputs_get_drafts(engines):
    """A grammar's bitmask is filled at each verified position, past the drafts before it:
    constrained greedy outputs equal the plain engine's, and drafts pass."""
    from jaxvllm import StructuredOutputsParams

    plain, spec = engines
    schema = {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 8, "maxItems": 8}
    regex = r"(ab|cd)( (ab|cd)){15}"
    cases = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    for structured, valid in zip(cases, [lambda text: re.fullmatch(regex, text),
                                         lambda text: len(json.loads(text)) == 8]):
        params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=structured)
        completion = lambda o: (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)  # noqa: E731
        want = [completion(o) for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                      use_tqdm=False)]
        got, proposed, passed = drafted(spec, lambda: [completion(o) for o in spec.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
        assert got == want and all(valid(text) for text, _, _ in got)
        assert 0 < passed < proposed, (structured, proposed, passed)


def test_processed_logprobs_of_every_emitted_token(tiny_checkpoint):
    """Under `processed_logprobs` each emitted token's logprobs are the target's after the
    request's penalties, accepted draft or not, as without drafts."""
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, repetition_penalty=1.2)
    results = []
    for spec in (None, SPEC):
        with LLM(path, speculative_config=spec, logprobs_mode="processed_logprobs", **ENGINE) as llm:
            results.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
            if spec:
                assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    for w, g in zip(*results):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for wd, gd in zip(w.logprobs, g.logprobs):
            assert list(gd) == list(wd)
            assert [e.logprob for e in gd.values()] == pytest.approx([e.logprob for e in wd.values()], abs=1e-4)
