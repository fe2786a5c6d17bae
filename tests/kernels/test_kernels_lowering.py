"""The compiled (non-interpret) kernels lower to Triton IR for CUDA, checked on a CPU.

`jax.export` with platforms=("cuda",) runs Pallas' Triton lowering on any host (for an
abstract H200 when no GPU is present), so the GPU shapes, dtypes and tile sizes are
checked here for what the lowering rejects: non-power-of-2 tensors, primitives without
a Triton lowering, tl.dot shapes. Triton's own compilation to PTX is checked by
scripts/gpu_aot_check.sh, the run on the GPU by scripts/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels import mixed_paged_attention, paged_decode_attention, ragged_paged_attention
from pallas_kernels.common import INTERPRET_ENV

TRITON_CALL = "__gpu$xla.gpu.triton"
NO_CHECK = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]


# With no GPU attached, jax >= 0.11 asks which GPU Pallas' Triton lowering targets.
H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
)


def lower_for_cuda(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        return export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=NO_CHECK)(*args).mlir_module()


def spec(*shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


# Qwen3-0.6B's attention: 16 q heads, 8 kv heads, head_dim 128, block_size 16.
S, T, HQ, HKV, D, BLOCKS, BS, MAX_BLOCKS = 16, 64, 16, 8, 128, 256, 16, 64


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window", [None, 100])
def test_kernels_lower_to_triton(dtype, window):
    cache = spec(HKV, BLOCKS, BS, D, dtype=dtype)
    common = dict(sm_scale=D**-0.5, sliding_window=window, interpret=False)
    decode = lower_for_cuda(partial(paged_decode_attention, **common), spec(S, HQ, D, dtype=dtype), cache, cache,
                            spec(S), spec(S, MAX_BLOCKS))
    ragged_args = (spec(T, HQ, D, dtype=dtype), cache, cache, spec(T), spec(S + 1), spec(S), spec(S, MAX_BLOCKS))
    ragged = lower_for_cuda(partial(ragged_paged_attention, **common), *ragged_args)
    mixed = lower_for_cuda(partial(mixed_paged_attention, **common), *ragged_args)
    assert decode.count(TRITON_CALL) == 1 and ragged.count(TRITON_CALL) == 1
    assert mixed.count(TRITON_CALL) == 2  # both kernels, every step


@pytest.mark.parametrize("group,block_size", [(1, 16), (4, 8), (7, 16)])  # G=7 pads to 8 rows
def test_kernel_tiles_lower_for_other_groups(group, block_size):
    cache = spec(2, 32, block_size, 64, dtype=jnp.bfloat16)
    args = (spec(T, 2 * group, 64, dtype=jnp.bfloat16), cache, cache, spec(T), spec(5), spec(4), spec(4, 8))
    lower_for_cuda(partial(mixed_paged_attention, sm_scale=0.125, interpret=False), *args)


def test_model_step_lowers_with_the_pallas_backend(monkeypatch):
    """The whole model forward with attention_backend="pallas", as the GPU engine jits it."""
    from jaxvllm.batch import ModelInputs
    from jaxvllm.model_config import ModelConfig
    from jaxvllm.dummy import get_dummy
    from jaxvllm.kv_cache import allocate_kv_caches
    from jaxvllm.loader import dummy_params
    from jaxvllm.models import forward

    monkeypatch.setenv(INTERPRET_ENV, "0")  # what a GPU default backend gives
    cfg = ModelConfig.from_hf(get_dummy("tiny").make_config())
    params = jax.eval_shape(lambda: dummy_params(cfg, jnp.bfloat16))
    # Placed as a layer's output comes back under the mesh, so that every layer's call sees one signature.
    auto = jax.sharding.NamedSharding(H200, jax.sharding.PartitionSpec())
    caches = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=auto),
                          jax.eval_shape(lambda: allocate_kv_caches(cfg, 64, 16, jnp.bfloat16)))
    inputs = ModelInputs(spec(T), spec(T), spec(T), spec(S + 1), spec(S), spec(S, 8), spec(S))
    # Every layer calls one lowered layer function (models.common.run_layers), which holds
    # both kernels (XLA inlines it back per layer).
    text = lower_for_cuda(partial(forward, cfg=cfg, attention_backend="pallas"), params, caches, inputs)
    assert text.count(TRITON_CALL) == 2 and text.count("call @layer_step") == cfg.num_layers
    # A decode-only batch (the host's promise): the decode kernel alone in each layer.
    decode_only = dataclasses.replace(inputs, decode_only=True)
    text = lower_for_cuda(partial(forward, cfg=cfg, attention_backend="pallas"), params, caches, decode_only)
    assert text.count(TRITON_CALL) == 1 and text.count("call @layer_step") == cfg.num_layers
