"""`LLM.update_weights`: another checkpoint's tensors pushed into a running engine give
that checkpoint's outputs (every architecture, from torch, numpy and device arrays), partial
updates change only what they name, a bad tensor changes nothing, device arrays take no
host round trip, and what is refused is refused with the engine still serving."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxvllm import LLM, SamplingParams
from tests.models.paged import hf_greedy

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


def completions(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


def hf_state(path) -> dict:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def leaves(llm: LLM) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(llm.get_params())]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"])
def test_update_gives_the_other_checkpoints_outputs(arch, tiny_checkpoint):
    """The engine of checkpoint A, given checkpoint B's HF state dict (torch tensors, in
    transformers' own names: fused experts included), generates as an engine of B does,
    greedy and seeded."""
    a, b = tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)
    with LLM(str(b), **ENGINE) as llm:
        want = completions(llm), completions(llm, SEEDED)
    state = AutoModelForCausalLM.from_pretrained(str(b), dtype=torch.float32).state_dict()
    with LLM(str(a), **ENGINE) as llm:
        before = completions(llm)
        count = llm.update_weights(state.items())
        assert count == len(state) - ("lm_head.weight" in state and llm.llm_engine.model_config.tie_word_embeddings)
        assert (completions(llm), completions(llm, SEEDED)) == want != (before,)
        stats = llm.stats()
        assert stats["weight_updates"] == 1 and stats["weight_update_seconds"] > 0


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), **ENGINE) as llm:
        yield llm


@pytest.fixture
def fresh(llm, tiny_checkpoint):
    """The module's engine with checkpoint A's weights put back after the test."""
    yield llm
    from safetensors.numpy import load_file

    if not llm.llm_engine.has_unfinished_requests():
        llm.update_weights(load_file(str(tiny_checkpoint("llama") / "model.safetensors")))


def test_partial_update_changes_only_what_it_names(fresh, tiny_checkpoint):
    """One layer's q_proj (a numpy array, and a part of the CPU's merged qkv_proj): the
    outputs are HF's with that one tensor replaced, and every param but that one is
    bit-identical."""
    b = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint("llama", seed=1)), dtype=torch.float32)
    name = "model.layers.1.self_attn.q_proj.weight"
    q = b.state_dict()[name].numpy()
    before = jax.tree.map(np.asarray, fresh.get_params())
    assert fresh.update_weights({name: q}) == 1
    after = jax.tree.map(np.asarray, fresh.get_params())
    changed = [path for path, (x, y) in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                                             zip(jax.tree.leaves(before), jax.tree.leaves(after)))
               if not np.array_equal(x, y)]
    assert len(changed) == 1 and "qkv_proj" in jax.tree_util.keystr(changed[0][0])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint("llama")), dtype=torch.float32)
    hf.state_dict()[name].copy_(torch.from_numpy(q))
    assert completions(fresh) == hf_greedy(hf.eval(), PROMPTS, 8)


def test_a_bad_tensor_changes_nothing(fresh, tiny_checkpoint):
    """A wrong shape or an unknown name in the middle of the list: a clear error, every
    weight bit-identical, and the engine serves as before."""
    state = hf_state(tiny_checkpoint("llama", seed=1))
    pairs = list(state.items())
    before, outputs = leaves(fresh), completions(fresh)
    bad_shape = pairs[:5] + [("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 64))] + pairs[5:]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight has shape \(64, 64\); the model's "
                                         r"is \(64, 128\)"):
        fresh.update_weights(bad_shape)
    with pytest.raises(ValueError, match=r"'model.layers.7.mlp.up_proj.weight' is not a weight of this model"):
        fresh.update_weights(pairs[:5] + [("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="has dtype int32; a floating-point tensor is expected"):
        fresh.update_weights({"model.norm.weight": np.zeros(64, np.int32)})
    assert all(np.array_equal(x, y) for x, y in zip(before, leaves(fresh)))
    assert completions(fresh) == outputs


def test_a_ctrl_c_while_a_generator_yields_lands_at_once(fresh, tiny_checkpoint):
    """A trainer's generator of weights is read with Ctrl-C let through (it may block for
    good): a SIGINT while it yields interrupts the update there, and nothing changed.
    Before, it was held until the whole update had gone in."""
    import signal

    pairs = list(hf_state(tiny_checkpoint("llama", seed=1)).items())
    before, outputs = leaves(fresh), completions(fresh)

    def weights():
        yield from pairs[:3]
        signal.raise_signal(signal.SIGINT)  # (a Ctrl-C while the trainer makes the rest)
        yield from pairs[3:]

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fresh.update_weights(weights())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(np.array_equal(x, y) for x, y in zip(before, leaves(fresh)))
    assert completions(fresh) == outputs


def test_device_arrays_take_no_host_round_trip(fresh, tiny_checkpoint):
    """jax arrays already on the device (a pytree of nested dicts, as a trainer holds
    them): no transfer to or from the host during the update."""
    state = hf_state(tiny_checkpoint("llama", seed=1))
    tree: dict = {}
    for name, tensor in state.items():
        node = tree
        *parents, leaf = name.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(tensor.numpy())
    jax.block_until_ready(tree)
    with jax.transfer_guard("disallow"):
        assert fresh.update_weights(tree) == len(state)
    with LLM(str(tiny_checkpoint("llama", seed=1)), **ENGINE) as other:
        assert completions(fresh) == completions(other)


def test_the_params_never_share_the_callers_buffers(fresh, tiny_checkpoint):
    """HF-named device arrays are copied in (as vLLM's load_weights copies): a trainer that
    donates them to its next step, or deletes them, leaves the engine serving."""
    state = hf_state(tiny_checkpoint("llama", seed=1))
    given = {name: jax.device_put(t.numpy(), jax.devices()[0]) for name, t in state.items()}
    fresh.update_weights(given)
    with LLM(str(tiny_checkpoint("llama", seed=1)), **ENGINE) as other:
        want = completions(other)
    jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(given)  # (a trainer's step)
    assert all(x.is_deleted() for x in given.values())
    assert completions(fresh) == want


def test_kv_cache_scales_and_bad_values(fresh, tiny_checkpoint, tmp_path):
    """A folder saved with an fp8 KV cache's scales goes back in (the scales are accepted and
    not used, as vLLM's live loads skip them); a value that is not an array, or one weight
    under two names, is refused by name."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "with-scales"
    shutil.copytree(tiny_checkpoint("llama", seed=1), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({f"model.layers.{i}.self_attn.{kv}_scale": np.array(0.5, np.float32) for i in range(2) for kv in "kv"})
    save_file(tensors, str(folder / "model.safetensors"))
    fresh.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    with LLM(str(tiny_checkpoint("llama", seed=1)), **ENGINE) as other:
        assert completions(fresh) == completions(other)
    with pytest.raises(TypeError, match=r"update_weights: model.norm.weight is a list, not an array"):
        fresh.update_weights({"model.norm.weight": [1.0] * 64})


def test_one_weight_under_two_names_is_refused(tiny_checkpoint):
    """An expert stack under transformers 5's fused name and under a per-expert name: the
    same weight twice, whichever comes first."""
    from jaxvllm.loader import load_config
    from jaxvllm.models import MODELS
    from jaxvllm.weight_update import check, weight_index

    cfg = load_config(tiny_checkpoint("qwen3_moe"))
    index = weight_index(MODELS[cfg.architecture].param_specs(cfg))
    fused = next(name for name, places in index.items() if places[0].fused and places[0].member.stacked)
    expert = next(name for name, places in index.items() if places[0].expert == 1 and
                  (places[0].spec.path, places[0].row) == (index[fused][0].spec.path, index[fused][0].row))
    pairs = [(name, np.zeros(index[name][0].hf_shape, np.float32)) for name in (fused, expert)]
    for given in (pairs, pairs[::-1]):
        with pytest.raises(ValueError, match=r"are the same weight, given twice"):
            check(given, index, frozenset())


def test_refused_while_requests_are_unfinished(fresh):
    engine = fresh.llm_engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="update_weights while requests are unfinished"):
        fresh.update_weights({})
    while engine.has_unfinished_requests():
        engine.step()
    assert fresh.update_weights({}) == 0


def test_quantized_checkpoint_refuses(tiny_checkpoint, tmp_path):
    """A checkpoint quantized offline cannot take full-precision tensors: refused, serving on."""
    from weights.make_quantized import make_fp8

    with LLM(str(make_fp8(tiny_checkpoint("llama"), tmp_path / "fp8", block=(32, 32))), **ENGINE) as llm:
        with pytest.raises(ValueError, match=r"update_weights on a quantized checkpoint \(fp8\) is not supported"):
            llm.update_weights({"model.norm.weight": np.ones(64, np.float32)})
        assert len(completions(llm)) == len(PROMPTS)


def _engine_and_trainer(llm: LLM, temperature: float, params=None) -> tuple[np.ndarray, np.ndarray]:
    """The engine's logprobs of its sampled tokens, and `sequence_logprobs` of the same."""
    from jaxvllm.models import sequence_logprobs

    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=10, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    trainer = jax.jit(sequence_logprobs, static_argnames=("cfg", "temperature"))(
        params or llm.get_params(), llm.llm_engine.model_config, ids, np.array([len(s) for s in seqs]),
        temperature=temperature)
    engine = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    mine = [np.asarray(trainer[i, len(p) - 1 : len(p) + 9]) for i, p in enumerate(PROMPTS)]
    return np.array(engine), np.stack(mine)


@pytest.mark.parametrize("mode,temperature", [("raw_logprobs", 1.0), ("processed_logprobs", 0.8)])
def test_engine_and_trainer_logprobs_agree(mode, temperature, tiny_checkpoint):
    """RL's importance ratios: the engine's logprobs of its sampled tokens (raw at
    temperature 1; processed, of the logits divided by the temperature, at 0.8) equal the
    trainer-side forward's within 1e-5 (float32), which is differentiable in the params."""
    from jaxvllm.models import sequence_logprobs

    with LLM(str(tiny_checkpoint("qwen3")), logprobs_mode=mode, **ENGINE) as llm:
        engine, trainer = _engine_and_trainer(llm, temperature)
        np.testing.assert_allclose(engine, trainer, atol=1e-5)
        grads = jax.grad(lambda p: sequence_logprobs(p, llm.llm_engine.model_config, np.array([PROMPTS[2]])).sum(),
                         allow_int=True)(llm.get_params())
        floats = [g for g in jax.tree.leaves(grads) if g.dtype != jax.dtypes.float0]
        assert all(np.isfinite(np.asarray(g)).all() for g in floats) and any(np.abs(g).max() > 0 for g in floats)


def test_a_trainers_own_pytree_goes_back(fresh):
    """`get_params()`'s structure, changed as a trainer's step would: taken whole (no name
    mapping), and the engine then scores as the trainer does."""
    params = fresh.get_params()
    trained = jax.tree.map(lambda x: x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    assert fresh.update_weights(trained) == len(jax.tree.leaves(params))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(fresh.get_params()),
                                                                           jax.tree.leaves(trained)))
    engine, trainer = _engine_and_trainer(fresh, 1.0, trained)
    np.testing.assert_allclose(engine, trainer, atol=1e-5)


