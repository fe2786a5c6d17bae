"""The vLLM-compatible surface: prompt forms, outputs, step-by-step engine use, bad input."""

import io
import sys

import numpy as np
import pytest

from jaxvllm import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen3"), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               token_buckets=[16, 64])


def test_prompt_forms_and_outputs(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("Hello, world").input_ids
    outputs = llm.generate(["Hello, world", {"prompt": "Hello, world"}, {"prompt_token_ids": ids}], GREEDY,
                           use_tqdm=False)
    assert [type(o) for o in outputs] == [RequestOutput] * 3
    a, b, c = outputs
    assert a.prompt == b.prompt == "Hello, world" and c.prompt is None
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    out = a.outputs[0]
    assert isinstance(out, CompletionOutput) and out.index == 0 and len(out.token_ids) == 5
    # (HF's decode where its characters are whole; vLLM's DecodeStream adds no partial one)
    full = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == full if "\ufffd" not in full else full.startswith(out.text.rstrip("\ufffd"))
    assert out.finish_reason == "length" and out.stop_reason is None
    m = a.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    single = llm.generate("Hello, world", GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == out.token_ids
    bars = []

    def make_bar(*, total, desc, dynamic_ncols, postfix):  # vLLM's use_tqdm may be a tqdm-like factory, given these
        from tqdm import tqdm

        bars.append(tqdm(total=total, desc=desc, dynamic_ncols=dynamic_ncols, postfix=postfix, file=io.StringIO()))
        return bars[-1]

    assert llm.generate(["Hello, world"] * 2, GREEDY, use_tqdm=make_bar)[1].outputs[0].token_ids == out.token_ids
    assert len(bars) == 1 and bars[0].n == 2 and bars[0].total == 2
    # As vLLM's, it counts completions, and shows the input and output speeds.
    llm.generate(["Hello, world"] * 2, SamplingParams(n=3, max_tokens=2), use_tqdm=make_bar)
    assert bars[1].n == bars[1].total == 6 and "est. speed input: " in str(bars[1].postfix)
    assert " toks/s, output: " in str(bars[1].postfix)
    # As vLLM's: any sequence of prompts (numpy, pandas, a datasets Column); empty multimodal
    # fields are ignored, others refused by name.
    import pandas as pd

    for prompts in (np.array(["Hello, world"] * 2), pd.Series(["Hello, world"] * 2)):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [out.token_ids] * 2
    with pytest.raises(TypeError, match="prompts must be a str, a dict or a sequence of them, got DataFrame"):
        llm.generate(pd.DataFrame({"prompt": ["Hello, world"]}), GREEDY, use_tqdm=False)  # (not its column names)
    empty = {"prompt": "Hello, world", "multi_modal_data": None, "mm_processor_kwargs": {}}
    assert llm.generate(empty, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match=r"multimodal inputs \(\['multi_modal_data'\]\) are not supported"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": 1}}, GREEDY, use_tqdm=False)


def test_what_a_detokenizer_reads_of_the_tokenizer_is_read_once(llm, monkeypatch):
    """Its special ids and decoder kind, per tokenizer, not per request (a vocabulary with
    thousands of added tokens took milliseconds a request)."""
    from jaxvllm.detokenizer import TokenizerInfo

    reads = []
    real = TokenizerInfo.of
    monkeypatch.setattr(TokenizerInfo, "of", lambda tokenizer: (reads.append(1), real(tokenizer))[1])
    outputs = llm.generate(["Hello", "Hi there"], SamplingParams(temperature=0, max_tokens=4, stop=["zz"]),
                           use_tqdm=False)
    assert len(outputs) == 2 and reads == []


def test_per_prompt_params_stop_ids_and_ignore_eos(llm):
    [ref] = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    tokens = ref.outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[tokens[2]])
    longer = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    a, b = llm.generate(["The quick brown fox"] * 2, [stop, longer], use_tqdm=False)
    assert a.outputs[0].token_ids == tokens[: tokens.index(tokens[2]) + 1]
    assert a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason == tokens[2]
    assert b.outputs[0].token_ids[:5] == tokens and len(b.outputs[0].token_ids) == 9
    with pytest.raises(ValueError, match="The lengths of prompts and .* must be the same.*one entry per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_eos_stops_unless_ignored(llm, tiny_checkpoint, tmp_path):
    """A checkpoint whose config.json (and no generation_config.json) names, as EOS, a token the
    greedy completion reaches. The tokenizer's EOS (2) is the model's; the other stops as
    vLLM's extra EOS ids do: as a stop token id, its id the stop_reason."""
    import json
    import shutil

    [ref] = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tokens = ref.outputs[0].token_ids
    eos = tokens[3]
    path = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "eos")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos]}))
    (path / "generation_config.json").unlink(missing_ok=True)  # (which vLLM reads instead, where there is one)
    other = LLM(path, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64])
    assert other.llm_engine.eos_token_ids == (2, eos)
    [out] = other.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[: tokens.index(eos) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == eos
    [ignored] = other.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
    assert ignored.outputs[0].token_ids == tokens and ignored.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    [alone] = llm.generate("Once upon a time", params, use_tqdm=False)
    others = [SamplingParams(temperature=0.7, max_tokens=8, seed=i) for i in range(7)]
    batch = llm.generate(["Hello"] * 3 + ["Once upon a time"] + ["Hello, world"] * 4, others[:3] + [params] + others[3:],
                         use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=8, seed=99),
                                use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    zero = SamplingParams(temperature=0, max_tokens=8, seed=5)
    [greedy] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.generate("Once upon a time", zero, use_tqdm=False)[0].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_priority_generate(llm):
    """Prompts of 60 tokens against a 64-token budget: one is admitted per step, lowest priority value first."""
    prompts = [{"prompt_token_ids": [10 + i] * 60} for i in range(4)]
    outs = llm.generate(prompts, GREEDY, priority=[2, 0, 3, 1], use_tqdm=False)
    assert [o.prompt_token_ids[0] for o in outs] == [10, 11, 12, 13]  # input order
    admitted = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert admitted == [1, 3, 0, 2]
    fcfs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sorted(range(4), key=lambda i: fcfs[i].metrics.first_scheduled_time) == [0, 1, 2, 3]
    assert [o.outputs[0].token_ids for o in fcfs] == [o.outputs[0].token_ids for o in outs]
    with pytest.raises(ValueError, match="The lengths of prompts and .* must be the same.*one entry per prompt"):
        llm.generate(["a", "b"], GREEDY, priority=[1], use_tqdm=False)


def test_engine_step_by_step_and_abort(llm):
    engine = llm.llm_engine
    engine.add_request("x", "Hello, world", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("y", {"prompt": "The quick brown fox"}, SamplingParams(temperature=0, max_tokens=30))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "again")
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        if len(seen.get("y", [])) == 3 and "y" in engine.scheduler.requests:
            [aborted] = engine.abort_request("y")
            assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
            assert len(aborted.outputs[0].token_ids) == 3
    assert seen["x"][-1].finished and len(seen["x"][-1].outputs[0].token_ids) == 6
    assert [len(o.outputs[0].token_ids) for o in seen["x"]] == [1, 2, 3, 4, 5, 6]
    assert engine.abort_request(["y", "unknown"]) == []
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]

    # vLLM's add_request signature: arrival_time 4th, tokenization_kwargs, trace_headers, priority.
    tokenizer = engine.get_tokenizer()
    engine.add_request("w", "Hello", SamplingParams(temperature=0, max_tokens=2), 1234.5,
                       tokenization_kwargs={"add_special_tokens": False}, trace_headers={"x": "y"}, priority=0)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].metrics.arrival_time == 1234.5
    assert outs[-1].prompt_token_ids == tokenizer.encode("Hello", add_special_tokens=False)
    # vLLM's LLM passes truncate_prompt_tokens to its engine as tokenization_kwargs.
    engine.add_request("t", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=1),
                       tokenization_kwargs={"truncation": True, "max_length": 2})
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].prompt_token_ids == [7, 8]
    with pytest.raises(ValueError, match=r"tokenization_kwargs \['padding'\] are not supported"):
        engine.add_request("v", "Hello", GREEDY, tokenization_kwargs={"truncation": True, "padding": True})


