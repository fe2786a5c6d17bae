"""Model configuration: what the engine needs from a HF `config.json`, as a hashable dataclass.

The dataclass is frozen and made of plain values so that it can be a static argument of
`jax.jit`: one compiled step per (config, shape bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxvllm.sampling_params import DEFAULT_MAX_LOGPROBS

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

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (1 but for YaRN: 0.1 * ln(factor) + 1 by default)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv_freq = (1.0 / (self.theta**exponents)).astype(np.float32)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim, exponents)
        if self.rope_type == "linear":
            return inv_freq / np.float32(self.factor)
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv_freq

    def _yarn_inv_freq(self, head_dim: int, exponents: np.ndarray) -> np.ndarray:
        """HF's YaRN blend: dimensions rotating more than `beta_fast` times over the original
        context keep their frequency, those below `beta_slow` are divided by `factor`, a
        linear ramp in between (float32 throughout, as torch computes it)."""
        pos_freqs = (np.float32(self.theta) ** exponents).astype(np.float32)
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as HF: no zero-width ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation_factor = (np.float32(1.0) - ramp).astype(np.float32)
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


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
    # Gemma 3 (jaxvllm/models/gemma3.py): the MLP's activation; the softmax scale is
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); tanh soft-capping of the
    # attention scores and of the final logits (None: none); the RoPE of the sliding-window
    # layers when it differs from `rope` (Gemma 3's local base), None: `rope` everywhere.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope: RopeConfig | None = None

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

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
        act = getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None) or "silu"
        acts = _GEMMA3_ACTIVATIONS if arch == "Gemma3ForCausalLM" else ("silu",)
        if act not in acts:
            raise ValueError(f"{arch}: hidden_act {act!r} is not supported (only {', '.join(map(repr, acts))})")
        num_heads = hf.num_attention_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
        attention_bias = bool(getattr(hf, "attention_bias", False))
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
            # Qwen2 always has q/k/v bias and no o bias; Llama and Qwen3 follow `attention_bias`.
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_windows=_sliding_windows_from_hf(hf, arch),
            dtype=str(dtype).removeprefix("torch."),
            initializer_range=getattr(hf, "initializer_range", 0.02),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            **_moe_from_hf(hf, arch),
            **_gemma3_from_hf(hf, arch, act),
        )


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
    params = dict(top.get(layer_type) or {}) if "sliding_attention" in top or "full_attention" in top else top
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
        "original_max_position_embeddings": params.get(
            "original_max_position_embeddings", hf.max_position_embeddings
        ),
    }
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type, **fields)


def _sliding_windows_from_hf(hf: Any, arch: str) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return (window,) * n  # every layer (Qwen3-MoE's config drops it without `use_sliding_window`)
    # Qwen2/Qwen3 say per layer which layers slide (transformers sets `layer_types`).
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM") and window is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")  # "auto" is llguidance


@dataclass
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config` engine argument: the backend, and JSON defaults
    every request gets (a request's own flags add to them)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r} is not available in jaxvllm; "
                             f"choose from {STRUCTURED_OUTPUTS_BACKENDS} ('auto' is llguidance)")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config {name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` takes; the names and defaults of vLLM's engine arguments."""

    model: str
    tokenizer: str | None = None  # default: the model's folder
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    max_model_len: int | None = None  # default: the config's max_position_embeddings
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # Schedule and dispatch step N+1 before reading step N's tokens (vLLM's async scheduling).
    async_scheduling: bool = True
    attention_backend: str = "auto"
    token_buckets: list[int] | None = field(default=None)
    # vLLM's flag: no tokenizer; prompts are token ids only, outputs carry no text.
    skip_tokenizer_init: bool = False
    # "auto": the fast (Rust) tokenizer when the folder has one; "slow": the Python one.
    tokenizer_mode: str = "auto"
    # Skip the warm-up: each shape compiles the first time a step needs it.
    enforce_eager: bool = False
    # Devices the model is split over (jaxvllm/sharding.py); the others are refused for now.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Engine replicas (`LLM` spreads requests over them), each on tensor_parallel_size devices
    # of its own; an `LLMEngine` is replica `data_parallel_rank`.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # vLLM's enable_expert_parallel: a mixture of experts' layers hold E / tensor_parallel_size
    # whole experts per device instead of a slice of every expert (jaxvllm/sharding.py);
    # attention stays split by heads. Nothing changes on one device or for a dense model.
    enable_expert_parallel: bool = False
    # The name `get_metrics()` labels metrics with (default: the model argument; of a list,
    # the first), as vLLM's.
    served_model_name: str | list[str] | None = None
    # "auto": the KV cache has the model's dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with
    # k/v scales per layer and KV head (the checkpoint's, else 1.0), half the bytes of a 16-bit cache;
    # "fp8_e5m2": float8_e5m2 likewise (2 mantissa bits for e4m3's 3, a range of +-57344).
    kv_cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: an fp8 cache's scales from the first batch written (its
    # largest |K| / 200 and |V| / 100 per layer and KV head) instead of the checkpoint's or 1.0. As in
    # vLLM, it changes nothing with a cache in the model's dtype.
    calculate_kv_scales: bool = False
    # Features jaxvllm lacks, accepted at their "off" value only: a clear error otherwise.
    quantization: str | None = None
    enable_lora: bool = False
    # The most logprobs a request may ask for (-1: the whole vocabulary), as vLLM's.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # What Logprob.logprob holds: vLLM's "raw_logprobs" (of the model's logits),
    # "raw_logits", "processed_logprobs" or "processed_logits" (of the logits the sampler
    # drew from: after bias, bad words, penalties, temperature, min_p/top-k/top-p).
    logprobs_mode: str = "raw_logprobs"
    # Where generate(prompts) with no sampling params takes its defaults from: "auto" (the
    # model's generation_config.json), "vllm" (SamplingParams()'s) or another folder.
    generation_config: str = "auto"
    # vLLM's names that mean nothing here, accepted so that vLLM scripts run unchanged:
    # no stats are logged periodically; only built-in architectures run, never remote code;
    # preemption recomputes instead of swapping to CPU; local folders have no revisions;
    # XLA compiles one executable per shape bucket (`token_buckets` is the knob).
    disable_log_stats: bool = False
    trust_remote_code: bool = False
    swap_space: float = 4.0
    revision: str | None = None
    compilation_config: Any = None
    # vLLM's structured outputs settings: a StructuredOutputsConfig or a dict of its fields.
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    download_dir: str | None = None  # nothing is ever downloaded
    max_seq_len_to_capture: int | None = None  # no CUDA graphs: one executable per token bucket

    def __post_init__(self) -> None:
        """Check every argument's type and range here, so that `LLM(...)` and the command
        line refuse bad values (naming the argument and the value) before loading anything."""
        from jaxvllm.layers import ATTENTION_BACKENDS, KV_CACHE_DTYPES
        from jaxvllm.loader import DTYPES, LOAD_FORMATS
        from jaxvllm.sampler import LOGPROBS_MODES
        from jaxvllm.scheduler import POLICIES

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a path or None, got {self.tokenizer!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_gpu_blocks_override"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), " (or None)")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float, np.floating, np.integer)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= -1 (-1: the whole vocabulary), got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size!r}: jaxvllm splits a model over "
                             "devices by tensor parallelism (tensor_parallel_size)")
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {self.data_parallel_size!r}")
        if not _is_int(self.data_parallel_rank) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank!r}")
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        if names is not None and (not isinstance(names, list) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"served_model_name must be a name, a list of names or None, got {self.served_model_name!r}")
        so = self.structured_outputs_config
        if so is None or isinstance(so, dict):
            try:
                self.structured_outputs_config = StructuredOutputsConfig(**(so or {}))
            except TypeError as e:
                raise ValueError(f"structured_outputs_config {so!r}: {e}") from e
        elif not isinstance(so, StructuredOutputsConfig):
            raise ValueError(f"structured_outputs_config must be a StructuredOutputsConfig or a dict, got {so!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose from "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        for name, off in (("quantization", None), ("enable_lora", False)):
            if getattr(self, name) != off:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by jaxvllm (only {off!r})")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling", "skip_tokenizer_init",
                     "enforce_eager", "disable_log_stats", "trust_remote_code", "calculate_kv_scales",
                     "enable_expert_parallel"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose from 'auto', {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not supported; choose from {LOAD_FORMATS}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is not available; choose from 'auto', {ATTENTION_BACKENDS}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that a full decode batch fits in one step"
            )
        if self.token_buckets is not None:
            buckets = self.token_buckets
            if (
                not isinstance(buckets, (list, tuple))
                or not buckets
                or not all(_is_int(b) and b > 0 for b in buckets)
            ):
                raise ValueError(f"token_buckets must be a non-empty list of positive ints (or None), got {buckets!r}")
            self.token_buckets = [int(b) for b in buckets]
            if max(self.token_buckets) < self.max_num_batched_tokens:
                raise ValueError(
                    f"the largest token bucket ({max(self.token_buckets)}) is below max_num_batched_tokens "
                    f"({self.max_num_batched_tokens})"
                )


# vLLM's dtype names for ours.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_positive_int(name: str, value: Any, extra: str = "") -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int{extra}, got {value!r}")
