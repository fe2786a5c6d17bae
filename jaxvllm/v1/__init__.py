"""vLLM's `vllm.v1` module paths that its scripts import, over jaxvllm's own modules."""