def test_generate_refuses_while_requests_added_by_hand(llm):
    engine = llm.llm_engine
    engine.add_request("z", "Hello", GREEDY)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    engine.abort_request("z")


def test_enqueue_and_wait_for_completion(llm, monkeypatch):
    """vLLM's: `enqueue` queues prompts and returns their ids, `wait_for_completion` runs them
    and returns their outputs in the order queued. A generate in between runs them along and
    returns only its own; an interrupted wait leaves them queued (the next goes on); a bad
    prompt queues none of its call's."""
    from jaxvllm.engine import LLMEngine

    engine = llm.llm_engine
    first, second = ["Hello", "The sky", "One two"], ["Why", "Four five six"]
    want = [o.outputs[0].token_ids for o in llm.generate(first + second, GREEDY, use_tqdm=False)]
    ids = llm.enqueue(first[:2], GREEDY)
    ids += llm.enqueue(first[2:], [GREEDY])
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 3
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.enqueue(["Fine", ""], GREEDY)
    import threading

    with pytest.raises(ValueError, match="does not support per request user provided logits processors"):
        llm.enqueue("Fine", SamplingParams(logits_processors=[threading.Lock()]))  # (shared by the copy, as vLLM's)
    assert sorted(engine.request_ids()) == sorted(ids)
    assert [o.outputs[0].token_ids for o in llm.generate(second, GREEDY, use_tqdm=False)] == want[3:]
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion(use_tqdm=False)] == want[:3]
    assert llm.wait_for_completion(use_tqdm=False) == [] and not engine.has_unfinished_requests()

    ids = llm.enqueue(first, GREEDY)
    real, calls = LLMEngine.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids and [o.outputs[0].token_ids for o in outputs] == want[:3]
    engine.add_request("by-hand", "Hello", GREEDY)
    with pytest.raises(RuntimeError, match="added by hand"):
        llm.enqueue("Hello", GREEDY)
    engine.abort_request("by-hand")
    engine.add_request("by-hand", "Hello", GREEDY)  # (finished by hand too: nothing by hand is left)
    while engine.has_unfinished_requests():
        engine.step()

    # The requests keep copies of their params: one changed and reused before the wait
    # changes only the next request.
    params = SamplingParams(temperature=0, max_tokens=5)
    llm.enqueue(first[0], params)
    params.temperature, params.logit_bias = 1.0, {7: 100.0}
    llm.enqueue(first[1], params)
    a, b = llm.wait_for_completion(use_tqdm=False)
    assert a.outputs[0].token_ids == want[0] and b.outputs[0].token_ids == [7] * 5
    # Priorities given to queued requests hold when a later call gives none (prompts of 40
    # tokens: one prefill a step, in the order scheduled, so they finish in that order).
    order = []
    real_step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: [o for o in real_step(self) if not order.append(o.request_id)])
    long = [{"prompt_token_ids": [5 + i] * 40} for i in range(3)]
    ids = llm.enqueue(long, GREEDY, priority=[2, 1, 0])
    ids += llm.enqueue_chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template="{{ messages[0].content }}")
    assert engine.scheduler.config.policy == "priority"
    llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    assert order.index(ids[2]) < order.index(ids[1]) < order.index(ids[0])


