"""An fp8 KV cache (kv_cache_dtype="fp8"): float8_e4m3fn pages with k/v scales per layer and KV head.

The engine with an fp8 cache against the same model with its own dtype's cache (bfloat16):
raw logits through the engine (`logprobs=-1` with logprobs_mode="raw_logits" for decode
steps, `prompt_logprobs` for chunked prefill) within a stated tolerance, the greedy
agreement rate over 32 prompts (printed; loosely asserted), twice the KV blocks at the same
memory budget, scales from the checkpoint, the Pallas backend and tensor parallelism.
The kernels' fp8 cases are in tests/kernels/test_fp8_attention.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import LLM, SamplingParams
from jaxvllm.kv_cache import cache_view
from jaxvllm.layers import K_SCALE_RANGE, V_SCALE_RANGE, calculate_kv_scales
from pallas_kernels import write_kv_reference

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64], dtype="bfloat16")
NUM_PROMPTS = 32
MAX_TOKENS = 8
# Raw logits of tiny qwen3 in bf16 have a standard deviation of 0.8 per row. Measured with
# the fp8 cache (scales 1.0) against the bf16 cache: decode logits max |difference| 0.31,
# mean 0.031; prompt-token logprobs max 0.25, mean 0.032 (e4m3 keeps 3 mantissa bits: each
# cached K/V value within 1/16 relative). The bounds are about twice that.
LOGIT_ATOL = 0.6
LOGIT_MEAN_ATOL = 0.06


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 100, size=NUM_PROMPTS)  # past 64 tokens: prefill in two chunks
    return [[int(t) for t in rng.integers(3, 384, size=n)] for n in lengths]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint):
    """Greedy completions of 32 prompts with every decode step's raw logits and every
    prompt token's logprob, once with the bf16 cache and once with the fp8 cache."""
    path = tiny_checkpoint("qwen3")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=-1, prompt_logprobs=0)
    results = {}
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, logprobs_mode="raw_logits", max_logprobs=-1, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        results[kv_cache_dtype] = (outs, llm.stats())
        llm.shutdown()
    return results


def logits_row(entry: dict, vocab: int) -> np.ndarray:
    row = np.full(vocab, np.nan)
    for token, lp in entry.items():
        row[token] = lp.logprob
    return row


def test_fp8_logits_close_to_the_model_dtype_cache(runs):
    (ref, ref_stats), (fp8, fp8_stats) = runs["auto"], runs["fp8"]
    assert ref_stats["kv_cache_dtype"] == "bfloat16" and fp8_stats["kv_cache_dtype"] == "float8_e4m3fn"
    decode, prefill, spread = [], [], []
    for a, b in zip(ref, fp8):
        ca, cb = a.outputs[0], b.outputs[0]
        # Decode steps while both completions agree so far: the same context, cached two ways.
        for i, (entry_a, entry_b) in enumerate(zip(ca.logprobs, cb.logprobs)):
            la, lb = logits_row(entry_a, 512), logits_row(entry_b, 512)
            assert not np.isnan(la).any() and not np.isnan(lb).any()  # the whole vocabulary
            decode.append(np.abs(la - lb))
            spread.append(la.std())
            if ca.token_ids[i] != cb.token_ids[i]:
                break
        for p in range(1, len(a.prompt_token_ids)):  # prompt tokens: chunked prefill over the fp8 cache
            token = a.prompt_token_ids[p]
            prefill.append(abs(a.prompt_logprobs[p][token].logprob - b.prompt_logprobs[p][token].logprob))
    decode, prefill = np.concatenate(decode), np.asarray(prefill)
    print(f"\nfp8 vs bf16 KV cache, raw logits (std {np.mean(spread):.2f}): decode max |diff| {decode.max():.4f}, "
          f"mean {decode.mean():.4f} over {decode.size} logits; prompt logprobs max |diff| {prefill.max():.4f}, "
          f"mean {prefill.mean():.4f} over {prefill.size} tokens")
    assert decode.max() < LOGIT_ATOL and decode.mean() < LOGIT_MEAN_ATOL
    assert prefill.max() < LOGIT_ATOL and prefill.mean() < LOGIT_MEAN_ATOL
    assert decode.max() > 0  # the fp8 run did quantize


