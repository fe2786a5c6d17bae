"""vLLM's semantics at the edges (the bugs listed first in the API-parity issue)."""

import pytest

from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3"), **ENGINE)
    yield llm
    llm.shutdown()


def greedy(llm, prompt="Hello", **kwargs):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kwargs})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_stop_strings_wait_for_min_tokens(llm):
    """vLLM looks for stop strings only once more than min_tokens tokens exist, and then only
    in the text that is new."""
    ref = greedy(llm)
    tokenizer = llm.get_tokenizer()
    stop = tokenizer.decode(ref.token_ids[:2])[-1]  # the last character of the first two tokens' text
    early = greedy(llm, stop=[stop])
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    late = greedy(llm, stop=[stop], min_tokens=5)
    assert len(late.token_ids) >= 6 and late.token_ids == ref.token_ids[: len(late.token_ids)]
    if late.finish_reason == "stop":  # only an occurrence in text that came after min_tokens counts
        full = tokenizer.decode(ref.token_ids[: len(late.token_ids)])
        assert full.find(stop, len(tokenizer.decode(ref.token_ids[:5])) - len(stop) + 1) != -1


def test_max_tokens_past_the_context_is_capped(llm):
    prompt = {"prompt_token_ids": list(range(10, 60))}  # 50 of 64 positions
    out = greedy(llm, prompt, max_tokens=100)
    assert len(out.token_ids) == 64 - 50 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len"):
        greedy(llm, {"prompt_token_ids": list(range(10, 74))})  # the prompt alone fills the context


def test_detokenize_false_leaves_decoded_token_none(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, detokenize=False),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == ""
    assert all(lp.decoded_token is None for step in out.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in out.prompt_logprobs[1:] for lp in step.values())
    text = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3, logprobs=2),
                        use_tqdm=False)[0]
    assert all(lp.decoded_token is not None for step in text.outputs[0].logprobs for lp in step.values())


def test_fields_assigned_after_construction_count(llm):
    ref = greedy(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop_id = ref.token_ids[2]
    params.stop_token_ids = [stop_id]
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1] and out.stop_reason == stop_id
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params.max_tokens = 3
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == ref.token_ids[:3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params.stop = [llm.get_tokenizer().decode(ref.token_ids[:4])[-1]]
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].finish_reason == "stop"


def test_vllm_engine_arguments_are_accepted(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    llm = LLM(path, **ENGINE, dtype="float", enforce_eager=True, disable_log_stats=True, trust_remote_code=True,
              swap_space=0, revision="main", compilation_config={"level": 3}, tokenizer_mode="auto",
              tensor_parallel_size=1)
    assert llm.llm_engine.config.dtype == "float32"
    assert llm.stats()["warmup_seconds"] == 0 and llm.stats()["num_compiled_buckets"] == 0  # enforce_eager: lazy
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.stats()["num_compiled_buckets"] == 1
    llm.shutdown()
    with pytest.raises(ValueError, match="tensor_parallel_size=2: jaxvllm runs on one device"):
        LLM(path, **ENGINE, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto' or 'slow'"):
        LLM(path, **ENGINE, tokenizer_mode="mistral")


def test_prompt_types_priority_lora_and_chat_kwargs(llm):
    from jaxvllm import TextPrompt, TokensPrompt
    from jaxvllm.inputs import TokensPrompt as Same

    assert Same is TokensPrompt
    params = SamplingParams(temperature=0, max_tokens=3)
    a, b = llm.generate([TokensPrompt(prompt_token_ids=[5, 6]), TextPrompt(prompt="Hello")], params, priority=1,
                        use_tqdm=False, lora_request=None)
    assert a.prompt_token_ids == [5, 6] and b.prompt == "Hello"
    with pytest.raises(ValueError, match="LoRA is not supported"):
        llm.generate("Hello", params, lora_request=object(), use_tqdm=False)
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}{{ suffix | default('') }}")
    user = [{"role": "user", "content": "Hi"}]
    [out] = llm.chat(user, params, chat_template=template, chat_template_kwargs={"suffix": "!"}, use_tqdm=False)
    assert out.prompt == "user: Hi;assistant:!"
    conversation = user + [{"role": "assistant", "content": "Well"}]
    [out] = llm.chat(conversation, params, chat_template=template, add_generation_prompt=False,
                     continue_final_message=True, use_tqdm=False)
    assert out.prompt == "user: Hi;assistant: Well"  # the reply goes on from the last message
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        llm.chat(conversation, params, chat_template=template, continue_final_message=True, use_tqdm=False)


def test_engine_args_from_the_command_line_and_engine_helpers(tiny_checkpoint):
    """vLLM's `EngineArgs` example: flags -> EngineArgs -> LLMEngine, stepped by hand."""
    import argparse

    from jaxvllm import EngineArgs, LLMEngine

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_checkpoint("qwen3")), "--max-model-len", "64", "--max-num-seqs", "8",
                              "--max-num-batched-tokens", "64", "--enforce-eager"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    assert engine.config.max_model_len == 64 and engine.config.enforce_eager
    engine.add_request("0", "Hello", SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("1", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    assert engine.get_num_unfinished_requests() == 2
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["0", "1"] and engine.get_num_unfinished_requests() == 0
    engine.shutdown()


def test_default_sampling_params_come_from_generation_config(tiny_checkpoint, tmp_path):
    import json
    import shutil

    path = tmp_path / "with-generation-config"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    llm = LLM(path, **ENGINE, enforce_eager=True)
    assert llm.get_default_sampling_params() == SamplingParams()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                             "max_new_tokens": 7, "do_sample": True}))
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 7)
    llm.shutdown()
