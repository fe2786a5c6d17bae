"""vLLM's sleep mode: sleep(1) / wake_up() gives the same outputs with the KV cache's memory
freed meanwhile and nothing recompiled; sleep(2) frees the weights too, and the RL sequence
(wake the weights, update them, wake the cache) serves the new weights; what is refused."""

from __future__ import annotations

import jax
import pytest
from safetensors.numpy import load_file

from jaxvllm import LLM, SamplingParams

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


def test_level_2_then_the_rl_sequence(llm, tiny_checkpoint, compile_counter):
    """sleep(2) frees the weights and the cache; wake_up(["weights"]), update_weights with
    another checkpoint's tensors, wake_up(["kv_cache"]): that checkpoint's outputs."""
    other = tiny_checkpoint("qwen3", seed=1)
    with LLM(str(other), **ENGINE) as fresh:
        want = completions(fresh)
    freed, before = kv_bytes(llm) + weight_bytes(llm), live_bytes()
    llm.sleep(level=2)
    assert before - live_bytes() >= freed
    with pytest.raises(RuntimeError, match=r"update_weights while the weights sleep"):
        llm.update_weights(load_file(str(other / "model.safetensors")))
    assert llm.wake_up(tags=["weights"]) is False
    llm.update_weights(load_file(str(other / "model.safetensors")))
    assert llm.wake_up(tags=["kv_cache"]) is True
    compiles = compile_counter.count  # (the update's own array ops trace; the step must not)
    assert completions(llm) == want
    assert compile_counter.count == compiles
    # back to the checkpoint's own weights, as vLLM's collective_rpc("reload_weights")
    assert llm.collective_rpc("reload_weights") == [None]
    with LLM(str(tiny_checkpoint("qwen3")), **ENGINE) as fresh:
        assert completions(llm) == completions(fresh)


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