@pytest.mark.parametrize(
    "prompts, params, error, match",
    [
        ("x" * 400, GREEDY, ValueError, "the model's context length is only 128 tokens"),
        ({"prompt_token_ids": list(range(3, 131))}, GREEDY, ValueError, r"^You passed 128 input tokens, and a completion needs at least 1 output token. However, the model's context length is only 128 tokens, resulting in a maximum input length of 127 tokens"),
        ("", GREEDY, ValueError, "^The decoder prompt cannot be empty \\(the text '' encodes to no tokens\\)\n"
                                 "\\(prompt 0 of 1\\)$"),
        ({"prompt_token_ids": []}, GREEDY, ValueError, "^The decoder prompt cannot be empty"),
        ({"prompt_token_ids": [5, 10_000]}, GREEDY, ValueError, r"^Token id 10000 is out of vocabulary"),
        ({"prompt_token_ids": "5 6"}, GREEDY, TypeError, "prompt_token_ids must be a list"),
        # (vLLM's TypeError and words, then what was missing)
        ({"text": "hi"}, GREEDY, TypeError, r"^inputs must be a string, TextPrompt, TokensPrompt, or EmbedsPrompt: a "
                                            r"prompt dict needs 'prompt' \(text\) or 'prompt_token_ids' \(it has "
                                            r"\['text'\]\)"),
        ({"prompt": "hi", "prompt_embeds": [[0.0]]}, GREEDY, ValueError, "prompt_embeds: prompt embeddings are not "
                                                                         "supported"),
        ({"prompt": 5, "prompt_token_ids": [4]}, GREEDY, TypeError, "TokensPrompt's 'prompt' .* must be a str"),
        ({"cache_salt": "s"}, GREEDY, TypeError, "needs 'prompt' \\(text\\) or 'prompt_token_ids'"),
        (123, GREEDY, TypeError, "prompts must be a str"),
        (["ok", 5], GREEDY, TypeError, "a prompt must be a str or a dict, got int"),
        ("ok", "greedy", TypeError, "sampling params must be SamplingParams"),
        ("ok", SamplingParams(max_tokens=None), None, None),  # None = up to max_model_len: fine
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(llm, prompts, params, error, match):
    [before] = llm.generate("Hello, world", GREEDY, use_tqdm=False)
    if error is None:
        [out] = llm.generate(prompts, params, use_tqdm=False)
        assert out.finished
    else:
        with pytest.raises(error, match=match):
            llm.generate(["Hello, world", prompts] if isinstance(prompts, dict) else prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] and not llm.llm_engine.has_unfinished_requests()
    [after] = llm.generate("Hello, world", GREEDY, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), r"^max_tokens must be at least 1, got 0.$"),
        (dict(max_tokens=2.5), "max_tokens must be an int, got 2.5"),
        (dict(temperature=-0.1), r"^temperature must be non-negative, got -0.1.$"),
        (dict(seed=-(2**63) - 1), r"seed must be in \[-9223372036854775808, 18446744073709551615\]"),
        (dict(stop_token_ids=[-3]), "stop_token_ids must be non-negative"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_no_step_left_in_flight_after_generate(llm):
    """Async scheduling dispatches the next step before reading a request's stop token:
    generate reads that step too before returning, so that the engine has no unfinished
    requests afterwards, as vLLM's (a test once saw one, by timing)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tokens = full[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and not llm.llm_engine.has_unfinished_requests()


def test_long_prefill_token_threshold_keeps_outputs(llm, tiny_checkpoint):
    """vLLM's `long_prefill_token_threshold`: prompts in chunks of at most 8 tokens, the same
    greedy outputs."""
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 30, 45)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_checkpoint("qwen3"), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
             token_buckets=[16, 64], long_prefill_token_threshold=8, enforce_eager=True) as capped:
        assert [o.outputs[0].token_ids for o in capped.generate(prompts, params, use_tqdm=False)] == want
        assert capped.llm_engine.scheduler.config.long_prefill_token_threshold == 8


def test_engine_arguments_are_checked(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's max_position_embeddings"):
        LLM(path, max_model_len=4096)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        LLM(path, max_num_seqs=64, max_num_batched_tokens=32)
    # vLLM's defaults: max_num_seqs at most max_num_batched_tokens; without chunked prefill a
    # budget that holds a whole prompt of max_model_len, and a smaller one given refused.
    with LLM(path, max_model_len=128, max_num_batched_tokens=32, enforce_eager=True) as small:
        assert small.llm_engine.config.max_num_seqs == 32
    with LLM(path, max_model_len=3000, enable_chunked_prefill=False, enforce_eager=True, hf_overrides={
            "max_position_embeddings": 4096}) as unchunked:
        assert unchunked.llm_engine.config.max_num_batched_tokens == 3000
    for budget in (dict(max_num_batched_tokens=64), dict(token_buckets=[16, 64])):
        with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\)"):
            LLM(path, max_model_len=128, enable_chunked_prefill=False, **budget)
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be an int >= 0"):
        LLM(path, max_model_len=128, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="largest token bucket"):
        LLM(path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[16])
    with pytest.raises(ValueError, match="attention_backend 'flash'"):
        LLM(path, max_model_len=128, attention_backend="flash")
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences'"):
        LLM(path, max_num_sequences=4)


def test_an_empty_text_that_encodes_to_a_bos_is_a_prompt(tiny_checkpoint, tmp_path):
    """As vLLM: the text is tokenized first, and only an empty token list is refused."""
    import shutil

    from tokenizers import Tokenizer, processors

    folder = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "bos")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    with LLM(folder, max_model_len=64, enforce_eager=True) as llm:
        [out] = llm.generate("", GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == [1] and len(out.outputs[0].token_ids) == 5


def test_set_tokenizer(llm):
    """vLLM's LLM.set_tokenizer: chat templates, text and the end ids come from the new
    tokenizer; refused while requests are unfinished."""
    import copy

    old = llm.get_tokenizer()
    new = copy.deepcopy(old)
    new.chat_template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    new.eos_token = new.convert_ids_to_tokens(7)
    conversation = [{"role": "user", "content": "Hi"}]
    llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)
    arrivals = llm.llm_engine.input_processor.next_arrival
    assert arrivals > 0
    try:
        llm.set_tokenizer(new)
        assert llm.get_tokenizer() is new and llm.llm_engine.eos_token_ids[0] == 7
        # (unseeded requests' seeds go on from the arrivals so far: no repeat of the first ones)
        assert llm.llm_engine.input_processor.next_arrival == arrivals
        [out] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert out.prompt == "<<Hi>>" and out.prompt_token_ids == new.encode("<<Hi>>", add_special_tokens=False)
        assert out.outputs[0].text == new.decode(out.outputs[0].token_ids, skip_special_tokens=True).rstrip("\ufffd")
        llm.enqueue({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="set_tokenizer\\(\\) while requests are unfinished"):
            llm.set_tokenizer(old)
        assert len(llm.wait_for_completion(use_tqdm=False)) == 1
    finally:
        llm.set_tokenizer(old)
    assert llm.get_tokenizer() is old and llm.llm_engine.eos_token_ids[0] == old.eos_token_id



def test_a_ctrl_c_in_set_tokenizer_switches_everything_or_nothing(llm):
    """A real SIGINT as the engine swaps its tokenizer and what is built on it lands after
    the swap: never prompts read with one tokenizer and outputs with another."""
    import copy
    import signal

    from jaxvllm.engine import LLMEngine
    from tests.engine.test_faults import sigint_in

    engine, old = llm.llm_engine, llm.get_tokenizer()
    new, structured = copy.deepcopy(old), engine.structured_outputs
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sigint_in(LLMEngine._use_tokenizer, "self.tokenizer, self.eos_token_ids, self.structured_outputs =")
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.set_tokenizer(new)
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, previous)
    try:
        assert engine.tokenizer is new and engine.input_processor.tokenizer is new
        assert engine.output_processor.tokenizer is new and engine.structured_outputs is not structured
    finally:
        llm.set_tokenizer(old)


def test_wait_for_completion_after_a_request_was_aborted_by_hand(llm):
    """An enqueued request aborted through llm_engine has no output to hand back: the others
    come back, and later calls work."""
    ids = llm.enqueue([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], GREEDY, use_tqdm=False)
    llm.llm_engine.abort_request(ids[0])
    assert [o.request_id for o in llm.wait_for_completion(use_tqdm=False)] == [ids[1]]
    assert llm.wait_for_completion(use_tqdm=False) == []
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)) == 1
