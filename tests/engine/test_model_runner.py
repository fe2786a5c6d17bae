"""Model runner: KV cache sizing from a profiled step (`jaxvllm/kv_cache.py`), the warm-up,
and a clear error for a missing tokenizer."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import pytest

import jaxvllm.kv_cache as kv_cache
from jaxvllm import LLM, EngineConfig
from jaxvllm.kv_cache import MAX_CACHE_ROWS, cache_view, num_kv_blocks
from jaxvllm.model_runner import ModelRunner
from jaxvllm.sampling_params import SamplingParams

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32])


def test_kv_cache_sized_from_device_memory(tiny_checkpoint, monkeypatch, caplog):
    """With allocator figures (a GPU), vLLM's meaning: blocks = utilization * the device's total
    memory - peak after a profiling run. JAX's allocator limit is 0.75 of the total by default,
    and caps the budget."""
    fake = {"bytes_limit": 75 << 20, "bytes_in_use": 5 << 20, "peak_bytes_in_use": 10 << 20}  # 100 MiB total
    calls = []

    def stats(device):  # the peak reaches 10 MiB during the profiling step (after 2 readings)
        calls.append(device)
        return dict(fake, peak_bytes_in_use=fake["peak_bytes_in_use"] if len(calls) % 3 == 0 else 0)

    monkeypatch.setattr(kv_cache, "device_memory_stats", stats)
    path = str(tiny_checkpoint("llama"))
    runner = ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.5, **SMALL))
    # llama tiny: 2 layers x 2 kv heads x 16 head_dim x 16 tokens x 4 bytes x (K and V) = 8 KiB a block
    assert runner.kv_spec.bytes_per_block == 8192
    assert runner.num_blocks == int((0.5 * (100 << 20) - (10 << 20)) // 8192)
    with caplog.at_level("INFO", logger="jaxvllm"):
        capped = ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.9, **SMALL))
    assert capped.num_blocks == int(((75 << 20) - (10 << 20)) // 8192)  # 90 MiB asked, 75 MiB allowed
    assert "gpu_memory_utilization=0.9 asks for 0.09 GiB, JAX's allocator allows 0.07 GiB" in caplog.text
    fake["peak_bytes_in_use"] = 50 << 20
    with pytest.raises(ValueError, match="only 0 KV blocks fit in gpu_memory_utilization=0.5 on "):
        ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.5, **SMALL))


def test_an_earlier_engines_peak_does_not_shrink_the_cache(tiny_checkpoint, monkeypatch):
    """JAX's peak_bytes_in_use never resets: after an engine of 60 MiB was freed, a new one
    reads that peak. Its own step's peak then comes from XLA's analysis of the compiled
    step, on top of what is in use (5 MiB here)."""
    fake = {"bytes_limit": 75 << 20, "bytes_in_use": 5 << 20, "peak_bytes_in_use": 60 << 20}
    monkeypatch.setattr(kv_cache, "device_memory_stats", lambda device: fake)
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), gpu_memory_utilization=0.5,
                                      enforce_eager=True, **SMALL))
    step = runner._profile_step_bytes()
    assert 0 < step < 5 << 20
    assert runner.num_blocks == int((0.5 * (100 << 20) - (5 << 20) - step) // 8192)


def test_kv_cache_cpu_default_and_override(tiny_checkpoint, caplog):
    path = str(tiny_checkpoint("llama"))
    with caplog.at_level("INFO", logger="jaxvllm"):
        runner = ModelRunner(EngineConfig(model=path, **SMALL))
    assert runner.num_blocks == 4 * 4  # every sequence at max_model_len: 4 seqs x 4 blocks
    assert "KV cache: 16 blocks x 16 tokens = 256 tokens" in caplog.text
    assert "Maximum concurrency for 64 tokens per request: 4.00x" in caplog.text  # (vLLM's line)
    assert "warm-up: compiled token buckets [32] x 1 block-table widths [4] and 4 sampler variants" in caplog.text
    assert ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=7, **SMALL)).num_blocks == 7
    # vLLM's kv_cache_memory_bytes: a device's bytes, no profile; the override wins over it.
    per_block = runner.kv_spec.bytes_per_block
    assert ModelRunner(EngineConfig(model=path, kv_cache_memory_bytes=9 * per_block + 5, **SMALL)).num_blocks == 9
    assert ModelRunner(EngineConfig(model=path, kv_cache_memory_bytes=9 * per_block, num_gpu_blocks_override=7,
                                    **SMALL)).num_blocks == 7
    # (with vLLM's advice: the longest max_model_len that fits)
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={per_block} holds 1 KV blocks .* needs 4. Based on "
                                         rf"the available memory, the estimated maximum model length is 16. Try "
                                         rf"increasing `kv_cache_memory_bytes`"):
        ModelRunner(EngineConfig(model=path, kv_cache_memory_bytes=per_block, **SMALL))


def test_every_block_table_width_is_warmed_up(tiny_checkpoint):
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=1024, block_size=2,
                                      max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32]))
    # (on CPU the reference attention's loop stops at the columns in use: the default ladder)
    assert runner.builder.widths == [64, 512] and runner.num_compiled_buckets() == 2  # both widths warmed up


def test_the_default_params_sampler_is_warmed_up(tiny_checkpoint, tmp_path, compile_counter, caplog):
    """generate() without params samples with the generation config's settings; Qwen2.5's
    repetition penalty needs a variant none of the common ones is: the warm-up compiles it
    too, so the first default generate compiles nothing."""
    import json

    path = tmp_path / "repetition-penalty"
    shutil.copytree(tiny_checkpoint("qwen2"), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    with caplog.at_level("INFO", logger="jaxvllm"):
        llm = LLM(str(path), **SMALL)
    assert "and 5 sampler variants" in caplog.text
    llm.llm_engine.finish_warmup()
    before = compile_counter.count
    outputs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)], use_tqdm=False)
    assert compile_counter.count == before, "the default params compiled a sampler after warm-up"
    assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outputs)
    llm.shutdown()


def test_missing_tokenizer_is_a_clear_error(tiny_checkpoint, tmp_path):
    path = tmp_path / "no-tokenizer"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoint("llama") / name, path)
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*no-tokenizer.*tokenizer=PATH"):
        LLM(path, **SMALL)
    llm = LLM(path, tokenizer=str(tiny_checkpoint("llama")), **SMALL)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_kv_blocks_are_capped_at_32_bit_offsets(tiny_checkpoint, monkeypatch, caplog):
    """A tiny model on a large device would get more blocks than 32-bit indices address in
    its cache (the kernels' and the K/V scatter's row index over every layer's tokens of a
    KV head): the count is capped there, with a log line; an explicit override past it is
    refused. A 1-byte cache also skips 2^31..2^32 elements, where Pallas keeps 32-bit
    element offsets (past them it takes 64-bit ones)."""
    path = str(tiny_checkpoint("llama"))
    config = EngineConfig(model=path, **SMALL)
    runner = ModelRunner(config)
    spec = runner.kv_spec
    limit = spec.max_blocks
    rows_per_block = runner.cfg.num_layers * spec.block_size  # 2 layers x 16 tokens
    assert limit * rows_per_block <= MAX_CACHE_ROWS < (limit + 1) * rows_per_block
    fp8 = dataclasses.replace(spec, dtype=jnp.float8_e4m3fn)
    elements = 2 * runner.cfg.num_kv_heads * spec.block_size * runner.cfg.head_dim  # a block, both layers: 1024
    assert fp8.addressable(3 << 20) == (2**31 - 1) // elements  # 3 x 2^30 elements: cut below 2^31
    assert fp8.addressable(1 << 23) == 1 << 23 and spec.addressable(3 << 20) == 3 << 20  # past 2^32; bf16
    # 1 TiB of device memory would give 2^27 blocks of 8 KiB: capped (sized only, nothing allocated here).
    monkeypatch.setattr(kv_cache, "device_memory_stats", lambda device: {"bytes_limit": 3 << 38,
                                                                        "bytes_in_use": 0, "peak_bytes_in_use": 0})
    with caplog.at_level("INFO", logger="jaxvllm"):
        assert num_kv_blocks(config, spec, runner.devices, 64, runner._profile, runner._profile_step_bytes) == limit
    assert f"KV cache: capped at {limit} blocks" in caplog.text
    override = dataclasses.replace(config, num_gpu_blocks_override=limit + 1)
    with pytest.raises(ValueError, match=f"num_gpu_blocks_override={limit + 1} exceeds the {limit} KV blocks"):
        num_kv_blocks(override, spec, runner.devices, 64, runner._profile, runner._profile_step_bytes)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto")])
def test_one_cache_for_every_layer_updated_in_place(dtype, kv_cache_dtype, tiny_checkpoint):
    """The step takes one K and one V cache (and an fp8 cache's scales) whatever the depth,
    [kv_heads, layers, blocks, block_size, head_dim], and the compiled CPU step updates it
    in place in every bucket: a 1-token one too, where XLA would otherwise turn the write
    into a dynamic-update-slice and copy the whole cache for each layer. Nothing else is
    re-laid out or converted either: not q/k/v/o with their head axes (which XLA:CPU once
    transposed on every step), not a 16-bit or fp8 cache, which XLA:CPU cannot scatter or
    gather (stored as bits on a CPU), not bf16 weights (which it once converted to float32
    before their matmuls)."""
    from pallas_kernels.hlo import count_cache_copies, parameter_rewrites

    path = str(tiny_checkpoint("llama", num_hidden_layers=5))
    config = EngineConfig(model=path, **dict(SMALL, token_buckets=[1, 4, 32]), dtype=dtype,
                          kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config)
    caches = runner.kv_caches
    assert len(caches) == (3 if kv_cache_dtype == "fp8" else 2)
    assert caches[0].shape == (runner.cfg.num_kv_heads, 5, runner.num_blocks, config.block_size, runner.cfg.head_dim)
    stored = {"float32": jnp.float32, "fp8": jnp.uint8, "bfloat16": jnp.uint16}[
        dtype if kv_cache_dtype == "auto" else kv_cache_dtype]
    assert caches[0].dtype == stored and cache_view(caches[0], runner.cfg).dtype == runner.kv_spec.dtype
    b = runner.builder
    for bucket in b.buckets:
        batch = b.padding_batch(bucket, b.widths[-1], None)
        packed = jax.device_put(batch.packed, runner._replicated)
        hlo = runner._forward.lower(runner.params, caches, packed, runner.last_sampled,
                                    layout=batch.layout).compile().as_text()
        assert count_cache_copies(hlo, caches[0].shape) == 0, bucket
        assert parameter_rewrites(hlo) == {}, bucket


def test_forward_takes_the_params_flattened_once(tiny_checkpoint, compile_counter):
    """The runner hands its forward the params as a `FlatTree`, made when the params are
    set: the step compiled ahead from the params' shapes is the one each call finds (no
    trace after warm-up), a FlatTree made anew of the same structure finds it too, and new
    params (a weight update, a wake-up) are flattened again."""
    from jaxvllm.sharding import FlatTree, structs

    llm = LLM(str(tiny_checkpoint("llama")), **SMALL)
    runner = llm.llm_engine.runner
    assert runner.flat_params.leaves == tuple(jax.tree.leaves(runner.params))
    assert jax.tree.structure(runner.flat_params.tree) == jax.tree.structure(runner.params)
    llm.llm_engine.finish_warmup()
    before = compile_counter.count
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert compile_counter.count == before
    runner.params = jax.tree.map(jnp.copy, runner.params)  # (new arrays, the same values)
    assert runner.flat_params.leaves == tuple(jax.tree.leaves(runner.params))
    before = compile_counter.count
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first and compile_counter.count == before
    # (a FlatTree of shapes and one of arrays: equal static parts, one compiled step)
    add = jax.jit(lambda flat: sum(x.sum() for x in jax.tree.leaves(flat.tree)))
    add.lower(FlatTree.of(structs(runner.params))).compile()
    before = compile_counter.count
    add(FlatTree.of(runner.params))
    add(FlatTree.of(runner.params))
    assert compile_counter.count == before and add._cache_size() == 1
    llm.llm_engine.shutdown()
