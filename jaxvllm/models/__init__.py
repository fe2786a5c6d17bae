"""Model implementations, picked by the `architectures` entry of config.json."""

from jaxvllm.config import SUPPORTED_ARCHITECTURES
from jaxvllm.models import llama

# Every supported architecture is a Llama-family decoder; what differs between them
# are flags of `ModelConfig` (bias, qk-norm, sliding windows, rope, tied embeddings).
MODELS = dict.fromkeys(SUPPORTED_ARCHITECTURES, llama)
