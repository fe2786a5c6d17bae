"""The engine's arguments (`EngineConfig`, vLLM's names and defaults), the values each
may take, and the checks that refuse a bad one by name before anything is loaded.

A leaf: it imports nothing from the rest of jaxvllm, so validating a config imports
neither jax nor the kernels. The modules that act on a setting (layers, loader,
sampler, scheduler) import its allowed names from here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

# The allowed values of the engine's arguments, in the order the error messages list them.
ATTENTION_BACKENDS = ("reference", "pallas")  # "auto" picks one (jaxvllm/model_runner.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # "auto": the model's dtype
DTYPES = ("float32", "bfloat16", "float16")  # and "auto": the checkpoint's
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# `quantization=`: a full-precision checkpoint's linear weights quantized at load: vLLM's
# online fp8, or 4-bit as a symmetric GPTQ checkpoint holds them (random 4-bit weights at real
# shapes with load_format="dummy", for benchmarks; rounded to nearest, not GPTQ's solver).
QUANTIZATION_METHODS = ("fp8", "gptq-dummy")  # online: the weights quantized as they load
# A quantized checkpoint's quant_method -> the names `quantization` may give it (vLLM's:
# marlin is vLLM's kernel for GPTQ and AWQ); the checkpoint is then read as it is.
CHECKPOINT_QUANTIZATIONS = {"fp8": ("fp8",), "gptq": ("gptq", "gptq_marlin", "marlin"),
                            "awq": ("awq", "awq_marlin", "marlin"), "compressed-tensors": ("compressed-tensors",)}
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's logprobs modes: of the model's logits, or of those the sampler drew from (after
# bias, bad words, penalties, temperature, min_p / top-k / top-p); logprobs or logits.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
POLICIES = ("fcfs", "priority")
# vLLM's prefix-cache hash names (jaxvllm's one hash serves both: see `EngineConfig`).
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor")
TOKENIZER_MODES = ("auto", "slow")
# vLLM's default `max_logprobs` engine argument: the most logprobs a request may ask for
# (up to this many, the top-k arrays on device have this fixed width).
DEFAULT_MAX_LOGPROBS = 20
# Where compiled steps are cached between runs (see `EngineConfig.compilation_cache_dir`).
DEFAULT_COMPILATION_CACHE = "~/.cache/jaxvllm/jax"
COMPILATION_CACHE_ENV = "JAXVLLM_COMPILATION_CACHE_DIR"
# max_num_batched_tokens left to the engine (None), by platform, as vLLM's CPU backend takes
# smaller steps: a CPU computes every padded token of a step, and compiles a bucket per
# power of two up to this at start-up.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 2048

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")  # "auto" is llguidance
_OTHER_STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")  # vLLM's others


@dataclass
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config` engine argument: the backend, and JSON defaults
    every request gets (a request's own flags add to them)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # vLLM 0.11's: no other backend to fall back to here; no reasoning parsers (only ""), so
    # enable_in_reasoning changes nothing.
    disable_fallback: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r} is not available in jaxvllm; "
                             f"choose from {STRUCTURED_OUTPUTS_BACKENDS} ('auto' is llguidance)")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback",
                     "enable_in_reasoning"):
            check_bool(f"structured_outputs_config {name}", getattr(self, name))
        if self.reasoning_parser != "":
            raise ValueError(f"structured_outputs_config reasoning_parser={self.reasoning_parser!r}: reasoning parsers "
                             "are not available in jaxvllm")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")  # vLLM's others are refused by name
_LATER_SPECULATIVE_METHODS = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp",
                              "mimo_mtp", "longcat_flash_mtp", "glm4_moe_mtp")
MODEL_SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3")  # (the ones with a model to load)
# vLLM's prompt lookup window when the config names neither end.
DEFAULT_PROMPT_LOOKUP = 5


def _inferred_method(model: Any) -> str:
    """vLLM's rule for a speculative_config without a method: by the draft's name (its EAGLE
    heads ship as "EAGLE-..." and "...eagle3..."), else a draft model."""
    name = str(model).lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    return "eagle" if "eagle-" in name else "eagle3" if "eagle3" in name else "draft_model"


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` engine argument (a dict of these fields, or this).

    "ngram" (vLLM's prompt lookup): the longest suffix n-gram of a request's tokens, for
    prompt_lookup_min <= n <= prompt_lookup_max, that occurs earlier proposes the
    `num_speculative_tokens` tokens that followed its first occurrence. With one end of
    the window given, the other is the same; with neither, both are 5 (vLLM's defaults).
    "draft_model" (inferred, as vLLM does, when only `model` is given): that smaller model,
    with the target's vocabulary, drafts the tokens greedily. "eagle" / "eagle3": an EAGLE
    head (its folder as `model`) drafts them from the target's hidden states."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    # No drafts in a step while more requests than this run (drafts pay in small batches).
    disable_by_batch_size: int | None = None
    # vLLM's: a drafter's longest sequence, at most the engine's: no drafts whose positions
    # reach it (the n-gram proposer ignores it, as vLLM's).
    max_model_len: int | None = None
    # vLLM 0.11's other fields, which change nothing here: logprobs are as SamplingParams ask
    # (disable_logprobs), a drafter is compiled like the target (enforce_eager), its batch
    # is padded whatever disable_padded_drafter_batch says, and local folders have no
    # revisions. A quantized draft and a token tree are refused when given.
    disable_logprobs: bool = True
    enforce_eager: bool | None = None
    disable_padded_drafter_batch: bool = False
    revision: str | None = None
    code_revision: str | None = None
    quantization: str | None = None
    speculative_token_tree: str | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method ('ngram') or a draft model")
            method = _inferred_method(self.model)
        if method == "[ngram]":
            method = "ngram"
        if method in _LATER_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported by jaxvllm yet; "
                             f"choose from {SPECULATIVE_METHODS}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative_config method {method!r}; choose from {SPECULATIVE_METHODS}")
        self.method = method
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (the tokens proposed per step)")
        self.num_speculative_tokens = check_int("num_speculative_tokens", self.num_speculative_tokens, low=1)
        if self.max_model_len is not None:
            self.max_model_len = check_int("speculative_config max_model_len", self.max_model_len, low=1)
        if self.quantization is not None:
            raise ValueError(f"speculative_config quantization={self.quantization!r}: a quantized draft is not "
                             "supported by jaxvllm (a draft checkpoint's own quantization_config is read)")
        if self.speculative_token_tree is not None:
            raise ValueError("speculative_config speculative_token_tree: tree drafts are not supported by jaxvllm")
        if self.disable_by_batch_size is not None and (not is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 2):
            raise ValueError("Expect the batch size threshold of disabling speculative decoding is > 1, but got "
                             f"disable_by_batch_size={self.disable_by_batch_size!r}")  # (vLLM's message)
        if method in MODEL_SPECULATIVE_METHODS:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config method {method!r} needs the draft's folder as model, "
                                 f"got {self.model!r}")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be > 0")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = int(lo), int(hi)

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """The engine argument as given: None, a dict of the fields, or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported key(s) {unknown}")
        return cls(**value)


