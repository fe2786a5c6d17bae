"""Built-in model configs (`--model dummy:NAME`) and the small tokenizer they use.

A benchmark or a first try of the command line should not need a checkpoint: a
dummy model is a folder with only `config.json` and a tokenizer, which
`LLM(folder, load_format="dummy")` fills with random weights and HF transformers
builds with `from_config`. The tokenizer is a byte-level BPE trained on the spot
from a built-in corpus (any text encodes; ids past its vocabulary decode to
nothing), so nothing is ever downloaded. `weights/make_tiny.py` uses it too.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxvllm.config import EngineConfig

PREFIX = "dummy:"

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join while others are decoding.",
    "JAX compiles one executable per input shape, so the runner pads to buckets.",
    "Once upon a time there was a small language model that lived on a CPU.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Ünïcödé text, emoji 🙂 and CJK 漢字 must also round-trip through bytes.",
]


# A ChatML-style template over the tokenizer's own specials, so that `llm.chat` runs on dummy models.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def make_tokenizer(path: str | Path, vocab_size: int = 384, chat_template: str | None = None):
    """Train a byte-level BPE on a built-in corpus and save it as a HF fast tokenizer.

    Special tokens: <pad> = 0, <s> = 1, </s> = 2 (the tiny configs use these ids).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


# -- built-in configs -------------------------------------------------------------------


def _tiny():
    from transformers import Qwen3Config

    # The size of the test checkpoints (weights/make_tiny.py "qwen3"): runs on any CPU.
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32",
    )


def _qwen3_0_6b():
    from transformers import Qwen3Config

    # Qwen/Qwen3-0.6B's config.json: the model of the B1 (nano-vllm) benchmark.
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
    )


def _llama3_8b():
    from transformers import LlamaConfig

    # meta-llama/Meta-Llama-3-8B's config.json.
    return LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
    )


def _tiny_moe():
    from transformers import Qwen3MoeConfig

    # dummy:tiny with Qwen3-MoE's sparse MLPs: 8 experts of 32, top 2. Runs on any CPU.
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32",
    )


def _qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    # Qwen/Qwen3-30B-A3B's config.json: 30.5B parameters, 3.3B active (8 of 128 experts).
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, max_window_layers=48,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
    )


@dataclass(frozen=True)
class DummyModel:
    """A named HF config; `make_config` builds it (transformers is imported only then).

    engine_defaults: `LLM(...)` arguments that fit the model's size better than the
    engine's defaults (the command line applies them under the user's own flags).
    """

    name: str
    description: str
    make_config: Callable[[], Any]
    engine_defaults: dict[str, Any] = field(default_factory=dict)


DUMMY_MODELS: dict[str, DummyModel] = {
    m.name: m
    for m in (
        # A CPU compiles and runs every token bucket at start-up: fewer, smaller ones.
        DummyModel("tiny", "Qwen3, hidden 64, 2 layers, vocab 512: CPU-sized", _tiny,
                   {"max_num_seqs": 64, "max_num_batched_tokens": 256}),
        DummyModel("qwen3-0.6b", "Qwen3-0.6B architecture, bf16 (the B1 benchmark model)", _qwen3_0_6b,
                   {"max_model_len": 4096}),  # B1's, rather than 40960
        DummyModel("llama3-8b", "Llama-3-8B architecture, bf16", _llama3_8b),
        DummyModel("tiny-moe", "Qwen3-MoE, hidden 64, 2 layers, 8 experts (top 2), vocab 512: CPU-sized", _tiny_moe,
                   {"max_num_seqs": 64, "max_num_batched_tokens": 256}),
        DummyModel("qwen3-30b-a3b", "Qwen3-30B-A3B architecture (MoE, 128 experts, 8 active), bf16", _qwen3_30b_a3b,
                   {"max_model_len": 4096}),
    )
}