def test_e5m2_cache_logits_close_to_the_model_dtype_cache(runs):
    """kv_cache_dtype="fp8_e5m2": 2 mantissa bits (each value within 1/8 relative), so about
    twice e4m3's logit error."""
    (ref, _), (e5m2, stats) = runs["auto"], runs["fp8_e5m2"]
    assert stats["kv_cache_dtype"] == "float8_e5m2"
    diff = np.concatenate([np.abs(logits_row(a.outputs[0].logprobs[0], 512) - logits_row(b.outputs[0].logprobs[0], 512))
                           for a, b in zip(ref, e5m2)])
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, e5m2))
    print(f"\nfp8_e5m2 vs bf16 KV cache: first decode logits max |diff| {diff.max():.4f}, mean {diff.mean():.4f}; "
          f"{same}/{NUM_PROMPTS} identical greedy completions")
    assert 0 < diff.max() < 2 * LOGIT_ATOL and diff.mean() < 2 * LOGIT_MEAN_ATOL


def test_fp8_greedy_agreement_rate(runs):
    ref, fp8 = runs["auto"][0], runs["fp8"][0]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, fp8))
    tokens = sum(x == y for a, b in zip(ref, fp8) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
    first = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(ref, fp8))
    print(f"\nfp8 vs bf16 KV cache, greedy: {same}/{NUM_PROMPTS} identical completions of {MAX_TOKENS} tokens "
          f"({same / NUM_PROMPTS:.0%}), first tokens {first}/{NUM_PROMPTS}, tokens at equal positions "
          f"{tokens}/{NUM_PROMPTS * MAX_TOKENS}")
    assert same / NUM_PROMPTS >= 0.5  # not required to be 100%: fp8 rounding may flip a near-tie


