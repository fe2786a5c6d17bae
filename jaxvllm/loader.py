"""Load a local HF checkpoint (config.json + safetensors) into a params pytree of jax arrays."""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jaxvllm.config import EngineConfig, ModelConfig
from jaxvllm.models import MODELS

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX_FILE = "model.safetensors.index.json"


def missing_model_message(model: str) -> str:
    """Why `model` cannot be loaded: jaxvllm never downloads, so name the fix."""
    from jaxvllm.dummy import DUMMY_MODELS, PREFIX

    message = (
        f"model directory {model!r} does not exist (jaxvllm loads local checkpoints only and never downloads; "
        f"built-in random models: {', '.join(PREFIX + n for n in DUMMY_MODELS)})"
    )
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        message += (
            f"; {model!r} looks like a Hugging Face Hub id: download it first "
            f"(`huggingface-cli download {model} --local-dir DIR`) and pass DIR"
        )
    return message


def resolve_model_dir(config: EngineConfig) -> tuple[EngineConfig, tempfile.TemporaryDirectory | None]:
    """The engine's model as a folder: a path is checked to exist (FileNotFoundError);
    `dummy:NAME` is written (config.json + tokenizer) into a temporary folder, returned
    with it so that the caller keeps it alive, with load_format "dummy" and the dummy
    model's engine defaults for the arguments left at EngineConfig's defaults."""
    from jaxvllm.dummy import get_dummy, is_dummy, write_dummy_model

    if not is_dummy(config.model):
        if not Path(config.model).is_dir():
            raise FileNotFoundError(missing_model_message(config.model))
        return config, None
    spec = get_dummy(config.model)  # ValueError naming the built-in ones
    if config.load_format not in ("auto", "dummy"):
        raise ValueError(f"{config.model} has no weights to load: it needs load_format 'dummy', got {config.load_format!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    overrides = {k: v for k, v in spec.engine_defaults.items() if getattr(config, k) == defaults[k]}
    tmp = tempfile.TemporaryDirectory(prefix="jaxvllm-dummy-")
    try:
        folder = write_dummy_model(config.model, tmp.name)
        return dataclasses.replace(config, model=str(folder), load_format="dummy", **overrides), tmp
    except BaseException:
        tmp.cleanup()
        raise


def load_config(model: str | Path) -> ModelConfig:
    """Read `config.json` with transformers' AutoConfig; never touches the network."""
    from transformers import AutoConfig

    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(missing_model_message(str(path)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}")
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad or unknown config
        raise ValueError(f"cannot read {path / 'config.json'}: {e}") from e
    return ModelConfig.from_hf(hf_config)


def resolve_dtype(dtype: str, cfg: ModelConfig):
    name = cfg.dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose from 'auto', {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    model: str | Path,
    *,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[ModelConfig, dict]:
    """Return (config, params) with params in `dtype` ("auto" = the checkpoint's dtype).

    load_format "dummy" builds random weights from config.json alone, for benchmarks.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose from {LOAD_FORMATS}")
    cfg = load_config(model)
    jdtype = resolve_dtype(dtype, cfg)
    if load_format == "dummy":
        return cfg, dummy_params(cfg, jdtype, seed)
    return cfg, load_safetensors(Path(model), cfg, jdtype)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to its file, from the index (sharded) or the files' headers."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {file.name}, which is missing from {path}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    files = {}
    for file in shards:
        with _open(file) as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="flax")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read safetensors file {file}: {e}") from e


def load_safetensors(path: Path, cfg: ModelConfig, dtype) -> dict:
    specs = MODELS[cfg.architecture].param_specs(cfg)
    files = _tensor_files(path)
    missing = [s.hf_name for s in specs if s.hf_name not in files]
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    by_file: dict[Path, list] = {}
    for spec in specs:
        by_file.setdefault(files[spec.hf_name], []).append(spec)
    params: dict = {}
    bar = tqdm(total=len(specs), desc="Loading safetensors", dynamic_ncols=True)
    for file, file_specs in by_file.items():
        with _open(file) as f:
            for spec in file_specs:
                try:
                    shape = tuple(f.get_slice(spec.hf_name).get_shape())
                    if shape != spec.hf_shape:
                        raise ValueError(
                            f"tensor {spec.hf_name} in {file.name} has shape {shape}, config.json implies {spec.hf_shape}"
                        )
                    array = f.get_tensor(spec.hf_name)
                except SafetensorError as e:
                    raise ValueError(f"cannot read tensor {spec.hf_name} from {file}: {e}") from e
                _put(params, spec.path, jnp.asarray(array, dtype).reshape(spec.shape))
                bar.update(1)
    bar.close()
    unused = set(files) - {s.hf_name for s in specs} - {"lm_head.weight"}
    if unused:
        logger.warning("ignoring %d tensor(s) not used by %s: %s", len(unused), cfg.architecture, sorted(unused)[:5])
    return params


def dummy_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Random weights of the right shapes (normal with the config's initializer_range)."""
    key = jax.random.key(seed)
    params: dict = {}
    specs = MODELS[cfg.architecture].param_specs(cfg)
    for i, spec in enumerate(tqdm(specs, desc="Initializing dummy weights", dynamic_ncols=True)):
        if spec.init == "normal":
            value = jax.random.normal(jax.random.fold_in(key, i), spec.shape, dtype) * cfg.initializer_range
        else:
            value = (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype)
        _put(params, spec.path, value.astype(dtype))
    return params


def _put(params: dict, path: tuple, value) -> None:
    """Set params[path] where int path parts index the list of layers."""
    node = params
    for part, nxt in zip(path[:-1], path[1:]):
        if isinstance(part, str):
            default = [] if isinstance(nxt, int) else {}
            node = node.setdefault(part, default)
        else:  # a layer index: layers are appended in order
            while len(node) <= part:
                node.append({})
            node = node[part]
    node[path[-1]] = value