# Arguments that vLLM's EngineArgs type Optional, None meaning its default: None means ours.
_NONE_MEANS_DEFAULT = ("seed", "block_size", "enable_prefix_caching", "enable_chunked_prefill", "async_scheduling")
DEFAULT_MAX_NUM_SEQS = 256


# What the processes of one engine under jax.distributed may set each its own way: where
# each finds its files and writes its caches and logs, and its memory budget (the KV cache
# takes the least room any process has). The other arguments decide the collective steps.
_PER_PROCESS_FIELDS = frozenset({
    "model", "tokenizer", "download_dir", "compilation_cache_dir", "hf_token", "allowed_local_media_path",
    "served_model_name", "disable_log_stats", "profiler_config", "max_parallel_loading_workers", "revision",
    "tokenizer_revision", "code_revision", "gpu_memory_utilization", "swap_space", "cpu_offload_gb",
    "safetensors_load_strategy", "ignore_patterns", "pt_load_map_location", "model_loader_extra_config",
})


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
    # vLLM's: the KV cache's bytes on each device, instead of sizing it from
    # gpu_memory_utilization (nothing is profiled then); num_gpu_blocks_override wins over it.
    kv_cache_memory_bytes: int | None = None
    # None: 256, or max_num_batched_tokens if smaller, as vLLM's (chosen with it, `for_platform`).
    max_num_seqs: int | None = None
    # None: chosen for the platform (`for_platform`): 8192, or 2048 on a CPU; at least
    # max_model_len without chunked prefill.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's: a request's chunk at most this many tokens (0: no cap), so that long prompts
    # take several steps and the requests decoding beside them keep going.
    long_prefill_token_threshold: int = 0
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
    # vLLM's sleep mode: `LLM.sleep(level)` frees the KV cache (and, level 1, moves the
    # weights to host memory; level 2, drops them) until `wake_up`.
    enable_sleep_mode: bool = False
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
    # vLLM's multi-LoRA serving (`jaxvllm.lora`): `max_loras` adapters on the device at once
    # (at most that many distinct ones in a step), each zero-padded to `max_lora_rank`;
    # `max_cpu_loras` (None: max_loras) kept read on the host; `lora_dtype` "auto": the model's.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # vLLM's, which change nothing here: how adapters split over devices (fully_sharded_loras:
    # outputs are the same either way), room for adapters' added tokens (embedding adapters
    # are refused), and multimodal default adapters (None only).
    fully_sharded_loras: bool = False
    lora_extra_vocab_size: int = 256
    default_mm_loras: dict | None = None
    # The most logprobs a request may ask for (-1: the whole vocabulary), as vLLM's.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # What Logprob.logprob holds: vLLM's "raw_logprobs" (of the model's logits),
    # "raw_logits", "processed_logprobs" or "processed_logits" (of the logits the sampler
    # drew from: after bias, bad words, penalties, temperature, min_p/top-k/top-p).
    logprobs_mode: str = "raw_logprobs"
    # Where generate(prompts) with no sampling params takes its defaults from: "auto" (the
    # model's generation_config.json), "vllm" (SamplingParams()'s) or another folder.
    generation_config: str = "auto"
    # vLLM's: fields (HF's names: temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens) over the generation config's; with generation_config="vllm" the only ones.
    override_generation_config: dict[str, Any] | None = None
    # vLLM's: fields set on the model's HF config before it is read (e.g. {"num_hidden_layers":
    # 2}; a dict value updates a nested config), or a function from config to config.
    hf_overrides: dict[str, Any] | Callable | None = None
    # vLLM's deprecated spellings of hf_overrides={"rope_scaling": ...} / {"rope_theta": ...}:
    # moved there, with vLLM's warning.
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float | None = None
    # vLLM's: no stats line logged every 10 s of steps (`metrics.StatLogger`; `LLM` sets it
    # by default, as vLLM's). get_metrics() counts whatever it says.
    disable_log_stats: bool = False
    # vLLM's names that mean nothing here, accepted so that vLLM scripts run unchanged:
    # only built-in architectures run, never remote code;
    # preemption recomputes instead of swapping to CPU; local folders have no revisions;
    # XLA compiles one executable per shape bucket (`token_buckets` is the knob).
    trust_remote_code: bool = False
    swap_space: float = 4.0
    revision: str | None = None
    tokenizer_revision: str | None = None
    code_revision: str | None = None
    max_parallel_loading_workers: int | None = None  # the safetensors files are read one after another
    compilation_config: Any = None
    # vLLM's model runner kind: jaxvllm runs generative models only ("auto" or "generate").
    runner: str = "auto"
    # vLLM's multi-modal settings, which a text model ignores (jaxvllm's models are all text);
    # vLLM's kernels' and executors' settings: one process drives every device here.
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    disable_chunked_mm_input: bool = False
    disable_custom_all_reduce: bool = False
    distributed_executor_backend: str | None = None
    allowed_local_media_path: str = ""
    hf_token: str | bool | None = None  # (nothing is downloaded)
    # vLLM features jaxvllm lacks, accepted off only: prompt embeddings, weights offloaded to CPU,
    # a model converted to a pooling one, V1 logits processors classes.
    enable_prompt_embeds: bool = False
    cpu_offload_gb: float = 0
    # vLLM 0.11's concurrent partial prefills: its V1 engine refuses any value but 1, as here.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # vLLM's prefix-cache hash: both of its choices are accepted. jaxvllm's block hash is
    # already sha256 over a fixed byte encoding of the ids (the same in every process), which
    # is what "sha256_cbor" adds over "sha256"; no other name is accepted.
    prefix_caching_hash_algo: str = "sha256"
    convert: str = "auto"
    pooler_config: Any = None
    logits_processors: list | None = None
    # vLLM's arguments for what jaxvllm has no use for, or lacks: accepted at their values that
    # change nothing (`_check_vllm_only`). task: vLLM 0.11's deprecated runner choice.
    task: str | None = None
    model_impl: str = "auto"
    kv_transfer_config: Any = None
    disable_sliding_window: bool = False
    enable_lora_bias: bool = False
    reasoning_parser: str = ""
    worker_extension_cls: str = ""
    # vLLM 0.11's deprecated names of structured_outputs_config's fields (None: as it says).
    guided_decoding_backend: str | None = None
    guided_decoding_disable_fallback: bool | None = None
    guided_decoding_disable_any_whitespace: bool | None = None
    guided_decoding_disable_additional_properties: bool | None = None
    use_tqdm_on_load: bool = True  # the loader's progress bar
    # vLLM's structured outputs settings: a StructuredOutputsConfig or a dict of its fields.
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    download_dir: str | None = None  # nothing is ever downloaded
    max_seq_len_to_capture: int | None = None  # no CUDA graphs: one executable per token bucket
    # The persistent JAX compilation cache, so that a second start skips compiling (JAX's cache
    # is process-wide: the first engine sets it, and a `jax_compilation_cache_dir` the user
    # set wins). None: $JAXVLLM_COMPILATION_CACHE_DIR if set, else ~/.cache/jaxvllm/jax;
    # "": no cache.
    compilation_cache_dir: str | None = None
    # vLLM's speculative decoding: a SpeculativeConfig or a dict of its fields (None: off).
    speculative_config: SpeculativeConfig | dict | None = None
    # vLLM's profiler settings, for LLM.start_profile / stop_profile: here {"profiler": "jax",
    # "jax_profiler_dir": FOLDER} (jax.profiler traces: TensorBoard's or Perfetto's viewer).
    profiler_config: dict | None = None
    # The rest of vLLM 0.11's engine arguments, with its defaults. These take any value, as
    # nothing here reads them: vLLM's GPU tuning (cascade attention, CUDA graph sizes,
    # dual-batch overlap, expert load balancing and placement, lookahead slots, its hybrid KV
    # cache manager), multimodal settings (a text model has no use for them), how weight files
    # are read or downloaded, hidden metrics, platform plugins' extras and its API servers' count.
    disable_cascade_attn: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=list)
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    enable_eplb: bool = False
    eplb_config: Any = None
    num_redundant_experts: int = 0
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    eplb_log_balancedness: bool = False
    expert_placement_strategy: str = "linear"
    num_lookahead_slots: int = 0
    disable_hybrid_kv_cache_manager: bool = False
    kv_sharing_fast_prefill: bool = False
    ray_workers_use_nsight: bool = False
    interleave_mm_strings: bool = False
    media_io_kwargs: dict = field(default_factory=dict)
    disable_mm_preprocessor_cache: bool = False
    mm_processor_cache_gb: float = 4
    mm_processor_cache_type: str = "lru"
    mm_shm_cache_max_object_size_mb: int = 128
    mm_encoder_tp_mode: str = "weights"
    skip_mm_profiling: bool = False
    video_pruning_rate: float | None = None
    enable_multimodal_encoder_data_parallel: bool = False
    allowed_media_domains: list[str] | None = None
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    safetensors_load_strategy: str = "lazy"
    ignore_patterns: str | list[str] | None = None  # (vLLM's apply to downloads only)
    pt_load_map_location: str | dict = "cpu"
    model_loader_extra_config: dict = field(default_factory=dict)  # vLLM's keys for load_format "auto" only
    logits_processor_pattern: str | None = None
    show_hidden_metrics_for_version: str | None = None
    additional_config: dict = field(default_factory=dict)
    _api_process_count: int = 1
    _api_process_rank: int = 0
    # vLLM 0.11's arguments for what jaxvllm lacks: accepted at their defaults only
    # (`_check_vllm_only` refuses the others by name).
    hf_config_path: str | None = None
    config_format: str = "auto"
    decode_context_parallel_size: int = 1
    data_parallel_start_rank: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_hybrid_lb: bool = False
    data_parallel_backend: str = "mp"
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: list[str] | None = None
    scheduler_cls: Any = "vllm.core.scheduler.Scheduler"
    worker_cls: str = "auto"
    kv_events_config: Any = None
    override_attention_dtype: str | None = None
    override_pooler_config: Any = None
    io_processor_plugin: str | None = None

    def __post_init__(self) -> None:
        """Check every argument's type and range here, so that `LLM(...)` and the command
        line refuse bad values (naming the argument and the value) before loading anything."""
        for f in dataclasses.fields(self):  # (vLLM's EngineArgs leave these None for "the default")
            if f.name in _NONE_MEANS_DEFAULT and getattr(self, f.name) is None:
                setattr(self, f.name, f.default)
        self.dtype = _dtype_name(self.dtype)
        self._check_names()
        self._check_sizes()
        self._check_parallelism()
        self._check_choices()
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling", "skip_tokenizer_init",
                     "enforce_eager", "disable_log_stats", "trust_remote_code", "calculate_kv_scales",
                     "enable_sleep_mode", "enable_expert_parallel"):
            check_bool(name, getattr(self, name))
        names = dict.fromkeys(QUANTIZATION_METHODS + sum(CHECKPOINT_QUANTIZATIONS.values(), ()))
        if self.quantization is not None and self.quantization not in names:
            raise ValueError(f"quantization={self.quantization!r} is not supported by jaxvllm; choose from None, "
                             + ", ".join(map(repr, names)) + " (those but 'gptq-dummy' name a quantized checkpoint's "
                             "own method, as its config.json does; 'fp8' and 'gptq-dummy' quantize at load)")
        self._check_profiler()
        self._check_vllm_only()
        check_bool("enable_lora", self.enable_lora)
        self._check_lora()
        so = self.structured_outputs_config
        if so is None or isinstance(so, dict):
            try:
                self.structured_outputs_config = StructuredOutputsConfig(**(so or {}))
            except TypeError as e:
                raise ValueError(f"structured_outputs_config {so!r}: {e}") from e
        elif not isinstance(so, StructuredOutputsConfig):
            raise ValueError(f"structured_outputs_config must be a StructuredOutputsConfig or a dict, got {so!r}")
        deprecated = {name: getattr(self, f"guided_decoding_{name}") for name in
                      ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")}
        if deprecated["backend"] in _OTHER_STRUCTURED_OUTPUTS_BACKENDS:
            # (vLLM 0.11 sets it where nothing reads it: scripts that pass it run on "auto" there)
            logger.warning("guided_decoding_backend=%r is not available in jaxvllm; llguidance ('guidance') "
                           "is used", deprecated["backend"])
            deprecated["backend"] = None
        # (vLLM 0.11 copies them onto attributes nothing reads; here they do what their names say)
        if given := {name: value for name, value in deprecated.items() if value is not None}:
            self.structured_outputs_config = dataclasses.replace(self.structured_outputs_config, **given)
        self.speculative_config = spec = SpeculativeConfig.of(self.speculative_config)
        if spec is not None and spec.method in MODEL_SPECULATIVE_METHODS and spec.draft_tensor_parallel_size not in (
                None, self.tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size={spec.draft_tensor_parallel_size!r}: the draft model is split "
                             f"as the target is (tensor_parallel_size={self.tensor_parallel_size})")
        if spec is not None and spec.method not in MODEL_SPECULATIVE_METHODS and self.async_scheduling:
            # The n-gram proposer reads each step's accepted tokens on the host before it
            # drafts the next step (docs/design.md, "Speculative decoding"); a draft model
            # and an EAGLE head draft on the device.
            logger.info("speculative decoding with %s: steps run synchronously (async_scheduling=False)", spec.method)
            self.async_scheduling = False

    def shared_fields(self) -> dict[str, str]:
        """The arguments every process of a multi-host engine must give alike, each as text
        that compares across processes (a function by its name, not its address; the draft
        model's folder left out, as the model's is)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PER_PROCESS_FIELDS}
        if fields["generation_config"] not in ("auto", "vllm"):  # (a folder: its file is compared as read)
            fields["generation_config"] = "a folder"
        return {name: _portable(value) for name, value in fields.items()}

    def for_platform(self, platform: str, max_model_len: int | None = None) -> "EngineConfig":
        """This config with the arguments left to the platform chosen for `platform` (JAX's
        backend name: "cpu", "gpu", "tpu"): max_num_batched_tokens, smaller on a CPU and at
        least max_num_seqs, so that a full decode batch fits in one step (with token_buckets
        given: the largest bucket). Without chunked prefill a whole prompt of up to
        `max_model_len` (the resolved one) must fit one step, as in vLLM."""
        unchunked = not self.enable_chunked_prefill and max_model_len is not None
        tokens = self.max_num_batched_tokens
        if tokens is None and self.token_buckets:
            tokens = max(self.token_buckets)
        if tokens is None:
            default = CPU_MAX_NUM_BATCHED_TOKENS if platform == "cpu" else DEFAULT_MAX_NUM_BATCHED_TOKENS
            tokens = max(default, self.max_num_seqs or 0, max_model_len if unchunked else 0)
        elif unchunked and tokens < max_model_len:  # (vLLM's words)
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) is smaller than max_model_len ({max_model_len}). This "
                "effectively limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject "
                "longer sequences. Please increase max_num_batched_tokens or decrease max_model_len.")
        seqs = min(DEFAULT_MAX_NUM_SEQS, tokens) if self.max_num_seqs is None else self.max_num_seqs
        return dataclasses.replace(self, max_num_batched_tokens=tokens, max_num_seqs=seqs)

    def _check_lora(self) -> None:
        """The LoRA arguments, as vLLM reads them: only with enable_lora (they are ignored
        otherwise), max_cpu_loras of 0 or less meaning max_loras, lora_dtype a name or a
        torch dtype."""
        if self.default_mm_loras:
            raise ValueError("default_mm_loras: multimodal models are not supported by jaxvllm")
        if not self.enable_lora:
            return
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_bool("fully_sharded_loras", self.fully_sharded_loras)
        if self.max_cpu_loras is None or (is_int(self.max_cpu_loras) and self.max_cpu_loras <= 0):
            self.max_cpu_loras = self.max_loras
        if type(self.lora_dtype).__module__ == "torch":  # (vLLM takes a torch.dtype too)
            self.lora_dtype = str(self.lora_dtype).removeprefix("torch.")
        if (not isinstance(self.max_cpu_loras, int) or isinstance(self.max_cpu_loras, bool)
                or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an int >= max_loras ({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype={self.lora_dtype!r}; choose from {LORA_DTYPES}")

    def _check_vllm_only(self) -> None:
        """vLLM's arguments for what jaxvllm lacks or has no use for: their values that mean
        nothing here pass, the others are refused by name."""
        if self.enable_prompt_embeds is not False:
            raise ValueError("enable_prompt_embeds=True: prompt embeddings are not supported by jaxvllm")
        if self.cpu_offload_gb not in (0, 0.0, None):
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb!r}: offloading weights to CPU memory is not "
                             "supported by jaxvllm (0 only)")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray", "external_launcher"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}: choose from None, "
                             "'uni', 'mp', 'ray', 'external_launcher' (one process drives every device either way)")
        if self.convert not in ("auto", "none") or self.pooler_config is not None:
            raise ValueError(f"convert={self.convert!r} / pooler_config={self.pooler_config!r}: pooling and embedding "
                             "models are not supported by jaxvllm")
        if self.logits_processors:
            raise ValueError("logits_processors: vLLM's V1 logits processor classes are not supported by jaxvllm "
                             "(SamplingParams' logit_bias, allowed_token_ids, bad_words and structured outputs are)")
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            if getattr(self, name) != 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: concurrent partial prefills are not supported "
                                 "(1 only, as vLLM's V1 engine)")
        if self.enable_prefix_caching and self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"Unknown prefix caching hash algorithm: {self.prefix_caching_hash_algo}. Must be one "
                             f"of {PREFIX_CACHING_HASH_ALGOS}.")
        if self.task not in (None, "auto", "generate"):
            raise ValueError(f"task={self.task!r}: jaxvllm runs generative models only ('auto' or 'generate')")
        if self.model_impl not in ("auto", "vllm"):
            raise ValueError(f"model_impl={self.model_impl!r}: jaxvllm runs its own models ('auto' or 'vllm')")
        multi_node_dp = "vLLM's multi-node data parallelism (jax.distributed is jaxvllm's)"
        refused = {"kv_transfer_config": "KV transfer (disaggregated prefill)", "disable_sliding_window":
                   "turning sliding windows off", "enable_lora_bias": "LoRA bias adapters", "reasoning_parser":
                   "reasoning parsers", "worker_extension_cls": "worker extensions (collective_rpc takes the "
                   "engine's own methods)", "hf_config_path": "a config.json from another folder than the model's",
                   "decode_context_parallel_size": "decode context parallelism", "data_parallel_start_rank":
                   multi_node_dp, "data_parallel_address": multi_node_dp, "data_parallel_rpc_port": multi_node_dp,
                   "data_parallel_hybrid_lb": "vLLM's hybrid data-parallel load balancing", "otlp_traces_endpoint":
                   "OpenTelemetry tracing", "collect_detailed_traces": "OpenTelemetry tracing", "worker_cls":
                   "other worker classes", "kv_events_config": "KV cache events", "override_attention_dtype":
                   "another attention dtype than the model's", "override_pooler_config": "pooling models",
                   "io_processor_plugin": "IO processor plugins"}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}

        def off(name: str) -> bool:
            """None, False, "" and the default (of its type: not 0 for 1) mean "off" for each."""
            value, default = getattr(self, name), defaults[name]
            if name == "hf_config_path" and value:  # (the model's own folder is no other)
                return os.path.realpath(value) == os.path.realpath(self.model)
            return value is None or value is False or value == "" or (type(value) is type(default) and value == default)

        for name, what in refused.items():
            if not off(name):
                raise ValueError(f"{name}={getattr(self, name)!r}: {what} not supported by jaxvllm")
        if self.data_parallel_size_local not in (None, self.data_parallel_size):
            raise ValueError(f"data_parallel_size_local={self.data_parallel_size_local!r}: {multi_node_dp} is not "
                             "supported by jaxvllm")
        if self.data_parallel_backend not in ("mp", "ray"):  # (vLLM's words)
            raise ValueError(f"data_parallel_backend can only be ray or mp, got {self.data_parallel_backend}")
        if self.config_format not in ("auto", "hf"):
            raise ValueError(f"config_format={self.config_format!r}: jaxvllm reads HF configs only ('auto' or 'hf')")
        if self.scheduler_cls not in ("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler"):
            raise ValueError(f"scheduler_cls={self.scheduler_cls!r}: scheduler classes other than vLLM's own are not "
                             "supported by jaxvllm")
        extra = self.model_loader_extra_config
        unexpected = set(extra) - {"enable_multithread_load", "num_threads"} if isinstance(extra, dict) else extra
        if unexpected:  # (vLLM's words, for its default loader)
            raise ValueError(f"Unexpected extra config keys for load format {self.load_format}: {unexpected}")
        check_bool("use_tqdm_on_load", self.use_tqdm_on_load)
        if self.runner not in ("auto", "generate"):
            raise ValueError(f"runner={self.runner!r}: jaxvllm runs generative models only ('auto' or 'generate'); "
                             "pooling and embedding models are not supported")

    def _check_profiler(self) -> None:
        given = self.profiler_config
        if given is None:
            return
        if isinstance(given, dict) and given.get("profiler", "jax") != "jax":
            raise ValueError(f"profiler_config profiler={given['profiler']!r}: jaxvllm's is 'jax' (jax.profiler "
                             "traces); torch's, CUDA's and proton's are not available")
        if not isinstance(given, dict) or set(given) - {"profiler", "jax_profiler_dir"}:
            raise ValueError(f'profiler_config must be {{"profiler": "jax", "jax_profiler_dir": FOLDER}}, got {given!r}')
        folder = given.get("jax_profiler_dir")
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"profiler_config needs jax_profiler_dir, the folder for the traces, got {folder!r}")

    def _check_names(self) -> None:
        """Paths and names."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a path or None, got {self.tokenizer!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if not (self.hf_overrides is None or isinstance(self.hf_overrides, dict) or callable(self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a dict of config fields or a function, got {self.hf_overrides!r}")
        for name in ("rope_scaling", "rope_theta"):
            value = getattr(self, name)
            if value is None or value == {}:
                continue
            if name == "rope_scaling" and not isinstance(value, dict):
                raise ValueError(f"rope_scaling must be a dict of RoPE scaling fields, got {value!r}")
            if callable(self.hf_overrides):
                raise ValueError(f"{name} with a function as hf_overrides: set {name} in the function")
            self.hf_overrides = {**(self.hf_overrides or {}), name: value}
            setattr(self, name, None)
            warnings.warn(f"`--{name.replace('_', '-')}` will be removed in a future release. Please instead use "
                          f"`--hf-overrides '{json.dumps(self.hf_overrides)}'` (as in vLLM 0.11)", DeprecationWarning,
                          stacklevel=4)
        overrides = self.override_generation_config
        if overrides is not None and (not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides)):
            raise ValueError(f"override_generation_config must be a dict of generation config fields, got {overrides!r}")
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        if names is not None and (not isinstance(names, list) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"served_model_name must be a name, a list of names or None, got {self.served_model_name!r}")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"compilation_cache_dir must be a folder, '' (no cache) or None, "
                             f"got {self.compilation_cache_dir!r}")

    def _check_sizes(self) -> None:
        """Counts, lengths and the memory share; the token buckets."""
        _check_positive_int("block_size", self.block_size)
        for name in ("max_model_len", "max_num_seqs", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                     "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), " (or None)")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float, np.floating, np.integer)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if not is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= -1 (-1: the whole vocabulary), got {self.max_logprobs!r}")
        if None not in (self.max_num_batched_tokens, self.max_num_seqs) and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that a full decode batch fits in one step"
            )
        t = self.long_prefill_token_threshold
        if not is_int(t) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0: no cap), got {t!r}")
        if self.token_buckets is None:
            return
        buckets = self.token_buckets
        if not isinstance(buckets, (list, tuple)) or not buckets or not all(is_int(b) and b > 0 for b in buckets):
            raise ValueError(f"token_buckets must be a non-empty list of positive ints (or None), got {buckets!r}")
        self.token_buckets = [int(b) for b in buckets]
        if self.max_num_batched_tokens is not None and max(self.token_buckets) < self.max_num_batched_tokens:
            raise ValueError(
                f"the largest token bucket ({max(self.token_buckets)}) is below max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )

    def _check_parallelism(self) -> None:
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size!r}: jaxvllm splits a model over "
                             "devices by tensor parallelism (tensor_parallel_size)")
        if not is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {self.data_parallel_size!r}")
        if not is_int(self.data_parallel_rank) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank!r}")

    def _check_choices(self) -> None:
        """Arguments that name one of a few values."""
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose from "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
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

    @property
    def compilation_cache(self) -> str | None:
        """The compilation cache folder this config asks for (None: none)."""
        folder = self.compilation_cache_dir
        if folder is None:
            folder = os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE)
        return os.path.expanduser(folder) if folder else None


