"""jaxvllm: a vLLM-style LLM inference engine on JAX/XLA with Pallas kernels.

The names below are imported on first use (PEP 562), so that importing a leaf such as
`jaxvllm.config` to validate engine arguments loads neither jax nor the kernels.
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "LLM": "jaxvllm.llm",
    "AsyncEngineArgs": "jaxvllm.engine_args",
    "AsyncLLM": "jaxvllm.async_llm",
    "AsyncLLMEngine": "jaxvllm.async_llm",
    "BeamSearchOutput": "jaxvllm.beam_search",
    "BeamSearchSequence": "jaxvllm.beam_search",
    "BeamSearchParams": "jaxvllm.sampling_params",
    "CompletionOutput": "jaxvllm.outputs",
    "EngineArgs": "jaxvllm.engine_args",
    "EngineConfig": "jaxvllm.config",
    "LLMEngine": "jaxvllm.engine",
    "LoRARequest": "jaxvllm.lora.request",
    "ModelConfig": "jaxvllm.model_config",
    "ModelInputs": "jaxvllm.batch",
    "RequestMetrics": "jaxvllm.outputs",
    "RequestOutput": "jaxvllm.outputs",
    "RequestOutputKind": "jaxvllm.sampling_params",
    "SUPPORTED_ARCHITECTURES": "jaxvllm.model_config",
    "SamplingParams": "jaxvllm.sampling_params",
    "StructuredOutputsParams": "jaxvllm.sampling_params",
    "TextPrompt": "jaxvllm.inputs",
    "TokensPrompt": "jaxvllm.inputs",
    "load_model": "jaxvllm.loader",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxvllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
