"""What the engine needs from a HF `config.json`: `ModelConfig`, parsed from transformers'
`PretrainedConfig`, refusing what the models cannot run.

The dataclasses are frozen and made of plain values so that a config can be a static
argument of `jax.jit`: one compiled step per (config, shape bucket). The RoPE math over
`RopeConfig` lives with the other layer math, in `jaxvllm/layers.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxvllm.config import EngineConfig

# Every architecture here is a Llama-family decoder; they differ only in the flags below.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",  # Qwen3 with mixture-of-experts MLPs (jaxvllm/models/moe.py)
    "MixtralForCausalLM",  # Mistral with mixture-of-experts MLPs
    "Gemma3ForCausalLM",  # Gemma 3 text (its own decoder: jaxvllm/models/gemma3.py)
)

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# How merged projections (`ModelConfig.merge_projections`) join their parts: q, k, v into
# [kv_heads, group + 2, ...], each KV head's query heads then its k and v; or gate, up
# into [2, ...] (`models.common.merge_parts`).
KV_GROUPS, SIDE_BY_SIDE = "kv_groups", "side_by_side"

@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters`, or `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (HF's `_compute_yarn_parameters`): the ramp between interpolated and extrapolated
    # frequencies, and the cos/sin scale (`attention_factor`; None: from factor and mscale).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: None = full causal attention, W = attend to the last W positions only.
    sliding_windows: tuple[int | None, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype, used by dtype="auto"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral): per layer, True where the MLP is the sparse
    # block of `num_experts` experts (each of `moe_intermediate_size`), `num_experts_per_tok`
    # of them per token; () or False: the dense MLP of `intermediate_size`.
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    # How a tensor-parallel run splits the stacked experts (set by `sharding.sharded_config`):
    # False: every expert by its intermediate dimension; True: whole experts, E / N per device.
    expert_parallel: bool = False
    # A quantized checkpoint's `quantization_config.quant_method` (None: full precision).
    quant_method: str | None = None
    # Each kind of layer weight one array over the layers (`models.common.stack_layers`),
    # else one array per layer: set by `loader.load_model` for its devices (a GPU stacks;
    # XLA:CPU copies each layer's slice out of a stack, every step).
    stack_layers: bool = True
    # q/k/v as one weight and gate/up as another (`models.common.attention_specs`), each one
    # matmul: set by `loader.load_model` where layers are not stacked (XLA:CPU), which also
    # stores each layer matrix inputs first there (`layers.InputMajorWeight`). XLA's GPU
    # backend merges those matmuls itself, and copies the slices of a merged one out.
    merge_projections: bool = False
    # The KV cache's element type when the cache is stored as unsigned ints of that width
    # (`kv_cache.with_cache_storage`: a 16-bit or fp8 cache on a CPU); None: stored as itself.
    kv_cache_bits: str | None = None
    # Gemma 3 (jaxvllm/models/gemma3.py): the MLP's activation; the softmax scale is
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); tanh soft-capping of the
    # attention scores and of the final logits (None: none); the RoPE of the sliding-window
    # layers when it differs from `rope` (Gemma 3's local base), None: `rope` everywhere.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope: RopeConfig | None = None
    # The longest sequence the engine running this model takes (vLLM's
    # `llm_engine.model_config.max_model_len`): set by the model runner; None as read.
    max_model_len: int | None = None

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def max_model_len_limit(self) -> int:
        """The longest sequence the model takes, as vLLM derives it: max_position_embeddings,
        but a RoPE scaled by `factor` reaches that many times further (YaRN's from its
        original_max_position_embeddings); Llama 3's scaling, and Gemma 3's, do not extend it."""
        rope = self.rope
        if self.architecture == "Gemma3ForCausalLM" or rope.rope_type not in ("linear", "yarn"):
            return self.max_position_embeddings
        base = rope.original_max_position_embeddings if rope.rope_type == "yarn" else self.max_position_embeddings
        return int(base * rope.factor)

    def checked_max_model_len(self, requested: int | None) -> int:
        """The engine's max_model_len: `requested`, if the model takes it, else the model's limit."""
        limit = self.max_model_len_limit
        if requested is not None and requested > limit:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's max_position_embeddings ({limit}"
                + (f": {self.max_position_embeddings} extended by its RoPE scaling)"
                   if limit != self.max_position_embeddings else ")")
            )
        return requested or limit

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def rope_of_layer(self, i: int) -> RopeConfig:
        sliding = bool(self.sliding_windows) and self.sliding_windows[i] is not None
        return self.sliding_rope if sliding and self.sliding_rope is not None else self.rope

    @property
    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        # A sparse layer holds every expert and the router in place of the dense MLP.
        moe = self.num_experts * (3 * d * self.moe_intermediate_size + d) - 3 * d * f
        return self.vocab_size * d + self.num_layers * layer + sum(self.moe_layers) * moe + d + head

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: of each sparse layer, its `num_experts_per_tok` experts."""
        inactive = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params - sum(self.moe_layers) * inactive

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig`; refuse what the models cannot run."""
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none in config.json)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # (Gemma 3's MLP reads `hidden_activation`; a Gemma 1/2-style config may also hold `hidden_act`)
        names = ("hidden_activation", "hidden_act") if arch == "Gemma3ForCausalLM" else ("hidden_act",)
        name, act = next(((name, getattr(hf, name)) for name in names if getattr(hf, name, None)), ("", "silu"))
        acts = _GEMMA3_ACTIVATIONS if arch == "Gemma3ForCausalLM" else ("silu",)
        if act not in acts:
            raise ValueError(f"{arch}: {name} {act!r} is not supported (only {', '.join(map(repr, acts))})")
        num_heads = hf.num_attention_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
        # The bias flags that HF's modeling code of the architecture reads (Mistral's and Mixtral's none).
        attention_bias = arch in _ATTENTION_BIAS_ARCHITECTURES and bool(getattr(hf, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope=_rope_from_hf(hf, arch),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_windows=_sliding_windows_from_hf(hf, arch),
            dtype=str(dtype).removeprefix("torch."),
            initializer_range=getattr(hf, "initializer_range", 0.02),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            quant_method=_quant_method(hf),
            **_moe_from_hf(hf, arch),
            **_gemma3_from_hf(hf, arch, act),
        )


_ATTENTION_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")


def _quant_method(hf: Any) -> str | None:
    quant = getattr(hf, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method))  # (transformers may hold an enum)


def _moe_from_hf(hf: Any, arch: str) -> dict:
    """The MoE fields: Mixtral's layers are all sparse (experts of `intermediate_size`, top-k
    weights always renormalized); Qwen3-MoE's layer i is sparse unless i is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, as HF's."""
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return {}
    n = hf.num_hidden_layers
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
    if arch == "MixtralForCausalLM":
        return dict(moe_layers=(True,) * n, num_experts=num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    layers = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return dict(moe_layers=layers, num_experts=num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob))


_GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _gemma3_from_hf(hf: Any, arch: str, act: str) -> dict:
    """Gemma 3's fields: its activation, softmax scale, soft-capping and the RoPE of its
    sliding layers (`rope_parameters` per layer type in transformers 5)."""
    if arch != "Gemma3ForCausalLM":
        return {}
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention is not supported (causal attention only)")
    nested = "sliding_attention" in (getattr(hf, "rope_parameters", None) or {})
    return dict(
        hidden_act=act,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        sliding_rope=_rope_from_hf(hf, arch, "sliding_attention") if nested else None,
    )


def _rope_from_hf(hf: Any, arch: str, layer_type: str = "full_attention") -> RopeConfig:
    # transformers 5 folds theta and scaling into `rope_parameters`; 4.x has them apart.
    # Models with per-layer-type RoPE (Gemma 3) nest one dict per layer type.
    top = dict(getattr(hf, "rope_parameters", None) or {})
    nested = "sliding_attention" in top or "full_attention" in top
    params = dict(top.get(layer_type) or {}) if nested else top
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{arch}: rope type {rope_type!r} is not supported (supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor != 1 is not supported")
    original = params.get("original_max_position_embeddings", hf.max_position_embeddings)
    if not nested and rope_type in ("llama3", "yarn") and getattr(hf, "original_max_position_embeddings", None):
        # HF's `standardize_rope_params`: a top-level value wins over rope_parameters' (Phi-3 saves it there)
        original = hf.original_max_position_embeddings
    if rope_type == "yarn":
        return RopeConfig(
            theta=float(params["rope_theta"]),
            rope_type=rope_type,
            # HF: no factor means max_position_embeddings / original_max_position_embeddings.
            factor=float(params.get("factor") or hf.max_position_embeddings / original),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            # HF reads `truncate` from the top-level dict, also for per-layer-type RoPE.
            truncate=bool(top.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
        )
    fields = {
        "factor": params.get("factor", 1.0),
        "low_freq_factor": params.get("low_freq_factor", 1.0),
        "high_freq_factor": params.get("high_freq_factor", 4.0),
        "original_max_position_embeddings": original,
    }
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type, **fields)


def _sliding_windows_from_hf(hf: Any, arch: str) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM") or (arch == "MistralForCausalLM" and not layer_types):
        return (window,) * n  # every layer (Qwen3-MoE's config drops it without `use_sliding_window`)
    # Qwen2, Qwen3, Gemma 3 and Ministral (a Mistral config with `layer_types`, which transformers
    # reads as Ministral's) say per layer which layers slide.
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM") and window is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types or ["full_attention"] * n)
    return (None,) * n


# generation_config.json's sampling fields that vLLM takes as the default sampling params, by
# their SamplingParams names.
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


# transformers 4's GenerationConfig defaults, which vLLM 0.11 (on transformers 4) leaves out of
# a model's generation config as unchanged: an explicit "top_k": 50 does not sample top-50
# there. (transformers 5's defaults are None, so its to_diff_dict keeps them.)
_TRANSFORMERS4_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def read_generation_config(config: EngineConfig) -> dict[str, Any]:
    """The fields of the model's generation_config.json that differ from transformers'
    defaults, as vLLM reads them: from the model's folder unless `generation_config` names
    another ("vllm" still reads the model's, for its EOS ids). Without the file, the
    sampling fields and end ids config.json holds (vLLM's `GenerationConfig.from_model_config`);
    {} without either in the model's folder, an error in a folder `generation_config` names
    (as vLLM's: a mistyped path, or the file's own, is not silently left unread)."""
    from transformers import GenerationConfig

    source = config.generation_config
    folder = config.model if source in ("auto", "vllm") else source
    try:
        fields = GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    except OSError:
        try:
            model_config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            if folder == config.model:
                return {}
            raise ValueError(f"generation_config={source!r} is not a folder holding generation_config.json or "
                             f"config.json") from None
        fields = {key: model_config[key] for key in (*_GENERATION_DEFAULTS, "eos_token_id")
                  if model_config.get(key) is not None}
    except ValueError as e:  # (transformers' checks of its values)
        raise ValueError(f"{folder}/generation_config.json (generation_config={source!r}) is not valid: {e}") from e
    return {key: value for key, value in fields.items()
            if key not in _TRANSFORMERS4_DEFAULTS or value != _TRANSFORMERS4_DEFAULTS[key]}


def default_sampling_fields(config: EngineConfig, generation_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's default SamplingParams fields (`get_diff_sampling_param`): the generation
    config's sampling settings, none when `generation_config` is "vllm", and
    `override_generation_config` over either."""
    given = {} if config.generation_config == "vllm" else dict(generation_config)
    given.update(config.override_generation_config or {})
    return {ours: given[hf] for hf, ours in _GENERATION_DEFAULTS.items() if given.get(hf) is not None}
