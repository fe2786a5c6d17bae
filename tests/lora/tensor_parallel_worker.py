"""LoRA under tensor and data parallelism on 4 CPU devices, run by tests/lora/test_lora.py in a process of
its own (the device count is fixed when jax starts): prints one JSON object, each engine's
greedy ids per adapter (None: the base model) and the placement of the slots' stacks.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/lora/tensor_parallel_worker.py CHECKPOINT A B
"""

from __future__ import annotations

import json
import sys

import jax

from jaxvllm import LLM, LoRARequest, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])


def _axes(spec) -> list:
    """A PartitionSpec's entries, trailing Nones dropped."""
    axes = list(spec)
    while axes and axes[-1] is None:
        axes.pop()
    return axes


def main(checkpoint: str, *adapters: str) -> None:
    from tests.lora.test_lora import MAX_TOKENS, PROMPTS

    loras = [None] + [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(adapters)]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for tp, dp in ((2, 1), (4, 1), (1, 2)):  # 4: the tiny llama's 2 KV heads repeated twice; then 2 replicas
        with LLM(checkpoint, tensor_parallel_size=tp, data_parallel_size=dp, enable_lora=True, max_loras=2,
                 max_lora_rank=8, **ENGINE) as llm:
            batch = [{"prompt_token_ids": p} for _ in loras for p in PROMPTS]
            outs = llm.generate(batch, sp, lora_request=[lr for lr in loras for _ in PROMPTS], use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            key = f"tp{tp}" if dp == 1 else f"dp{dp}"
            out[key] = [ids[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i in range(len(loras))]
            if dp > 1:
                # id 1 given adapter B's folder on every replica (LLM.add_lora; llm_engine is replica 0)
                replaced = LoRARequest("adapter-0", 1, adapters[1])
                llm.add_lora(replaced)
                outs = llm.generate(batch[: len(PROMPTS)] * 2, sp, lora_request=replaced, use_tqdm=False)
                out["dp2 replaced"] = [list(o.outputs[0].token_ids) for o in outs]
                out["dp2 replaced per replica"] = [e.runner.lora.requests[1].lora_path for e in llm.engines]
                continue
            stacks = llm.llm_engine.runner.lora.stacks
            out[f"specs {key}"] = {name: [_axes(x.sharding.spec) for x in jax.tree.leaves(pair)]
                                  for name, pair in stacks.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
