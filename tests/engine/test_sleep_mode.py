"""vLLM's sleep mode: sleep(1) / wake_up() gives the same outputs with the KV cache's memory
freed meanwhile and nothing recompiled; sleep(2) frees the weights too, and the RL sequence
(wake the weights, update them, wake the cache) serves the new weights; the same with a
draft model or EAGLE head, whose weights and cache sleep too; what is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxvllm import LLM, SamplingParams
from tests.spec_decode.eagle_heads import make_head

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64],
              enable_sleep_mode=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]


def completions(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def kv_bytes(llm: LLM) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(llm.llm_engine.runner.kv_caches))


def weight_bytes(llm: LLM) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(llm.get_params()))


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("qwen3")), **ENGINE) as llm:
        llm.llm_engine.finish_warmup()  # (the tests count compiles)
        yield llm


def test_level_1_keeps_the_outputs_and_frees_the_kv_cache(llm, compile_counter):
    want = completions(llm)
    cache, before = kv_bytes(llm), live_bytes()
    llm.sleep(level=1)
    assert llm.llm_engine.is_sleeping()
    assert before - live_bytes() >= cache
    with pytest.raises(RuntimeError, match=r"a request while the engine sleeps \(kv_cache, weights not awake\): "
                                           r"call wake_up\(\) first"):
        llm.generate(PROMPTS, use_tqdm=False)
    compiles = compile_counter.count
    assert llm.wake_up() is True and not llm.llm_engine.is_sleeping()
    assert completions(llm) == want
    assert compile_counter.count == compiles
    assert llm.stats()["prefix_cache_hits"] >= 0


@pytest.fixture(scope="module")
def other(tiny_checkpoint):
    """Another checkpoint of the same shapes, and its greedy outputs."""
    path = tiny_checkpoint("qwen3", seed=1)
    with LLM(str(path), **ENGINE) as fresh:
        return path, completions(fresh)


def test_level_2_then_the_rl_sequence(llm, tiny_checkpoint, other, compile_counter):
    """sleep(2) frees the weights and the cache; wake_up(["weights"]), update_weights with
    another checkpoint's tensors, wake_up(["kv_cache"]): that checkpoint's outputs."""
    other, want = other
    freed, before = kv_bytes(llm) + weight_bytes(llm), live_bytes()
    rows = np.array(llm.get_params()["layer_rows"])  # (a copy; not weights: no update refills them)
    llm.sleep(level=2)
    assert before - live_bytes() >= freed
    with pytest.raises(RuntimeError, match=r"update_weights while the weights sleep"):
        llm.update_weights(load_file(str(other / "model.safetensors")))
    assert llm.wake_up(tags=["weights"]) is False
    llm.update_weights(load_file(str(other / "model.safetensors")))
    np.testing.assert_array_equal(llm.get_params()["layer_rows"], rows)  # (they were zeros: every layer read layer 0's)
    assert llm.wake_up(tags=["kv_cache"]) is True
    compiles = compile_counter.count  # (the update's own array ops trace; the step must not)
    assert completions(llm) == want
    assert compile_counter.count == compiles
    # back to the checkpoint's own weights, as vLLM's collective_rpc("reload_weights")
    assert llm.collective_rpc("reload_weights", timeout=30) == [None]
    assert llm.collective_rpc("is_sleeping", None, ()) == [False]  # (vLLM's order: method, timeout, args, kwargs)
    assert llm.llm_engine.collective_rpc("reset_prefix_cache", kwargs={"reset_running_requests": True}) == [True]
    with LLM(str(tiny_checkpoint("qwen3")), **ENGINE) as fresh:
        own = completions(fresh)
        assert completions(llm) == own
    # vLLM's reload_weights arguments: a trainer's saved folder, or (name, tensor) pairs.
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other)})
    assert completions(llm) == want
    own_tensors = load_file(str(tiny_checkpoint("qwen3") / "model.safetensors"))
    # (older HF saves hold RoPE's inv_freq: not a weight, skipped as the loader and vLLM skip it)
    own_tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = own_tensors["model.norm.weight"][:8]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(own_tensors.items())})
    assert completions(llm) == own
    with pytest.raises(ValueError, match=r"is_checkpoint_format=False\) is not supported"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other), "is_checkpoint_format": False})


def test_refusals(llm, tiny_checkpoint):
    with pytest.raises(ValueError, match="collective_rpc method 'save_sharded_state' is not supported"):
        llm.collective_rpc("save_sharded_state")
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags"):
        llm.wake_up(tags=["cache"])
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match=r"sleep\(\) while requests are unfinished"):
        llm.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    with LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
             token_buckets=[64]) as plain:
        with pytest.raises(ValueError, match=r"sleep\(\) needs an engine started with enable_sleep_mode=True"):
            plain.sleep()


def test_sleep_twice_warns_and_get_params_waits_for_the_weights(llm, caplog):
    """As vLLM's executor, a second sleep() warns and changes nothing; the weights' pytree
    is refused while they sleep (it is not there), and given once they are awake."""
    want = completions(llm)
    llm.sleep(level=2)
    with caplog.at_level("WARNING", logger="jaxvllm.engine"):
        llm.sleep(level=1)
    assert "the engine is asleep already" in caplog.text
    with pytest.raises(RuntimeError, match=r"get_params\(\) while the weights sleep: call wake_up"):
        llm.get_params()
    llm.wake_up(tags=["weights"])
    assert llm.get_params() is llm.llm_engine.runner.params
    llm.collective_rpc("reload_weights")
    llm.wake_up()
    assert completions(llm) == want


def test_sleep_leaves_a_trainers_arrays_alone(llm):
    """update_weights takes a trainer's own-structure pytree as it is; sleep(2) then lets
    go of those arrays without deleting them (they are still the trainer's)."""
    want = completions(llm)
    trainer = jax.tree.map(lambda x: x + 0, llm.get_params())
    llm.update_weights(trainer)
    llm.sleep(level=2)
    assert not any(x.is_deleted() for x in jax.tree.leaves(trainer))
    llm.wake_up(tags=["weights"])
    llm.update_weights(trainer)
    llm.wake_up(tags=["kv_cache"])
    assert completions(llm) == want


@pytest.fixture(scope="module", params=["draft_model", "eagle"])
def spec_llm(request, tiny_checkpoint, tmp_path_factory):
    """The tiny model with K=2 drafts from itself as a draft model (every draft accepted), or
    from an EAGLE head that passes the target's state through (drafting its last token again)."""
    target, d = tiny_checkpoint("qwen3"), 64  # (4 heads x 32 wide, and the MLP: 128)
    passing = {"fc.weight": np.concatenate([np.zeros((d, d)), np.eye(d)], 1).astype(np.float32),
               "layers.0.self_attn.o_proj.weight": np.zeros((d, 128), np.float32),
               "layers.0.mlp.down_proj.weight": np.zeros((d, 128), np.float32)}
    drafter = target if request.param == "draft_model" else make_head(target, tmp_path_factory.mktemp("eagle"),
                                                                      "eagle", **passing)
    spec = {"method": request.param, "model": str(drafter), "num_speculative_tokens": 2}
    with LLM(str(target), speculative_config=spec, **ENGINE) as llm:
        yield llm


def spec_completions(llm: LLM) -> tuple[list[list[int]], int, int]:
    """The greedy outputs, and the drafts made and accepted for them."""
    stats = [llm.stats()[f"spec_decode_num_{n}_tokens"] for n in ("draft", "accepted")]
    out = completions(llm)
    return out, *[llm.stats()[f"spec_decode_num_{n}_tokens"] - s for n, s in zip(("draft", "accepted"), stats)]


def drafter_bytes(llm: LLM) -> int:
    return sum(a.nbytes for a in llm.llm_engine.runner.drafter.arrays())


def test_level_1_with_a_drafter(spec_llm, compile_counter):
    """The drafter's weights go to host memory and its cache is freed; waking gives the same
    outputs and the same drafts (so the same drafter weights), compiling nothing."""
    want = spec_completions(spec_llm)
    assert want[2] > 0  # (drafts accepted: a drafter's weights changed would change them)
    freed, before = kv_bytes(spec_llm) + drafter_bytes(spec_llm), live_bytes()
    spec_llm.sleep(level=1)
    assert before - live_bytes() >= freed
    compiles = compile_counter.count
    assert spec_llm.wake_up() is True
    assert spec_completions(spec_llm) == want
    assert compile_counter.count == compiles


def test_level_2_with_a_drafter(spec_llm, other, compile_counter):
    """The RL sequence after sleep(2) serves the new target weights with the drafter intact
    (update_weights does not touch it): the new checkpoint's greedy outputs, and after
    reload_weights the first outputs and drafts again."""
    (other, other_want), first = other, spec_completions(spec_llm)
    freed, before = kv_bytes(spec_llm) + weight_bytes(spec_llm) + drafter_bytes(spec_llm), live_bytes()
    spec_llm.sleep(level=2)
    assert before - live_bytes() >= freed
    assert spec_llm.wake_up(tags=["weights"]) is False
    spec_llm.update_weights(load_file(str(other / "model.safetensors")))
    assert spec_llm.wake_up(tags=["kv_cache"]) is True
    compiles = compile_counter.count
    assert spec_completions(spec_llm)[0] == other_want
    assert compile_counter.count == compiles
    spec_llm.collective_rpc("reload_weights")
    assert spec_completions(spec_llm) == first
    # reload_weights while asleep brings the drafter's weights back too
    spec_llm.sleep(level=2)
    spec_llm.collective_rpc("reload_weights")
    assert spec_llm.wake_up(tags=["kv_cache"]) is True
    assert spec_completions(spec_llm) == first
