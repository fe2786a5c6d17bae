"""jaxvllm: a vLLM-style LLM inference engine on JAX/XLA with Pallas kernels."""

from jaxvllm.batch import ModelInputs
from jaxvllm.beam_search import BeamSearchOutput, BeamSearchSequence
from jaxvllm.config import EngineConfig
from jaxvllm.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxvllm.engine import LLMEngine
from jaxvllm.engine_args import EngineArgs
from jaxvllm.inputs import TextPrompt, TokensPrompt
from jaxvllm.llm import LLM
from jaxvllm.loader import load_model
from jaxvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "ModelInputs",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SUPPORTED_ARCHITECTURES",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "load_model",
    "__version__",
]
