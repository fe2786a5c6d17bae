"""Bad engine arguments and model names fail at construction, with messages that say what is wrong;
built-in dummy models and skip_tokenizer_init work through `LLM(...)`."""

import argparse
import shutil
from pathlib import Path

import pytest

import jaxvllm.model_runner as model_runner
from jaxvllm import LLM, EngineConfig, SamplingParams
from jaxvllm.dummy import ModelSource
from jaxvllm.engine_args import add_engine_args, engine_kwargs

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32])
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if an engine gets as far as loading weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the bad argument was refused")

    monkeypatch.setattr(model_runner, "load_model", refuse)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len=0), r"max_model_len must be a positive int \(or None\), got 0"),
    (dict(max_model_len=-5), r"max_model_len .* got -5"),
    (dict(max_model_len="128"), r"max_model_len .* got '128'"),
    (dict(max_model_len=64.0), r"max_model_len .* got 64.0"),
    (dict(token_buckets=[0, 32]), r"token_buckets must be a non-empty list of positive ints .* got \[0, 32\]"),
    (dict(token_buckets=[-16, 8192]), r"token_buckets .* got \[-16, 8192\]"),
    (dict(token_buckets=[16.5, 8192]), r"token_buckets .* got \[16.5, 8192\]"),
    (dict(token_buckets=[]), r"token_buckets .* got \[\]"),
    (dict(token_buckets=32), r"token_buckets .* got 32"),
    (dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[16]),
     r"largest token bucket \(16\) is below max_num_batched_tokens \(64\)"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be a number in \(0, 1\], got 0"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization .* got 1.5"),
    (dict(gpu_memory_utilization=-0.1), r"gpu_memory_utilization .* got -0.1"),
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization .* got '0.5'"),
    (dict(max_num_seqs=0), r"max_num_seqs must be a positive int \(or None\), got 0"),
    (dict(max_num_seqs=2.5), r"max_num_seqs .* got 2.5"),
    (dict(max_num_batched_tokens=-1), r"max_num_batched_tokens must be a positive int \(or None\), got -1"),
    (dict(max_num_batched_tokens="64"), r"max_num_batched_tokens .* got '64'"),
    (dict(block_size=0), r"block_size must be a positive int, got 0"),
    (dict(block_size=True), r"block_size .* got True"),
    (dict(num_gpu_blocks_override=0), r"num_gpu_blocks_override .* got 0"),
    (dict(kv_cache_memory_bytes=-1), r"kv_cache_memory_bytes .* got -1"),
    (dict(runner="pooling"), r"runner='pooling': jaxvllm runs generative models only"),
    (dict(enable_prompt_embeds=True), r"enable_prompt_embeds=True: prompt embeddings are not supported"),
    (dict(convert="embed"), r"convert='embed' / pooler_config=None: pooling and embedding models are not supported"),
    (dict(logits_processors=["my.Processor"]), r"logits_processors: vLLM's V1 logits processor classes are not"),
    (dict(cpu_offload_gb=4), r"cpu_offload_gb=4: offloading weights to CPU memory is not supported"),
    (dict(max_num_partial_prefills=2), r"max_num_partial_prefills=2: concurrent partial prefills are not supported"),
    (dict(max_long_partial_prefills=0), r"max_long_partial_prefills=0: concurrent partial prefills are not"),
    (dict(prefix_caching_hash_algo="builtin"), r"Unknown prefix caching hash algorithm: builtin. Must be one of"),
    (dict(distributed_executor_backend="slurm"), r"distributed_executor_backend='slurm': choose from"),
    (dict(hf_config_path="/elsewhere"), r"hf_config_path='/elsewhere': a config.json from another folder than the"),
    (dict(decode_context_parallel_size=2), r"decode_context_parallel_size=2: decode context parallelism not supported"),
    (dict(decode_context_parallel_size=0), r"decode_context_parallel_size=0: decode context parallelism not supported"),
    (dict(data_parallel_address="10.0.0.1"), r"data_parallel_address='10.0.0.1': vLLM's multi-node data parallelism"),
    (dict(data_parallel_size_local=2), r"data_parallel_size_local=2: vLLM's multi-node data parallelism"),
    (dict(data_parallel_backend="slurm"), r"^data_parallel_backend can only be ray or mp, got slurm$"),
    (dict(config_format="mistral"), r"config_format='mistral': jaxvllm reads HF configs only"),
    (dict(scheduler_cls="my.Scheduler"), r"scheduler_cls='my.Scheduler': scheduler classes other than vLLM's own"),
    (dict(worker_cls="my.Worker"), r"worker_cls='my.Worker': other worker classes not supported"),
    (dict(otlp_traces_endpoint="http://x"), r"otlp_traces_endpoint='http://x': OpenTelemetry tracing not supported"),
    (dict(model_loader_extra_config={"tensorizer_uri": "x"}),
     r"Unexpected extra config keys for load format auto: \{'tensorizer_uri'\}"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"),
    (dict(scheduling_policy="lifo"), r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"),
    (dict(attention_backend="flash"), r"attention_backend 'flash' is not available"),
    # (sequence_logprobs' cache-free attention, `layers.DENSE_ATTENTION`, is no engine backend)
    (dict(attention_backend="dense"), r"attention_backend 'dense' is not available"),
    (dict(dtype="int8"), r"dtype 'int8' is not supported"),
    (dict(load_format="pt"), r"load_format 'pt' is not supported"),
    (dict(enable_prefix_caching="no"), r"enable_prefix_caching must be True or False, got 'no'"),
    (dict(skip_tokenizer_init=1), r"skip_tokenizer_init must be True or False, got 1"),
    (dict(calculate_kv_scales="yes"), r"calculate_kv_scales must be True or False, got 'yes'"),
    (dict(enable_expert_parallel="yes"), r"enable_expert_parallel must be True or False, got 'yes'"),
])
def test_bad_engine_args(tiny_checkpoint, no_loading, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_checkpoint("llama"), **kwargs)


