"""vLLM's semantics at the edges (the bugs listed first in the API-parity issue)."""

import argparse
import dataclasses

import numpy as np
import pytest

from jaxvllm import LLM, EngineArgs, SamplingParams

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
    with pytest.raises(ValueError, match="the model's context length is only 64 tokens"):
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


def test_add_request_keeps_a_copy_of_the_params(llm):
    """As vLLM's engine (it clones them): params changed or reused after `add_request` leave
    the request alone. Before, the fields the sampler reads when the request is first
    scheduled (temperature, penalties, logit_bias) were read from the caller's object."""
    engine = llm.llm_engine
    ref = greedy(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("copy", "Hello", params)
    params.temperature, params.repetition_penalty, params.logit_bias = 1.0, 2.0, {5: 100.0}
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == ref.token_ids


def test_a_text_prompt_past_the_model_vocabulary_is_refused(tiny_checkpoint):
    """A tokenizer may hold ids the model lacks (added tokens): a text that encodes to one is
    refused as its ids would be, and the request in flight goes on. Before, it was taken,
    and with penalties every later step raised (the sampler's prompt mask), so nothing
    in flight finished."""
    llm = LLM(tiny_checkpoint("llama", vocab_size=384, extra_tokens=1), **ENGINE)
    engine = llm.llm_engine
    want = greedy(llm, repetition_penalty=1.2).token_ids
    engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       repetition_penalty=1.2))
    engine.step()
    for prompt in ("Hello <|extra_0|>", {"prompt_token_ids": [5, 384]}):
        with pytest.raises(ValueError, match="Token id 384 is out of vocabulary"):
            engine.add_request("bad", prompt, SamplingParams(repetition_penalty=1.2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "good" and outputs[-1].outputs[0].token_ids == want
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]
    llm.shutdown()


def test_request_ids_of_completions_and_refused_calls(llm):
    """vLLM's rules for ids: a str (TypeError otherwise), and not one in use, a completion's
    ("{index}_{id}" for n > 1) included while its request runs: before, a finished
    completion's id was taken, and aborting its request then freed the newcomer's row
    (its output changed). A refused call takes no arrival number, so later unseeded
    requests draw what they would have drawn; n set to 0 after construction is refused."""
    engine = llm.llm_engine
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(5, "Hello", SamplingParams())
    # n = 2, each completion 10 or 11 (11 stops it): a seed with which completion 0 ends first
    def two(seed):
        return SamplingParams(n=2, temperature=1.0, seed=seed, allowed_token_ids=[10, 11], stop_token_ids=[11],
                              max_tokens=40)

    lengths = [[len(c.token_ids) for c in out.outputs]
               for out in llm.generate([{"prompt_token_ids": [1, 2]}] * 20, [two(s) for s in range(20)], use_tqdm=False)]
    seed = next(s for s, (first, second) in enumerate(lengths) if first + 4 < second)
    engine.add_request("X", {"prompt_token_ids": [1, 2]}, two(seed))
    while "0_X" in engine.scheduler.requests:
        engine.step()
    assert "1_X" in engine.scheduler.requests
    arrival = engine.input_processor.next_arrival
    with pytest.raises(ValueError, match="request id '0_X' is already in use"):
        engine.add_request("0_X", "Hello", SamplingParams())
    assert engine.input_processor.next_arrival == arrival
    engine.abort_request("X")
    assert not engine.has_unfinished_requests()
    bad = SamplingParams()
    bad.n = 0
    for prompts in (["Hello", "Hi", ""], ["Hello", "Hi", "Hey"]):
        with pytest.raises(ValueError, match="cannot be empty|n must be at least 1"):
            llm.generate(prompts, [SamplingParams(), SamplingParams(), bad if prompts[2] else SamplingParams()],
                         use_tqdm=False)
        assert engine.input_processor.next_arrival == arrival and not engine._parents
    # A Ctrl-C while the prompts are checked gives the arrivals back too (it took them before).
    process, calls = engine.input_processor.process, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return process(*args, **kwargs)

    engine.input_processor.process = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello", "Hi", "Hey"], SamplingParams(), use_tqdm=False)
    finally:
        del engine.input_processor.process
    assert engine.input_processor.next_arrival == arrival and not engine._parents


# vLLM 0.11's EngineArgs fields, in its order (vllm/engine/arg_utils.py).
VLLM_ENGINE_ARGS = """
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init enable_prompt_embeds
tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains download_dir
safetensors_load_strategy load_format config_format dtype kv_cache_dtype seed max_model_len cuda_graph_sizes
distributed_executor_backend pipeline_parallel_size tensor_parallel_size decode_context_parallel_size
data_parallel_size data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_address
data_parallel_rpc_port data_parallel_hybrid_lb data_parallel_backend enable_expert_parallel enable_dbo
dbo_decode_token_threshold dbo_prefill_token_threshold eplb_config enable_eplb expert_placement_strategy
_api_process_count _api_process_rank num_redundant_experts eplb_window_size eplb_step_interval
eplb_log_balancedness max_parallel_loading_workers block_size enable_prefix_caching prefix_caching_hash_algo
disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb gpu_memory_utilization
kv_cache_memory_bytes max_num_batched_tokens max_num_partial_prefills max_long_partial_prefills
long_prefill_token_threshold max_num_seqs max_logprobs logprobs_mode disable_log_stats revision code_revision
rope_scaling rope_theta hf_token hf_overrides tokenizer_revision quantization enforce_eager
disable_custom_all_reduce limit_mm_per_prompt interleave_mm_strings media_io_kwargs mm_processor_kwargs
disable_mm_preprocessor_cache mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb
mm_encoder_tp_mode io_processor_plugin skip_mm_profiling video_pruning_rate enable_lora enable_lora_bias
max_loras max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_extra_vocab_size
ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config ignore_patterns
enable_chunked_prefill disable_chunked_mm_input disable_hybrid_kv_cache_manager structured_outputs_config
reasoning_parser guided_decoding_backend guided_decoding_disable_fallback
guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties logits_processor_pattern
speculative_config show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces
scheduling_policy scheduler_cls pooler_config override_pooler_config compilation_config worker_cls
worker_extension_cls kv_transfer_config kv_events_config generation_config enable_sleep_mode
override_generation_config model_impl override_attention_dtype calculate_kv_scales mamba_cache_dtype
mamba_ssm_cache_dtype additional_config use_tqdm_on_load pt_load_map_location
enable_multimodal_encoder_data_parallel logits_processors async_scheduling kv_sharing_fast_prefill""".split()


def test_every_vllm_engine_argument_is_taken():
    """A vLLM script's engine arguments are LLM(...)'s, each with a command-line flag: none
    is an unexpected keyword (those for features jaxvllm lacks are refused by name, below
    and in tests/api/test_bad_engine_args.py)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert [name for name in VLLM_ENGINE_ARGS if name not in names] == []
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = {action.dest for action in parser._actions}
    assert [name for name in VLLM_ENGINE_ARGS if name not in flags and not name.startswith("_")] == []
    aliases = {"-tp": 2, "-pp": 1, "-dp": 2, "-dpn": 1, "-dpr": 0, "-dpl": 2, "-dpa": "10.0.0.1", "-dpp": 5,
               "-dpb": "ray", "-dcp": 1, "-q": "fp8", "-O": "3"}  # (vLLM's short flags)
    args = vars(parser.parse_args(["--model", "m", *[str(x) for pair in aliases.items() for x in pair]]))
    assert [args[name] for name in ("tensor_parallel_size", "data_parallel_rank", "data_parallel_address",
                                    "decode_context_parallel_size", "compilation_config")] == [2, 1, "10.0.0.1", 1, "3"]
    # The flags' defaults are LLM(...)'s, lists and dicts too: the same config either way
    from jaxvllm.config import EngineConfig

    cli = EngineArgs(**{k: v for k, v in vars(parser.parse_args(["--model", "m"])).items() if v is not None})
    assert cli.shared_fields() == EngineConfig(model="m").shared_fields()
    assert EngineConfig(model="m", hf_config_path="m").hf_config_path == "m"  # (the model's own folder)


def test_vllm_engine_arguments_are_accepted(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    llm = LLM(path, **ENGINE, dtype="float", enforce_eager=True, disable_log_stats=True, trust_remote_code=True,
              swap_space=0, revision="main", compilation_config={"level": 3}, tokenizer_mode="auto",
              tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, kv_cache_dtype="auto",
              quantization=None, enable_lora=False, download_dir="/nowhere", max_seq_len_to_capture=8192,
              served_model_name="tiny", tokenizer_revision="main", code_revision="main",
              max_parallel_loading_workers=2, runner="generate", limit_mm_per_prompt={"image": 5},
              mm_processor_kwargs={}, disable_chunked_mm_input=True, disable_custom_all_reduce=True,
              distributed_executor_backend="mp", enable_prompt_embeds=False, cpu_offload_gb=0, hf_token=None,
              convert="auto", logits_processors=None, allowed_local_media_path="", pooler_config=None,
              max_num_partial_prefills=1, max_long_partial_prefills=1, prefix_caching_hash_algo="sha256_cbor",
              task="generate", model_impl="auto", kv_transfer_config=None, disable_sliding_window=False,
              enable_lora_bias=False, reasoning_parser="", worker_extension_cls="", guided_decoding_backend="guidance",
              guided_decoding_disable_any_whitespace=True, guided_decoding_disable_fallback=None,
              use_tqdm_on_load=False, disable_cascade_attn=True, cuda_graph_sizes=[1, 8], enable_dbo=True,
              enable_eplb=True, num_redundant_experts=2, expert_placement_strategy="round_robin",
              num_lookahead_slots=4, disable_hybrid_kv_cache_manager=True, kv_sharing_fast_prefill=True,
              mm_processor_cache_gb=0, media_io_kwargs={"video": {"num_frames": 8}}, ignore_patterns=["original/**"],
              safetensors_load_strategy="eager", model_loader_extra_config={"enable_multithread_load": True},
              additional_config={"x": 1}, config_format="hf", data_parallel_backend="ray", data_parallel_size_local=1,
              scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler", worker_cls="auto", _api_process_count=1)
    assert {m.labels["model_name"] for m in llm.get_metrics() if m.name != "vllm:cache_config_info"} == {"tiny"}
    structured = llm.llm_engine.config.structured_outputs_config
    assert structured.backend == "guidance" and structured.disable_any_whitespace
    assert llm.llm_engine.config.dtype == "float32"
    assert llm.stats()["warmup_seconds"] == 0 and llm.stats()["num_compiled_buckets"] == 0  # enforce_eager: lazy
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.stats()["num_compiled_buckets"] == 1
    llm.shutdown()
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 exceeds the 1 cpu device\(s\) here"):
        LLM(path, **ENGINE, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: jaxvllm splits a model over devices by tensor"):
        LLM(path, **ENGINE, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='fp8_inc' is not supported; choose from 'auto', 'fp8'"):
        LLM(path, **ENGINE, kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match=r"^quantization='awq' names a quantized checkpoint's method, but config.json "
                                         r"has no quantization_config"):
        LLM(path, **ENGINE, quantization="awq")
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto' or 'slow'"):
        LLM(path, **ENGINE, tokenizer_mode="mistral")
    from jaxvllm.config import EngineConfig

    for name, value, message in [("task", "embed", "generative models only"), ("model_impl", "transformers", "own models"),
                                 ("disable_sliding_window", True, "turning sliding windows off"),
                                 ("reasoning_parser", "deepseek_r1", "reasoning parsers"),
                                 ("worker_extension_cls", "my.Ext", "worker extensions"),
                                 ("guided_decoding_backend", "nonsense", "backend 'nonsense' is not available"),
                                 ("structured_outputs_config", {"backend": "outlines"},
                                  "backend 'outlines' is not available")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=str(path), **{name: value})
    # vLLM 0.11 sets its deprecated guided_decoding_backend where nothing reads it: scripts that name
    # another backend there run (on llguidance here, with a warning); enable_in_reasoning is taken
    config = EngineConfig(model=str(path), guided_decoding_backend="xgrammar",
                          structured_outputs_config={"enable_in_reasoning": True})
    assert config.structured_outputs_config.backend == "auto"


def test_vllm_0_11s_deprecated_guided_decoding_names_and_list_fields(llm):
    """GuidedDecodingParams and SamplingParams(guided_decoding=...) still work, with vLLM
    0.11's DeprecationWarning; stop and bad_words are lists, as vLLM's."""
    from jaxvllm.sampling_params import GuidedDecodingParams

    with pytest.warns(DeprecationWarning, match="GuidedDecodingParams is deprecated"):
        guided = GuidedDecodingParams(choice=["yes", "no"])
    with pytest.warns(DeprecationWarning, match="guided_decoding is deprecated"):
        params = SamplingParams(temperature=0, max_tokens=5, guided_decoding=guided)
    assert params.structured_outputs is guided and params.guided_decoding is None
    [out] = llm.generate("Hello", params, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    assert (SamplingParams().stop, SamplingParams().bad_words, SamplingParams().stop_token_ids) == ([], [], [])
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=("x", "y")).stop == ["x", "y"]


def test_prompt_types_priority_lora_and_chat_kwargs(llm):
    from jaxvllm import TextPrompt, TokensPrompt
    from jaxvllm.inputs import TokensPrompt as Same

    assert Same is TokensPrompt
    params = SamplingParams(temperature=0, max_tokens=3)
    a, b = llm.generate([TokensPrompt(prompt_token_ids=[5, 6]), TextPrompt(prompt="Hello")], params, priority=1,
                        use_tqdm=False, lora_request=None)
    assert a.prompt_token_ids == [5, 6] and b.prompt == "Hello"
    # A TokensPrompt may carry its text: the ids are what runs, the text is reported.
    [c] = llm.generate(TokensPrompt(prompt_token_ids=[5, 6], prompt="five six"), params, use_tqdm=False)
    assert (c.prompt, c.prompt_token_ids, c.outputs[0].token_ids) == ("five six", [5, 6], a.outputs[0].token_ids)
    # Keys vLLM does not read are ignored, as by vLLM (a dataset row with its answer).
    [d] = llm.generate({"prompt_token_ids": [5, 6], "answer": "x", "token_type_ids": [0, 0]}, params, use_tqdm=False)
    assert d.outputs[0].token_ids == a.outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA adapters need an engine started with enable_lora=True"):
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
    # vLLM's preprocess_chat: chat's prompts as token ids, which generate runs as chat does.
    prompts = llm.preprocess_chat([user, conversation], chat_template=template, add_generation_prompt=False,
                                  chat_template_kwargs={"suffix": "!"})
    texts = ["user: Hi;!", "user: Hi;assistant: Well;!"]
    assert [p["prompt_token_ids"] for p in prompts] == [llm.get_tokenizer().encode(t, add_special_tokens=False)
                                                        for t in texts]
    [by_ids] = llm.generate(prompts[1], params, use_tqdm=False)
    [by_chat] = llm.chat(conversation, params, chat_template=template, add_generation_prompt=False,
                         chat_template_kwargs={"suffix": "!"}, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_chat.outputs[0].token_ids
    assert llm.llm_engine.get_model_config() is llm.llm_engine.model_config
    assert llm.llm_engine.get_supported_tasks() == ("generate",)
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        llm.chat(conversation, params, chat_template=template, continue_final_message=True, use_tqdm=False)


def test_chat_content_parts_as_the_template_reads_them(llm):
    """As vLLM's `LLM.chat`: content may be a list of OpenAI text parts or None. A template
    that reads one string gets the text parts joined by newlines (None: ""); one that loops
    over a message's content gets parts (a string becomes one part). Tool-call arguments
    sent as JSON reach the template as dicts. Non-text parts are refused."""
    params = SamplingParams(temperature=0, max_tokens=2)
    string = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
    parts = ("{% for m in messages %}{{ m.role }}:{% for p in m.content %} <{{ p.text }}>{% endfor %};"
             "{% endfor %}")
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]},
        {"role": "assistant", "content": None},
    ]

    def prompt(template, **kwargs):
        return llm.chat(conversation, params, chat_template=template, add_generation_prompt=False, use_tqdm=False,
                        **kwargs)[0].prompt

    assert prompt(string) == "system: Be brief.;user: What is\n2 + 2?;assistant: ;"
    assert prompt(parts) == "system: <Be brief.>;user: <What is> <2 + 2?>;assistant:;"
    # Empty parts are dropped, as vLLM drops them: no extra newline, no empty part.
    conversation[1]["content"].insert(1, {"type": "text", "text": ""})
    conversation.append({"role": "user", "content": ""})
    assert prompt(string) == "system: Be brief.;user: What is\n2 + 2?;assistant: ;user: ;"
    assert prompt(parts) == "system: <Be brief.>;user: <What is> <2 + 2?>;assistant:;user:;"
    del conversation[1]["content"][1], conversation[-1]
    [forced] = llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=string, use_tqdm=False,
                        add_generation_prompt=False, chat_template_content_format="openai")  # (as asked)
    assert forced.prompt == "user: [{'type': 'text', 'text': 'Hi'}];"
    tools = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
             "{{ c.function.arguments['x'] + 1 }}{% endfor %}{% endfor %}")
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"x": 41}'}}]}
    [out] = llm.chat([conversation[0], call], params, chat_template=tools, add_generation_prompt=False,
                     use_tqdm=False)
    assert out.prompt == "add42"
    with pytest.raises(ValueError, match="content part .*image_url.* is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 chat_template=string, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(conversation, params, chat_template=string, chat_template_content_format="json", use_tqdm=False)


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'eq', 'text') %}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages[1:] %}{% for p in m.content[0:] %}{% endfor %}{% endfor %}", "openai"),
    ("{% set msgs = messages | reverse %}{% for m in msgs %}{% for p in m.content %}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% generation %}{% for p in m.content %}{% endfor %}{% endgeneration %}{% endfor %}",
     "openai"),
    ("{% for d in documents %}{% for p in d.content %}{% endfor %}{% endfor %}", "string"),  # not a message's
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # (does not parse)
])
def test_chat_content_format_detection(template, expected):
    """vLLM's `_detect_content_format`: a loop over a message's content, through filters,
    slices and assignments of `messages`, in transformers' environment (its `generation` tag)."""
    from jaxvllm.chat_utils import detect_content_format

    assert detect_content_format(template) == expected


def test_chat_renders_as_vllm(llm):
    """As vLLM's `LLM.chat`: chat_template_kwargs win over the named arguments; a tokenizer's
    named templates are chosen by tools; each message reaches the template rebuilt (role,
    content, name, an assistant's tool calls and reasoning, a tool's call id and its content
    as a string: nothing else); thinking parts are text, text parts without text skipped; a
    template's error is a ValueError naming the conversation; mm_processor_kwargs only empty."""
    from jaxvllm.chat_utils import render_chat

    params = SamplingParams(temperature=0, max_tokens=1)
    one = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    other = "other{% for m in messages %}:{{ m.content }}{% endfor %}"
    user = [{"role": "user", "content": "Hi"}]

    def prompt(messages, template=one, **kwargs):  # (the rendering alone: these prompts outgrow the engine's 64)
        return render_chat(llm.get_tokenizer(), [messages], chat_template=template, **kwargs)[0]

    [out] = llm.chat(user, params, chat_template=one, chat_template_kwargs={"add_generation_prompt": False},
                     use_tqdm=False)
    assert out.prompt == "user:Hi;"  # (a TypeError once)
    assert prompt(user, chat_template_kwargs={"chat_template": other}) == "other:Hi"
    tokenizer = llm.get_tokenizer()
    own = tokenizer.chat_template
    parts = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    tokenizer.chat_template = {"default": parts, "tool_use": "tools" + one}
    try:  # (the named templates' "default" read parts: once taken for strings, each character a part)
        assert prompt(user, template=None) == "[Hi]"
        assert prompt(user, template=None, tools=[{"type": "function", "function": {"name": "f"}}]) == "toolsuser:Hi;A:"
    finally:
        tokenizer.chat_template = own
    keys = ("{% for m in messages %}{{ m.role }}({{ 'extra' in m }},{{ 'tool_calls' in m }},{{ 'tool_call_id' in m }},"
            "{{ m.name }},{{ m.reasoning }}){% endfor %}")
    messages = [{"role": "user", "content": "q", "name": "ann", "tool_calls": [], "extra": 1},
                {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "old", "tool_call_id": 3,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                 "tool_call_id": "7", "name": 5},
                {"role": "assistant", "content": "b", "tool_calls": []}, {"role": "assistant", "tool_calls": None}]
    assert prompt(messages, keys, add_generation_prompt=False) == (  # (an assistant's [] kept, None not: vLLM's)
        "user(False,False,False,ann,)assistant(False,True,False,,r)tool(False,False,True,,)"
        "assistant(False,True,False,,)assistant(False,False,False,,)")
    tool_content = "{% for m in messages %}{% for p in m.content %}{% endfor %}{{ m.content }}{% endfor %}"
    assert prompt(messages[2:3], tool_content, add_generation_prompt=False) == "x\ny"  # (openai format; a tool's a str)
    thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "t"}, {"type": "text", "text": None},
                                             {"type": "text", "text": "u"}]}]
    assert prompt(thinking, add_generation_prompt=False) == "user:t\nu;"
    strict = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="no tools here") as caught:
        llm.chat([user, messages[2:3]], params, chat_template=strict, use_tqdm=False)
    assert "(conversation 1 of 2)" in caught.value.__notes__
    for empty in (None, {}):
        assert llm.chat(user, params, chat_template=one, mm_processor_kwargs=empty, use_tqdm=False)[0].prompt == (
            "user:Hi;A:")
    with pytest.raises(ValueError, match=r"mm_processor_kwargs \{'num_crops': 4\} are not supported"):
        llm.chat(user, params, chat_template=one, mm_processor_kwargs={"num_crops": 4}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_args_from_the_command_line_and_engine_helpers(tiny_checkpoint):
    """vLLM's `EngineArgs` example: flags -> EngineArgs -> LLMEngine, stepped by hand."""
    import argparse

    from jaxvllm import EngineArgs, LLMEngine

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_checkpoint("qwen3")), "--max-model-len", "64", "--max-num-seqs", "8",
                              "--max-num-batched-tokens", "64", "--enforce-eager"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    assert engine.config.max_model_len == 64 and engine.config.enforce_eager
    assert engine.model_config.max_model_len == 64  # (vLLM's scripts read it there)
    engine.add_request("0", "Hello", SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("1", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    assert engine.get_num_unfinished_requests() == 3  # (as vLLM's: each of the n = 2 completions counts)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["0", "1"] and engine.get_num_unfinished_requests() == 0
    engine.shutdown()


def test_async_engine_args_flags():
    """vLLM's AsyncEngineArgs.add_cli_args: the engine flags and --enable-log-requests (its
    deprecated --disable-log-requests parsed, not read), or those alone (`async_args_only`);
    the deprecated `disable_log_requests` property."""
    import argparse

    from jaxvllm import AsyncEngineArgs

    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "dummy:tiny", "--max-model-len", "64", "--enable-log-requests",
                              "--disable-log-requests"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.enable_log_requests and engine_args.max_model_len == 64
    assert vars(AsyncEngineArgs.add_cli_args(argparse.ArgumentParser(), async_args_only=True).parse_args([])) == {
        "enable_log_requests": False, "disable_log_requests": True}
    with pytest.warns(DeprecationWarning, match="disable_log_requests is deprecated"):
        assert engine_args.disable_log_requests is False
    engine_args.disable_log_requests = True
    assert engine_args.enable_log_requests is False


def test_vllm_script_flags_and_none_defaults():
    """The flags vLLM's example scripts pass (`--seed`, `--trust-remote-code`, `-tp`, `-O3`, a JSON
    flag's keys one at a time, ...), through `from jaxvllm.utils import FlexibleArgumentParser`
    (vLLM's path up to 0.10); and
    None for the arguments vLLM types Optional means the default."""
    import json

    from jaxvllm import EngineArgs
    from jaxvllm.config import EngineConfig
    from jaxvllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "dummy:tiny", "--seed", "42", "--trust-remote-code", "-tp", "1", "-O3",
                              "--served-model-name", "a", "b", "--tokenizer_mode", "auto", "--disable-log-stats",
                              "--swap-space", "0", "--scheduling-policy", "priority"])
    config = EngineArgs.from_cli_args(args)
    assert (config.seed, config.trust_remote_code, config.tensor_parallel_size, config.served_model_name,
            config.scheduling_policy) == (42, True, 1, ["a", "b"], "priority")
    # A JSON flag one key at a time, merged (vLLM's parser); vLLM's flags for what jaxvllm leaves unused.
    args = parser.parse_args(["--model", "dummy:tiny", "--hf-overrides.num_hidden_layers", "2",
                              "--hf_overrides.rope_scaling.factor=2.0", "--hf-overrides.rope_scaling.rope_type", "linear",
                              "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3",
                              "-O.level", "3", "--served-model-name", "a", "--distributed-executor-backend", "mp",
                              "--disable-custom-all-reduce", "--limit-mm-per-prompt", '{"image": 0}', "--task", "generate",
                              "--token-buckets", "16", "64"])
    config = EngineArgs.from_cli_args(args)
    assert config.hf_overrides == {"num_hidden_layers": 2, "rope_scaling": {"factor": 2.0, "rope_type": "linear"}}
    # vLLM's deprecated --rope-scaling / --rope-theta: moved into hf_overrides, with vLLM's warning.
    with pytest.warns(DeprecationWarning) as warned:
        rope = EngineArgs.from_cli_args(parser.parse_args([
            "--model", "dummy:tiny", "--hf-overrides", '{"num_hidden_layers": 2}', "--rope-scaling",
            '{"rope_type": "linear", "factor": 2.0}', "--rope-theta", "20000"]))
    assert rope.hf_overrides == {"num_hidden_layers": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                   "rope_theta": 20000.0}
    assert (rope.rope_scaling, rope.rope_theta) == (None, None)
    assert [str(w.message).split(" will")[0] for w in warned] == ["`--rope-scaling`", "`--rope-theta`"]
    with pytest.raises(ValueError, match="rope_scaling must be a dict"):
        EngineArgs(model="dummy:tiny", rope_scaling=2.0)
    assert (args.speculative_config, args.compilation_config) == ({"method": "ngram", "num_speculative_tokens": 3},
                                                                  '{"level": 3}')
    assert (config.distributed_executor_backend, config.disable_custom_all_reduce, config.limit_mm_per_prompt,
            config.task, config.token_buckets) == ("mp", True, {"image": 0}, "generate", [16, 64])
    assert parser.parse_args(["--model", "dummy:tiny", "--gpu-memory-utilization", "-0.5"]).gpu_memory_utilization == -0.5
    assert parser.parse_args(["--model", "dummy:tiny", "--hf-token"]).hf_token is True  # (vLLM's: the login's token)
    # Only this parser's own flags take keys; lists with key+; nothing moves past `--`.
    mine = FlexibleArgumentParser()
    mine.add_argument("--config-json", type=json.loads)
    mine.add_argument("--prompt")
    mine.add_argument("files", nargs="*")
    args = mine.parse_args(["--config-json.a+", "x,y", "--prompt", "--note. read this", "--config-json.a+=z",
                            "--config-json.c.d=2", "--", "--config-json.e", "3"])
    assert (args.config_json, args.prompt, args.files) == ({"a": ["x", "y", "z"], "c": {"d": 2}}, "--note. read this",
                                                           ["--config-json.e", "3"])
    assert parser.parse_known_args(["--model", "dummy:tiny", "--other.b=1"])[1] == ["--other.b=1"]  # (left as given)
    defaults = EngineConfig(model="dummy:tiny")
    nones = EngineConfig(model="dummy:tiny", seed=None, block_size=None, max_num_seqs=None,
                         enable_prefix_caching=None, enable_chunked_prefill=None, async_scheduling=None)
    assert nones == defaults


