"""Structured outputs (vLLM's StructuredOutputsParams, on llguidance) on random-weight tiny
models, where only the constraint can make the text valid."""

import dataclasses
import json
import re
import threading

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from jaxvllm import LLM, SamplingParams, StructuredOutputsParams
from jaxvllm.config import StructuredOutputsConfig
from jaxvllm.structured_output import StructuredOutputManager, bitmask_words, grammar_text

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64])
PROMPTS = [f"Record {i}:" for i in range(24)]

SCHEMAS = [
    {  # required fields, a bounded string and integer, an array of enums
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {  # a nested object and an enum
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "kind": {"enum": ["red", "green", "blue"]},
        },
        "required": ["point", "kind"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


# A tokenizer with an id past the model's vocabulary (<|extra_0|> = 384, vocab_size 384), as
# transformers 5 gives Qwen2's tokenizer an <|endoftext|> more than the model's embeddings.
SHORT_VOCAB = dict(vocab_size=384, extra_tokens=1)


def constrained(max_tokens=200, temperature=0.0, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None,
                          structured_outputs=StructuredOutputsParams(**spec))


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """engines(short_vocab=False, async_scheduling=True) -> an LLM over the llama checkpoint
    (or its SHORT_VOCAB variant), built once per pair and shut down with the module."""
    made = {}

    def get(short_vocab: bool = False, async_scheduling: bool = True) -> LLM:
        if (short_vocab, async_scheduling) not in made:
            path = tiny_checkpoint("llama", **(SHORT_VOCAB if short_vocab else {}))
            made[short_vocab, async_scheduling] = LLM(path, **ENGINE, async_scheduling=async_scheduling)
        return made[short_vocab, async_scheduling]

    yield get
    for llm in made.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def llm(engines):
    return engines()


@pytest.fixture(scope="module")
def sync_llm(engines):
    return engines(async_scheduling=False)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["fields", "nested", "array"])
def test_json_schema_outputs_validate(llm, schema):
    params = constrained(json=schema, disable_any_whitespace=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # sampled completions too (each its own matcher)
    outputs = llm.generate(PROMPTS[:8], constrained(json=json.dumps(schema), temperature=1.0,
                                                    disable_any_whitespace=True), use_tqdm=False)
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


@pytest.mark.parametrize("pattern", [r"\d{3}-[a-z]{2,5}", r"(yes|no), because [A-Z][a-z]{1,6}\."])
def test_regex_outputs_fully_match(llm, pattern):
    outputs = llm.generate(PROMPTS, constrained(regex=pattern), use_tqdm=False)
    for text in texts(outputs):
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["positive", "negative", "neutral", "not sure"]
    outputs = llm.generate(PROMPTS, constrained(choice=choices), use_tqdm=False)
    assert all(text in choices for text in texts(outputs))
    params = [dataclasses.replace(constrained(choice=choices, temperature=1.0), seed=i) for i in range(len(PROMPTS))]
    sampled = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(text in choices for text in texts(sampled))
    assert len(set(texts(sampled))) > 1  # the mask leaves the choice to the model


def test_json_object_outputs_parse(llm):
    """Any JSON object. A random model writes endless strings, so a bias towards '"' (which
    ends a string) and, less, '}' (which ends the object after a value) lets objects close."""
    tokenizer = llm.get_tokenizer()
    bias = {tokenizer.encode(c, add_special_tokens=False)[0]: b for c, b in (('"', 8.0), ("}", 4.0))}
    params = SamplingParams(temperature=0, max_tokens=100, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    for text in texts(llm.generate(PROMPTS, params, use_tqdm=False)):
        assert isinstance(json.loads(text), dict), text


def test_grammar_outputs_match(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    for text in texts(llm.generate(PROMPTS, constrained(grammar=grammar, max_tokens=100), use_tqdm=False)):
        assert re.fullmatch(r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)", text), text


def test_structural_tag(llm):
    """Free text until a trigger; after one, the tag's schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    tag = json.dumps({"structures": [{"begin": "<function=a>", "schema": schema, "end": "</function>"}],
                      "triggers": ["<function="]})
    outputs = llm.generate(PROMPTS[:4], constrained(structural_tag=tag, max_tokens=8), use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outputs)
    bad = json.dumps({"structures": [{"begin": "<g>", "schema": schema, "end": "</g>"}], "triggers": ["<function="]})
    with pytest.raises(ValueError, match="starts with no trigger"):
        llm.generate("x", constrained(structural_tag=bad), use_tqdm=False)
    for malformed in ({"structures": [{"begin": "<function=a>"}], "triggers": ["<function="]},
                      {"structures": [5], "triggers": ["<function="]}, {"structures": 5, "triggers": []},
                      {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": [3]}):
        with pytest.raises(ValueError, match="structural_tag"):
            llm.generate("x", constrained(structural_tag=json.dumps(malformed)), use_tqdm=False)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether a grammar matches `text` whole (token by token, as the engine would feed it)."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_disable_additional_properties_as_vllm(path):
    """vLLM's rule: schemas listing properties get additionalProperties false; free-form
    objects, const values and json_object stay open; untyped or union-typed schemas with
    properties are closed too."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    closed = StructuredOutputsConfig(disable_additional_properties=True)

    def both(text, **spec):
        spec = StructuredOutputsParams(**spec)
        return accepts(tokenizer, grammar_text(spec, StructuredOutputsConfig()), text), \
            accepts(tokenizer, grammar_text(spec, closed), text)

    assert both('{"x": 1}', json_object=True) == (True, True)
    meta = {"type": "object", "properties": {"meta": {"type": "object"}}}
    assert both('{"meta": {"k": "v"}}', json=meta) == (True, True)
    assert both('{"meta": {}, "extra": 1}', json=meta) == (True, False)
    const = {"type": "object", "properties": {"c": {"const": {"type": "object", "p": 1}}}}
    assert both('{"c": {"type": "object", "p": 1}}', json=const) == (True, True)
    untyped = {"properties": {"a": {"type": "integer"}}}
    assert both('{"a": 1, "b": 2}', json=untyped) == (True, False)
    union = {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}}
    assert both('{"a": 1, "b": 2}', json=union) == (True, False)
    nested = {"type": "array", "items": {"anyOf": [{"properties": {"a": {"type": "integer"}}}]}}
    assert both('[{"a": 1, "b": 2}]', json=nested) == (True, False)
    # a $ref's target outside the schema keywords (OpenAPI's components), closed as vLLM closes it
    pet = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    openapi = {"$ref": "#/components/schemas/Pet", "components": {"schemas": {"Pet": pet}}}
    assert both('{"name": "a", "x": 1}', json=openapi) == (True, False)
    assert openapi["components"]["schemas"]["Pet"] == pet  # (the caller's schema is left as it was)
    # (a NUL in a regex is a character like any other)
    assert both("a\x00b", regex="a\x00b") == (True, True) and both("ab", regex="a\x00b") == (False, False)


def test_property_order_is_kept(llm):
    """Two schemas that differ only in property order are two grammars: each output follows its own."""
    props = {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 9}}
    forward = {"type": "object", "properties": props, "required": ["name", "age"], "additionalProperties": False}
    backward = {**forward, "properties": dict(reversed(props.items()))}
    params = [constrained(json=schema, disable_any_whitespace=True) for schema in (forward, backward)]
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [list(json.loads(o.outputs[0].text)) for o in outputs] == [["name", "age"], ["age", "name"]]


@pytest.mark.parametrize("engine", ["llm", "sync_llm"])
def test_a_complete_match_ends_with_the_eos_its_mask_leaves(request, engine):
    """vLLM's rule: once the match is complete, the mask allows only EOS, which the model
    samples and which ends the request (its id in token_ids, stop_reason None); under
    ignore_eos, the tokens after that EOS are not constrained (vLLM's terminated grammar):
    the model's own continuation; where min_tokens or allowed_token_ids mask that EOS, the
    request ends at the match."""
    llm = request.getfixturevalue(engine)
    eos = llm.get_tokenizer().eos_token_id
    spec = dict(choice=["alpha", "beta"])
    plain, ignoring, short = llm.generate(
        ["Pick:"] * 3, [constrained(max_tokens=12, **spec), SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, structured_outputs=StructuredOutputsParams(**spec)),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=11, structured_outputs=StructuredOutputsParams(**spec))],
        use_tqdm=False)
    done = plain.outputs[0]
    assert done.text in spec["choice"] and done.token_ids[-1] == eos and eos not in done.token_ids[:-1]
    assert (done.finish_reason, done.stop_reason) == ("stop", None)
    word = done.token_ids[:-1]
    rest = llm.generate({"prompt_token_ids": plain.prompt_token_ids + word + [eos]},
                        SamplingParams(temperature=0, max_tokens=12 - len(word) - 1, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert ignoring.outputs[0].token_ids == word + [eos] + rest and rest != [eos] * len(rest)
    assert ignoring.outputs[0].finish_reason == "length" and ignoring.outputs[0].text.startswith(done.text)
    assert short.outputs[0].token_ids == word and short.outputs[0].finish_reason == "stop"
    # (allowed_token_ids that leave the EOS out: it ends at the match too, not aborted)
    no_eos = [i for i in range(len(llm.get_tokenizer())) if i != eos]
    masked = llm.generate("Pick:", SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=no_eos,
                                                  structured_outputs=StructuredOutputsParams(**spec)),
                          use_tqdm=False)[0].outputs[0]
    assert (masked.token_ids, masked.finish_reason) == (word, "stop")
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]


def hf_masked_greedy(hf, tokenizer, vocab_size, spec: StructuredOutputsParams, prompt_ids, max_tokens, eos):
    """The oracle: HF transformers' logits, the same grammar's mask applied, argmax, step by
    step, to the EOS (vLLM's rule: a complete match's mask allows only EOS)."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size),
                                   grammar_text(spec, StructuredOutputsConfig()))
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float32)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            llguidance.numpy.apply_token_bitmask_inplace(logits[None], mask)
            token = int(np.argmax(logits))
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
            if token == eos:
                break
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["llm", "sync_llm"])
def test_greedy_equals_hf_with_the_same_mask(request, engine, path, hf_model):
    llm = request.getfixturevalue(engine)
    tokenizer = llm.get_tokenizer()
    hf = hf_model(path)
    vocab = llm.llm_engine.model_config.vocab_size
    specs = [StructuredOutputsParams(json=SCHEMAS[1], disable_any_whitespace=True),
             StructuredOutputsParams(regex=r"[a-z]{2,6} \d{1,3}"),
             StructuredOutputsParams(choice=["alpha", "beta", "gamma"])]
    for spec in specs:
        prompts = PROMPTS[:4]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
                               use_tqdm=False)
        for out in outputs:
            want = hf_masked_greedy(hf, tokenizer, vocab, spec, out.prompt_token_ids, 40, tokenizer.eos_token_id)
            assert out.outputs[0].token_ids == want


def test_unconstrained_rows_are_unchanged_by_constrained_ones(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:8], [plain, sampled] * 4, use_tqdm=False)
    json_params = constrained(json=SCHEMAS[0], disable_any_whitespace=True)
    mixed = llm.generate(PROMPTS[:8] * 2, [plain, sampled] * 4 + [json_params] * 8, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:8]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[8:]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[0])


def test_async_and_sync_scheduling_agree(llm, sync_llm):
    params = [constrained(json=SCHEMAS[2], disable_any_whitespace=True), constrained(regex=r"\d{2,4}[a-z]+"),
              SamplingParams(temperature=0, max_tokens=16)] * 4
    want = [o.outputs[0].token_ids for o in sync_llm.generate(PROMPTS[:12], params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:12], params, use_tqdm=False)] == want


def test_preemption_in_the_middle_of_constrained_requests(llm, path):
    """Preempted requests are recomputed from their tokens; their matchers stay where the
    tokens are, so the outputs are those of a run without preemption."""
    params = constrained(json=SCHEMAS[0], disable_any_whitespace=True, max_tokens=60)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(8)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **ENGINE, num_gpu_blocks_override=14) as small:  # 8 x 6 blocks wanted at most
        got = small.generate(prompts, params, use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for out in got:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[0])


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "Grammar error: .*strin"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="[a-"), "(?s)Grammar error: .*unclosed character class"),
    (dict(grammar='root ::= "a" undefined_rule'), "Rule 'undefined_rule' not found"),
])
def test_invalid_specs_are_refused_and_the_engine_keeps_serving(llm, spec, message):
    good = SamplingParams(temperature=0, max_tokens=8)
    want = llm.generate(PROMPTS[:2], good, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:3], [good, good, constrained(**spec)], use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.runner.num_blocks
    assert texts(llm.generate(PROMPTS[:2], good, use_tqdm=False)) == texts(want)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="You must use one kind of structured outputs constraint but none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="You can only use one kind of structured outputs constraint but multiple"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_skip_tokenizer_init_refuses_structured_outputs(path):
    with LLM(path, **ENGINE, skip_tokenizer_init=True, enforce_eager=True) as llm:
        with pytest.raises(ValueError, match="^Structured outputs requires a tokenizer so it can't be used with "
                                             "'skip_tokenizer_init'"):
            llm.generate({"prompt_token_ids": [5, 6]}, constrained(regex="a+"), use_tqdm=False)


def test_unknown_backend_is_refused(path):
    with pytest.raises(ValueError, match="backend 'xgrammar' is not available in jaxvllm"):
        LLM(path, **ENGINE, structured_outputs_config={"backend": "xgrammar"})
    with pytest.raises(ValueError, match="reasoning_parser='qwen3': reasoning parsers are not available"):
        StructuredOutputsConfig(reasoning_parser="qwen3")
    # vLLM 0.11's other fields, at values that mean nothing here
    assert StructuredOutputsConfig(disable_fallback=True, reasoning_parser="").disable_fallback


def test_a_request_whose_grammar_compiles_waits_without_holding_others_back(llm):
    """Compilation runs in a thread pool: a request whose grammar is not ready stays queued
    while the others run; it starts once the grammar is there. Each spec compiles once."""
    engine = llm.llm_engine
    manager = engine.structured_outputs
    release, calls, real = threading.Event(), [], manager._compile

    def slow_compile(text):
        calls.append(text)
        release.wait(timeout=60)
        return real(text)

    manager._compile = slow_compile
    try:
        spec = dict(regex=r"[a-c]{4,8}z")  # a spec no other test uses: not compiled yet
        engine.add_request("constrained-1", "x", constrained(**spec))
        engine.add_request("constrained-2", "y", constrained(**spec))
        engine.add_request("plain", "z", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        finished = {}
        while "plain" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert not finished.keys() & {"constrained-1", "constrained-2"}
        assert {r.request_id for r in engine.scheduler.waiting} == {"constrained-1", "constrained-2"}
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        manager._compile = real
        release.set()
    assert len(calls) == 1
    for rid in ("constrained-1", "constrained-2"):
        assert re.fullmatch(r"[a-c]{4,8}z", finished[rid].outputs[0].text)


def test_n_completions_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["one", "two", "three"]))
    out = llm.generate("x", params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.text in ("one", "two", "three") for c in out.outputs)


def test_chat_accepts_structured_outputs(llm):
    schema = SCHEMAS[1]
    messages = [{"role": "user", "content": "Give me a point."}]
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    out = llm.chat(messages, constrained(json=schema, disable_any_whitespace=True), chat_template=template,
                   use_tqdm=False)[0]
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_mask_filling_is_counted(llm):
    before = llm.llm_engine.stats()["structured_output_mask_steps"]
    llm.generate(PROMPTS[:4], constrained(choice=["a1", "b2"]), use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["structured_output_mask_steps"] > before and stats["structured_output_mask_seconds"] > 0


@pytest.fixture(scope="module")
def short_vocab_path(tiny_checkpoint):
    return tiny_checkpoint("llama", **SHORT_VOCAB)


@pytest.mark.parametrize("short_vocab", [True, False], ids=["short_vocab", "padded_vocab"])
def test_tokenizer_and_vocabulary_of_different_sizes(engines, short_vocab):
    """A tokenizer with more ids than the model's vocabulary (llguidance refused it: "vocab
    size too small; 384 vs 385"), and one with fewer (the tiny model's 512 embeddings, 384
    ids): the outputs follow the grammar, with no id past either size."""
    llm = engines(short_vocab)
    vocab = llm.llm_engine.model_config.vocab_size
    assert (len(llm.get_tokenizer()) > vocab) == short_vocab
    limit = min(vocab, len(llm.get_tokenizer()))
    choices = ["alpha", "beta", "gamma"]
    cases = [
        (dict(json=SCHEMAS[1], disable_any_whitespace=True), lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])),
        (dict(regex=r"\d{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"\d{3}-[a-z]{2,5}", t) or pytest.fail(t)),
        (dict(choice=choices), lambda t: t in choices or pytest.fail(t)),
    ]
    for spec, check in cases:
        for out in llm.generate(PROMPTS[:8], constrained(**spec), use_tqdm=False):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop"
            check(completion.text)
            assert max(completion.token_ids) < limit


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_grammar_that_needs_an_id_past_the_vocabulary_ends_the_request(engines, async_scheduling):
    """After "a" the grammar allows only <|extra_0|>, which the model cannot produce: the
    request ends there ("abort"), without a junk token, and the others in the batch go on."""
    llm = engines(short_vocab=True, async_scheduling=async_scheduling)
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    stuck = SamplingParams(temperature=0, max_tokens=20, logprobs=1,
                           structured_outputs=StructuredOutputsParams(grammar='start: "a" <|extra_0|> "b"'))
    others = [constrained(regex=r"[a-z]{3,6}"), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], others, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:4], others + [stuck] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[2:]:
        completion = out.outputs[0]
        assert (completion.token_ids, completion.text, completion.finish_reason) == (a, "a", "abort")
        assert len(completion.logprobs) == len(a)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.runner.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_dead_end_in_a_step_that_failed_is_counted_once(engines, async_scheduling, monkeypatch):
    """A request a dead end ended, in a step whose outputs then failed: it stays ended (it got
    no token to take back), its final output comes with the next step, and it is a finished
    request in the metrics, once (it was not counted at all)."""
    llm = engines(short_vocab=True, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    stuck = SamplingParams(temperature=0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(grammar='start: "a" "a" <|extra_0|> "b"'))
    original, armed = engine.output_processor.step_outputs, [True]

    def failing(requests, parents):
        if armed[0] and any(r.is_finished for r in requests):
            armed[0] = False
            raise RuntimeError("injected")
        return original(requests, parents)

    monkeypatch.setattr(engine.output_processor, "step_outputs", failing)
    before = dict(engine.metrics.request_success), sum(engine.metrics.e2e_request_latency.counts)
    engine.add_request("dead-end", {"prompt_token_ids": a * 6}, stuck)
    finals = []
    while engine.has_unfinished_requests():
        try:
            finals += [o for o in engine.step() if o.finished]
        except RuntimeError:
            pass
    assert not armed[0] and [o.outputs[0].finish_reason for o in finals] == ["abort"]
    assert engine.metrics.request_success["abort"] == before[0]["abort"] + 1
    assert sum(engine.metrics.e2e_request_latency.counts) == before[1] + 1


def test_a_complete_match_that_only_an_eos_past_the_vocabulary_could_follow_stops(short_vocab_path):
    """The tokenizer's EOS past the model's vocabulary: a complete match is a dead end that
    stops (not aborts); every mask is the model's width, with no id past it allowed."""
    tokenizer = AutoTokenizer.from_pretrained(short_vocab_path)
    tokenizer.eos_token = "<|extra_0|>"
    vocab = SHORT_VOCAB["vocab_size"]
    manager = StructuredOutputManager(tokenizer, vocab, StructuredOutputsConfig(), wait=True)
    grammar = manager.grammar(StructuredOutputsParams(grammar='start: "a" <|extra_0|>?'))
    a = tokenizer.encode("a", add_special_tokens=False)
    mask = manager.bitmask([(1, grammar, [])], 3)
    assert mask.shape == (3, bitmask_words(vocab))
    assert np.flatnonzero(np.unpackbits(mask[1].view(np.uint8), bitorder="little")).tolist() == a
    assert (mask[[0, 2]] == -1).all() and not grammar.dead_end
    assert grammar.accept(a[0]) and grammar.matcher.is_accepting() and not grammar.stopped
    mask = manager.bitmask([(1, grammar, [])], 3)  # only <|extra_0|> (EOS, or the grammar's) may follow
    assert grammar.dead_end and grammar.dead_end_reason == "stop" and (mask == -1).all()
    manager.shutdown()


