"""Model implementations, picked by the `architectures` entry of config.json."""

from jaxvllm.config import SUPPORTED_ARCHITECTURES
from jaxvllm.models import gemma3, llama

# Every supported architecture is a Llama-family decoder; what differs between them
# are flags of `ModelConfig` (bias, qk-norm, sliding windows, rope, tied embeddings).
MODELS = dict.fromkeys(SUPPORTED_ARCHITECTURES, llama)
# Gemma 3 has its own decoder layer (four norms, (1 + w) RMSNorm, scaled embeddings, two RoPEs).
MODELS["Gemma3ForCausalLM"] = gemma3