def test_default_sampling_params_come_from_generation_config(tiny_checkpoint, tmp_path):
    """As vLLM's: read once from generation_config.json (generation_config="auto"), used by
    generate/chat when given no sampling params; "vllm" ignores the file."""
    import json
    import shutil

    path = tmp_path / "with-generation-config"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    with LLM(path, **ENGINE, enforce_eager=True) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                             "max_new_tokens": 3, "do_sample": True}))
    with LLM(path, **ENGINE, enforce_eager=True) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 3)
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, use_tqdm=False)  # no params: these
        assert all(len(o.outputs[0].token_ids) <= 3 for o in outputs)
        assert any(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 3 for o in outputs)
    with LLM(path, **ENGINE, enforce_eager=True, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    # override_generation_config: over the file's fields, or (with "vllm") alone.
    override = {"temperature": 0.3, "max_new_tokens": 5}
    with LLM(path, **ENGINE, enforce_eager=True, override_generation_config=override) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.3, 0.9, 20, 5)
    with LLM(path, **ENGINE, enforce_eager=True, generation_config="vllm", override_generation_config=override) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.3, max_tokens=5)
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        LLM(path, **ENGINE, override_generation_config=[("temperature", 0.3)])


def test_generation_config_is_read_as_vllm_0_11_reads_it(tiny_checkpoint, tmp_path):
    """vLLM 0.11 runs on transformers 4, whose defaults a generation config leaves out: an
    explicit top_k of 50 samples the whole vocabulary there. With no generation_config.json,
    the sampling fields and end ids of config.json count (GenerationConfig.from_model_config)."""
    import json
    import shutil

    from jaxvllm.config import EngineConfig
    from jaxvllm.model_config import read_generation_config

    path = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "model")
    (path / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "temperature": 0.7, "top_k": 50, "repetition_penalty": 1.2}))
    assert read_generation_config(EngineConfig(model=str(path))) == {"temperature": 0.7, "repetition_penalty": 1.2,
                                                                     "eos_token_id": config["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps({"top_k": 50, "top_p": 0.8, "temperature": 1.0}))
    fields = read_generation_config(EngineConfig(model=str(path)))
    assert fields["top_p"] == 0.8 and "top_k" not in fields and "temperature" not in fields
    # A generation_config that names neither kind of folder (a typo, the file's own path) is an
    # error, as vLLM's (it was left unread: the defaults stayed plain SamplingParams())
    assert read_generation_config(EngineConfig(model=str(path), generation_config=str(path)))["top_p"] == 0.8
    for wrong in (tmp_path / "typo", path / "generation_config.json"):
        with pytest.raises(ValueError, match=rf"generation_config='{wrong}' is not a folder holding "
                                             rf"generation_config.json or config.json"):
            read_generation_config(EngineConfig(model=str(path), generation_config=str(wrong)))


def test_generation_config_eos_ids_stop_as_stop_token_ids(llm, tiny_checkpoint, tmp_path):
    """generation_config.json may list more end ids than the tokenizer's EOS (Qwen and Llama 3
    instruct models do): vLLM (`update_from_generation_config`) adds them to stop_token_ids,
    so they stop a completion with their id as stop_reason; the tokenizer's EOS keeps None;
    ignore_eos ignores both. HF's generate stops at them too."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    prompt, greedy_8 = [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8)
    base = llm.generate({"prompt_token_ids": prompt}, greedy_8, use_tqdm=False)[0].outputs[0].token_ids
    eos, extra = llm.get_tokenizer().eos_token_id, base[1]
    assert extra not in base[:1] and eos not in base
    path = tmp_path / "two-eos"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, extra]}))
    hf = AutoModelForCausalLM.from_pretrained(path).generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert hf[0, len(prompt):].tolist() == base[:2]
    with LLM(path, **ENGINE, enforce_eager=True) as two:
        out = two.generate({"prompt_token_ids": prompt}, greedy_8, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (base[:2], "stop", extra)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert two.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids == base
        params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[eos])
        out = two.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    # config.json's end ids count only where there is no generation_config.json (vLLM reads
    # the file, else `GenerationConfig.from_model_config`).
    from transformers import AutoConfig

    from jaxvllm.config import EngineConfig
    from jaxvllm.input_processor import eos_token_ids
    from jaxvllm.model_config import ModelConfig, read_generation_config

    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [eos, extra]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    def ends():
        engine_config = EngineConfig(model=str(path))
        config_eos = ModelConfig.from_hf(AutoConfig.from_pretrained(path)).eos_token_ids
        return eos_token_ids(config_eos, read_generation_config(engine_config), llm.get_tokenizer())

    assert ends() == (eos,)
    with LLM(path, **ENGINE, enforce_eager=True) as one:
        assert one.generate({"prompt_token_ids": prompt}, greedy_8, use_tqdm=False)[0].outputs[0].token_ids == base
    (path / "generation_config.json").unlink()
    assert ends() == (eos, extra)


def test_the_length_cap_comes_before_a_stop_token(llm):
    """vLLM's `check_stop` order: a stop id or EOS that is also the last allowed token ends
    the completion as "length" (its text kept); under ignore_eos an EOS listed in
    stop_token_ids is that id's stop, reported by id."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    eos = llm.get_tokenizer().eos_token_id
    cases = [  # (params, tokens, finish_reason, stop_reason)
        (SamplingParams(temperature=0, max_tokens=k + 1, stop_token_ids=[ids[k]]), ids[: k + 1], "length", None),
        (SamplingParams(temperature=0, max_tokens=k + 2, stop_token_ids=[ids[k]]), ids[: k + 1], "stop", ids[k]),
        (SamplingParams(temperature=0, max_tokens=3, min_tokens=2, logit_bias={eos: 100.0}), ids[:2] + [eos],
         "length", None),
        (SamplingParams(temperature=0, max_tokens=8, min_tokens=2, logit_bias={eos: 100.0}), ids[:2] + [eos],
         "stop", None),
        (SamplingParams(temperature=0, max_tokens=8, min_tokens=2, ignore_eos=True, stop_token_ids=[eos],
                        logit_bias={eos: 100.0}), ids[:2] + [eos], "stop", eos),
    ]
    for params, tokens, reason, stop_reason in cases:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens, reason, stop_reason), params
        if reason == "length":  # (a stop token's text is left out of a "stop" only)
            assert out.text == llm.get_tokenizer().decode(tokens, skip_special_tokens=True).rstrip("\ufffd")


# -- SamplingParams fields and engine arguments for logprobs ---------------------------------


def test_max_logprobs_and_logprobs_minus_one(llm, tiny_checkpoint):
    """vLLM's rule and words: a request may ask for at most max_logprobs (default 20; -1 =
    the whole vocabulary), and logprobs=-1 means the whole vocabulary."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    for kwargs, words in [(dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
                          (dict(logprobs=-1), "Requested sample logprobs of 512, which is greater than max allowed: 20"),
                          (dict(prompt_logprobs=25), "Requested prompt logprobs of 25, which is greater than max allowed: 20")]:
        with pytest.raises(ValueError, match=f"^{words}"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert SamplingParams(logprobs=True).logprobs == 1  # vLLM reads True as 1
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=20, prompt_logprobs=5),
                       use_tqdm=False)[0]
    with LLM(tiny_checkpoint("qwen3"), **ENGINE, max_logprobs=-1, enforce_eager=True) as big:
        out = big.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=40),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, ref_step in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert len(step) == 512  # every token of the vocabulary, ranks 1..512
            assert sorted(lp.rank for lp in step.values()) == list(range(1, 513))
            assert np.isclose(sum(np.exp(lp.logprob) for lp in step.values()), 1.0, atol=1e-4)
            for token, lp in ref_step.items():
                assert np.isclose(step[token].logprob, lp.logprob, atol=1e-5) and step[token].rank == lp.rank
        assert all(len(step) in (40, 41) for step in out.prompt_logprobs[1:])


def test_logprobs_modes(llm, tiny_checkpoint):
    """raw_logprobs (the default) are of the model's logits; raw_logits are those logits;
    processed_* are of the logits the sampler drew from (after bias, temperature, top-k)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=3, logprobs=5, logit_bias={9: 5.0})
    sampled = SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=3, logprobs=5)
    top_1 = SamplingParams(temperature=0.5, top_k=1, seed=1, max_tokens=3, logprobs=5)  # (drawn as greedy)
    every = (greedy, sampled, top_1)
    raw = [llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in every]
    by_mode = {}
    for mode in ("raw_logits", "processed_logprobs", "processed_logits"):
        with LLM(tiny_checkpoint("qwen3"), **ENGINE, logprobs_mode=mode, enforce_eager=True) as other:
            outs = by_mode[mode] = [other.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in every]
        for out, ref, params in zip(outs, raw, every):
            if mode == "processed_logits":  # top_k = 1 as vLLM samples it: the top logit over T, the rest -inf
                if params is top_1:
                    logits = by_mode["raw_logits"][every.index(top_1)].logprobs
                    for step, step_logits, token in zip(out.logprobs, logits, out.token_ids):
                        finite = {t: lp.logprob for t, lp in step.items() if np.isfinite(lp.logprob)}
                        assert list(finite) == [token]
                        assert np.isclose(finite[token], step_logits[token].logprob / 0.5, atol=1e-4)
                continue
            assert out.token_ids == ref.token_ids  # the mode changes what is reported, never the tokens
            for step, ref_step in zip(out.logprobs, ref.logprobs):
                tokens = [t for t in ref_step if t in step]
                values = np.array([step[t].logprob for t in tokens])
                ref_values = np.array([ref_step[t].logprob for t in tokens])
                if mode == "raw_logits":  # logits = logprobs + one constant (the log-partition) per step
                    assert np.ptp(values - ref_values) < 1e-4 and np.all(values - ref_values > 0.1)
                elif params is greedy:  # processed = log_softmax(logits + bias): raw + bias + one constant
                    bias = 5.0 * (np.array(tokens) == 9)
                    assert np.ptp(values - ref_values - bias) < 1e-4
                else:  # processed with temperature 0.5 and top_k k: k finite logprobs summing to 1
                    finite = [lp.logprob for lp in step.values() if np.isfinite(lp.logprob)]
                    assert len(finite) == params.top_k and np.isclose(np.sum(np.exp(finite)), 1.0, atol=1e-4)



