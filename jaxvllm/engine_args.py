"""Engine flags of the command line (vLLM's names) and their mapping onto `LLM(...)` keyword args.

Every flag defaults to None and only the flags a user sets are passed on, so that
`EngineConfig`'s defaults stay the single source of defaults. A built-in dummy model
may bring CPU-sized defaults of its own, under the user's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from typing import Any

from jaxvllm.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from jaxvllm.dummy import MODEL_HELP, ModelSource


def json_object(text: str) -> dict[str, Any]:
    """argparse type of a flag whose value is a JSON object (vLLM's --speculative-config):
    a usage error naming what is wrong, before any model loads."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def human_readable_int(value: str) -> int:
    """vLLM's sizes: `1k` = 1000, `1K` = 1024 (k, m, g decimal; K, M, G binary), or a plain int."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", value.strip())
    if not match:
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: no decimals with a binary suffix ({suffix}); did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMG".index(suffix) + 1)


# flag name -> (type, help); the keyword argument is the flag with '_' for '-'.
_VALUE_FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "dtype": (str, "weights and KV cache dtype ('auto' = the checkpoint's)"),
    "quantization": (str, "'fp8': the linear weights quantized to fp8 at load (per channel) and activations per "
                          "token on the fly, as vLLM's online fp8; 'gptq-dummy': to 4-bit per group of 128 "
                          "(round to nearest; random 4-bit weights with --load-format dummy); a quantized "
                          "checkpoint's own method ('gptq', 'awq', 'compressed-tensors', 'fp8') reads it as it is, "
                          "as leaving this unset does"),
    "kv-cache-dtype": (str, "KV cache dtype: 'auto' (the model's dtype), 'fp8' / 'fp8_e4m3' (float8_e4m3fn "
                            "with k/v scales from the checkpoint, else 1.0: twice the blocks) or "
                            "'fp8_e5m2'"),
    "max-model-len": (human_readable_int, "longest sequence (prompt + output); default: the model's "
                                          "max_position_embeddings"),
    "max-num-seqs": (int, "most sequences in one step"),
    "max-num-batched-tokens": (human_readable_int, "most tokens in one step (also the largest compiled token "
                                                   "bucket)"),
    "long-prefill-token-threshold": (int, "most tokens of one request in a step (0: no cap), so that a long "
                                          "prompt takes several steps beside the requests decoding"),
    "block-size": (int, "tokens per KV cache block"),
    "gpu-memory-utilization": (float, "share of device memory for weights, activations and KV cache"),
    "num-gpu-blocks-override": (int, "number of KV cache blocks, instead of sizing them from device memory"),
    "kv-cache-memory-bytes": (human_readable_int, "the KV cache's bytes on each device, instead of sizing it from "
                                   "gpu-memory-utilization"),
    "attention-backend": (str, "'auto', 'reference' or 'pallas' (where available)"),
    "tokenizer": (str, "tokenizer folder (default: the model's)"),
    "load-format": (str, "'auto', 'safetensors' or 'dummy' (random weights)"),
    "tensor-parallel-size": (int, "devices each model replica is split over (tensor parallelism)"),
    "data-parallel-size": (int, "model replicas, each on tensor-parallel-size devices of its own"),
    "max-logprobs": (int, "most logprobs a request may ask for (-1: the whole vocabulary)"),
    "logprobs-mode": (str, "raw_logprobs, raw_logits, processed_logprobs or processed_logits"),
    "generation-config": (str, "default sampling params from: 'auto' (the model's), 'vllm' or a folder"),
    "hf-overrides": (json_object, 'fields set on the model\'s HF config, as a JSON object, e.g. '
                                  '\'{"num_hidden_layers": 2}\''),
    "rope-scaling": (json_object, "vLLM's deprecated form of hf-overrides' rope_scaling"),
    "rope-theta": (float, "vLLM's deprecated form of hf-overrides' rope_theta"),
    "override-generation-config": (json_object, 'default sampling params over the generation config\'s, as a '
                                                'JSON object of its fields, e.g. \'{"temperature": 0.5}\''),
    "speculative-config": (json_object, 'speculative decoding, as a JSON object, e.g. \'{"method": "ngram", '
                                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                        '"prompt_lookup_min": 2}\' (n-gram steps run synchronously)'),
    "max-loras": (int, "LoRA: adapters on the device at once (the most distinct ones in a step)"),
    "max-lora-rank": (int, "LoRA: the largest adapter rank (smaller ones are zero-padded to it)"),
    "max-cpu-loras": (int, "LoRA: adapters kept read in host memory (default: max-loras)"),
    "lora-dtype": (str, "LoRA: the adapters' dtype ('auto': the model's)"),
    "scheduling-policy": (str, "'fcfs' or 'priority' (lower priority values first)"),
    "tokenizer-mode": (str, "'auto' (HF's fast tokenizer)"),
    "pipeline-parallel-size": (int, "1 only (jaxvllm has no pipeline parallelism)"),
    "structured-outputs-config": (json_object, "structured outputs settings, as a JSON object of vLLM's "
                                               "StructuredOutputsConfig fields"),
    "compilation-config": (str, "accepted for vLLM's scripts; XLA compiles one executable per token bucket"),
    "max-seq-len-to-capture": (int, "accepted for vLLM's scripts (no CUDA graphs)"),
    "swap-space": (float, "accepted for vLLM's scripts (preemption recomputes)"),
    "max-num-partial-prefills": (int, "1 only, as vLLM's V1 engine (no concurrent partial prefills)"),
    "max-long-partial-prefills": (int, "1 only, as vLLM's V1 engine"),
    "prefix-caching-hash-algo": (str, "'sha256' or 'sha256_cbor': both give jaxvllm's one hash, sha256 over "
                                      "a fixed byte encoding of the ids"),
    "revision": (str, "accepted for vLLM's scripts (local folders have no revisions)"),
    "tokenizer-revision": (str, "accepted for vLLM's scripts"),
    "code-revision": (str, "accepted for vLLM's scripts"),
    "download-dir": (str, "accepted for vLLM's scripts (nothing is downloaded)"),
    "max-parallel-loading-workers": (int, "accepted for vLLM's scripts"),
    "runner": (str, "'auto' or 'generate' (generative models only)"),
    "profiler-config": (json_object, 'for LLM.start_profile: \'{"profiler": "jax", "jax_profiler_dir": FOLDER}\''),
    "served-model-name": (str, "the name(s) the metrics' model_name label shows (default: the model's path)"),
    "token-buckets": (int, "the token counts a step is compiled for (default: powers of two up to "
                           "max-num-batched-tokens)"),
    "compilation-cache-dir": (str, "where compiled steps are kept between runs ('' for none)"),
}
# vLLM's flags for what jaxvllm takes and leaves unused, or at its default only (README: "Switching from vLLM").
_VALUE_FLAGS.update({flag: (kind, "accepted for vLLM's scripts") for flag, kind in {
    "distributed-executor-backend": str, "task": str, "model-impl": str, "convert": str, "reasoning-parser": str,
    "worker-extension-cls": str, "hf-token": str, "allowed-local-media-path": str, "guided-decoding-backend": str,
    "cpu-offload-gb": float, "lora-extra-vocab-size": int, "data-parallel-rank": int, "logits-processors": str,
    "limit-mm-per-prompt": json_object, "mm-processor-kwargs": json_object, "kv-transfer-config": json_object,
    "pooler-config": json_object, "default-mm-loras": json_object, "cuda-graph-sizes": int,
    "dbo-decode-token-threshold": int, "dbo-prefill-token-threshold": int, "eplb-config": json_object,
    "num-redundant-experts": int, "eplb-window-size": int, "eplb-step-interval": int,
    "expert-placement-strategy": str, "num-lookahead-slots": int, "media-io-kwargs": json_object,
    "mm-processor-cache-gb": float, "mm-processor-cache-type": str, "mm-shm-cache-max-object-size-mb": int,
    "mm-encoder-tp-mode": str, "video-pruning-rate": float, "allowed-media-domains": str, "mamba-cache-dtype": str,
    "mamba-ssm-cache-dtype": str, "safetensors-load-strategy": str, "ignore-patterns": str,
    "pt-load-map-location": str, "model-loader-extra-config": json_object, "logits-processor-pattern": str,
    "show-hidden-metrics-for-version": str, "additional-config": json_object}.items()})
# vLLM's flags for features jaxvllm lacks: refused by name away from their defaults.
_VALUE_FLAGS.update({flag: (kind, "not supported by jaxvllm (its default only)") for flag, kind in {
    "hf-config-path": str, "config-format": str, "decode-context-parallel-size": int, "data-parallel-start-rank": int,
    "data-parallel-size-local": int, "data-parallel-address": str, "data-parallel-rpc-port": int,
    "data-parallel-backend": str, "otlp-traces-endpoint": str, "collect-detailed-traces": str, "scheduler-cls": str,
    "worker-cls": str, "kv-events-config": json_object, "override-attention-dtype": str,
    "override-pooler-config": json_object, "io-processor-plugin": str}.items()})
# Flags with more names (vLLM's short ones) or that take several values.
_ALIASES = {"tensor-parallel-size": ["-tp"], "pipeline-parallel-size": ["-pp"], "data-parallel-size": ["-dp"],
            "quantization": ["-q"], "compilation-config": ["-O"], "decode-context-parallel-size": ["-dcp"],
            "data-parallel-rank": ["-dpn"], "data-parallel-start-rank": ["-dpr"], "data-parallel-size-local": ["-dpl"],
            "data-parallel-address": ["-dpa"], "data-parallel-rpc-port": ["-dpp"], "data-parallel-backend": ["-dpb"]}
_NARGS = {"served-model-name": "+", "token-buckets": "+", "logits-processors": "+", "hf-token": "?",
          "cuda-graph-sizes": "+", "allowed-media-domains": "+", "ignore-patterns": "+", "collect-detailed-traces": "+"}
_BOOL_FLAGS: dict[str, str] = {
    "enable-chunked-prefill": "cut long prompts into chunks that share steps with decoding requests",
    "enable-prefix-caching": "reuse the KV cache blocks of prompt prefixes seen before",
    "async-scheduling": "schedule and dispatch each step before reading the last one's tokens",
    "enforce-eager": "skip the warm-up: each shape compiles the first time a step needs it",
    "calculate-kv-scales": "fp8 KV cache: scales per layer and KV head from the first batch (max |K| / 200, "
                           "max |V| / 100) instead of the checkpoint's or 1.0",
    "enable-expert-parallel": "mixture of experts: split the experts whole over the tensor-parallel devices "
                              "(E / N each) instead of each expert by its intermediate dimension",
    "enable-lora": "serve LoRA adapters (PEFT folders) over the base model, several in one batch",
    "enable-sleep-mode": "allow LLM.sleep(level) / wake_up(tags), which free the KV cache and the weights",
    "skip-tokenizer-init": "load no tokenizer: token-id prompts only, no text",
    "trust-remote-code": "accepted for vLLM's scripts (only built-in architectures run, never remote code)",
    "disable-log-stats": "no stats line every 10 s of steps (LLM's default, as vLLM's)",
}
_BOOL_FLAGS.update(dict.fromkeys([
    "disable-custom-all-reduce", "disable-sliding-window", "enable-lora-bias", "enable-prompt-embeds",
    "fully-sharded-loras", "use-tqdm-on-load", "disable-chunked-mm-input", "guided-decoding-disable-fallback",
    "guided-decoding-disable-any-whitespace", "guided-decoding-disable-additional-properties",
    "disable-cascade-attn", "enable-dbo", "enable-eplb", "eplb-log-balancedness", "disable-hybrid-kv-cache-manager",
    "kv-sharing-fast-prefill", "ray-workers-use-nsight", "interleave-mm-strings", "disable-mm-preprocessor-cache",
    "skip-mm-profiling", "enable-multimodal-encoder-data-parallel"],
    "accepted for vLLM's scripts"))
_BOOL_FLAGS["data-parallel-hybrid-lb"] = "not supported by jaxvllm (its default only)"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (LLM(...) keyword arguments)")
    for flag, (kind, help_text) in _VALUE_FLAGS.items():
        extra: dict[str, Any] = {"choices": ["auto", *DTYPES, "half", "float"]} if flag == "dtype" else {}
        if flag == "kv-cache-dtype":
            extra = {"choices": list(KV_CACHE_DTYPES)}
        if kind is json_object:
            extra = {"metavar": "JSON"}
        if flag == "hf-token":  # (vLLM's: alone, the token of `huggingface-cli login`)
            extra = {"const": True}
        group.add_argument(f"--{flag}", *_ALIASES.get(flag, []), type=kind, default=None, help=help_text,
                           nargs=_NARGS.get(flag), **extra)
    for flag, help_text in _BOOL_FLAGS.items():
        group.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text)


def engine_kwargs(args: argparse.Namespace, source: ModelSource, **defaults: Any) -> dict[str, Any]:
    """The `LLM(...)` keyword args: the user's flags over `defaults` over the dummy model's."""
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if v is not None}
    for flag in (*_VALUE_FLAGS, *_BOOL_FLAGS):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            kwargs[flag.replace("-", "_")] = value
    kwargs = source.engine_kwargs(kwargs)
    try:
        EngineConfig(model=source.path, **kwargs)
    except TypeError as e:  # a flag this engine's EngineConfig does not know
        raise ValueError(f"engine arguments {sorted(kwargs)}: {e}") from e
    return kwargs


class EngineArgs(EngineConfig):
    """vLLM's `EngineArgs`: the engine arguments, with the command-line helpers that vLLM's
    examples build their scripts with (`add_cli_args`, `from_cli_args`), and
    `LLMEngine.from_engine_args(...)` to make an engine of them."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The engine flags, defaulting (as vLLM's) to the engine's defaults, so that a script
        may pass every parsed flag on: `LLM(**vars(parser.parse_args()))`."""
        parser.add_argument("--model", default=None, help=MODEL_HELP)
        add_engine_args(parser)
        # (jaxvllm's own commands take --seed for the prompts' sampling; vLLM's scripts for the engine)
        parser.add_argument("--seed", type=int, default=None, help="the engine's seed (sampling without one)")
        names = {flag.replace("-", "_") for flag in (*_VALUE_FLAGS, *_BOOL_FLAGS, "seed")}
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(EngineConfig) if f.name in names}
        parser.set_defaults(**{k: v for k, v in defaults.items() if v is not dataclasses.MISSING})
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`, for `AsyncLLM.from_engine_args`: the engine arguments, and
    whether to log each request's arrival, end and abort."""

    enable_log_requests: bool = False

    @property
    def disable_log_requests(self) -> bool:
        """vLLM's deprecated opposite of `enable_log_requests`."""
        warnings.warn("disable_log_requests is deprecated (as in vLLM 0.11); use enable_log_requests",
                      DeprecationWarning, stacklevel=2)
        return not self.enable_log_requests

    @disable_log_requests.setter
    def disable_log_requests(self, value: bool) -> None:
        self.enable_log_requests = not value

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, async_args_only: bool = False) -> argparse.ArgumentParser:
        """vLLM's: the engine flags (not with `async_args_only`) and --enable-log-requests
        (--disable-log-requests is vLLM's deprecated flag, which its `from_cli_args` does not read either)."""
        if not async_args_only:
            parser = EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                            help="log each request's arrival, end and abort")
        parser.add_argument("--disable-log-requests", action=argparse.BooleanOptionalAction, default=True,
                            help="[deprecated] use --enable-log-requests")
        return parser