# vLLM's dtype names for ours.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype_name(dtype: Any) -> Any:
    """As vLLM: a dtype's name in any case, an alias, or a torch dtype (torch.bfloat16);
    anything else is left for the check to refuse."""
    name = str(dtype)
    if not isinstance(dtype, str) and not name.startswith("torch."):
        return dtype
    name = name.removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(name, name)
# Sampling floats go to device as float32: a larger magnitude would become inf there.
_FLOAT32_MAX = 3.4028234663852886e38
# vLLM's messages for its range checks ({} is the value).
_RANGE_MESSAGES = {
    "n": "n must be at least 1, got {}.",
    "temperature": "temperature must be non-negative, got {}.",
    "top_k": "top_k must be 0 (disable), or at least 1, got {}.",
    "repetition_penalty": "repetition_penalty must be greater than zero, got {}.",
    "max_tokens": "max_tokens must be at least 1, got {}.",
    "min_tokens": "min_tokens must be greater than or equal to 0, got {}.",
}


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (a Python or numpy scalar, not a bool) within range, as a Python int."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    check_range(name, value, low=low, high=high)
    return value


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> float:
    """A finite real number (a Python or numpy scalar, not a bool) within range, as a Python float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # a Python int too large for a float
        number = math.inf
    shown = value if isinstance(value, int) else number  # numpy scalars shown as plain floats
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {shown!r}")
    if abs(number) > _FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number within float32 range, got {shown!r}")
    check_range(name, number, low=low, high=high, low_open=low_open)
    return number


def check_range(name: str, value: float, *, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    below = value <= low if low_open else value < low if low is not None else False
    if below or (high is not None and value > high):
        if name in _RANGE_MESSAGES:
            raise ValueError(_RANGE_MESSAGES[name].format(value))
        bound = lambda x: f"{x:g}" if isinstance(x, float) else f"{x}"  # noqa: E731  (2.0 -> "2", as vLLM)
        lo = "-inf" if low is None else bound(low)
        hi = "inf" if high is None else bound(high)
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{lo}, {hi}], got {value!r}.")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_positive_int(name: str, value: Any, extra: str = "") -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int{extra}, got {value!r}")


def _portable(value: Any) -> str:
    """`value` as text that is the same in every process given the same value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, SpeculativeConfig):
            for name in ("model", "revision", "code_revision"):  # (each process may keep the draft elsewhere)
                fields.pop(name)
        return type(value).__name__ + _portable(fields)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_portable(k)}: {_portable(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_portable, value)) + "]"
    if callable(value) or " at 0x" in repr(value):  # (functions, classes, objects shown by address)
        named = value if hasattr(value, "__qualname__") else type(value)
        return f"{named.__module__}.{named.__qualname__}"
    return repr(value)
