"""What pushing new weights into a running engine costs, against building a new `LLM`
from the checkpoint on disk; and sleep mode's sleep / wake_up:

    python -m jaxvllm.benchmarks.weight_update [--model dummy:qwen3-0.6b dummy:llama3-8b] [--json PATH]

For each model, a checkpoint of random weights in HF's names is written to a temporary
folder (safetensors), an engine starts from it, and then:
- `new_llm`: a second `LLM(folder)` built (load and warm-up, the persistent compilation
  cache warm), what a notebook user pays without `update_weights`;
- `update_host`: `update_weights` from the checkpoint's tensors as host (numpy) arrays;
- `update_device_hf`: from the same tensors already on the device, by HF name;
- `update_device_own`: from a pytree of the params' own structure on the device (a JAX
  trainer's), each leaf taken as it is;
- `sleep_1` / `wake_1`, `sleep_2` / `wake_2_weights` / `wake_2_kv_cache`: sleep mode.
Each update runs twice and the second is reported (the first traces the array ops).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxvllm.benchmarks.common import write_report
from jaxvllm.dummy import resolve_model
from jaxvllm.llm import LLM
from jaxvllm.loader import load_config
from jaxvllm.models import MODELS
from jaxvllm.weight_update import weight_index

ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, token_buckets=[16, 256],
              enable_sleep_mode=True)


def write_checkpoint(model: str, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The model's config and tokenizer with random weights in HF's names (safetensors)."""
    with resolve_model(model) as source:
        shutil.copytree(source.path, out)
    cfg = load_config(out)
    rng = np.random.default_rng(seed)
    np_dtype = jnp.dtype(dtype)
    tensors = {}
    for name, places in weight_index(MODELS[cfg.architecture].param_specs(cfg)).items():
        if places[0].fused:
            continue  # (transformers 5's own name of a tensor written under its usual one)
        shape = places[0].hf_shape
        tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(np_dtype)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config))
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure(model: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(model, Path(folder) / "ckpt")
        llm = LLM(str(path), **ENGINE)
        figures = {"weight_bytes": sum(llm.stats()["weight_bytes_per_device"])}
        second = time.perf_counter()
        other = LLM(str(path), **ENGINE)
        figures["new_llm"] = time.perf_counter() - second
        other.shutdown()
        host = load_file(str(path / "model.safetensors"))
        device = {name: jnp.asarray(array) for name, array in host.items()}
        own = jax.tree.map(lambda x: x + 0, llm.get_params())
        for key, weights in (("update_host", host), ("update_device_hf", device), ("update_device_own", own)):
            llm.update_weights(weights)
            figures[key] = timed(lambda: (llm.update_weights(weights), llm.get_params())[1])
        figures["sleep_1"] = timed(lambda: llm.sleep(1))
        figures["wake_1"] = timed(lambda: (llm.wake_up(), llm.get_params())[1])
        figures["sleep_2"] = timed(lambda: llm.sleep(2))
        figures["wake_2_weights"] = timed(lambda: (llm.wake_up(["weights"]), llm.get_params())[1])
        figures["wake_2_kv_cache"] = timed(lambda: (llm.wake_up(["kv_cache"]), llm.llm_engine.runner.kv_caches)[1])
        llm.shutdown()
    figures["update_host_vs_new_llm"] = figures["update_host"] / figures["new_llm"]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    report = {"benchmark": "weight_update", "platform": jax.default_backend(), "models": {}}
    for model in args.model:
        figures = report["models"][model] = measure(model)
        print(f"{model}: {figures['weight_bytes'] / 2**30:.2f} GiB of weights; new LLM {figures['new_llm']:.2f} s; "
              f"update_weights from host {figures['update_host']:.3f} s "
              f"({figures['update_host_vs_new_llm']:.3f}x the new LLM), from device arrays by HF name "
              f"{figures['update_device_hf']:.3f} s, the params' own pytree {figures['update_device_own']:.4f} s; "
              f"sleep(1) {figures['sleep_1']:.3f} s, wake_up {figures['wake_1']:.3f} s; sleep(2) "
              f"{figures['sleep_2']:.3f} s, wake weights {figures['wake_2_weights']:.3f} s, KV cache "
              f"{figures['wake_2_kv_cache']:.3f} s")
    write_report(args.json, report, None)
    return report


if __name__ == "__main__":
    main()