def test_a_pytree_of_uncommitted_arrays_compiles_nothing(fresh, compile_counter):
    """Arrays a trainer made with jnp.array or jax.random are not committed to a device:
    taken as they are, every step's forward compiled again (jit keys on committedness)."""
    completions(fresh)
    uncommitted = jax.tree.map(lambda x: jnp.array(np.asarray(x)), fresh.get_params())
    assert not any(x.committed for x in jax.tree.leaves(uncommitted))
    fresh.update_weights(uncommitted)
    before = compile_counter.count
    completions(fresh)
    assert compile_counter.count == before
    # The ids kept from deletion at shutdown are of arrays the params hold, none else (an RL
    # loop's piled up, and a dead one's id could come back for a KV cache).
    assert fresh.llm_engine.runner._given <= {id(p) for p in jax.tree.leaves(fresh.get_params())}


def test_shutdown_leaves_a_trainers_arrays_alive(tiny_checkpoint):
    """Arrays update_weights took as they were stay the caller's: shutdown deletes the
    engine's own (the KV cache, arrays it made), not them."""
    with LLM(str(tiny_checkpoint("llama")), **ENGINE) as llm:
        trained = jax.tree.map(lambda x: x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x, llm.get_params())
        llm.update_weights(trained)
        norm = jnp.full((64,), 2.0)
        llm.update_weights({"model.layers.1.input_layernorm.weight": norm, "model.norm.weight": norm})
        given = {id(x) for x in jax.tree.leaves(trained) + [norm]}
        made = [x for x in jax.tree.leaves(llm.get_params()) if id(x) not in given]
        kv = jax.tree.leaves(llm.llm_engine.runner.kv_caches)
    assert not any(x.is_deleted() for x in jax.tree.leaves(trained) + [norm])
    assert made and all(x.is_deleted() for x in made + kv)
    # Uncommitted arrays (jnp.array's) are committed to the params' placement, which shares
    # their buffers: shutdown deleted them through it.
    with LLM(str(tiny_checkpoint("llama")), **ENGINE) as llm:
        uncommitted = jax.tree.map(lambda x: jnp.array(np.asarray(x)), llm.get_params())
        llm.update_weights(uncommitted)
    assert not any(x.is_deleted() for x in jax.tree.leaves(uncommitted))


