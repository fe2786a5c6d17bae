"""`update_weights` under tensor, expert and data parallelism on 2 CPU devices, run by
tests/engine/test_update_weights.py in a process of its own: prints one JSON object, for each
case whether the updated engine's greedy ids equal a fresh engine's of the new checkpoint.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/engine/update_weights_worker.py A B A_MOE B_MOE
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from safetensors.numpy import load_file

from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]


def ids(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def main(a: str, b: str, a_moe: str, b_moe: str) -> None:
    out = {}
    tp2 = {"tensor_parallel_size": 2}
    for name, (src, dst), kwargs in [("tp2", (a, b), tp2), ("tp2_moe", (a_moe, b_moe), tp2),
                                     ("ep2_moe", (a_moe, b_moe), {**tp2, "enable_expert_parallel": True}),
                                     ("dp2", (a, b), {"data_parallel_size": 2})]:
        with LLM(dst, **kwargs, **ENGINE) as llm:
            want = ids(llm)
        with LLM(src, **kwargs, **ENGINE) as llm:
            before = ids(llm)
            llm.update_weights(load_file(f"{dst}/model.safetensors"))
            out[name] = {"equal": ids(llm) == want, "changed": before != want}
    out["elsewhere"] = elsewhere(a, b)
    out["refused_by_one_replica"] = refused_by_one_replica(a, b)
    out["ctrl_c_between_replicas"] = ctrl_c_between_replicas(a, b)
    print(json.dumps(out))


def elsewhere(a: str, b: str) -> dict:
    """Tensors on other devices than their param's (one the engine does not use, or one of
    its two under TP 2; part of a merged q/k/v, one layer's row of a stack): moved there,
    the same as from numpy."""
    tensors = load_file(f"{b}/model.safetensors")
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"]
    out = {}
    for case, kwargs, device in (("one", {}, 1), ("dp2", {"data_parallel_size": 2}, 0),
                                 ("tp2", {"tensor_parallel_size": 2}, 0)):
        with LLM(a, **kwargs, **ENGINE) as llm:
            llm.update_weights({n: tensors[n] for n in names})
            want = ids(llm), params(llm)
        with LLM(a, **kwargs, **ENGINE) as llm:
            llm.update_weights({n: jax.device_put(tensors[n], jax.devices()[device]) for n in names})
            out[case] = ids(llm) == want[0] and params(llm) == want[1]
    return out


def refused_by_one_replica(a: str, b: str) -> dict:
    """2 replicas, one with a request unfinished: sleep and collective_rpc's update are
    refused by it, so neither replica sleeps or changes."""
    with LLM(a, data_parallel_size=2, enable_sleep_mode=True, **ENGINE) as llm:
        before = params(llm)
        llm.engines[1].add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
        out = {}
        for call in (lambda: llm.sleep(1),
                     lambda: llm.collective_rpc("update_weights", args=(load_file(f"{b}/model.safetensors"),))):
            try:
                call()
                out["refused"] = False
            except RuntimeError:
                out["refused"] = out.get("refused", True)
        out["asleep"] = [e.is_sleeping() for e in llm.engines]
        out["unchanged"] = params(llm) == before
    return out


def ctrl_c_between_replicas(a: str, b: str) -> dict:
    """A Ctrl-C during replica 0's update lands once replica 1 has it too (it landed between
    them: the replicas answered from two models)."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a pytest-xdist parent left it ignored)
    with LLM(b, data_parallel_size=2, **ENGINE) as llm:
        want = params(llm)[0]
    with LLM(a, data_parallel_size=2, **ENGINE) as llm:
        first, update = llm.engines[0], llm.engines[0].update_weights

        def update_then_ctrl_c(weights):
            count = update(weights)
            signal.raise_signal(signal.SIGINT)
            return count

        first.update_weights = update_then_ctrl_c
        try:
            llm.update_weights(load_file(f"{b}/model.safetensors"))
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        return {"interrupted": interrupted, "both_updated": params(llm) == [want, want]}


def params(llm: LLM) -> list:
    """Every replica's params, as nested lists."""
    return [[np.asarray(x).tolist() for x in jax.tree.leaves(e.runner.params)] for e in llm.engines]


if __name__ == "__main__":
    main(*sys.argv[1:])