def test_a_logit_bias_of_minus_infinity_bans_a_token(llm):
    """vLLM adds a logit_bias as given: -inf bans the token, greedy or sampled (NaN and +inf,
    which leave a row no distribution, are refused)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    first = greedy(llm, prompt, max_tokens=1).token_ids[0]
    assert greedy(llm, prompt, max_tokens=1, logit_bias={first: float("-inf")}).token_ids[0] != first
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=1, seed=0, n=16, logit_bias={first: -np.inf})
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert all(c.token_ids[0] != first for c in out.outputs)
    assert params.logit_bias == {first: float("-inf")}

def test_bad_words_ban_their_last_token_after_the_rest(llm):
    """vLLM's rule: the last token of a bad word's token sequence is banned when the output
    so far ends with the rest of it; only output tokens count. A word whose sequence the
    greedy output contains (two tokens long, so the prefix rule is exercised) must then
    change the output exactly where the sequence would be completed."""
    ref = greedy(llm, "1 2 3", max_tokens=16).token_ids
    word, banned, first = two_token_bad_word(llm, ref)
    out = greedy(llm, "1 2 3", max_tokens=16, bad_words=[word]).token_ids
    assert out[:first] == ref[:first] and out[first] != ref[first]
    for seq in banned:  # never generated, anywhere
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out) - len(seq) + 1)), (word, seq, out)
    with pytest.raises(ValueError, match=r"^bad_words cannot contain an empty string"):
        SamplingParams(bad_words=["ok", ""])


def two_token_bad_word(llm, ref: list[int]):
    """A word whose two-token sequence the output `ref` contains: (word, its banned
    sequences, where `ref` first completes one)."""
    tokenizer, engine = llm.get_tokenizer(), llm.llm_engine
    for j in range(len(ref) - 1):
        word = tokenizer.decode(ref[j : j + 2]).strip()
        banned = engine.input_processor.bad_words_token_ids([word]) if word else []
        ends = [i for seq in banned if len(seq) == 2 for i in range(1, len(ref)) if ref[i - 1 : i + 1] == seq]
        if ends:
            return word, banned, min(ends)
    raise AssertionError(f"no two-token word of the greedy output {ref} tokenizes back to itself")


def test_bad_words_survive_preemption(llm, tiny_checkpoint):
    """The recent outputs that bad words are matched against live on the device per running
    request; a preempted request gets them back from its tokens when it is admitted again."""
    word, _, _ = two_token_bad_word(llm, greedy(llm, "1 2 3", max_tokens=16).token_ids)
    rng = np.random.default_rng(0)
    prompts = ["1 2 3"] * 3 + [{"prompt_token_ids": rng.integers(3, 500, 30).tolist()} for _ in range(9)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=[word])
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_checkpoint("qwen3"), **ENGINE, num_gpu_blocks_override=12) as small:  # 8 x 4 blocks wanted
        got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
        assert small.stats()["num_preemptions"] > 0
    assert got == want


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(5, 25))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=6),
                       use_tqdm=False)[0]
    ref = llm.generate({"prompt_token_ids": ids[-6:]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-6:] and out.outputs[0].token_ids == ref.outputs[0].token_ids
    long = {"prompt_token_ids": list(range(5, 105))}  # 100 tokens, past the 64-token context
    out = llm.generate(long, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(42, 105)) and len(out.outputs[0].token_ids) == 1  # 63 + 1 = 64
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens value \(100\) is greater than max_model_len \(64\)"):
        llm.generate(long, SamplingParams(truncate_prompt_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be an integer >= 1 or -1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)


def test_truncate_prompt_tokens_keeps_a_texts_bos(llm, tiny_checkpoint, tmp_path, monkeypatch):
    """vLLM truncates a text in its tokenizer (truncation_side "left"): the BOS a tokenizer
    adds stays, with the text's last tokens (the ids' last ones lost it)."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    from jaxvllm.config import EngineConfig
    from jaxvllm.input_processor import load_tokenizer

    folder = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "bos")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(folder)
    tokenizer = load_tokenizer(EngineConfig(model=str(folder)))
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 8
    monkeypatch.setattr(llm.llm_engine.input_processor, "tokenizer", tokenizer)
    params = SamplingParams(max_tokens=1, truncate_prompt_tokens=5)
    outputs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [ids[:1] + ids[-4:]] * 2 + [ids[-5:]]
    # A tokenizer set to truncate on the right cuts both kinds there (vLLM's _truncate_inputs)
    tokenizer.truncation_side = "right"
    outputs = llm.generate([text, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [ids[:5]] * 2


def test_skip_reading_prefix_cache(llm):
    prompt = {"prompt_token_ids": list(range(100, 140))}
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    skipped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, skip_reading_prefix_cache=True),
                           use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and skipped.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == skipped.outputs[0].token_ids
    # prompt logprobs skip reading by default (every prompt token must be computed), and still write
    scored = llm.generate({"prompt_token_ids": list(range(200, 240))},
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0 and all(lp is not None for lp in scored.prompt_logprobs[1:])
    reuse = llm.generate({"prompt_token_ids": list(range(200, 240))}, params, use_tqdm=False)[0]
    assert reuse.num_cached_tokens == 32


def test_best_of_logits_processors_extra_args_and_seed(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"^vLLM V1 does not yet support best_of."):
        llm.generate(prompt, SamplingParams(n=1, best_of=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^best_of must be greater than or equal to n, got n=3 and best_of=2.$"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="^vLLM V1 does not support per request user provided logits processors."):
        llm.generate(prompt, SamplingParams(logits_processors=[lambda ids, logits: logits]), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=2, best_of=1, extra_args={"tag": 7}, seed=-1)
    assert params.seed is None and params.extra_args == {"tag": 7}  # seed -1 is vLLM's "no seed"
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["x"])


def test_seeds_take_vllms_64_bit_range(llm):
    """vLLM hands seeds to torch.Generator.manual_seed: any int in [-2**63, 2**64 - 1]. Each
    gives its own reproducible stream; those below 2**32 keep the streams they always had."""
    from jaxvllm.input_processor import fold_seed

    assert [fold_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    folded = {fold_seed(s) for s in (2**32, 2**40, 2**64 - 2, -1, -5, -(2**63), 2**63 + 7)}
    assert len(folded) == 7 and not folded & {0, 7, 256}
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def sample(seed):
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    big, negative = sample(2**40 + 3), sample(-5)
    assert big == sample(2**40 + 3) and negative == sample(-5)
    assert len({tuple(big), tuple(negative), tuple(sample(3))}) == 3
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"):
        SamplingParams(seed=2**64)


def test_unseeded_requests_do_not_repeat_a_seeded_stream(llm):
    """An unseeded request's seed is drawn, not counted (request k had seed k's stream), and
    completions of one unseeded request differ; the same engine seed still repeats them."""
    from jaxvllm.input_processor import unseeded

    assert unseeded(0, 5) == unseeded(0, 5) and len({unseeded(0, k) for k in range(1000)}) == 1000
    assert not {unseeded(0, k) for k in range(1000)} & set(range(1000))
    prompt = {"prompt_token_ids": [5, 6, 7]}
    kw = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([prompt] * 8, [SamplingParams(**kw) for _ in range(8)], use_tqdm=False)
    drawn = {tuple(o.outputs[0].token_ids) for o in outs}
    seeded = llm.generate([prompt] * 64, [SamplingParams(seed=s, **kw) for s in range(64)], use_tqdm=False)
    assert len(drawn) == 8 and not drawn & {tuple(o.outputs[0].token_ids) for o in seeded}


def test_special_token_text_options(llm):
    tokenizer = llm.get_tokenizer()
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    prompt = {"prompt_token_ids": [5, 6]}
    for skip in (True, False):
        for spaces in (True, False):
            params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[special, 40], ignore_eos=True,
                                    skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=skip,
                                                spaces_between_special_tokens=spaces).rstrip("\ufffd")


# -- output text: stop tokens, streams and the prompt's context ------------------------------


def test_stop_token_text_is_left_out(llm):
    """vLLM's detokenizer leaves the EOS or stop token id that ended a completion out of its
    text (its id stays in token_ids), unless include_stop_str_in_output."""
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [5, 6, 7]}
    ref = greedy(llm, prompt, max_tokens=6)
    stop_id = ref.token_ids[2]
    assert stop_id not in ref.token_ids[:2] and tokenizer.decode([stop_id])
    out = greedy(llm, prompt, max_tokens=6, stop_token_ids=[stop_id])
    assert (out.token_ids, out.stop_reason) == (ref.token_ids[:3], stop_id)
    assert out.text == tokenizer.decode(ref.token_ids[:2])
    kept = greedy(llm, prompt, max_tokens=6, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.text == tokenizer.decode(ref.token_ids[:3])
    # The EOS (a special token): left out even where special tokens are shown.
    eos = tokenizer.eos_token_id
    params = dict(max_tokens=6, ignore_eos=False, allowed_token_ids=[eos, 40], logit_bias={eos: 100},
                  min_tokens=2, skip_special_tokens=False)
    out = greedy(llm, prompt, **params)
    assert out.token_ids[-1] == eos and out.stop_reason is None
    assert out.text == tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)


def test_a_completion_cut_inside_a_character_ends_before_it(llm):
    """As vLLM's DecodeStream: a completion that ends in the middle of a multi-byte
    character (here its max_tokens) leaves out the tokens that started it, where HF's
    decode shows U+FFFD (every output of a stream too)."""
    from jaxvllm.sampling_params import RequestOutputKind

    tokenizer = llm.get_tokenizer()
    lead = tokenizer.encode("\U0001F600", add_special_tokens=False)[0]  # (the emoji's first byte alone)
    assert tokenizer.decode([lead]) == "\ufffd"
    prompt = {"prompt_token_ids": [5, 6, 7]}
    for n in (1, 2):
        out = greedy(llm, prompt, max_tokens=n, allowed_token_ids=[lead])
        assert out.token_ids == [lead] * n and tokenizer.decode(out.token_ids).endswith("\ufffd")
        assert out.text == tokenizer.decode(out.token_ids).rstrip("\ufffd") == ""
    # A token of a character and the first byte of another ("c" + a lead byte): vLLM's stream
    # adds its text only with the token that completes the character, so none here.
    both = next(i for i in range(len(tokenizer)) if len(text := tokenizer.decode([i])) > 1
                and text.endswith("\ufffd") and text[0] != "\ufffd")
    assert greedy(llm, prompt, max_tokens=1, allowed_token_ids=[both]).text == ""
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[lead],
                                output_kind=kind)
        llm.llm_engine.add_request("cut", prompt, params)
        texts = []
        while llm.llm_engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in llm.llm_engine.step() if o.request_id == "cut"]
        assert texts == [""] * 3
    assert llm.chat([], SamplingParams(), use_tqdm=False) == [] == llm.preprocess_chat([])  # (vLLM's: no outputs)


