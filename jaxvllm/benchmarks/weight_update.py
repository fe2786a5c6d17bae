"""What pushing new weights into a running engine costs, against building a new `LLM`
from the checkpoint on disk; and sleep mode's sleep / wake_up:

    python -m jaxvllm.benchmarks.weight_update [--model dummy:qwen3-0.6b dummy:llama3-8b] [--by-layer] [--json PATH]

For each model, a checkpoint of random weights in HF's names is written to a temporary
folder (safetensors, a file per layer), an engine starts from it, and then:
- `new_llm`: a second `LLM(folder)` built (load and warm-up, the persistent compilation
  cache warm), what a notebook user pays without `update_weights`;
- `update_host`: `update_weights` from the checkpoint's tensors as host (numpy) arrays;
- `update_device_hf`: from the same tensors already on the device, by HF name;
- `update_device_own`: from a pytree of the params' own structure on the device (a JAX
  trainer's), each leaf taken as it is;
- `sleep_1` / `wake_1`, `sleep_2` / `wake_2_weights` / `wake_2_kv_cache`: sleep mode.
Each update runs twice and the second is reported (the first traces the array ops).

`--by-layer` (taken by itself on a CPU when the weights pass a third of the host's memory,
as dummy:llama3-8b's 16 GB do on a 24 GB machine): the updates go one layer's tensors a
call, as a trainer streaming its weights would, and the figure is their sum; the own
pytree is the params themselves; `new_llm` is built after the first engine shut down,
and `sleep_1` is left out (on a CPU the host copy and the weights share one memory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
# A model near the host's memory, by layer on a CPU: the smallest step and cache (the warm-up runs one).
BIG_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16],
                  num_gpu_blocks_override=64)


def write_checkpoint(model: str, out: Path, dtype: str = "bfloat16", seed: int = 0) -> list[Path]:
    """The model's config and tokenizer with random weights in HF's names: one safetensors
    file per layer (and one for the rest), written one at a time, with HF's index file.
    Returns the files, the rest's first."""
    with resolve_model(model) as source:
        shutil.copytree(source.path, out)
    cfg = load_config(out)
    # (values tiled from one random block: the figures depend on sizes only, and tiling is fast)
    block = (np.random.default_rng(seed).standard_normal(1 << 20, np.float32) * 0.02).astype(jnp.dtype(dtype))
    files: dict[str, list[tuple[str, tuple]]] = {}
    for name, places in weight_index(MODELS[cfg.architecture].param_specs(cfg)).items():
        if places[0].fused:
            continue  # (transformers 5's own name of a tensor written under its usual one)
        row = places[0].row
        files.setdefault("rest" if row is None else f"layer-{row:03d}", []).append((name, places[0].hf_shape))
    weight_map = {}
    for key in sorted(files):
        save_file({name: np.resize(block, shape) for name, shape in files[key]}, str(out / f"{key}.safetensors"))
        weight_map.update({name: f"{key}.safetensors" for name, _ in files[key]})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config))
    return [out / f"{key}.safetensors" for key in sorted(files, key=lambda k: k != "rest")]


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def update_time(llm: LLM, parts: list, by_layer: bool) -> float:
    """Seconds of `update_weights` with `parts` (loaders of each file's tensors): all in one
    call, or a call a part (summed; loading is not timed). The first call, untimed, traces."""
    if not by_layer:
        weights = {name: a for load in parts for name, a in load().items()}
        llm.update_weights(weights)
        return timed(lambda: (llm.update_weights(weights), llm.get_params())[1])
    llm.update_weights(parts[-1]())
    total = 0.0
    for load in parts:
        weights = load()
        total += timed(lambda: (llm.update_weights(weights), llm.get_params())[1])
        del weights
    return total


def too_big_for_host(model: str) -> bool:
    """Whether the model's weights pass a third of the host's memory, on a CPU (where they are in it)."""
    if jax.default_backend() != "cpu":
        return False
    with resolve_model(model) as source:
        cfg = load_config(source.path)
    params = sum(math.prod(places[0].hf_shape) for places in
                 weight_index(MODELS[cfg.architecture].param_specs(cfg)).values() if not places[0].fused)
    return params * 2 > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 3


def measure(model: str, by_layer: bool) -> dict:
    engine = dict(ENGINE, **(BIG_ENGINE if by_layer else {}))
    with tempfile.TemporaryDirectory() as folder:
        files = write_checkpoint(model, Path(folder) / "ckpt")
        path = files[0].parent
        llm = LLM(str(path), **engine)
        figures = {"weight_bytes": sum(llm.stats()["weight_bytes_per_device"]), "by_layer": by_layer}
        if not by_layer:
            second = time.perf_counter()
            LLM(str(path), **engine).shutdown()
            figures["new_llm"] = time.perf_counter() - second
        host = [lambda f=f: load_file(str(f)) for f in files]
        device = [lambda f=f: {name: jnp.asarray(a) for name, a in load_file(str(f)).items()} for f in files]
        figures["update_host"] = update_time(llm, host, by_layer)
        figures["update_device_hf"] = update_time(llm, device, by_layer)
        own = llm.get_params() if by_layer else jax.tree.map(lambda x: x + 0, llm.get_params())
        llm.update_weights(own)
        figures["update_device_own"] = timed(lambda: (llm.update_weights(own), llm.get_params())[1])
        del own
        if not by_layer:
            figures["sleep_1"] = timed(lambda: llm.sleep(1))
            figures["wake_1"] = timed(lambda: (llm.wake_up(), llm.get_params())[1])
        figures["sleep_2"] = timed(lambda: llm.sleep(2))
        figures["wake_2_weights"] = timed(lambda: (llm.wake_up(["weights"]), llm.get_params())[1])
        figures["wake_2_kv_cache"] = timed(lambda: (llm.wake_up(["kv_cache"]), llm.llm_engine.runner.kv_caches)[1])
        llm.shutdown()
        if by_layer:
            second = time.perf_counter()
            LLM(str(path), **engine).shutdown()
            figures["new_llm"] = time.perf_counter() - second
    figures["update_host_vs_new_llm"] = figures["update_host"] / figures["new_llm"]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    parser.add_argument("--by-layer", action="store_true",
                        help="update one layer a call (taken by itself on a CPU for weights past a third of its memory)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    report = {"benchmark": "weight_update", "platform": jax.default_backend(), "models": {}}
    for model in args.model:
        by_layer = args.by_layer or too_big_for_host(model)
        figures = report["models"][model] = measure(model, by_layer)
        sleep_1 = (f"sleep(1) {figures['sleep_1']:.3f} s, wake_up {figures['wake_1']:.3f} s; "
                   if "sleep_1" in figures else "")
        print(f"{model}: {figures['weight_bytes'] / 2**30:.2f} GiB of weights; new LLM {figures['new_llm']:.2f} s; "
              f"update_weights{' one layer a call, summed' if by_layer else ''}: from host "
              f"{figures['update_host']:.3f} s ({figures['update_host_vs_new_llm']:.3f}x the new LLM), from device "
              f"arrays by HF name {figures['update_device_hf']:.3f} s, the params' own pytree "
              f"{figures['update_device_own']:.4f} s; {sleep_1}sleep(2) {figures['sleep_2']:.3f} s, wake weights "
              f"{figures['wake_2_weights']:.3f} s, KV cache {figures['wake_2_kv_cache']:.3f} s")
    write_report(args.json, report, None)
    return report


if __name__ == "__main__":
    main()