# Derived, so that the help texts and the errors name every built-in model, however many there are.
DUMMY_NAMES = ", ".join(PREFIX + name for name in DUMMY_MODELS)
MODEL_HELP = f"checkpoint folder, or a built-in model with random weights: {DUMMY_NAMES}"


def is_dummy(model: str) -> bool:
    return str(model).startswith(PREFIX)


def get_dummy(model: str) -> DummyModel:
    """`dummy:NAME` (or NAME) -> its DummyModel; ValueError names the choices."""
    name = str(model).removeprefix(PREFIX)
    if name not in DUMMY_MODELS:
        raise ValueError(f"unknown dummy model {model!r}; built-in: {DUMMY_NAMES}")
    return DUMMY_MODELS[name]


def write_dummy_model(model: str, folder: str | Path) -> Path:
    """Write config.json and the small tokenizer of `dummy:NAME` into `folder`; return it.

    `LLM(folder, load_format="dummy")` then runs it with random weights.
    """
    spec = get_dummy(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec.make_config().save_pretrained(str(folder))
    make_tokenizer(folder, chat_template=CHAT_TEMPLATE)
    return folder


def missing_model_message(model: str) -> str:
    """Why `model` cannot be loaded: jaxvllm never downloads, so name the fix."""
    message = (
        f"model directory {model!r} does not exist (jaxvllm loads local checkpoints only and never downloads; "
        f"built-in random models: {DUMMY_NAMES})"
    )
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        message += (
            f"; {model!r} looks like a Hugging Face Hub id: download it first "
            f"(`huggingface-cli download {model} --local-dir DIR`) and pass DIR"
        )
    return message


@dataclass(frozen=True)
class ModelSource:
    """Where a model argument lives: a folder, and whether its weights are random. A
    dummy model's folder is temporary: it lives until `close()` (or the `with` block ends)."""

    name: str  # what the user gave: a path or dummy:NAME
    path: str  # a folder with config.json and a tokenizer
    dummy: bool
    folder: tempfile.TemporaryDirectory | None = field(default=None, repr=False, compare=False)

    @property
    def load_format(self) -> str | None:
        """What `LLM(..., load_format=)` needs; None: keep the engine's default."""
        return "dummy" if self.dummy else None

    def engine_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`LLM(...)` keyword args for this model: for a dummy model, its CPU-sized engine
        defaults under `kwargs` and load_format "dummy" (another is refused)."""
        if not self.dummy:
            return dict(kwargs)
        merged = {**get_dummy(self.name).engine_defaults, **kwargs}
        given = merged.get("load_format", "dummy")
        if given not in ("auto", "dummy"):
            raise ValueError(f"{self.name} has no weights to load: it needs load_format 'dummy', got {given!r}")
        return {**merged, "load_format": "dummy"}

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """`config` on this folder; for a dummy model, with its engine defaults for the
        arguments `config` left at EngineConfig's defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        names = set(get_dummy(self.name).engine_defaults) | {"load_format"} if self.dummy else set()
        given = {k: getattr(config, k) for k in names if getattr(config, k) != defaults[k]}
        return dataclasses.replace(config, model=self.path, **self.engine_kwargs(given))

    def close(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()

    def __enter__(self) -> "ModelSource":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def resolve_model(model: str) -> ModelSource:
    """A model argument as a folder: a path is checked to exist (FileNotFoundError, naming
    the fix); `dummy:NAME` is written (config.json + tokenizer) into a temporary folder
    (ValueError for an unknown name). The one place `dummy:NAME` is resolved."""
    if not is_dummy(model):
        if not Path(model).is_dir():
            raise FileNotFoundError(missing_model_message(model))
        return ModelSource(model, str(model), dummy=False)
    get_dummy(model)  # fail before making a folder
    folder = tempfile.TemporaryDirectory(prefix="jaxvllm-dummy-")
    try:
        return ModelSource(model, str(write_dummy_model(model, folder.name)), dummy=True, folder=folder)
    except BaseException:
        folder.cleanup()
        raise
