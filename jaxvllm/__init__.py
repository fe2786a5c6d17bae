"""jaxvllm: a vLLM-style LLM inference engine on JAX/XLA with Pallas kernels."""

from jaxvllm.batch import ModelInputs
from jaxvllm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxvllm.loader import load_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ModelInputs", "SUPPORTED_ARCHITECTURES", "load_model", "__version__"]