def test_min_tokens_masks_eos_even_when_ignored(llm):
    """vLLM's min_tokens masks every stop id, the EOS included, with ignore_eos as without;
    and a positive temperature below 0.01 is raised to 0.01."""
    eos = llm.get_tokenizer().eos_token_id
    for ignore_eos in (False, True):
        out = greedy(llm, {"prompt_token_ids": [5, 6, 7]}, max_tokens=6, logit_bias={eos: 100}, min_tokens=3,
                     ignore_eos=ignore_eos)
        assert eos not in out.token_ids[:3] and out.token_ids[3] == eos
        assert len(out.token_ids) == (6 if ignore_eos else 4)
    assert [SamplingParams(temperature=t).temperature for t in (0, 1e-4, 0.01, 0.5)] == [0, 0.01, 0.01, 0.5]


def test_streams_hold_back_what_may_start_a_stop_string(llm):
    """Until a completion ends, a stream holds back len(longest stop string) - 1 characters
    (vLLM's stop buffer): CUMULATIVE texts only grow, DELTA pieces add up to the final text,
    and no piece shows what the stop string takes back."""
    from jaxvllm import RequestOutputKind

    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [5, 6, 7]}
    words = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isalpha()
             and len(tokenizer.decode([i])) >= 3]  # (plain text, so characters and tokens line up)
    ref = greedy(llm, prompt, max_tokens=10, allowed_token_ids=words)
    text = tokenizer.decode(ref.token_ids)
    # 5 characters that first appear after the 4th token.
    stop = next(text[p:p + 5] for p in range(len(tokenizer.decode(ref.token_ids[:4])), len(text) - 4)
                if text.find(text[p:p + 5]) == p)
    engine = llm.llm_engine
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine.add_request(kind.name, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                             allowed_token_ids=words, stop=[stop], output_kind=kind))
    texts = {"CUMULATIVE": [], "DELTA": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
    final = text[: text.find(stop)]
    assert texts["CUMULATIVE"][-1] == final and "".join(texts["DELTA"]) == final
    assert all(final.startswith(t) for t in texts["CUMULATIVE"])
    assert len(texts["DELTA"]) > 2 and all(len(t) <= len(final) for t in texts["CUMULATIVE"])


def test_streamed_completions_of_one_request_report_their_own(llm):
    """n = 2, streamed: each output holds one completion with its own num_cached_tokens (the
    second reads the first's prompt blocks), and an abort reports the completions still
    running, each once (one that finished before was reported again, with all n)."""
    from jaxvllm import RequestOutputKind

    engine, prompt = llm.llm_engine, {"prompt_token_ids": list(range(5, 45))}
    base = dict(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)
    first, second = (c.token_ids for c in llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs)
    stop = next(t for t in first[2:] if t not in second)  # (ends the first completion only)
    llm.reset_prefix_cache()
    engine.add_request("r", prompt, SamplingParams(**base, stop_token_ids=[stop],
                                                   output_kind=RequestOutputKind.DELTA))
    outputs = []
    while not any(c.index == 0 and c.finish_reason for o in outputs for c in o.outputs):
        outputs += engine.step()
    outputs += engine.step()
    aborted = engine.abort_request("r")
    assert all(len(o.outputs) == 1 for o in outputs + aborted)
    cached = {o.outputs[0].index: o.num_cached_tokens for o in outputs}
    assert cached[0] == 0 and cached[1] == 32  # (two full blocks of 16)
    assert [(o.outputs[0].index, o.outputs[0].finish_reason, o.finished) for o in aborted] == [(1, "abort", True)]
    assert [c.finish_reason for o in outputs + aborted for c in o.outputs if c.index == 0 and c.finish_reason] == \
        ["stop"]


def test_a_request_aborted_before_it_ran_reports_no_cached_tokens(llm):
    """vLLM's output counts 0 cached tokens before the request's first admission (not None,
    which a sum over outputs trips on); streamed n = 2 too."""
    from jaxvllm import RequestOutputKind

    engine = llm.llm_engine
    engine.add_request("never-ran", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    engine.add_request("never-ran-2", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(n=2, max_tokens=2, output_kind=RequestOutputKind.DELTA))
    outputs = engine.abort_request(["never-ran", "never-ran-2"])
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert all(o.outputs[0].finish_reason == "abort" for o in outputs) and outputs[0].finished and outputs[-1].finished


def test_text_continues_the_prompt(tiny_checkpoint, tmp_path):
    """As vLLM's (and transformers' text-generation pipeline), a completion's text is what it
    adds to the prompt: with a SentencePiece tokenizer (Llama 2, Mistral), a first token
    "▁word" keeps its space, which decoding the completion alone drops."""
    import shutil

    from tests.engine.test_detokenizer import _sentencepiece_tokenizer

    path = tmp_path / "llama-sentencepiece"
    shutil.copytree(tiny_checkpoint("llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer = _sentencepiece_tokenizer()
    tokenizer.save_pretrained(path)
    words = [i for t, i in tokenizer.get_vocab().items() if t.startswith("▁") and len(t) > 2]
    with LLM(path, **ENGINE, enforce_eager=True) as sp:
        params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=words)
        [out] = sp.generate("The quick brown", params, use_tqdm=False)
    ids = out.prompt_token_ids
    text = tokenizer.decode(ids + out.outputs[0].token_ids)[len(tokenizer.decode(ids)):]
    assert out.outputs[0].text == text and text.startswith(" ")
    assert not tokenizer.decode(out.outputs[0].token_ids).startswith(" ")


def test_profiling_writes_a_jax_trace(tiny_checkpoint, tmp_path, monkeypatch):
    """vLLM's start_profile / stop_profile, with profiler_config naming jax.profiler's folder,
    or vLLM 0.11's VLLM_TORCH_PROFILER_DIR."""
    path = tiny_checkpoint("qwen3")
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with LLM(path, **ENGINE, enforce_eager=True, profiler_config={"profiler": "jax",
                                                                 "jax_profiler_dir": str(tmp_path)}) as llm:
        llm.start_profile("run1")
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        llm.stop_profile()
    assert list((tmp_path / "run1").rglob("*.xplane.pb"))
    with LLM(path, **ENGINE, enforce_eager=True) as llm:
        with pytest.raises(RuntimeError, match="profiling is not enabled"):
            llm.start_profile()
        monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "by-env"))
        llm.start_profile()
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        llm.stop_profile()
    assert list((tmp_path / "by-env").rglob("*.xplane.pb"))
    with pytest.raises(ValueError, match="profiler_config profiler='torch': jaxvllm's is 'jax'"):
        LLM(path, profiler_config={"profiler": "torch", "torch_profiler_dir": "/tmp"})


def test_request_output_positional_fields_and_add():
    """vLLM's RequestOutput: (request_id, prompt, prompt_token_ids, prompt_logprobs, outputs,
    finished, ...) positionally, and `add` merging a later output (aggregate: DELTA pieces
    appended; else each completion replaced; a new index appended)."""
    from jaxvllm import CompletionOutput, RequestOutput

    first = RequestOutput("r", "hi", [1, 2], None, [CompletionOutput(0, "a", [5], logprobs=[{5: 0.0}])], False)
    assert (first.prompt_logprobs, first.finished, first.metrics, first.num_cached_tokens) == (None, False, None, None)
    assert first.encoder_prompt is None and first.multi_modal_placeholders == {} and first.kv_transfer_params is None
    later = RequestOutput("r", "hi", [1, 2], None, [CompletionOutput(0, "b", [6], -1.5, [{6: -1.5}], "stop", 9),
                                                    CompletionOutput(1, "c", [7])], True)
    held = first.outputs[0].token_ids
    first.add(later, aggregate=True)
    assert first.finished and len(first.outputs) == 2
    done = first.outputs[0]
    assert held is done.token_ids  # (extended in place, as vLLM's)
    # a plain class in vLLM: compared and hashed by identity (sets and dict keys of outputs)
    twin = RequestOutput("r", "hi", [1, 2], None, [], False)
    assert twin != RequestOutput("r", "hi", [1, 2], None, [], False) and len({twin, first}) == 2
    assert (done.text, done.token_ids, done.logprobs, done.cumulative_logprob) == ("ab", [5, 6], [{5: 0.0}, {6: -1.5}], -1.5)
    assert (done.finish_reason, done.stop_reason, first.outputs[1].text) == ("stop", 9, "c")
    first.add(RequestOutput("r", "hi", [1, 2], None, [CompletionOutput(1, "cd", [7, 8])], True), aggregate=False)
    assert first.outputs[1].token_ids == [7, 8] and first.outputs[0].text == "ab"


def test_allowed_token_ids_past_the_tokenizer_are_refused(llm):
    """vLLM checks allowed_token_ids against the tokenizer (the tiny checkpoint's 384 tokens
    in a vocabulary of 512): ids past it decode to nothing."""
    size = len(llm.get_tokenizer())
    assert size < llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"allowed_token_ids contains out-of-vocab token id {size}"):
        llm.generate("Hello", SamplingParams(max_tokens=2, allowed_token_ids=[5, size]), use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, allowed_token_ids=[5, size - 1]), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {5, size - 1}
    vocab = llm.llm_engine.model_config.vocab_size  # (a logit_bias against the model's, with vLLM's words)
    with pytest.raises(ValueError, match=rf"^token_id\(s\) \[{vocab}, {vocab + 1}\] in logit_bias contain out-of-vocab "
                                         rf"token ids. Vocabulary size: {vocab}\n"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logit_bias={5: 1.0, vocab: 1.0, vocab + 1: 2.0}),
                     use_tqdm=False)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_gpu_blocks"]


