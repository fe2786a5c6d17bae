"""`update_weights` under tensor, expert and data parallelism on 2 CPU devices, run by
tests/engine/test_update_weights.py in a process of its own: prints one JSON object, for each
case whether the updated engine's greedy ids equal a fresh engine's of the new checkpoint.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/engine/update_weights_worker.py A B A_MOE B_MOE
"""

from __future__ import annotations

import json
import sys

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
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