@pytest.mark.parametrize("arch,quantization", [("llama", "fp8"), ("qwen3_moe", "fp8"), ("qwen3", "gptq-dummy"),
                                               ("qwen3_moe", "gptq-dummy")])
def test_online_quantized_engine_quantizes_the_update(arch, quantization, tiny_checkpoint):
    """quantization="fp8" or "gptq-dummy" (experts too): the update is quantized as the
    load quantized it, so the outputs are those of the other checkpoint loaded so. A part
    of a merged weight (q of q/k/v on a CPU) is quantized alone: both scale each output row
    alone, so q, then the rest, give the params of the other checkpoint's load exactly (a
    GPU's unmerged layout took it; a CPU's refused it)."""
    a, b = tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)
    with LLM(str(b), quantization=quantization, **ENGINE) as llm:
        want, want_leaves = completions(llm), leaves(llm)
    state = hf_state(b)
    with LLM(str(a), quantization=quantization, **ENGINE) as llm:
        llm.update_weights(state.items())
        assert completions(llm) == want
    with LLM(str(a), quantization=quantization, **ENGINE) as llm:
        before = completions(llm)
        q = "model.layers.0.self_attn.q_proj.weight"
        llm.update_weights({q: state[q]})
        assert completions(llm) != before
        llm.update_weights({name: value for name, value in state.items() if name != q})
        assert all(np.array_equal(x, y) for x, y in zip(leaves(llm), want_leaves))