def test_cli_shares_the_checks(tiny_checkpoint):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    source = ModelSource("x", str(tiny_checkpoint("llama")), dummy=False)
    with pytest.raises(ValueError, match="max_model_len must be a positive int.*got 0"):
        engine_kwargs(parser.parse_args(["--max-model-len", "0"]), source)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization .* got 2.0"):
        engine_kwargs(parser.parse_args(["--gpu-memory-utilization", "2"]), source)
    assert engine_kwargs(parser.parse_args(["--enable-expert-parallel"]), source) == {"enable_expert_parallel": True}


def test_good_args_pass_and_buckets_are_normalized():
    config = EngineConfig(model="m", token_buckets=(16, 8192), gpu_memory_utilization=1)
    assert config.token_buckets == [16, 8192]


@pytest.mark.parametrize("model, match", [
    ("/nonexistent", r"model directory '/nonexistent' does not exist \(jaxvllm loads local checkpoints only "
                     r"and never downloads; built-in random models: dummy:tiny"),
    ("no-such-org/no-such-model", r"model directory 'no-such-org/no-such-model' does not exist .*"
                                  r"looks like a Hugging Face Hub id.*--local-dir DIR"),
])
def test_missing_model_directory(no_loading, model, match):
    with pytest.raises(FileNotFoundError, match=match):
        LLM(model)