def test_sampling_params_from_optional_sampling_type_and_random_uuid():
    """vLLM 0.11's helpers: `SamplingParams.from_optional` (None is the default; logit_bias
    keys may be strings, biases clamped to [-100, 100]), `sampling_type`, and
    `vllm.utils.random_uuid` for request ids."""
    from jaxvllm.sampling_params import SamplingType
    from jaxvllm.utils import random_uuid

    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          frequency_penalty=None, repetition_penalty=None, max_tokens=5,
                                          logit_bias={"7": 250, 3: -1000.0, 4: 0.5})
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias == {7: 100.0, 3: -100.0, 4: 0.5}
    with pytest.raises(TypeError):
        SamplingParams.from_optional(no_such_field=1)
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams().sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED == 2
    ids = {random_uuid() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_lora_requests_compare_and_hash_by_name():
    """vLLM's LoRARequest: equal, and one entry in a set, when the names are equal."""
    from jaxvllm.lora.request import LoRARequest

    a, b, c = LoRARequest("sql", 1, "/a"), LoRARequest("sql", 2, "/b"), LoRARequest("chat", 1, "/a")
    assert a == b and hash(a) == hash(b) and len({a, b, c}) == 2 and a != c and a != "sql"


def test_vllms_tokenizer_loader_and_logprob_module(tiny_checkpoint):
    """`from vllm.transformers_utils.tokenizer import get_tokenizer` and `from vllm.logprobs
    import Logprob`, as vLLM scripts import them: the engine's tokenizer is the one
    get_tokenizer loads (left truncation, fast unless "slow"), and outputs' logprobs are
    jaxvllm.logprobs.Logprob."""
    from jaxvllm.logprobs import Logprob, SampleLogprobs
    from jaxvllm.transformers_utils.tokenizer import get_tokenizer

    path = tiny_checkpoint("llama")
    tokenizer = get_tokenizer(path)
    assert tokenizer.truncation_side == "left" and tokenizer.is_fast
    assert get_tokenizer(str(path), truncation_side="right").truncation_side == "right"
    with pytest.raises(ValueError, match="Cannot use the fast tokenizer in slow tokenizer mode."):
        get_tokenizer(path, tokenizer_mode="slow", use_fast=True)
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto' or 'slow', got 'mistral'"):
        get_tokenizer(path, tokenizer_mode="mistral")
    with LLM(path, max_model_len=64, enforce_eager=True) as llm:
        assert type(llm.get_tokenizer()) is type(tokenizer)
        assert llm.get_tokenizer().encode("Hello there") == tokenizer.encode("Hello there")
        [out] = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
    logprobs: SampleLogprobs = out.outputs[0].logprobs
    assert all(isinstance(v, Logprob) for entry in logprobs for v in entry.values())
