"""vLLM's `vllm.v1.engine` module paths, over jaxvllm's own modules."""