def test_num_gpu_blocks_double_at_the_same_memory_budget(tiny_checkpoint, monkeypatch):
    """Both sizing paths: CPU's fixed byte budget, and a device's memory figures (here made up)."""
    from jaxvllm import kv_cache

    path = str(tiny_checkpoint("qwen3"))
    kw = dict(ENGINE, enforce_eager=True, max_num_seqs=64, max_num_batched_tokens=64)

    def blocks(kv_cache_dtype):
        llm = LLM(path, kv_cache_dtype=kv_cache_dtype, **kw)
        stats, per_block = llm.stats(), llm.llm_engine.runner.kv_spec.bytes_per_block
        llm.shutdown()
        return stats["num_gpu_blocks"], per_block, stats["kv_cache_per_device"][0]["bytes"]

    # CPU: min(every sequence at max_model_len, CPU_KV_CACHE_BYTES // bytes_per_block); a budget
    # of 100 bf16 blocks binds below the 64 x 8 blocks that every sequence would want.
    n16, per16, _ = blocks("auto")
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 100 * per16)
    n16, per16, bytes16 = blocks("auto")
    n8, per8, bytes8 = blocks("fp8")
    print(f"\nCPU budget of {100 * per16} bytes: {n16} bf16 blocks ({per16} B each), {n8} fp8 blocks ({per8} B each)")
    assert per8 * 2 == per16 and (n16, n8) == (100, 200) and bytes8 == bytes16

    # A GPU's figures: 1 GiB allowed, 0.9 of it for the engine, 100 MiB in use at the peak.
    limit, peak = 2**30, 100 << 20
    monkeypatch.setattr(kv_cache, "device_memory_stats",
                        lambda device: {"bytes_limit": limit, "bytes_in_use": peak, "peak_bytes_in_use": peak})
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.0")
    monkeypatch.setattr(kv_cache.KVCacheSpec, "max_blocks", 1 << 40)  # no 32-bit cap on the count
    g16, _, _ = blocks("auto")
    g8, _, _ = blocks("fp8")
    print(f"GPU budget 0.9 GiB - 100 MiB peak: {g16} bf16 blocks, {g8} fp8 blocks ({g8 / g16:.2f}x)")
    assert g16 == int((0.9 * limit - peak) // per16) and g8 == int((0.9 * limit - peak) // per8)
    assert abs(g8 - 2 * g16) <= 1


def test_bad_kv_cache_dtype_names_the_allowed_values(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    for bad in ("fp8_inc", "int8", "bfloat16", None):
        with pytest.raises(ValueError, match=r"^kv_cache_dtype=.* is not supported; choose from 'auto', 'fp8', "
                                             r"'fp8_e4m3', 'fp8_e5m2'$"):
            LLM(path, **ENGINE, kv_cache_dtype=bad)
    llm = LLM(path, **ENGINE, kv_cache_dtype="fp8_e4m3", enforce_eager=True)  # vLLM's other name for it
    assert llm.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    llm.shutdown()


def test_kv_write_quantizes_with_the_scale_and_clips():
    cache = jnp.zeros((1, 2, 2, 4), jnp.float8_e4m3fn)
    k = jnp.asarray([[[0.1, -0.25, 3.0, 1e6]], [[-1e6, 0.5, 0.0, 2.0]]], jnp.bfloat16)  # [T=2, 1 head, 4]
    new_k, new_v = write_kv_reference(cache, cache, k, k, jnp.asarray([3, 0], jnp.int32), 0.5, 2.0)
    assert new_k.dtype == jnp.float8_e4m3fn
    k_rows = np.asarray(new_k.reshape(4, 4).astype(jnp.float32))
    v_rows = np.asarray(new_v.reshape(4, 4).astype(jnp.float32))
    np.testing.assert_allclose(k_rows[3], [0.203125, -0.5, 6.0, 448.0])  # x / 0.5, clipped at 448
    np.testing.assert_allclose(k_rows[0], [-448.0, 1.0, 0.0, 4.0])
    np.testing.assert_allclose(v_rows[3], [0.05078125, -0.125, 1.5, 448.0])  # x / 2
    assert not np.isnan(k_rows).any() and (k_rows[1:3] == 0).all()
    # Per KV head: each head's rows divided by its own scale.
    cache = jnp.zeros((2, 1, 2, 2), jnp.float8_e4m3fn)
    k = jnp.asarray([[[1.0, -2.0], [1.0, -2.0]]], jnp.float32)  # [T=1, 2 heads, 2]
    new_k, _ = write_kv_reference(cache, cache, k, k, jnp.asarray([1], jnp.int32), jnp.asarray([0.5, 0.25]), None)
    np.testing.assert_array_equal(np.asarray(new_k.astype(jnp.float32))[:, 0, 1], [[2.0, -4.0], [4.0, -8.0]])


def test_scales_come_from_the_checkpoint(tiny_checkpoint, tmp_path):
    """vLLM's `model.layers.{i}.self_attn.k_scale` / `v_scale` tensors, one value or one per
    KV head, are read into the cache's scales per KV head (1.0 where a layer has neither;
    one alone for both, as vLLM's); the cached values are K / k_scale."""
    from safetensors.numpy import save_file

    from jaxvllm.loader import load_config, load_kv_scales

    path = tmp_path / "with-scales"
    shutil.copytree(tiny_checkpoint("llama"), path)  # 2 KV heads
    save_file({"model.layers.0.self_attn.k_scale": np.asarray(0.05, np.float32),
               "model.layers.0.self_attn.v_scale": np.asarray([0.02], np.float32),
               "model.layers.1.self_attn.k_scale": np.asarray([[[0.1]], [[0.3]]], np.float32)},  # [heads, 1, 1]
              str(path / "kv_scales.safetensors"))
    llm = LLM(str(path), kv_cache_dtype="fp8", **ENGINE, enforce_eager=True)
    runner = llm.llm_engine.runner
    want = [[[0.05, 0.02], [0.05, 0.02]], [[0.1, 0.1], [0.3, 0.3]]]  # [layer, KV head, (k, v)]
    np.testing.assert_allclose(runner.kv_scales, want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(runner.kv_caches[2]).swapaxes(0, 1), want, rtol=1e-6)  # [KV head, layer]
    prompt = prompts()[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    k_cache = np.asarray(cache_view(runner.kv_caches[0], runner.cfg)[:, 0].astype(jnp.float32))  # layer 0
    # With k_scale 0.05 the stored keys are 20x the keys: well inside e4m3's range, not clipped.
    assert 5 < np.abs(k_cache).max() < 448
    llm.shutdown()
    # Without kv_cache_dtype="fp8" the scales are ignored, with no warning about unused tensors.
    llm = LLM(str(path), **ENGINE, enforce_eager=True)
    assert llm.llm_engine.runner.kv_scales is None and len(llm.llm_engine.runner.kv_caches) == 2
    llm.shutdown()
    # Under a mesh with more devices than KV heads each repeated head keeps its head's scales.
    run_cfg = dataclasses.replace(load_config(path), num_kv_heads=4)
    np.testing.assert_allclose(load_kv_scales(path, run_cfg)[0][1, :, 0], [0.1, 0.1, 0.3, 0.3], rtol=1e-6)
    # The other names vLLM reads: llm-compressor's and AutoFP8's output scales, the older
    # kv_scale (k and v), ModelOpt's, a merged qkv_proj's (they were ignored, with a warning).
    one = lambda x: np.asarray(x, np.float32)  # noqa: E731
    for names, want in [(("k_proj.output_scale", "v_proj.output_scale", "kv_scale"), [(0.04, 0.03), (0.2, 0.2)]),
                        (("k_proj.k_scale", "v_proj.v_scale", "qkv_proj.k_scale"), [(0.04, 0.03), (0.2, 0.2)])]:
        save_file({f"model.layers.0.self_attn.{names[0]}": one(0.04), f"model.layers.0.self_attn.{names[1]}": one(0.03),
                   f"model.layers.1.self_attn.{names[2]}": one(0.2)}, str(path / "kv_scales.safetensors"))
        scales, found = load_kv_scales(path, load_config(path))
        np.testing.assert_allclose(scales, np.repeat(np.asarray(want, np.float32)[:, None], 2, axis=1), rtol=1e-6)
        assert found == 3
    # A scale of any other size is refused, named.
    save_file({"model.layers.0.self_attn.v_scale": np.asarray([0.1, 0.2, 0.3], np.float32)},
              str(path / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.v_scale in kv_scales.safetensors has 3 values: "
                                         r"a KV cache scale has one, or one per KV head \(2\)"):
        load_kv_scales(path, load_config(path))


def test_calculate_kv_scales_takes_the_first_written_batch_once():
    """vLLM's calculate_kv_scales, per KV head: max |K| / 200 and max |V| / 100 over the
    tokens written (padding rows, slot -1, left out), then never again; a step writing
    nothing keeps waiting; an all-zero head gets 1.0."""
    scales = jnp.ones((2, 3), jnp.float32)  # 2 KV heads: (k_scale, v_scale, to_calculate)
    head0 = jnp.asarray([[2.0, -40.0], [1e4, 0.0], [3.0, 1.0]], jnp.float32)
    k = jnp.stack([head0, head0 / 4], axis=1).astype(jnp.bfloat16)  # [T=3, 2 heads, 2]
    v = -k / 8
    padding = jnp.asarray([-1, -1, -1], jnp.int32)
    np.testing.assert_array_equal(calculate_kv_scales(scales, k, v, padding), scales)  # nothing written: unchanged
    first = calculate_kv_scales(scales, k, v, jnp.asarray([5, -1, 7], jnp.int32))  # the 1e4 row is padding
    np.testing.assert_allclose(np.asarray(first), [[40 / K_SCALE_RANGE, 5 / V_SCALE_RANGE, 0.0],
                                                   [10 / K_SCALE_RANGE, 1.25 / V_SCALE_RANGE, 0.0]])
    again = calculate_kv_scales(first, k * 10, v * 10, jnp.asarray([1, 2, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))  # calculated once
    zeros = calculate_kv_scales(scales, k.at[:, 1].set(0), v.at[:, 1].set(0), jnp.asarray([0, 1, 2], jnp.int32))
    np.testing.assert_allclose(np.asarray(zeros)[1], [1.0, 1.0, 0.0])  # an all-zero head: 1.0, not 0


def test_engine_calculates_kv_scales_from_the_first_batch(tiny_checkpoint, runs):
    """With calculate_kv_scales the warm-up (padding only) leaves the scales to calculate;
    the first batch sets every layer's, its largest |K| is then stored as 200 (the scales
    then kept, through sleep too, as vLLM's), and greedy outputs stay as close to the bf16
    cache's as with scales of 1.0."""
    path = str(tiny_checkpoint("qwen3"))
    llm = LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, logprobs_mode="raw_logits", max_logprobs=-1,
              enable_sleep_mode=True, **ENGINE)
    runner = llm.llm_engine.runner
    assert (np.asarray(runner.kv_caches[2]) == 1.0).all()  # after the warm-up
    first = min(prompts(), key=len)
    assert len(first) <= ENGINE["max_num_batched_tokens"]  # one batch
    llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    scales = np.asarray(runner.kv_caches[2])  # [KV head, layer, 3]
    assert (scales[..., 2] == 0).all() and (scales[..., :2] != 1.0).all()
    k_cache = np.abs(np.asarray(cache_view(runner.kv_caches[0], runner.cfg)[:, 0].astype(jnp.float32)))
    assert 184 <= k_cache.max() <= 216  # the first batch's largest key: 200, e4m3-rounded (a step of 16 there)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    np.testing.assert_array_equal(np.asarray(runner.kv_caches[2]), scales)  # kept
    llm.sleep(level=1)
    llm.wake_up()
    np.testing.assert_array_equal(np.asarray(runner.kv_caches[2]), scales)  # and through sleep (they were lost)
    llm.shutdown()
    ref = runs["auto"][0]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, outs))
    diff = np.concatenate([np.abs(logits_row(a.outputs[0].logprobs[0], 512) - logits_row(b.outputs[0].logprobs[0], 512))
                           for a, b in zip(ref, outs)])
    print(f"\nfp8 with calculated scales vs bf16 KV cache: {same}/{NUM_PROMPTS} identical greedy completions; "
          f"first decode logits max |diff| {diff.max():.4f}, mean {diff.mean():.4f}")
    assert same / NUM_PROMPTS >= 0.5 and diff.max() < LOGIT_ATOL and diff.mean() < LOGIT_MEAN_ATOL


def test_pallas_backend_with_fp8_cache_equals_reference(tiny_checkpoint):
    """The kernels (interpret mode on CPU) over the fp8 cache generate what the reference does."""
    path = str(tiny_checkpoint("qwen3"))
    requests = [{"prompt_token_ids": p} for p in prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    outs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(path, kv_cache_dtype="fp8", attention_backend=backend, **ENGINE, enforce_eager=True)
        outs[backend] = llm.generate(requests, params, use_tqdm=False)
        llm.shutdown()
    ref, pal = outs["reference"], outs["pallas"]
    assert [o.outputs[0].token_ids for o in pal] == [o.outputs[0].token_ids for o in ref]
    # bf16 activations over an fp8 cache: the two backends round differently, and XLA's
    # excess-precision rewrites move with the step's HLO (measured up to 0.022 over 4 tokens).
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in pal],
                               [o.outputs[0].cumulative_logprob for o in ref], atol=3e-2)


_TP_SCRIPT = """
import json, sys
import jax
from jaxvllm import LLM, SamplingParams
from jaxvllm.kv_cache import cache_view
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64], dtype="bfloat16")
prompts = [list(range(5, 5 + n)) for n in (3, 17, 70)]
params = SamplingParams(temperature=0, max_tokens=6)
out = {}
for tp in (1, 2):
    for calculate in (False, True):
        llm = LLM(sys.argv[1], kv_cache_dtype="fp8", tensor_parallel_size=tp, calculate_kv_scales=calculate, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.llm_engine.runner
        k_cache, v_cache, scales = runner.kv_caches
        out[f"{tp}{'-calculated' if calculate else ''}"] = dict(
            tokens=[o.outputs[0].token_ids for o in outs], dtype=str(cache_view(k_cache, runner.cfg).dtype),
            cache_shards=sorted({tuple(s.data.shape) for s in k_cache.addressable_shards}),
            scale_shards=sorted({tuple(s.data.shape) for s in scales.addressable_shards}),
            scales=jax.device_get(scales).swapaxes(0, 1).tolist(),  # [layer, KV head, 2 or 3]
            blocks=llm.stats()["num_gpu_blocks"])
        llm.shutdown()
print(json.dumps(out))
"""


def test_tensor_parallel_with_fp8_cache(tiny_checkpoint):
    """2 CPU devices (a process of its own): the cache and its scales split on KV heads, each
    device calculating its own heads' scales as one device does, and the same greedy tokens."""
    path = tiny_checkpoint("llama")  # 2 KV heads: one per device
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = out["1"], out["2"]
    assert one["dtype"] == two["dtype"] == "float8_e4m3fn"
    # [KV heads, layers, 2], split on KV heads, as the cache
    assert one["scale_shards"] == [[2, 2, 2]] and two["scale_shards"] == [[1, 2, 2]]
    (heads1, *rest1), (heads2, *rest2) = one["cache_shards"][0], two["cache_shards"][0]
    assert heads2 * 2 == heads1 and rest1 == rest2
    assert two["tokens"] == one["tokens"]
    # Calculated scales: each device its own KV head's, as one device calculates them.
    one, two = out["1-calculated"], out["2-calculated"]
    assert one["scale_shards"] == [[2, 2, 3]] and two["scale_shards"] == [[1, 2, 3]]
    # Each is one bf16 K or V value (max |x| / 200) out of differently split matmuls: within
    # a bf16 rounding or two (2^-8 relative each) of one device's. (So greedy tokens, which
    # the tiny random model's near-ties make sensitive to them, are compared above.)
    np.testing.assert_allclose(two["scales"], one["scales"], rtol=1e-2)
    assert all(head[2] == 0 and head[0] != 1.0 for layer in two["scales"] for head in layer)