@pytest.mark.parametrize("quantization", ["fp8", "gptq-dummy"])
def test_a_float32_update_of_a_bfloat16_engine_is_quantized_as_a_load(quantization, tiny_checkpoint):
    """A trainer's float32 weights into a bf16 engine quantized online: rounded to bf16 first,
    as the loader rounds them, so the params equal a fresh load's."""
    a, b = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)
    with LLM(str(b), quantization=quantization, dtype="bfloat16", **ENGINE) as llm:
        want = leaves(llm)
    with LLM(str(a), quantization=quantization, dtype="bfloat16", **ENGINE) as llm:
        llm.update_weights(hf_state(b).items())
        assert all(np.array_equal(x, y) for x, y in zip(leaves(llm), want))
    with LLM(str(a), **ENGINE) as llm:  # (a pytree's integers and floats do not mix)
        params = llm.get_params()
        wrong = jax.tree.map(lambda x: x.astype(jnp.int32), params)
        with pytest.raises(ValueError, match=r"has dtype int32; the model's is float32"):
            llm.update_weights(wrong)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_stacked_layout(arch, tiny_checkpoint, monkeypatch):
    """A GPU's layout on a CPU (each kind of layer weight one stack, q/k/v apart): each
    layer's tensor written into its row of the stack; experts from per-expert tensors."""
    import jaxvllm.loader as loader
    from safetensors.numpy import load_file

    monkeypatch.setattr(loader, "stacks_layers", lambda device: True)
    a, b = tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)
    with LLM(str(b), **ENGINE) as llm:
        want = completions(llm)
    with LLM(str(a), **ENGINE) as llm:
        assert not isinstance(llm.get_params()["layers"]["q_proj"], list)
        llm.update_weights(load_file(str(b / "model.safetensors")))
        assert completions(llm) == want


def test_tensor_and_expert_parallel(tiny_checkpoint):
    """TP 2 (a dense and a MoE model), expert parallelism and 2 data-parallel replicas (each
    replica gets every tensor), in a process of 2 CPU devices."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    paths = [tiny_checkpoint(arch, **seed) for arch in ("llama", "qwen3_moe") for seed in ({}, {"seed": 1})]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "tests" / "engine" / "update_weights_worker.py"),
                           *map(str, paths)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {case: results.pop(case) for case in ("tp2", "tp2_moe", "ep2_moe", "dp2")} == \
        {case: {"equal": True, "changed": True} for case in ("tp2", "tp2_moe", "ep2_moe", "dp2")}
    # Arrays on a device the engine does not use (it raised "incompatible devices", after
    # replica 0 had taken the update); what one replica refuses, none does.
    assert results == {"elsewhere": {"one": True, "dp2": True, "tp2": True},
                       "refused_by_one_replica": {"refused": True, "asleep": [False, False], "unchanged": True},
                       "ctrl_c_between_replicas": {"interrupted": True, "both_updated": True}}


def test_fp8_kv_cache(tiny_checkpoint):
    a, b = tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3", seed=1)
    from safetensors.numpy import load_file

    with LLM(str(b), kv_cache_dtype="fp8", **ENGINE) as llm:
        want = completions(llm)
    with LLM(str(a), kv_cache_dtype="fp8", **ENGINE) as llm:
        llm.update_weights(load_file(str(b / "model.safetensors")))
        assert completions(llm) == want
