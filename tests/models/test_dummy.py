"""Built-in dummy models: their configs, their folders, and how engine flags layer over them."""

import argparse
import json
from pathlib import Path

import pytest

from jaxvllm.dummy import DUMMY_MODELS, ModelSource, get_dummy, resolve_model, write_dummy_model
from jaxvllm.engine_args import add_engine_args, engine_kwargs
from jaxvllm.loader import load_config


@pytest.mark.parametrize("name, arch, billions", [
    ("qwen3-0.6b", "Qwen3ForCausalLM", 0.60),  # 0.44 B without the tied 151936 x 1024 embedding
    ("llama3-8b", "LlamaForCausalLM", 8.03),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.53),  # all 128 experts; 3.35 B active
])
def test_real_architectures(tmp_path, name, arch, billions):
    path = write_dummy_model(f"dummy:{name}", tmp_path / name)
    cfg = load_config(path)
    assert cfg.architecture == arch and cfg.dtype == "bfloat16"
    assert abs(cfg.num_params / 1e9 - billions) < 0.01, cfg.num_params
    assert not list(path.glob("*.safetensors"))  # random weights come from load_format="dummy"
    assert (path / "tokenizer.json").is_file()


def test_qwen3_0_6b_is_the_b1_model(tmp_path):
    cfg = load_config(write_dummy_model("dummy:qwen3-0.6b", tmp_path))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        1024, 28, 16, 8, 128, 151936)
    assert cfg.intermediate_size == 3072 and cfg.tie_word_embeddings and cfg.max_position_embeddings == 40960


def test_llama3_8b_config(tmp_path):
    cfg = load_config(write_dummy_model("dummy:llama3-8b", tmp_path))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        4096, 32, 32, 8, 14336)
    assert cfg.vocab_size == 128256 and cfg.rope.theta == 500000.0 and cfg.max_position_embeddings == 8192
    assert not cfg.tie_word_embeddings


def test_tiny_is_test_sized_and_cleaned_up():
    from transformers import AutoTokenizer

    with resolve_model("dummy:tiny") as source:
        assert source.dummy and source.load_format == "dummy"
        folder = Path(source.path)
        cfg = load_config(folder)
        raw = json.loads((folder / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.max_position_embeddings) == (64, 2, 512, 2048)
    assert len(tokenizer) <= cfg.vocab_size and tokenizer.decode(tokenizer("Hi there").input_ids) == "Hi there"
    assert not folder.exists()  # the temporary folder is gone


def test_unknown_dummy_and_missing_folder():
    with pytest.raises(ValueError, match="dummy:tiny"):
        get_dummy("dummy:nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        with resolve_model("/no/such/folder"):
            pass


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_engine_kwargs_layering():
    tiny = ModelSource("dummy:tiny", "/unused", dummy=True)
    defaults = DUMMY_MODELS["tiny"].engine_defaults
    assert engine_kwargs(_args(), tiny) == {**defaults, "load_format": "dummy"}
    # the user's flags over a command's defaults over the dummy model's defaults
    kwargs = engine_kwargs(_args("--max-num-seqs", "4", "--no-enable-prefix-caching"), tiny,
                           max_model_len=100, max_num_seqs=99)
    assert kwargs["max_num_seqs"] == 4 and kwargs["max_model_len"] == 100
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["max_num_batched_tokens"] == defaults["max_num_batched_tokens"]
    # a checkpoint folder gets only what was set: the engine's own defaults stay the defaults
    real = ModelSource("/some/model", "/some/model", dummy=False)
    assert engine_kwargs(_args("--dtype", "bfloat16"), real) == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="load_format"):
        engine_kwargs(_args("--load-format", "safetensors"), tiny)
