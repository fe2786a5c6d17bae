"""One process of a two-process, eight-device run (4 CPU devices each), started by
tests/distributed/test_multihost.py: every process runs this same script, as JAX's multi-controller
model asks, and each prints one JSON object of its results.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/distributed/multihost_worker.py DIR PORT RANK
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax

from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 17, 25, 33, 40)]
PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, n=2, ignore_eos=True)] * 3


def run(llm: LLM, prompts=PROMPTS) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, PARAMS[: len(prompts)], use_tqdm=False)]


def sizing(path: Path) -> dict:
    """KV blocks agreed across processes: fake allocator figures (100 MiB per device, JAX's
    0.75 limit) where process 1's devices peak at 30 MiB and process 0's at 10 MiB."""
    import jaxvllm.kv_cache as kv_cache

    def stats(device):
        peak = (30 if device.process_index == 1 else 10) << 20
        return {"bytes_limit": 75 << 20, "bytes_in_use": peak, "peak_bytes_in_use": peak}

    real, kv_cache.device_memory_stats = kv_cache.device_memory_stats, stats
    try:
        with LLM(path, **ENGINE, tensor_parallel_size=8, gpu_memory_utilization=0.5, enforce_eager=True) as llm:
            runner = llm.llm_engine.runner
            return {"num_blocks": runner.num_blocks, "bytes_per_block": runner.kv_spec.bytes_per_block}
    finally:
        kv_cache.device_memory_stats = real


def updates(path: Path, other: Path) -> dict:
    """update_weights in every process with the same tensors: host arrays, then a multi-controller
    trainer's global arrays (sharded over all 8 devices); processes that disagree get an error."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from safetensors.numpy import load_file

    tensors = load_file(other / "model.safetensors")
    mesh = Mesh(np.array(jax.devices()), ("x",))
    trainer = {name: jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x") if a.shape[0] % 8 == 0 else P()),
                                                  lambda index, a=a: a[index]) for name, a in tensors.items()}
    results: dict = {"errors": {}}
    with LLM(path, **ENGINE, tensor_parallel_size=8) as llm:
        results["count"] = (llm.update_weights(tensors), len(tensors))
        results["host"] = run(llm)
        llm.collective_rpc("reload_weights")
        with jax.transfer_guard("disallow"):  # (the engine spans the trainer's devices: no host round trip)
            llm.update_weights(trainer)
        results["device"] = run(llm)
        llm.collective_rpc("reload_weights")
        mine = dict(tensors) if jax.process_index() == 0 else {k: v for k, v in tensors.items() if k != "model.norm.weight"}
        try:
            llm.update_weights(mine)
        except RuntimeError as e:
            results["errors"]["update"] = str(e)
        results["after_update_error"] = run(llm)
        mine = {k: v + (jax.process_index() if "embed" in k else 0) for k, v in tensors.items()}
        try:
            llm.update_weights(mine)
        except RuntimeError as e:
            results["errors"]["values"] = str(e)
    with LLM(path, **ENGINE, tensor_parallel_size=4, data_parallel_size=2) as llm:  # replicas on 4 of the 8
        llm.update_weights(trainer)
        results["dp2_tp4"] = run(llm)
    return results


def with_adapter(path: Path, adapter: Path, **kwargs) -> list:
    """Every other prompt under a LoRA adapter (the slots' writes and the adapters' matmuls
    across processes)."""
    from jaxvllm import LoRARequest

    lora = LoRARequest("a", 1, str(adapter))
    with LLM(path, **ENGINE, **kwargs, enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.generate(PROMPTS, PARAMS[: len(PROMPTS)], use_tqdm=False, lora_request=[lora, None] * 3)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def main(folder: str, port: str, rank: str) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(rank))
    path = Path(folder) / "llama-8-heads"
    results: dict = {"processes": jax.process_count(), "devices": jax.device_count(),
                     "local_devices": jax.local_device_count(), "errors": {}}
    for name, kwargs in (("tp8", dict(tensor_parallel_size=8)),
                         ("tp2_pallas", dict(tensor_parallel_size=2, attention_backend="pallas")),
                         ("dp2_tp4", dict(tensor_parallel_size=4, data_parallel_size=2))):
        with LLM(path, **ENGINE, **kwargs) as llm:
            results[name] = run(llm)
            results[name + "_processes"] = [sorted({d.process_index for d in e.runner.devices}) for e in llm.engines]
    # TP 2 (2 of the 8 devices): a step left in flight by requests that stopped early must not
    # overlap the next call's check over all 8.
    with LLM(path, **ENGINE, tensor_parallel_size=2) as llm:
        results["after_early_stops"] = []
        for i in range(4):
            llm.generate(["abc def"], SamplingParams(temperature=0.8, seed=3 + i, max_tokens=20, stop=["e", "a"]),
                         use_tqdm=False)
            results["after_early_stops"].append(run(llm, PROMPTS[:2]))
    # Processes given different engine arguments get a clear error before anything loads;
    # a served model name (or a path, or a memory budget) of their own is fine.
    own = Path(folder) / f"llama-8-heads-process-{jax.process_index()}"  # (its config.json: another rms_norm_eps)
    shutil.copytree(path, own)
    config = json.loads((own / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5 * (1 + jax.process_index())}))
    for name, kwargs in (("seed", dict(seed=jax.process_index())),
                         ("max_model_len", dict(max_model_len=128 + 64 * jax.process_index())),
                         ("hf_overrides, config.json", dict(hf_overrides={"rms_norm_eps": 1e-5 * (1 + jax.process_index())})),
                         ("config.json", dict(model=own))):
        try:
            LLM(**{"model": path, **ENGINE, **kwargs}, tensor_parallel_size=8)
        except ValueError as e:
            results["errors"]["arguments_" + name] = str(e)
    # Processes that disagree on the requests get a clear error, not wrong outputs.
    with LLM(path, **ENGINE, tensor_parallel_size=8, served_model_name=f"process-{jax.process_index()}") as llm:
        mine = PROMPTS[:2] if jax.process_index() == 0 else PROMPTS[1:3]
        try:
            run(llm, mine)
        except RuntimeError as e:
            results["errors"]["differ"] = str(e)
        results["after_error"] = run(llm)
        salt = {"cache_salt": "mine"} if jax.process_index() == 0 else {}
        try:
            llm.generate([{**PROMPTS[0], **salt}], PARAMS[0], use_tqdm=False)
        except RuntimeError as e:
            results["errors"]["salt"] = str(e)
    results["sizing"] = sizing(path)
    results["updates"] = updates(path, Path(folder) / "llama-8-heads-seed-1")
    results["lora_tp8"] = with_adapter(path, Path(folder) / "adapter", tensor_parallel_size=8)
    for tp in (1, 3):  # one device cannot span two processes; 3 devices do not split evenly over them
        try:
            LLM(path, **ENGINE, tensor_parallel_size=tp)
        except ValueError as e:
            results["errors"][f"tp{tp}"] = str(e)
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