def test_bad_generation_config_is_refused_before_loading(tiny_checkpoint, no_loading, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": -1}')
    with pytest.raises(ValueError, match=r"generation_config.json \(generation_config='.*'\) is not valid: "
                                         r"`max_new_tokens` must be greater than 0"):
        LLM(tiny_checkpoint("llama"), **SMALL, generation_config=str(tmp_path))


def test_missing_tokenizer_directory(tiny_checkpoint, no_loading, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*nope.* does not exist"):
        LLM(tiny_checkpoint("llama"), tokenizer=str(tmp_path / "nope"))


def test_bad_dummy_names(no_loading):
    with pytest.raises(ValueError, match="unknown dummy model 'dummy:nope'; built-in: dummy:tiny"):
        LLM("dummy:nope")
    with pytest.raises(ValueError, match="dummy:tiny has no weights to load: it needs load_format 'dummy'"):
        LLM("dummy:tiny", load_format="safetensors")


def test_dummy_model_in_the_api():
    """`LLM("dummy:tiny")`: a temporary folder with random weights, living as long as the engine;
    the dummy model's engine defaults apply to the arguments left at their defaults."""
    llm = LLM("dummy:tiny", max_model_len=64, max_num_batched_tokens=32, token_buckets=[32], max_num_seqs=4)
    config = llm.llm_engine.config
    folder = Path(config.model)
    assert config.load_format == "dummy" and folder.is_dir() and (folder / "config.json").is_file()
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (64, 4, 32)
    [out] = llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    [out] = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert out.finished
    llm.shutdown()
    del llm, out
    import gc

    gc.collect()
    assert not folder.exists()


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoint("llama") / name, path)
    return path


def test_folder_without_tokenizer_is_an_error(no_tokenizer_dir):
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*tokenizer=PATH.*skip_tokenizer_init=True"):
        LLM(no_tokenizer_dir, **SMALL)


def test_folder_whose_tokenizer_would_be_empty_is_an_error(tiny_checkpoint, no_loading, tmp_path):
    """transformers makes Qwen2's tokenizer from config.json alone, with one token: refused as
    a missing tokenizer, not served (every text then "encodes to no tokens")."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoint("qwen3") / name, tmp_path)
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*it has no vocabulary files"):
        LLM(tmp_path, **SMALL)


def test_load_errors_name_the_problem(tiny_checkpoint, no_loading, tmp_path):
    """Before any weight loads: a config.json that is no JSON is named (not blamed on the
    tokenizer); max_model_len past the model's limit (config.json decides it). And a
    safetensors index that is not a map of names to files; a tokenizer= that names a file."""
    model = tiny_checkpoint("qwen3")
    bad_config = tmp_path / "bad-config"
    shutil.copytree(model, bad_config)
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        LLM(bad_config, **SMALL)
    with pytest.raises(ValueError, match=r"max_model_len 100000 exceeds the model's max_position_embeddings"):
        LLM(model, **{**SMALL, "max_model_len": 100000})
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*tokenizer.json' is a file: give its folder"):
        LLM(model, tokenizer=str(model / "tokenizer.json"), **SMALL)
    from jaxvllm.loader import tensor_files

    for index in ("[1, 2]", '{"weight_map": {"a": 3}}'):
        (tmp_path / "model.safetensors.index.json").write_text(index)
        with pytest.raises(ValueError, match="is not a valid safetensors index"):
            tensor_files(tmp_path)


def test_dtypes_as_vllm_takes_them():
    """Any case, an alias, or a torch dtype, as vLLM's; other values are refused by name."""
    import torch

    for dtype, name in (("BFloat16", "bfloat16"), (torch.float16, "float16"), ("half", "float16"), ("AUTO", "auto")):
        assert EngineConfig(model="m", dtype=dtype).dtype == name
    with pytest.raises(ValueError, match=r"dtype \['bfloat16'\] is not supported"):
        EngineConfig(model="m", dtype=["bfloat16"])


def test_a_failure_after_the_weights_loaded_frees_them(tiny_checkpoint):
    """An error the runner raises after loading (no KV block fits) deletes the weights at
    once: a notebook keeps the last exception, and its traceback held them."""
    import jax

    before = len(jax.live_arrays())
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1 holds 0 KV blocks") as caught:
        LLM(tiny_checkpoint("qwen3"), kv_cache_memory_bytes=1, **SMALL)
    assert len(jax.live_arrays()) == before and caught.value is not None


def test_skip_tokenizer_init(no_tokenizer_dir, tiny_checkpoint):
    llm = LLM(no_tokenizer_dir, skip_tokenizer_init=True, **SMALL)
    assert llm.llm_engine.tokenizer is None
    ids = [1, 17, 42, 99, 3]
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.token_ids) == 4 and completion.text == "" and out.prompt is None
    with_tokenizer = LLM(tiny_checkpoint("llama"), **SMALL)
    [ref] = with_tokenizer.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert completion.token_ids == ref.outputs[0].token_ids
    with_tokenizer.shutdown()

    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, logprobs=2),
                         use_tqdm=False)
    assert all(lp.decoded_token is None for step in out.outputs[0].logprobs for lp in step.values())
    for prompt in ("Hello", {"prompt": "Hello"}, ["Hello"]):
        with pytest.raises(ValueError, match="skip_tokenizer_init=True: pass prompt_token_ids, not text"):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True: stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True: this engine has no tokenizer"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.shutdown()