def test_masks_after_drafts_and_a_dead_end_past_them(short_vocab_path):
    """A speculative step's rows: the grammar's next tokens at the first, then after each
    draft (a copy of the matcher advanced); a dead end past a draft marks `dead_end_at`."""
    tokenizer = AutoTokenizer.from_pretrained(short_vocab_path)
    manager = StructuredOutputManager(tokenizer, SHORT_VOCAB["vocab_size"], StructuredOutputsConfig(), wait=True)
    grammar = manager.grammar(StructuredOutputsParams(grammar='start: "a" "b" <|extra_0|>'))
    a, b = (tokenizer.encode(s, add_special_tokens=False) for s in "ab")
    allowed = lambda row: np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()  # noqa: E731
    assert grammar.valid_prefix(a + b + a) == 2
    mask = manager.bitmask([(1, grammar, a + b)], 4)
    reference = grammar.matcher.deep_copy()
    want = llguidance.numpy.allocate_token_bitmask(1, manager.tokenizer.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(reference, want, 0)
    assert allowed(mask[1]) == allowed(want[0][: mask.shape[1]])
    assert reference.consume_token(a[0])
    llguidance.numpy.fill_next_token_bitmask(reference, want, 0)
    assert allowed(mask[2]) == allowed(want[0][: mask.shape[1]]) == b
    assert (mask[[0, 3]] == -1).all()  # row 3, after "ab", could only take <|extra_0|>: a dead end
    assert grammar.dead_end_at == 2 and not grammar.dead_end
    assert grammar.accept(a[0])  # (the grammar's own matcher is still at the start)
    manager.shutdown()


def test_drafts_under_a_grammar_that_cannot_roll_back(path):
    """A Lark grammar with a `stop=` lexeme, which llguidance cannot roll back: the rows after
    drafts come from a copy of the matcher, which stays as it was (rolling it back put it in
    error, and its request went on unconstrained); a matcher in error refuses every token, so
    its request ends ("abort") rather than going on unconstrained."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, StructuredOutputsConfig(), wait=True)
    spec = StructuredOutputsParams(grammar='start: gen\ngen[stop="!"]: /[ab]*/')
    grammar, plain = manager.grammar(spec), manager.grammar(spec)
    a, b = (tokenizer.encode(s, add_special_tokens=False) for s in "ab")
    mask = manager.bitmask([(0, grammar, a + b)], 3)
    assert not grammar.failed
    for row, token in enumerate(a + b, 1):
        assert plain.accept(token)
        assert (mask[row] == manager.bitmask([(0, plain, [])], 1)[0]).all()
    assert grammar.accept(b[0]) and not grammar.failed
    grammar.matcher.rollback(1)  # (what the draft rows did before)
    assert grammar.failed and not grammar.accept(a[0])
    manager.shutdown()


def test_a_dead_end_among_accepted_drafts_ends_the_request_there(engines, short_vocab_path):
    """N-gram drafts "a a a" under a grammar that needs <|extra_0|> after three: the request
    keeps the drafts up to the dead end and ends there as without drafts ("abort")."""
    plain = engines(short_vocab=True, async_scheduling=False)
    a = plain.get_tokenizer().encode("a", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=1, structured_outputs=StructuredOutputsParams(
        grammar='start: "a" "a" "a" <|extra_0|> "b"'))
    prompt = [{"prompt_token_ids": a * 6}]
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}
    with LLM(short_vocab_path, **ENGINE, speculative_config=spec) as llm:
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
        assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.runner.num_blocks
    assert (got.token_ids, got.finish_reason, len(got.logprobs)) == (want.token_ids, "abort", 3)
    assert list(got.token_ids) == a * 3
